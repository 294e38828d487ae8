"""The `hybridflow` command: one subcommand per job, each implemented in the module that owns it."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module:function", one-line help). Each function takes the remaining argv (list of
# str) and returns an exit code; importing lazily keeps `hybridflow --help` fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("hybridflow.trainers.demo:main", "whole pipeline (SFT -> reward model -> PPO) on the built-in task, CPU"),
    "train": ("hybridflow.trainers.cli:train_main", "RL training (PPO, GRPO, ReMax, ...) from a YAML config"),
    "sft": ("hybridflow.trainers.cli:sft_main", "supervised fine-tuning on prompt/response pairs"),
    "rm": ("hybridflow.trainers.cli:rm_main", "reward-model training on chosen/rejected pairs"),
    "export": ("hybridflow.trainers.export:export_main", "a run's checkpoint -> Hugging Face directories (+ tokenizer)"),
    "data": ("hybridflow.data.cli:data_main", "write the built-in task's prompt/SFT/preference files"),
    "plan": ("hybridflow.mapping.cli:plan_main", "auto-mapping: placement, allocation and parallelism"),
    "calibrate": ("hybridflow.calibrate:calibrate_main", "measure this machine's FLOP/s and bandwidths"),
}


def _usage() -> str:
    lines = ["usage: hybridflow COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    lines += ["", "`hybridflow COMMAND --help` describes each command's arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"hybridflow: unknown command {name!r}; allowed: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    module_name, function_name = target.split(":")
    from hybridflow.trainers.boundary import errors_directory, run_guarded

    # every command answers a failure in one line (train, sft and rm name their run's errors/ directory)
    return run_guarded(f"hybridflow {name}",
                       lambda: int(getattr(importlib.import_module(module_name), function_name)(rest) or 0),
                       errors_dir=lambda: errors_directory(None))


if __name__ == "__main__":
    sys.exit(main())
