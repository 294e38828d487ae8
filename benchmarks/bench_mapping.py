"""Auto-mapping benchmark: search time, the paper's placement sweep, and predicted-vs-measured ranking.

    python benchmarks/bench_mapping.py                      # paper vs planner, figure 15, search times
    python benchmarks/bench_mapping.py --granularity divisor   # the same with pools of whole nodes + part of one
    python benchmarks/bench_mapping.py --granularity-sweep  # node vs divisor granularity, 7B-70B on 16-128 GPUs
    python benchmarks/bench_mapping.py --search-times --granularity divisor   # search times only
    python benchmarks/bench_mapping.py --backends           # native vs vllm rollout: the plans each gets
    python benchmarks/bench_mapping.py --native-decode      # the native engine's measured H100 decode, predicted
    python benchmarks/bench_mapping.py --template out.json  # tiny-PPO layouts to measure, with predictions
    python benchmarks/bench_mapping.py --template out.json --model small --max-ranks 8   # small model, 2-8 ranks
    python benchmarks/bench_mapping.py --measure runs.json  # run each layout with the PPO trainer (Ray)
    python benchmarks/bench_mapping.py --validate-measured measured.json   # Spearman rho vs measurements

The measured-runs file (--template writes one with measured_seconds = null):
    {"algorithm": "ppo", "hardware": "cpu-local", "per_node": 4,
     "models": {"actor": "tiny", ...}, "workload": {"prompts_per_step": 16, ...},
     "runs": [{"name": "...", "config": {<the config fragment the run used>}, "measured_seconds": 12.3}, ...]}
measured_seconds is the mean iteration time the trainer measured with that config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from hybridflow.mapping import (Cluster, Plan, PoolPlan, RoleStrategy, Workload, load_hardware, plan, simulate_plan,
                                spearman_correlation)
from hybridflow.mapping.dataflow import dataflow
from hybridflow.mapping.rollout import NATIVE, RolloutBackend
from hybridflow.mapping.search import Planner, resolve_models

PPO_ROLES = ("actor", "critic", "reference", "reward")
# the command: PPO, prompt = response = 1024, 1024 prompts per step, 8 PPO updates (mini-batch 128)
PAPER_WORKLOAD = Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024, mini_batch_size=128)
# section 8.3 / figures 12-13: the placement the paper found best per model size and GPU count
PAPER_PLACEMENTS = {
    ("llama-13b", 16): "colocate", ("llama-13b", 32): "colocate", ("llama-13b", 64): "colocate",
    ("llama-13b", 96): "split actor+ref | critic+rm 48|48", ("llama-13b", 128): "standalone 64|32|16|16",
    ("llama-34b", 32): "colocate", ("llama-34b", 64): "colocate",
    ("llama-34b", 96): "split actor+ref | critic+rm 48|48", ("llama-34b", 128): "split actor+ref | critic+rm 64|64",
}
PAPER_LABELS = {"colocate": "actor+critic+reference+reward", "split": "actor+reference | critic+reward",
                "standalone": "actor | critic | reference | reward"}


def _short(plan: Plan) -> str:
    if len(plan.pools) == 1:
        return "colocate"
    return f"{plan.placement_label} {plan.allocation_label}"


def paper_sweep(hardware: str, workload: Workload = PAPER_WORKLOAD, backend: RolloutBackend = NATIVE,
                granularity: str = "node") -> None:
    """Paper vs planner for every case of section 8.3, with the paper's placement's rank and time."""
    if backend != NATIVE:
        print(f"what-if rollout model: {backend}")
    print(f"PPO, 4 models of one size, {workload.prompts_per_step} prompts, prompt {workload.prompt_length} + "
          f"response {workload.response_length}, mini-batch {workload.samples_per_update}, micro-batch "
          f"{workload.sequences_per_micro_batch} sequence(s), {load_hardware(hardware).name}, 8 per node"
          + (", uneven batches padded" if workload.pad_uneven else "")
          + ("" if workload.pad_generation else ", generation replicas dividing the prompts (no padding)")
          + f", pool granularity {granularity}")
    print(f"{'model':<10} {'GPUs':>4} {'search s':>8}  {'paper':<36} {'planner':<44} {'iter s':>7}  "
          f"paper's placement: rank, iter s")
    for (model, num_devices), paper in PAPER_PLACEMENTS.items():
        cluster = Cluster(num_devices=num_devices, devices_per_node=8, hardware=load_hardware(hardware))
        start = time.perf_counter()
        best = plan("ppo", dict.fromkeys(PPO_ROLES, model), workload, cluster, top=15, backend=backend,
                    granularity=granularity)
        seconds = time.perf_counter() - start
        ranked = [best, *best.alternatives]
        label = PAPER_LABELS[paper.split()[0]]
        rank, theirs = next((i + 1, p) for i, p in enumerate(ranked) if p.placement_label == label)
        print(f"{model:<10} {num_devices:>4} {seconds:>8.2f}  {paper:<36} {_short(best):<44} "
              f"{best.total_seconds:>7.1f}  {rank}, {theirs.total_seconds:.1f} ({theirs.allocation_label}; "
              f"gen {theirs.stage_seconds['generation']:.1f} prep {theirs.stage_seconds['preparation']:.1f} "
              f"train {theirs.stage_seconds['training']:.1f} vs {best.stage_seconds['generation']:.1f} "
              f"{best.stage_seconds['preparation']:.1f} {best.stage_seconds['training']:.1f})")


def _pool_memory_gib(planner: Planner, candidate: Plan) -> list[float]:
    """Per pool, the GiB per device its roles keep resident plus the largest working set (of a usable budget)."""
    shares = planner.stage_shares([pool.roles for pool in candidate.pools], [pool.num_devices for pool in candidate.pools])
    used = []
    for pool in candidate.pools:
        costs = planner.set_result(pool.roles, pool.num_devices, shares).costs.values()
        used.append((sum(c.resident_bytes for c in costs) + max(c.transient_bytes for c in costs)) / 2**30)
    return used


def break_even(hardware: str, workload: Workload = PAPER_WORKLOAD, granularity: str = "node") -> None:
    """For each case where the planner's choice is not the paper's: how far apart they are, what the paper's
    placement gains and loses per stage, how full the devices are (resident state + largest working set,
    before the KV cache), and the break-even factor: how many times slower the chosen plan's preparation and
    training (the stages that a split runs side by side) would have to be for the paper's placement to tie."""
    print("cases that differ: gap, per-stage difference (paper's - chosen), memory per device, break-even factor")
    for (model, num_devices), paper in PAPER_PLACEMENTS.items():
        cluster = Cluster(num_devices=num_devices, devices_per_node=8, hardware=load_hardware(hardware))
        models = dict.fromkeys(PPO_ROLES, model)
        best = plan("ppo", models, workload, cluster, top=15, granularity=granularity)
        label = PAPER_LABELS[paper.split()[0]]
        if best.placement_label == label:
            continue
        theirs = next(p for p in best.alternatives if p.placement_label == label)
        planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(models), workload=workload, cluster=cluster,
                          granularity=granularity)
        usable = cluster.hardware.usable_memory_bytes / 2**30
        deltas = " ".join(f"{stage[:4]} {theirs.stage_seconds[stage] - best.stage_seconds[stage]:+.1f}"
                          for stage in best.stage_seconds)
        chosen_memory = "|".join(f"{gib:.0f}" for gib in _pool_memory_gib(planner, best))
        their_memory = "|".join(f"{gib:.0f}" for gib in _pool_memory_gib(planner, theirs))
        paper_sets = [tuple(block.split("+")) for block in label.split(" | ")]
        paper_allocation = (num_devices,) if paper == "colocate" else tuple(
            int(count) for count in paper.split()[-1].split("|"))
        exact = planner.plan_for(paper_sets, paper_allocation)
        at_paper = "" if theirs.allocation_label == "|".join(map(str, paper_allocation)) else (
            f" (at the paper's {theirs.allocation_label if paper == 'colocate' else paper.split()[-1]}: " + (f"{exact.total_seconds:.1f} s, generation "
                                                          f"{exact.stage_seconds['generation']:.1f} s)" if exact else "no layout)"))
        scaled = best.stage_seconds["preparation"] + best.stage_seconds["training"]
        factor = (theirs.total_seconds - best.stage_seconds["generation"]) / scaled
        print(f"  {model} on {num_devices}: paper's {theirs.allocation_label} {theirs.total_seconds:.1f} s vs "
              f"{_short(best)} {best.total_seconds:.1f} s (+{100 * (theirs.total_seconds / best.total_seconds - 1):.1f}%){at_paper}; "
              f"{deltas} s; GiB per device {their_memory} vs {chosen_memory} of {usable:.0f}; break-even x{factor:.2f}")


def generation_tp_sweep(hardware: str, workload: Workload = PAPER_WORKLOAD) -> None:
    """Figure 15: 16 GPUs, all models colocated, each 3d p1 t8 (d = 2), the actor generating with tg = 1..8."""
    cluster = Cluster(num_devices=16, devices_per_node=8, hardware=load_hardware(hardware))
    print("generation seconds by generation TP size tg (16 GPUs, colocated, training 1-8-2):")
    for model in ("llama-7b", "llama-13b"):
        seconds = {}
        for tg in (1, 2, 4, 8):
            strategies = {role: RoleStrategy(layout="3d", pp_size=1, tp_size=8) for role in PPO_ROLES}
            strategies["actor"] = RoleStrategy(layout="3d", pp_size=1, tp_size=8, generation_pp_size=1,
                                               generation_tp_size=tg)
            layout = Plan(pools=(PoolPlan(name="all", roles=PPO_ROLES, devices_per_node=(8, 8)),),
                          strategies=strategies)
            seconds[tg] = simulate_plan(layout, "ppo", dict.fromkeys(PPO_ROLES, model), workload,
                                        cluster).stage_seconds["generation"]
        best = min(seconds, key=seconds.get)
        print(f"  {model:<10} " + "  ".join(f"tg={tg}: {s:6.1f}s" for tg, s in seconds.items())
              + f"  best tg={best}, {100 * (1 - seconds[best] / seconds[8]):.1f}% below tg=8")


def search_times(hardware: str, workload: Workload = PAPER_WORKLOAD, granularity: str = "node") -> None:
    """Search wall and CPU seconds of 4 models on 128 and 512 GPUs (the issue's targets: 10 s, 60 s)."""
    import os

    for model, num_devices in (("llama-13b", 128), ("llama-70b", 128), ("llama-7b", 512), ("llama-13b", 512),
                               ("llama-70b", 512)):
        cluster = Cluster(num_devices=num_devices, devices_per_node=8, hardware=load_hardware(hardware))
        wall, cpu = time.perf_counter(), time.process_time()
        best = plan("ppo", dict.fromkeys(PPO_ROLES, model), workload, cluster, top=3, granularity=granularity)
        print(f"search {model} x4 on {num_devices} ({granularity}): {time.perf_counter() - wall:.2f} s wall, "
              f"{time.process_time() - cpu:.2f} s CPU, load average {os.getloadavg()[0]:.1f}: "
              f"{_short(best)} {best.total_seconds:.1f} s")


def granularity_sweep(hardware: str, workload: Workload = PAPER_WORKLOAD) -> None:
    """Per model and cluster: the plan of each granularity, and the best plan with a pool of whole nodes plus part
    of one (its rank among the 15 placements' best allocations under ``divisor``)."""
    print("granularity node vs divisor (the paper's workload); best plan with a pool of whole nodes + part of one")
    for model in ("llama-7b", "llama-13b", "llama-34b", "llama-70b"):
        for num_devices in (16, 24, 32, 48, 64, 96, 128):
            cluster = Cluster(num_devices=num_devices, devices_per_node=8, hardware=load_hardware(hardware))
            chosen = []
            for granularity in ("node", "divisor"):
                try:
                    chosen.append(plan("ppo", dict.fromkeys(PPO_ROLES, model), workload, cluster, top=15,
                                       granularity=granularity))
                except ValueError:
                    chosen.append(None)
            if chosen[0] is None:
                print(f"{model:<10} {num_devices:>4}  no plan")
                continue
            ranked = [chosen[1], *chosen[1].alternatives]
            partial = next(((rank, p) for rank, p in enumerate(ranked, start=1)
                            if any(pool.num_devices > 8 and pool.num_devices % 8 for pool in p.pools)), None)
            same = "same" if (chosen[0].placement_label, chosen[0].allocation_label) == (
                chosen[1].placement_label, chosen[1].allocation_label) else "CHANGED"
            partial_text = (f"{partial[1].placement_label} {partial[1].allocation_label} "
                            f"{partial[1].total_seconds:.1f} s, rank {partial[0]}") if partial else "none"
            print(f"{model:<10} {num_devices:>4}  node: {_short(chosen[0])} {chosen[0].total_seconds:.1f} s; "
                  f"divisor: {_short(chosen[1])} {chosen[1].total_seconds:.1f} s ({same}); with a part: {partial_text}")


# PPO layouts runnable on 1-8 CPU processes (the measured validation)
TINY_LAYOUTS: dict[str, dict] = {
    "colocated-2-fsdp": {"pools": {"all": [2]}, "roles": dict.fromkeys(PPO_ROLES, "all"), "actor_tp": 1},
    "colocated-4-fsdp": {"pools": {"all": [4]}, "roles": dict.fromkeys(PPO_ROLES, "all"), "actor_tp": 1},
    "colocated-4-actor-tp2": {"pools": {"all": [4]}, "roles": dict.fromkeys(PPO_ROLES, "all"), "actor_tp": 2},
    "split-2-2": {"pools": {"actor_reference": [2], "critic_reward": [2]},
                  "roles": {"actor": "actor_reference", "reference": "actor_reference",
                            "critic": "critic_reward", "reward": "critic_reward"}, "actor_tp": 1},
    "standalone-1-1-1-1": {"pools": {role: [1] for role in PPO_ROLES}, "roles": {role: role for role in PPO_ROLES},
                           "actor_tp": 1},
    # added after the first three measurements (the model was not changed afterwards): blind checks
    "actor-2-others-2": {"pools": {"actor": [2], "others": [2]},
                         "roles": {"actor": "actor", "critic": "others", "reference": "others", "reward": "others"},
                         "actor_tp": 1},
    "trained-2-scorers-2": {"pools": {"trained": [2], "scorers": [2]},
                            "roles": {"actor": "trained", "critic": "trained", "reference": "scorers",
                                      "reward": "scorers"}, "actor_tp": 1},
    # 8 processes (`--max-ranks 8`): the same placements twice as wide, written before any was measured
    "colocated-8-fsdp": {"pools": {"all": [8]}, "roles": dict.fromkeys(PPO_ROLES, "all"), "actor_tp": 1},
    "colocated-8-actor-tp2": {"pools": {"all": [8]}, "roles": dict.fromkeys(PPO_ROLES, "all"), "actor_tp": 2},
    "split-4-4": {"pools": {"actor_reference": [4], "critic_reward": [4]},
                  "roles": {"actor": "actor_reference", "reference": "actor_reference",
                            "critic": "critic_reward", "reward": "critic_reward"}, "actor_tp": 1},
    "standalone-2-2-2-2": {"pools": {role: [2] for role in PPO_ROLES}, "roles": {role: role for role in PPO_ROLES},
                           "actor_tp": 1},
    "actor-4-others-4": {"pools": {"actor": [4], "others": [4]},
                         "roles": {"actor": "actor", "critic": "others", "reference": "others", "reward": "others"},
                         "actor_tp": 1},
}

MEASURED_MODELS = ("hybridflow/data/builtin/assets", "small")
"""Models ``--measure`` runs by name: the built-in arithmetic model (4 layers, hidden 128) and the 3.2 M parameter
model of benchmarks/vs_trl ("small", 4 layers, hidden 256), both with the arithmetic task's tokenizer."""


def layout_ranks(layout: dict) -> int:
    return sum(sum(sizes) for sizes in layout["pools"].values())


def model_directory(model: str) -> str:
    """The HF directory of "small" (built once under ~/.cache/hybridflow/bench_mapping); other names and paths as
    given ("tiny" is the planner's named tiny spec in predictions; ``--measure`` runs the built-in model for it)."""
    from pathlib import Path

    if model == "small":
        sys.path.insert(0, str(Path(__file__).resolve().parent / "vs_trl"))
        from assets import build_model_dir

        return str(build_model_dir("small", Path.home() / ".cache" / "hybridflow" / "bench_mapping"))
    return model


def tiny_fragment(layout: dict) -> dict:
    fragment = {"placement": {"pools": layout["pools"], "roles": layout["roles"]}}
    for role in PPO_ROLES:
        fragment[role] = {"engine": {"layout": "fsdp", "pp_size": 1, "tp_size": 1}}
    if layout["actor_tp"] > 1:
        fragment["actor"]["engine"] = {"layout": "3d", "pp_size": 1, "tp_size": layout["actor_tp"]}
    fragment["actor"]["hybrid_engine"] = {"pp_size": 1, "tp_size": layout["actor_tp"]}
    return fragment


def write_template(path: str, hardware: str, *, model: str = "tiny", prompts: int = 32, prompt_length: int = 32,
                   response_length: int = 32, max_ranks: int = 4) -> None:
    """The layouts of at most ``max_ranks`` processes (all on this one machine) with their predictions."""
    layouts = {name: layout for name, layout in TINY_LAYOUTS.items() if layout_ranks(layout) <= max_ranks}
    spec = {"algorithm": "ppo", "hardware": hardware, "per_node": max(4, max_ranks),
            "models": dict.fromkeys(PPO_ROLES, model),  # a name or path: model_directory() resolves it
            # 4096: the trainer's default micro-batch token budget (engine.micro_batch_tokens)
            "workload": {"prompts_per_step": prompts, "prompt_length": prompt_length,
                         "response_length": response_length, "micro_batch_tokens": 4096},
            "runs": [{"name": name, "config": tiny_fragment(layout), "measured_seconds": None}
                     for name, layout in layouts.items()]}
    for run, predicted in zip(spec["runs"], predict(spec)):
        run["predicted_seconds"] = round(predicted, 6)
    with open(path, "w") as handle:
        json.dump(spec, handle, indent=2)
    print(f"wrote {path}: {len(spec['runs'])} layouts to measure (fill in measured_seconds)")


def predict(spec: dict) -> list[float]:
    """Predicted iteration seconds of every run of a measured-runs spec."""
    workload = Workload(**spec["workload"])
    hardware = load_hardware(spec["hardware"])
    predictions = []
    for run in spec["runs"]:
        layout = Plan.from_config_fragment(run["config"])
        num_devices = sum(pool.num_devices for pool in layout.pools)
        cluster = Cluster(num_devices=num_devices, devices_per_node=min(spec["per_node"], num_devices),
                          hardware=hardware)
        models = {role: model_directory(model) for role, model in spec["models"].items()}
        simulated = simulate_plan(layout, spec.get("algorithm", "ppo"), models, workload, cluster)
        predictions.append(simulated.total_seconds)
    return predictions


def _dotted(prefix: str, value, out: list[str]) -> list[str]:
    """Config overrides ``a.b=value`` of a nested fragment (placement pools/roles stay whole dicts)."""
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(item, dict) and name not in ("placement.pools", "placement.roles"):
            _dotted(name, item, out)
        else:
            out.append(f"{name}={json.dumps(item)}")
    return out


def measure(path: str, *, steps: int) -> None:
    """Run every layout of a runs file with the PPO trainer on the built-in arithmetic task (every role the
    runs file's model: the built-in arithmetic model or a directory) and store the mean seconds of steps 2..steps."""
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    from hybridflow.data.builtin import ASSETS_DIR

    with open(path) as handle:
        spec = json.load(handle)
    workload = spec["workload"]
    builtin = os.path.realpath(ASSETS_DIR)
    directories = {role: os.path.realpath(model_directory(spec["models"][role])) for role in PPO_ROLES}
    models = [f"{role}.model.builtin=arithmetic" if spec["models"][role] == "tiny" or directory == builtin
              else f"{role}.model.path={directory}" for role, directory in directories.items()]
    work_dir = tempfile.mkdtemp(prefix="bench_mapping_")
    train_path = os.path.join(work_dir, "train.jsonl")
    task = ArithmeticTaskConfig(min_digits=1, max_digits=3, operations=("+", "-", "*"))
    with open(train_path, "w") as handle:
        for row in prompt_rows(512, split="train", seed=0, config=task):
            handle.write(json.dumps(row) + "\n")
    ray.init(num_cpus=16, include_dashboard=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}})
    try:
        for run in spec["runs"]:
            overrides = [f"data.train_path={train_path}", f"data.max_prompt_tokens={workload['prompt_length']}",
                         *models,
                         f"batch.prompts_per_step={workload['prompts_per_step']}",
                         f"batch.mini_batch_size={workload['prompts_per_step']}",
                         f"actor.generation.max_new_tokens={workload['response_length']}",
                         f"trainer.total_steps={steps}", "trainer.progress_bar=false", "trainer.resume=false",
                         "trainer.overwrite=true",
                         f"trainer.output_dir={os.path.join(work_dir, run['name'])}",
                         *_dotted("", run["config"], [])]
            trainer = RLTrainer(load_rl_config(None, overrides), tensorboard=False)
            stamps: list[float] = []
            try:
                trainer.fit(on_step=lambda step, metrics: stamps.append(time.perf_counter()))
            finally:
                trainer.shutdown()
            per_step = [later - earlier for earlier, later in zip(stamps, stamps[1:])]  # step 1 warms up
            run["measured_seconds"] = sum(per_step) / len(per_step)
            run["measured_steps"] = per_step
            print(f"{run['name']:<28} {run['measured_seconds']:.3f} s/step {[round(s, 3) for s in per_step]}",
                  flush=True)
            with open(path, "w") as handle:
                json.dump(spec, handle, indent=2)
    finally:
        ray.shutdown()


def validate_measured(path: str, hardware: str | None = None) -> float:
    """Spearman's rho of the runs file's measured seconds against predictions from its profile (or ``hardware``)."""
    with open(path) as handle:
        spec = json.load(handle)
    if hardware:
        spec["hardware"] = hardware
    runs = spec["runs"]
    missing = [run["name"] for run in runs if run.get("measured_seconds") is None]
    if missing:
        raise ValueError(f"{path}: runs {missing} have no measured_seconds")
    predicted = predict(spec)
    measured = [float(run["measured_seconds"]) for run in runs]
    print(f"{'run':<28} {'predicted s':>12} {'measured s':>11}")
    for run, p, m in zip(runs, predicted, measured):
        print(f"{run['name']:<28} {p:>12.4f} {m:>11.3f}")
    rho = spearman_correlation(predicted, measured)
    print(f"Spearman rank correlation over {len(runs)} runs: {rho:.3f}")
    return rho


BACKEND_CASES = (("llama-7b", 16), ("llama-7b", 64), ("llama-13b", 16), ("llama-13b", 64), ("llama-13b", 128),
                 ("llama-34b", 64), ("llama-34b", 128))


def backend_comparison(hardware: str, workload: Workload = PAPER_WORKLOAD,
                       vllm_kv_cache_gib: float | None = None) -> None:
    """The plan the planner picks for each rollout backend (actor.generation.backend), per case; vllm's KV cache
    is ``vllm_kv_cache_gib`` per device, or all memory left."""
    print(f"\nrollout backend: native vs vllm ({hardware}, the paper's workload; vllm KV cache "
          f"{f'{vllm_kv_cache_gib:g} GiB' if vllm_kv_cache_gib else 'all memory left'})")
    print(f"{'model':<10} {'GPUs':>4}  {'backend':<7} {'planner':<44} {'actor (gen)':<26} {'waves x batch':>13} "
          f"{'load s':>6} {'gen s':>7} {'iter s':>7}")
    for model, num_devices in BACKEND_CASES:
        cluster = Cluster(num_devices=num_devices, devices_per_node=8, hardware=load_hardware(hardware))
        for backend in ("native", "vllm"):
            kv_cache_gib = vllm_kv_cache_gib if backend == "vllm" else None
            try:
                best = plan("ppo", dict.fromkeys(PPO_ROLES, model), workload, cluster, top=1, backend=backend,
                            kv_cache_gib=kv_cache_gib)
            except ValueError as error:
                print(f"{model:<10} {num_devices:>4}  {backend:<7} no plan: {error}")
                continue
            actor = best.strategies["actor"]
            planner = Planner(dataflow=dataflow("ppo"), models=resolve_models(dict.fromkeys(PPO_ROLES, model)),
                              workload=workload, cluster=cluster, backend=backend, kv_cache_gib=kv_cache_gib)
            pool = best.pool_of("actor")
            cost = planner.set_result(pool.roles, pool.num_devices).costs["actor"]
            waves = f"{cost.details['generation_waves']:.0f} x {cost.details['generation_batch']:.0f}"
            print(f"{model:<10} {num_devices:>4}  {backend:<7} {_short(best):<44} {actor.describe():<26} "
                  f"{waves:>13} {cost.details['weight_load_seconds']:>6.2f} "
                  f"{best.stage_seconds['generation']:>7.1f} {best.total_seconds:>7.1f}")


def native_decode_check() -> None:
    """The native engine's one GPU decode measurement (benchmarks/README.md, "GPU smoke plan": TinyLlama-1.1B's
    shape, bf16, 128 rows, prompt 128, 256 new tokens, one H100: 17,794-24,041 tokens/s) as the simulator
    predicts it with h100-80g, and with the host time per sequence traded for a lower decode bandwidth."""
    from hybridflow.mapping.hardware import HardwareProfile
    from hybridflow.mapping.model_spec import spec_from_hf_config
    from hybridflow.mapping.rollout import NATIVE
    from hybridflow.mapping.simulator import Simulator

    spec = spec_from_hf_config({"hidden_size": 2048, "num_hidden_layers": 22, "num_attention_heads": 32,
                                "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000},
                               name="tinyllama-1.1b")
    workload = Workload(prompts_per_step=128, prompt_length=128, response_length=256)
    strategy = RoleStrategy(layout="3d", generation_pp_size=1, generation_tp_size=1)
    base = load_hardware("h100-80g")
    print("native decode, TinyLlama-1.1B shape, 128 rows, prompt 128 + 256 new tokens, one H100 "
          "(measured 17,794-24,041 tokens/s)")
    for changes in ({}, {"decode_host_seconds_per_sequence": 0.0},
                    {"decode_host_seconds_per_sequence": 0.0, "native_decode_bandwidth_fraction": 0.12}):
        hardware = HardwareProfile(**(base.to_dict() | changes))
        simulator = Simulator(workload=workload, cluster=Cluster(num_devices=1, devices_per_node=1, hardware=hardware),
                              backend=NATIVE)
        seconds, _ = simulator.generation_seconds(spec, strategy, 1, 60 * 1024**3)
        print(f"  h100-80g {changes or '(as shipped)'}: {128 * 256 / seconds:,.0f} tokens/s predicted")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hardware", default="a100-80g", help="profile of the sweep (default a100-80g)")
    parser.add_argument("--micro-batch-tokens", type=int, default=0,
                        help="sweep: micro-batch token budget of the paper's workload (default 0: one sequence)")
    parser.add_argument("--pad-uneven", action="store_true",
                        help="sweep: allow layouts that do not split the batch evenly (padded, as the paper's 48-GPU "
                             "pools need); the trainer cannot run them")
    parser.add_argument("--even-generation", action="store_true",
                        help="sweep: only generation layouts whose replicas divide the prompts (Workload("
                             "pad_generation=False), the planner before the trainer accepted padded generation)")
    parser.add_argument("--decode-dispatch-us", type=float, default=None,
                        help="sweep, what-if: the profile's decode_dispatch_seconds_per_layer in microseconds (eager "
                             "decode: a step takes at least layers x this)")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=None,
                        help="--backends: vLLM's KV cache per device (default: all memory left)")
    parser.add_argument("--paged-kv", action="store_true",
                        help="sweep only, what-if: the native backend (tensor-parallel generation, no weight "
                             "copy) with vLLM's paged KV cache, as the paper's vLLM 0.3.1 in the 3D-HybridEngine had")
    parser.add_argument("--granularity", default="node",
                        help="sweep and search times: pool sizes searched, node (divisors of a node, then whole "
                             "nodes; default) or divisor (also whole nodes plus a divisor of a node)")
    parser.add_argument("--search-times", action="store_true",
                        help="print only the search times (4 models on 128 and 512 GPUs) at --granularity")
    parser.add_argument("--granularity-sweep", action="store_true",
                        help="7B-70B on 16-128 GPUs: the plan of each granularity and the best with a part of a node")
    parser.add_argument("--backends", action="store_true",
                        help="print the plans the native and the vllm rollout backends get on the paper's workload")
    parser.add_argument("--native-decode", action="store_true",
                        help="predict the native engine's measured H100 decode (benchmarks/README.md)")
    parser.add_argument("--template", metavar="PATH", help="write the tiny-PPO layouts to measure (cpu-local)")
    parser.add_argument("--template-hardware", default="cpu-local", help="profile of the template's predictions")
    parser.add_argument("--model", default="tiny",
                        help=f"template: model of every role ({' or '.join(MEASURED_MODELS)}, or an HF directory)")
    parser.add_argument("--max-ranks", type=int, default=4, choices=[4, 8],
                        help="template: measure the layouts of up to this many processes")
    parser.add_argument("--prompts", type=int, default=32, help="template: prompts per step")
    parser.add_argument("--prompt-len", type=int, default=32, help="template: prompt tokens")
    parser.add_argument("--response-len", type=int, default=32, help="template: response tokens")
    parser.add_argument("--measure", metavar="PATH", help="runs file: run each layout with the PPO trainer")
    parser.add_argument("--steps", type=int, default=5, help="--measure: steps per layout (the first is dropped)")
    parser.add_argument("--validate-measured", metavar="PATH", help="measured-runs JSON: print Spearman rho")
    parser.add_argument("--validate-hardware", metavar="PROFILE",
                        help="--validate-measured: predict with this profile instead of the runs file's")
    args = parser.parse_args(argv)
    if args.template:
        write_template(args.template, args.template_hardware, model=args.model, prompts=args.prompts,
                       prompt_length=args.prompt_len, response_length=args.response_len, max_ranks=args.max_ranks)
    elif args.measure:
        measure(args.measure, steps=args.steps)
    elif args.validate_measured:
        validate_measured(args.validate_measured, args.validate_hardware)
    elif args.native_decode:
        native_decode_check()
    elif args.granularity_sweep:
        granularity_sweep(args.hardware)
    elif args.search_times:
        search_times(args.hardware, granularity=args.granularity)
    elif args.backends:
        backend_comparison(args.hardware, replace(PAPER_WORKLOAD, micro_batch_tokens=args.micro_batch_tokens,
                                                  pad_uneven=args.pad_uneven,
                                                  pad_generation=not args.even_generation), args.vllm_kv_cache_gib)
    elif args.paged_kv:
        paper_sweep(args.hardware, replace(PAPER_WORKLOAD, micro_batch_tokens=args.micro_batch_tokens,
                                           pad_uneven=args.pad_uneven,
                                           pad_generation=not args.even_generation), replace(NATIVE, paged_kv_cache=True))
    else:
        workload = replace(PAPER_WORKLOAD, micro_batch_tokens=args.micro_batch_tokens, pad_uneven=args.pad_uneven,
                           pad_generation=not args.even_generation)
        hardware = args.hardware
        if args.decode_dispatch_us is not None:
            hardware = replace(load_hardware(hardware), decode_dispatch_seconds_per_layer=args.decode_dispatch_us * 1e-6)
            print(f"what-if: decode dispatch floor {args.decode_dispatch_us:g} us per layer and step")
        paper_sweep(hardware, workload, granularity=args.granularity)
        break_even(hardware, workload, granularity=args.granularity)
        generation_tp_sweep(hardware, workload)
        if workload == PAPER_WORKLOAD and args.decode_dispatch_us is None:
            search_times(hardware, granularity=args.granularity)
    return 0


if __name__ == "__main__":
    sys.exit(main())
