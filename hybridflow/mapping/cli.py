"""`hybridflow plan`: search a mapping, print it, write it as a config fragment.

(`hybridflow calibrate` lives in hybridflow.calibrate: it needs torch, the planner does not.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from hybridflow.mapping.cluster import GRANULARITIES, Cluster, check_granularity
from hybridflow.mapping.dataflow import DATAFLOWS, Dataflow, dataflow
from hybridflow.mapping.hardware import LOCAL_PROFILE_NAMES, builtin_profile_names, load_hardware
from hybridflow.mapping.model_spec import KNOWN_MODELS
from hybridflow.mapping.plan import format_table
from hybridflow.mapping.rollout import ROLLOUT_BACKENDS
from hybridflow.mapping.search import plan
from hybridflow.mapping.workload import Workload


def _plan_parser() -> argparse.ArgumentParser:
    models_help = f"a known name ({', '.join(KNOWN_MODELS)}) or a local Hugging Face model directory"
    parser = argparse.ArgumentParser(
        prog="hybridflow plan",
        description="Find the placement, device allocation and parallel sizes that minimize the simulated "
                    "RLHF iteration time (HybridFlow auto-mapping).")
    parser.add_argument("--algorithm", default="ppo", choices=sorted(DATAFLOWS), help="dataflow (default ppo)")
    parser.add_argument("--actor", required=True, help=f"actor model: {models_help}")
    parser.add_argument("--critic", help="critic model (algorithms with a critic)")
    parser.add_argument("--reference", help="reference model (default: the actor's)")
    parser.add_argument("--reward", help="reward model (default: the critic's, else the actor's); 'none' for a "
                                         "rule-based reward (no reward model to place)")
    parser.add_argument("--cost", help="cost model for safe-rlhf (default: the reward's)")
    parser.add_argument("--devices", type=int, required=True, help="devices (GPUs or CPU processes) in all")
    parser.add_argument("--per-node", type=int, default=8, help="devices per node (default 8)")
    parser.add_argument("--prompt-len", type=int, required=True, help="prompt tokens")
    parser.add_argument("--response-len", type=int, required=True, help="response tokens")
    parser.add_argument("--batch", type=int, required=True, help="prompts per step")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="responses per prompt (default 1)")
    parser.add_argument("--mini-batch", type=int, default=0, help="samples per optimizer update (0: all)")
    parser.add_argument("--ppo-epochs", type=int, default=1, help="passes over the samples in training")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="per rank (0: one sequence)")
    parser.add_argument("--hardware", default="a100-80g",
                        help=f"{', '.join(builtin_profile_names())}, {' or '.join(LOCAL_PROFILE_NAMES.values())} "
                             f"(after `hybridflow calibrate`) or a profile JSON file (default a100-80g)")
    parser.add_argument("--backend", default="native",
                        help=f"the actor's rollout engine, actor.generation.backend: {', '.join(ROLLOUT_BACKENDS)} "
                             f"(default native; vllm generates with tg = pg = 1 only)")
    parser.add_argument("--kv-cache-gib", type=float, default=None,
                        help="KV cache the rollout engine allocates per device, GiB (vllm: "
                             "actor.generation.vllm_kv_cache_gib); default: all memory the roles leave")
    parser.add_argument("--granularity", default="node",
                        help=f"pool sizes searched: {'; '.join(f'{name}: {text}' for name, text in GRANULARITIES.items())} "
                             f"(default node)")
    parser.add_argument("--max-staleness", type=int, default=0,
                        help="async.max_staleness k: with k >= 1 also weigh splits with a rollout pool of their own, "
                             "pipelined with staleness k (docs/async.md, \"Placement\"); 0: synchronous placements "
                             "only (default)")
    parser.add_argument("--top", type=int, default=10, help="placements to list (default 10)")
    parser.add_argument("--write", metavar="PATH", help="write the chosen plan as a YAML config fragment")
    return parser


def _dataflow_and_models(args: argparse.Namespace) -> tuple[Dataflow, dict[str, str]]:
    flow = dataflow(args.algorithm)
    if args.reward == "none":  # a rule-based reward runs on the driver: no model to place
        flow = replace(flow, roles={role: kind for role, kind in flow.roles.items() if role != "reward"})
    reward_default = args.critic or args.actor
    given = {"actor": args.actor, "critic": args.critic, "reference": args.reference or args.actor,
             "reward": args.reward or reward_default, "cost": args.cost or args.reward or reward_default}
    if "critic" in flow.roles and not args.critic:
        raise ValueError(f"--critic is required for --algorithm {args.algorithm}")
    if "critic" not in flow.roles and args.critic:
        raise ValueError(f"--algorithm {args.algorithm} has no critic; drop --critic")
    if "cost" in flow.roles and given["cost"] == "none":
        raise ValueError("--cost is required for --algorithm safe-rlhf when --reward is none")
    return flow, {role: given[role] for role in flow.roles}


def plan_main(argv: list[str]) -> int:
    args = _plan_parser().parse_args(argv)
    try:
        if args.backend not in ROLLOUT_BACKENDS:
            raise ValueError(f"--backend (actor.generation.backend) must be one of {', '.join(ROLLOUT_BACKENDS)}, "
                             f"got {args.backend!r}")
        check_granularity(args.granularity)
        _check_sizes(args)
        if args.write:
            _check_writable(args.write)
        workload = Workload(prompts_per_step=args.batch, prompt_length=args.prompt_len,
                            response_length=args.response_len, samples_per_prompt=args.samples_per_prompt,
                            mini_batch_size=args.mini_batch, ppo_epochs=args.ppo_epochs,
                            micro_batch_tokens=args.micro_batch_tokens)
        cluster = Cluster(num_devices=args.devices, devices_per_node=args.per_node,
                          hardware=load_hardware(args.hardware))
        start = time.perf_counter()
        flow, models = _dataflow_and_models(args)
        best = plan(flow, models, workload, cluster, top=args.top, backend=args.backend,
                    kv_cache_gib=args.kv_cache_gib, granularity=args.granularity, max_staleness=args.max_staleness)
        search_seconds = time.perf_counter() - start
    except ValueError as error:
        print(f"hybridflow plan: {error}", file=sys.stderr)
        return 2
    print(f"{args.algorithm} on {args.devices} x {cluster.hardware.name} ({args.per_node} per node), "
          f"{best.backend} rollout; "
          f"search took {search_seconds:.2f} s\n")
    print(best.describe())
    print(f"\ntop placements (each with its best allocation):\n{format_table([best, *best.alternatives])}")
    if args.write:
        import yaml

        with open(args.write, "w") as handle:
            handle.write(f"# hybridflow plan: {best.placement_label} on {best.allocation_label} devices, "
                         f"predicted {best.total_seconds:.1f} s per iteration ({cluster.hardware.name})\n"
                         f"# planned for: {_workload_text(workload)}, rollout backend {best.backend}\n")
            yaml.safe_dump(best.to_config_fragment(), handle, sort_keys=False)
        print(f"\nwrote {args.write}")
    return 0


def _workload_text(workload: Workload) -> str:
    """The batch the plan was searched for, in the trainer's batch vocabulary (its layouts split it evenly)."""
    return (f"{workload.prompts_per_step} prompts per step x {workload.samples_per_prompt} samples, prompt "
            f"{workload.prompt_length} + response {workload.response_length} tokens, mini-batch "
            f"{workload.samples_per_update} samples, {workload.ppo_epochs} epoch(s), micro-batch tokens "
            f"{workload.micro_batch_tokens or workload.sequence_length}")


# flags that count something: the error names the flag, not the planner's field it becomes
POSITIVE_FLAGS = ("devices", "per_node", "prompt_len", "response_len", "batch", "samples_per_prompt", "ppo_epochs",
                  "top")
NON_NEGATIVE_FLAGS = ("mini_batch", "micro_batch_tokens")


def _check_sizes(args: argparse.Namespace) -> None:
    """ValueError naming the flag for a count below its bound, and for a --hardware file that does not exist."""
    for names, bound in ((POSITIVE_FLAGS, 1), (NON_NEGATIVE_FLAGS, 0)):
        for name in names:
            value = getattr(args, name)
            if value < bound:
                raise ValueError(f"--{name.replace('_', '-')} got {value}; allowed: an integer >= {bound}")
    if args.devices > args.per_node and args.devices % args.per_node:
        raise ValueError(f"--devices got {args.devices}; allowed: at most --per-node ({args.per_node}) or a multiple "
                         f"of it (whole nodes)")
    hardware = args.hardware
    if (hardware.endswith(".json") or os.sep in hardware) and not Path(hardware).is_file():
        raise ValueError(f"--hardware {hardware!r}: the profile file "
                         f"{'is a directory' if Path(hardware).is_dir() else 'does not exist'}")


def _check_writable(path: str) -> None:
    """ValueError before searching if ``--write`` cannot create its file."""
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"--write {path!r} is a folder; give a file path such as {target / 'plan.yaml'}")
    if not folder.is_dir():
        raise ValueError(f"--write {path!r}: folder {str(folder)!r} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--write {path!r}: folder {str(folder)!r} is not writable")
