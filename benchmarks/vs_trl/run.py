"""hybridflow against TRL on identical GRPO and PPO work, side by side: `python benchmarks/vs_trl/run.py`.

1. Makes its own virtual environments under ``$HYBRIDFLOW_CACHE/vs_trl`` (default ~/.cache/hybridflow):
   torch==2.13.0 first, then trl (1.16 for GRPOTrainer, 1.12 for PPOTrainer, the last release that
   has it); reused on later runs.
2. Builds the shared assets: the built-in character tokenizer, random-init Llama directories
   (tiny, small; ``--models smollm2`` uses the converted SmolLM2-135M-Instruct), an addition prompt file; the reward is ``reward.py``, a plain function both call.
   PPO also gets a score model (the policy's backbone under a seeded one-label head,
   ``assets.build_score_model_dir``): the reward model and the value model's init on both sides.
3. Per algorithm (``--algorithms``, default both) and model runs TRL's trainer, then ``hybridflow``
   at its defaults (Ray, one worker), with matched settings: 32 prompts per step (GRPO: x 4
   samples, no KL/reference; PPO: 1 sample, reference, critic, reward model, KL in the reward with
   ``--kl-coef``, GAE gamma 1 lambda 0.95, one PPO epoch of one mini-batch), at most 32 new tokens,
   temperature 1, no top-p/top-k, stop at EOS, the same learning rate, one optimizer step per batch
   per trained model, fp32, 2 threads, prompts fed as the raw text (TRL templates only chat rows, so
   hybridflow's side sets ``data.chat_template=never``). ``--fixed-length`` makes every completion
   exactly ``--max-new-tokens`` long on both sides (end tokens cannot be sampled before). The first
   ``--warmup`` steps are dropped.
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
TRL_PPO_VERSION = "1.12.0"


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
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"], choices=["grpo", "ppo"])
    parser.add_argument("--steps", type=int, default=4, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--samples-per-prompt", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--trl-no-checkpointing", action="store_true",
                        help="run TRL's GRPO without its default activation checkpointing (its update then computes "
                             "the same FLOPs as hybridflow's)")
    parser.add_argument("--fixed-length", action="store_true",
                        help="every completion exactly --max-new-tokens long on both sides (EOS cannot be sampled before)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--kl-coef", type=float, default=0.05, help="PPO's KL-in-reward coefficient (both sides)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--local", action="store_true", help="also run hybridflow with placement.runtime=local")
    parser.add_argument("--ray", action="store_true", help="also run hybridflow with placement.runtime=ray "
                        "(the default, auto, runs this one-device workload in the driver's process)")
    parser.add_argument("--fp32", action="store_true",
                        help="also run hybridflow with every role's engine.dtype=float32 (the default, auto, computes "
                             "in bf16 on CPUs with native bf16 dot products)")
    parser.add_argument("--runs", type=int, default=1,
                        help="processes per side, interleaved; each side reports its median run (steadier on a "
                             "shared machine, where one process can run 30%% slower than the next)")
    parser.add_argument("--bf16", action="store_true",
                        help="also run hybridflow with every role's engine.dtype=bfloat16 (what auto picks or not)")
    parser.add_argument("--trl-bf16", action="store_true",
                        help="also run TRL with bf16=True (autocast over its fp32 weights)")
    parser.add_argument("--also-set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="also run hybridflow with these config overrides (side 'hybridflow +set'), interleaved "
                             "with the default one: an A/B of a setting inside one run, e.g. "
                             "actor.engine.micro_batch_tokens=4096")
    args = parser.parse_args()

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(REPO))
    from assets import build_prompts

    work = cache_dir()
    total_steps = args.steps + args.warmup
    prompts = build_prompts(work / "prompts.jsonl", args.prompts_per_step * total_steps)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO), "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    rows = []
    for algorithm in args.algorithms:
        rows += run_algorithm(algorithm, args, work, prompts, total_steps, env)
    name = "results" + ("-fixed" if args.fixed_length else "") + ("-trl-no-checkpointing" if args.trl_no_checkpointing else "")
    (work / f"{name}.json").write_text(json.dumps(rows, indent=1))


def run_algorithm(algorithm: str, args, work: Path, prompts: Path, total_steps: int, env: dict) -> list:
    """TRL then hybridflow on every model for ``algorithm``; prints a line per side and the ratios."""
    from assets import build_model_dir, build_score_model_dir
    from transformers import AutoTokenizer

    samples_per_prompt = args.samples_per_prompt if algorithm == "grpo" else 1  # PPO: one response per prompt
    python_trl = trl_python(TRL_GRPO_VERSION if algorithm == "grpo" else TRL_PPO_VERSION)
    common = ["--prompts", str(prompts), "--steps", str(total_steps), "--prompts-per-step",
              str(args.prompts_per_step), "--samples-per-prompt", str(samples_per_prompt),
              "--max-new-tokens", str(args.max_new_tokens), "--lr", str(args.lr)]
    if args.fixed_length:
        common += ["--min-new-tokens", str(args.max_new_tokens)]
    if algorithm == "ppo":
        common += ["--kl-coef", str(args.kl_coef)]
    samples = args.prompts_per_step * samples_per_prompt
    label = ("" if algorithm == "grpo" else "ppo ") + ("fixed " if args.fixed_length else "")
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
        trl_flags = ["--no-gradient-checkpointing"] if args.trl_no_checkpointing else []
        sides = {"trl": [python_trl, str(HERE / f"trl_{algorithm}.py"), "--threads", str(args.threads)] + trl_flags,
                 "hybridflow": [sys.executable, str(HERE / f"hybridflow_{algorithm}.py")]}
        if algorithm == "ppo":
            score_dir = ["--score-dir", str(build_score_model_dir(model_dir, work / "models"))]
            sides = {side: command + score_dir for side, command in sides.items()}
        if args.local:
            sides["hybridflow --local"] = sides["hybridflow"] + ["--runtime", "local"]
        if args.ray:
            sides["hybridflow --ray"] = sides["hybridflow"] + ["--runtime", "ray"]
        roles = ("actor", "reference", "critic", "reward") if algorithm == "ppo" else ("actor",)
        for wanted, name, dtype in ((args.fp32, "fp32", "float32"), (args.bf16, "bf16", "bfloat16")):
            if wanted:
                sides[f"hybridflow {name}"] = sides["hybridflow"] + ["--set"] + [f"{role}.engine.dtype={dtype}"
                                                                                 for role in roles]
        if args.trl_bf16:
            sides["trl bf16"] = sides["trl"] + ["--bf16"]
        if args.also_set:
            sides["hybridflow +set"] = sides["hybridflow"] + ["--set", *args.also_set]
        results, attempts = {}, {side: [] for side in sides}
        for _ in range(args.runs):  # the sides interleaved, so each sees the machine's drift alike
            for side, command in sides.items():
                out = work / "runs" / (label.replace(" ", "-") + model) / side.replace(" ", "")
                attempts[side].append(run_side(command + ["--model-dir", str(model_dir), "--output-dir", str(out)]
                                               + common, env, args.warmup))
        for side, runs in attempts.items():
            results[side] = r = sorted(runs, key=lambda run: run["step_s"])[(len(runs) - 1) // 2]  # the median run
            r["runs_step_s"] = [round(run["step_s"], 3) for run in runs]
            r["tokens_per_s"] = samples * (prompt_tokens + r["completion_length"]) / r["step_s"]
            r["algorithm"] = algorithm
            rows.append((model, side, r))
            r["tokens_per_cpu_s"] = samples * (prompt_tokens + r["completion_length"]) / r["cpu_s"]
            print(f"{label}{model:6s} {side:18s} step={r['step_s']:.3f}s tok/s={r['tokens_per_s']:8.0f} "
                  f"cpu={r['cpu_s']:.3f}s tok/cpu-s={r['tokens_per_cpu_s']:8.0f} "
                  f"gen={r['generate_s']:.3f} score={r['score_s']:.3f} update={r['update_s']:.3f} "
                  f"len={r['completion_length']:.1f} peak={r['peak_rss_gib']:.2f}GiB load={r['load']:.1f} "
                  f"steps={r['per_step_s']}" + (f" startup={r['startup_s']:.1f}s" if r["startup_s"] else "")
                  + (f" runs={r['runs_step_s']}" if args.runs > 1 else ""),
                  flush=True)
        for side in results:
            if side != "trl":  # every other side against TRL's fp32 run
                ratio = results[side]["tokens_per_s"] / results["trl"]["tokens_per_s"]
                cpu_ratio = results[side]["tokens_per_cpu_s"] / results["trl"]["tokens_per_cpu_s"]
                print(f"{label}{model:6s} {side} / trl throughput ratio: {ratio:.2f}x wall, "
                      f"{cpu_ratio:.2f}x per CPU-second", flush=True)
    return rows


if __name__ == "__main__":
    main()
