"""The planner's overlap model against measured runs: `python benchmarks/bench_async_placement.py --hardware
PROFILE.json [--steps 8] [--placements colocated split-k0 split-k1] [--new-tokens 24] [--predict-only]`.

GRPO on the built-in arithmetic model (the workload of benchmarks/bench_async.py: 16 prompts x 4 samples, 24 new
tokens) on two CPU processes under Ray, in four placements: ``colocated`` (actor and reference on one pool of 2,
the actor generating through the 3D-HybridEngine, synchronous), ``split-k0`` (actor and reference on one process,
a rollout replica on the other, taking turns), ``split-k1`` (the same split, the replica generating one step
ahead: async.max_staleness=1) and ``split-k1-ref-gen`` (split-k1 with the reference on the replica's process,
scoring each batch there ahead of the trainer). For each it prints the planner's predicted seconds per step
(``simulate_plan`` of that layout on the hardware profile given: docs/async.md, "Placement"; with the reference
on the rollout pool its seconds count on the rollout side) and the measured steps per second over steps 2..N with
the load average before and after; then the ratios of the predictions and of the measurements.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.mapping import Plan, simulate_plan
from hybridflow.trainers.auto_mapping import planning_inputs
from hybridflow.trainers.config.rl import RLConfig, load_rl_config

SPLIT = ["placement.pools={trainer: [1], gen: [1]}",
         "placement.roles={actor: trainer, reference: trainer, rollout: gen}"]
PLACEMENTS = {
    "colocated": ["placement.pools={cluster: [2]}", "placement.roles={actor: cluster, reference: cluster}"],
    "split-k0": SPLIT + ["async.max_staleness=0"],
    "split-k1": SPLIT + ["async.max_staleness=1"],
    # the reference with the rollout replica: it scores each batch there as soon as it is generated, while the
    # trainer updates on the batch before (docs/async.md, "Scoring ahead on the rollout pool")
    "split-k1-ref-gen": ["placement.pools={trainer: [1], gen: [1]}",
                         "placement.roles={actor: trainer, reference: gen, rollout: gen}", "async.max_staleness=1"],
}


def config_of(placement: str, *, directory: Path, steps: int, hardware: str, new_tokens: int = 24,
              prompts: int = 16, prompt_tokens: int = 16) -> RLConfig:
    return load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        f"actor.generation.max_new_tokens={new_tokens}", f"actor.generation.min_new_tokens={new_tokens}",
        "actor.engine.optim.lr=1e-4", "algorithm.advantage_estimator=grpo", f"batch.prompts_per_step={prompts}",
        "batch.samples_per_prompt=4", f"batch.mini_batch_size={prompts * 4}", f"trainer.total_steps={steps}",
        "trainer.progress_bar=false", f"trainer.output_dir={directory / placement}", "actor.loss.tis_cap=2.0",
        # the planner costs prompts at this length (padded); the task's are a few tokens, so the run is unchanged
        f"data.max_prompt_tokens={prompt_tokens}",
        "placement.runtime=ray", f"placement.hardware={hardware}", *PLACEMENTS[placement]])


def predicted_seconds(config: RLConfig) -> Plan:
    """The planner's prediction for the config's own placement and layouts."""
    placement = config.placement
    fragment: dict = {"placement": {"pools": placement.pools, "roles": placement.roles},
                      "async": {"max_staleness": config.asynchrony.max_staleness}}
    for role in config.active_roles:
        engine = config.section_of(role).engine
        fragment[role] = {"engine": {"layout": engine.layout, "pp_size": engine.pp_size, "tp_size": engine.tp_size}}
    if placement.rollout_pool is None:
        hybrid = config.actor.hybrid_engine
        fragment["actor"]["hybrid_engine"] = {"pp_size": hybrid.pp_size, "tp_size": hybrid.tp_size}
    inputs = planning_inputs(config)
    inputs.pop("kv_cache_gib")
    return simulate_plan(Plan.from_config_fragment(fragment), inputs.pop("dataflow"), **inputs)


def prediction_text(config: RLConfig, placement: str, predicted: dict[str, float]) -> str:
    """The planner's seconds per step for ``placement`` (kept in ``predicted``) with its stages, as printed."""
    plan = predicted_seconds(config)
    predicted[placement] = plan.total_seconds
    detail = plan.overlap_text() if plan.overlap is not None else \
        ", ".join(f"{stage} {seconds:.3g}" for stage, seconds in plan.stage_seconds.items())
    return f"predicted {plan.total_seconds:.3f} s/step ({detail})"


def auto_choice_text(config: RLConfig) -> str:
    """What ``placement.mapping: auto`` (k = 1) picks for ``config``'s workload on its hardware profile, as printed:
    the plan's mode, placement and predicted seconds per step."""
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    auto = replace(config, placement=replace(config.placement, mapping="auto", pools={"cluster": [2]}, roles={}))
    _, chosen = resolve_auto_mapping(auto)
    roles = ", ".join(f"{pool.name}: {'+'.join(pool.roles)}" for pool in chosen.all_pools)
    layouts = ", ".join(f"{role} {strategy.layout}" for role, strategy in chosen.strategies.items())
    return f"mapping=auto picks {chosen.mode} ({roles}; {layouts}): predicted {chosen.total_seconds:.3f} s/step"


def timed_fit(config: RLConfig) -> tuple[list[dict], list[float], float, float]:
    """Train ``config`` to its end: (metrics history, wall-clock stamp of every step's end, load average before,
    load average after)."""
    from hybridflow.trainers.rl import RLTrainer

    load_before = os.getloadavg()[0]
    trainer = RLTrainer(config, tensorboard=False)
    stamps: list[float] = []
    try:
        trainer.fit(on_step=lambda step, metrics: stamps.append(time.perf_counter()))
        history = trainer.logger.history
    finally:
        trainer.shutdown()
    return history, stamps, load_before, os.getloadavg()[0]


def measure(config: RLConfig) -> dict[str, float]:
    history, stamps, load_before, load_after = timed_fit(config)
    wait = [metrics.get("async/wait_generation_s", 0.0) for metrics in history[1:]]
    phases = sorted(name for name in history[-1] if name.startswith("time/") and name.endswith("_s"))
    print("  measured phases (mean s, steps 2..N): " + ", ".join(
        f"{name[5:]} {sum(metrics.get(name, 0.0) for metrics in history[1:]) / (len(history) - 1):.3f}"
        for name in phases), flush=True)
    return {"steps_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]), "wait_generation_s": sum(wait) / len(wait),
            "load_before": load_before, "load_after": load_after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", required=True, help="placement.hardware: a profile JSON file, or cpu-local")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=list(PLACEMENTS))
    parser.add_argument("--new-tokens", type=int, default=24,
                        help="tokens per response (default 24; 5 is the workload of benchmarks/bench_async_curves.py "
                             "--model small)")
    parser.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    args = parser.parse_args()
    predicted, measured = {}, {}
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        write_jsonl(directory / "train.jsonl", prompt_rows(256, split="train", seed=0,
                                                           config=ArithmeticTaskConfig(max_digits=2)))
        print(auto_choice_text(config_of("split-k1", directory=directory, steps=args.steps, hardware=args.hardware,
                                         new_tokens=args.new_tokens)), flush=True)
        for placement in args.placements:
            config = config_of(placement, directory=directory, steps=args.steps, hardware=args.hardware,
                               new_tokens=args.new_tokens)
            line = f"{placement:<16} | {prediction_text(config, placement, predicted)}"
            if not args.predict_only:
                measured[placement] = measure(config)
                line += " | " + " | ".join(f"{key} {value:.3f}" for key, value in measured[placement].items())
            print(line, flush=True)
    for first, second in (("split-k0", "split-k1"), ("colocated", "split-k1"), ("split-k0", "colocated"),
                          ("split-k1", "split-k1-ref-gen")):
        if first in measured and second in measured or first in predicted and second in predicted:
            text = f"{second} vs {first}: predicted speed-up " + (
                f"{predicted[first] / predicted[second]:.2f}x" if first in predicted and second in predicted else "n/a")
            if first in measured and second in measured:
                text += f", measured {measured[second]['steps_per_s'] / measured[first]['steps_per_s']:.2f}x"
            print(text)


if __name__ == "__main__":
    main()
