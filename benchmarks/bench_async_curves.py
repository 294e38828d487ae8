"""Asynchronous (k = 1) against synchronous GRPO on the same two processes: steps per second and reward curves.

    python benchmarks/bench_async_curves.py --model small --seeds 0 1 2 --steps 30 --out runs/async_curves
    python benchmarks/bench_async_curves.py --model smollm2 --seeds 0 --steps 8 --out runs/async_curves

Two CPU processes under Ray, the placements of benchmarks/bench_async_placement.py: ``colocated``
(actor and reference on one pool of 2, FSDP d = 2, the actor generating through the 3D-HybridEngine),
``split-k0`` (actor and reference on one process, one rollout replica on the other, taking turns),
``split-k1`` (the same split, async.max_staleness = 1: the replica generates batch i + 1 while batch i trains) and
``split-k1-ref-gen`` (split-k1 with the reference on the replica's process, scoring batch i + 1 there too).
The two synchronous placements are both run, so "the best synchronous placement" is whichever was faster.

Models:
- ``small``: the built-in Llama (hidden 128, 4 layers, 0.8 M parameters, character tokenizer) as the demo trains
  its policy (docs/demo.md): a base from random weights on correct worked additions, then SFT on an imperfect
  demonstrator who drops the digit of the final carry in 70% of the sums that have one (held-out accuracy about
  26%). GRPO with the exact checker then has that habit to remove, so the reward rises. The start model is built
  once (about 10 minutes) and kept under ``--out``; ``--start-model DIR`` takes one already made (the demo's
  ``runs/demo/sft/model``).
- ``smollm2``: SmolLM2-135M-Instruct (scripts/get_smollm2.py), the config of examples/smollm2_gsm8k with
  2-digit arithmetic word problems and the math final-answer reward.

Each run prints steps per second over steps 2..N (step 1 pays the workers' warm-up), the load average before and
after, and its reward per step; ``--out`` gets ``curves_MODEL.json`` (per run: seconds since the first step and
``reward/score_mean`` per step) and ``curves_MODEL.png`` (mean over seeds against steps and against seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_async_placement import PLACEMENTS, timed_fit  # noqa: E402

SYNCHRONOUS = ("colocated", "split-k0")
"""The placements without staleness (the others are compared with the faster of these)."""
PHASES = ("async/wait_generation_s", "async/wait_scoring_s", "async/sync_s", "time/generate_s", "time/score_s",
          "time/update_s")
"""Mean seconds per step (steps 2..N) kept per run: where a step's time goes, and so what overlap can hide."""


def small_start_model(root: Path) -> Path:
    """The demo's SFT policy (docs/demo.md): the built-in model, base on correct additions, then SFT on the flawed
    demonstrator (its defaults: 2,000 + 300 steps). Built once under ``root``; ``hybridflow demo`` makes the same
    model (``runs/demo/sft/model``), which ``--start-model`` can name instead."""
    from hybridflow.trainers.demo import DemoConfig, train_sft, write_task_data

    policy = root / "small-policy" / "model"
    if (policy / "config.json").exists():
        return policy
    demo = DemoConfig(output_dir=str(root / "small-policy"), ppo_steps=1)
    files = write_task_data(demo, root / "small-policy" / "data")
    base = train_sft(demo, files["sft_base"], root / "small-policy" / "base", steps=demo.base_steps,
                     lr=demo.base_lr, init_dir=None, tensorboard=False)
    sft = train_sft(demo, files["sft_policy"], root / "small-policy" / "sft", steps=demo.sft_steps,
                    lr=demo.sft_lr, init_dir=base["model_dir"], tensorboard=False)
    Path(sft["model_dir"]).rename(policy)
    return policy


def model_overrides(model: str, root: Path, steps: int, start_model: Path | None = None
                    ) -> tuple[Path | None, list[str]]:
    """(config file, overrides) of the model's workload, without placement, seed and output."""
    if model == "small":
        from hybridflow.data import write_jsonl
        from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows

        policy = start_model or small_start_model(root)
        prompts = write_jsonl(root / "small-prompts.jsonl", prompt_rows(
            16 * steps, split="train", seed=2, config=ArithmeticTaskConfig(min_digits=2, max_digits=2, reverse_answer=True)))
        return None, [f"data.train_path={prompts}", f"actor.model.path={policy}", "reward.function=arithmetic",
                      "actor.generation.max_new_tokens=5", "actor.engine.optim.lr=3e-4",
                      "algorithm.advantage_estimator=grpo", "batch.prompts_per_step=16", "batch.samples_per_prompt=4",
                      "batch.mini_batch_size=64"]
    from hybridflow.models import smollm2_path

    if smollm2_path() is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted: run python scripts/get_smollm2.py")
    example = Path(__file__).resolve().parents[1] / "examples" / "smollm2_gsm8k"
    sys.path.insert(0, str(example))
    import run as smollm2_example

    train_path, _ = smollm2_example.write_prompts(root, num_train=8 * steps, num_eval=1, problems="arithmetic")
    return smollm2_example.CONFIG, [f"actor.model.path={smollm2_path()}", f"data.train_path={train_path}",
                                    "trainer.val_every=0", "actor.generation.max_new_tokens=96"]


def run_once(model: str, placement: str, seed: int, *, root: Path, steps: int, start_model: Path | None,
             overrides: tuple[str, ...] = ()) -> dict:
    from hybridflow.trainers.config.rl import load_rl_config

    config_path, workload = model_overrides(model, root, steps, start_model)
    config = load_rl_config(config_path, [
        *workload, f"trainer.total_steps={steps}", f"trainer.seed={seed}", "trainer.progress_bar=false",
        "trainer.save_every=0", "trainer.resume=false", "trainer.overwrite=true", "actor.loss.tis_cap=2.0",
        f"trainer.output_dir={root / 'runs' / f'{model}-{placement}-s{seed}'}", "placement.runtime=ray",
        *PLACEMENTS[placement], *overrides])
    history, stamps, load_before, load_after = timed_fit(config)
    return {"model": model, "placement": placement, "seed": seed,
            "steps_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "seconds": [stamp - stamps[0] for stamp in stamps],
            "reward": [record["reward/score_mean"] for record in history],
            "phases": {name: statistics.mean(record.get(name, 0.0) for record in history[1:])
                       for name in (*PHASES, *sorted({key for record in history[1:] for key in record
                                                      if key.startswith("time/") and key not in PHASES}))},
            "old_log_prob_skipped": history[-1].get("perf/old_log_prob_skipped", 0.0),
            "load_before": load_before, "load_after": load_after}


def summarize(runs: list[dict]) -> list[str]:
    """Mean steps/s per placement over seeds, and each k = 1 placement against the faster synchronous one."""
    speed = {placement: statistics.mean(run["steps_per_s"] for run in runs if run["placement"] == placement)
             for placement in dict.fromkeys(run["placement"] for run in runs)}
    lines = [f"{placement:<10} mean {value:.4g} steps/s over {sum(r['placement'] == placement for r in runs)} runs"
             for placement, value in speed.items()]
    synchronous = {name: value for name, value in speed.items() if name in SYNCHRONOUS}
    for name in (name for name in speed if name not in SYNCHRONOUS and synchronous):
        best = max(synchronous, key=synchronous.get)
        lines.append(f"{name} vs best synchronous ({best}): {speed[name] / synchronous[best]:.2f}x")
    return lines


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for placement in dict.fromkeys(run["placement"] for run in runs):
        chosen = [run for run in runs if run["placement"] == placement]
        length = min(len(run["reward"]) for run in chosen)
        mean = [statistics.mean(run["reward"][i] for run in chosen) for i in range(length)]
        seconds = [statistics.mean(run["seconds"][i] for run in chosen) for i in range(length)]
        label = f"{placement} ({len(chosen)} seeds)"
        by_step.plot(range(1, length + 1), mean, label=label)
        by_time.plot(seconds, mean, label=label)
    by_step.set(xlabel="step", ylabel="reward/score_mean (mean over seeds)")
    by_time.set(xlabel="seconds since step 1", ylabel="reward/score_mean (mean over seeds)")
    by_step.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "smollm2"], default="small")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--out", default="runs/async_curves")
    parser.add_argument("--start-model", type=Path, help="small: the SFT policy to start from (default: built)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="config overrides for every run, after the model's workload (e.g. batch.mini_batch_size=32)")
    args = parser.parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in args.seeds:  # placements interleaved per seed, so a change of load hits every placement
        for placement in args.placements:
            run = run_once(args.model, placement, seed, root=root, steps=args.steps,
                           start_model=args.start_model, overrides=tuple(args.set))
            runs.append(run)
            print(f"{args.model} {placement:<10} seed {seed} | steps_per_s {run['steps_per_s']:.4g} "
                  f"({1 / run['steps_per_s']:.3g} s/step) | load "
                  f"{run['load_before']:.2f} -> {run['load_after']:.2f} | "
                  + " ".join(f"{name.split('/')[1]} {value:.3g}" for name, value in run["phases"].items() if value)
                  + f" | old_log_prob_skipped {run['old_log_prob_skipped']:g}"
                  + " | reward "
                  + " ".join(f"{value:.2f}" for value in run["reward"]), flush=True)
    for line in summarize(runs):
        print(line)
    (root / f"curves_{args.model}.json").write_text(json.dumps(runs, indent=1))
    plot(runs, root / f"curves_{args.model}.png")
    print(f"wrote {root / f'curves_{args.model}.json'} and {root / f'curves_{args.model}.png'}")


if __name__ == "__main__":
    main()
