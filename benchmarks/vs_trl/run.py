"""hybridflow against TRL on identical GRPO work, side by side: `python benchmarks/vs_trl/run.py`.

1. Makes its own virtual environment under ``$HYBRIDFLOW_CACHE/vs_trl`` (default ~/.cache/hybridflow):
   torch==2.13.0 first, then trl (1.16 for GRPOTrainer); reused on later runs.
2. Builds the shared assets: the built-in character tokenizer, random-init Llama directories
   (tiny, small; ``--models smollm2`` uses the converted SmolLM2-135M-Instruct), an addition prompt file; the reward is ``reward.py``, a plain function both call.
3. Per model runs TRL's GRPOTrainer, then ``hybridflow`` at its defaults (Ray, one worker), with
   matched settings: 32 prompts x 4 samples per step, at most 32 new tokens, temperature 1, no
   top-p/top-k, stop at EOS, the same learning rate, one optimizer step per batch, no KL/reference,
   fp32, 2 threads. The first ``--warmup`` steps are dropped.
4. Prints per-step time, tokens/s (prompt + response tokens per second of RL step), the
   generate / score / update split, peak memory, mean completion length, the load average and the
   ratio. The machine is shared: compare only within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TORCH_VERSION = "2.13.0"
TRL_GRPO_VERSION = "1.16.0"


def cache_dir() -> Path:
    root = os.environ.get("HYBRIDFLOW_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridflow")
    return Path(root) / "vs_trl"


def trl_python(version: str) -> str:
    """The suite's venv with torch then trl ``version`` installed (created once)."""
    venv = cache_dir() / f"venv-trl{version}"
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run(pip + [f"torch=={TORCH_VERSION}"], check=True)
        subprocess.run(pip + [f"trl=={version}", f"torch=={TORCH_VERSION}"], check=True)
        marker.write_text(version)
    return str(python)


def run_side(command: list[str], env: dict, warmup: int) -> dict:
    """Run one side; average its per-step JSON lines after the warm-up steps."""
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    records = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"')]
    steps = [r for r in records if "step_s" in r]
    if result.returncode != 0 or len(steps) <= warmup:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"{command[1]} failed (exit {result.returncode}, {len(steps)} steps)")
    timed = steps[warmup:]
    summary = {key: statistics.mean(r[key] for r in timed) for key in
               ("step_s", "cpu_s", "generate_s", "score_s", "update_s", "completion_length", "load")}
    summary["peak_rss_gib"] = max(r["peak_rss_gib"] for r in steps)
    summary["per_step_s"] = [round(r["step_s"], 3) for r in timed]
    summary["startup_s"] = next((r["startup_s"] for r in records if "startup_s" in r), None)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="tiny, small, smollm2")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--local", action="store_true", help="also run hybridflow --local (single process)")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    from assets import build_model_dir, build_prompts
    from transformers import AutoTokenizer

    work = cache_dir()
    total_steps = args.steps + args.warmup
    prompts = build_prompts(work / "prompts.jsonl", args.prompts_per_step * total_steps)
    python_trl = trl_python(TRL_GRPO_VERSION)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    common = ["--prompts", str(prompts), "--steps", str(total_steps), "--prompts-per-step",
              str(args.prompts_per_step), "--samples-per-prompt", str(args.samples_per_prompt),
              "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr)]
    samples = args.prompts_per_step * args.samples_per_prompt
    rows = []
    for model in args.models:
        if model == "smollm2":  # the converted checkpoint (hybridflow/models/smollm2.py), its own tokenizer
            from hybridflow.models.smollm2 import smollm2_path

            if smollm2_path() is None:
                print("smollm2: no converted checkpoint, skipped (scripts/get_smollm2.py makes it)")
                continue
            model_dir = Path(smollm2_path())
        else:
            model_dir = build_model_dir(model, work / "models")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]
        prompt_tokens = statistics.mean(len(tokenizer(text)["input_ids"]) for text in texts)
        sides = {"trl": [python_trl, str(HERE / "trl_grpo.py"), "--threads", str(args.threads)],
                 "hybridflow": [sys.executable, str(HERE / "hybridflow_grpo.py")]}
        if args.local:
            sides["hybridflow --local"] = sides["hybridflow"] + ["--local"]
        results = {}
        for side, command in sides.items():
            out = work / "runs" / model / side.replace(" ", "")
            results[side] = run_side(command + ["--model-dir", str(model_dir), "--output-dir", str(out)] + common,
                                     env, args.warmup)
            r = results[side]
            r["tokens_per_s"] = samples * (prompt_tokens + r["completion_length"]) / r["step_s"]
            rows.append((model, side, r))
            r["tokens_per_cpu_s"] = samples * (prompt_tokens + r["completion_length"]) / r["cpu_s"]
            print(f"{model:6s} {side:18s} step={r['step_s']:.3f}s tok/s={r['tokens_per_s']:8.0f} "
                  f"cpu={r['cpu_s']:.3f}s tok/cpu-s={r['tokens_per_cpu_s']:8.0f} "
                  f"gen={r['generate_s']:.3f} score={r['score_s']:.3f} update={r['update_s']:.3f} "
                  f"len={r['completion_length']:.1f} peak={r['peak_rss_gib']:.2f}GiB load={r['load']:.1f} "
                  f"steps={r['per_step_s']}" + (f" startup={r['startup_s']:.1f}s" if r["startup_s"] else ""),
                  flush=True)
        for side in results:
            if side != "trl":
                ratio = results[side]["tokens_per_s"] / results["trl"]["tokens_per_s"]
                cpu_ratio = results[side]["tokens_per_cpu_s"] / results["trl"]["tokens_per_cpu_s"]
                print(f"{model:6s} {side} / trl throughput ratio: {ratio:.2f}x wall, {cpu_ratio:.2f}x per CPU-second",
                      flush=True)
    (work / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
