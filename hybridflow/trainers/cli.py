"""Command-line jobs: `hybridflow train|sft|rm CONFIG.yaml [key=value ...] [--local] [--print-config]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Each command's override examples: only keys of that command's config.
OVERRIDE_EXAMPLES = {
    "train": "actor.engine.optim.lr=1e-5 batch.prompts_per_step=64 placement.pools='{train: [8]}'",
    "sft": "engine.optim.lr=1e-5 batch_size=64 model.path=/my/model max_steps=100",
    "rm": "model.path=runs/sft/model reward_type=likelihood batch_size=64 engine.optim.lr=1e-5",
}


def usage_epilog(kind: str) -> str:
    """How overrides are written, with examples and the top-level keys of ``hybridflow KIND``'s config."""
    import dataclasses

    from hybridflow.trainers.config.rl import RLConfig  # config classes import no torch
    from hybridflow.trainers.config.supervised import RMConfig, SFTConfig

    cls = {"train": RLConfig, "sft": SFTConfig, "rm": RMConfig}[kind]
    keys = [field.name for field in dataclasses.fields(cls) if field.init]
    return (f"Overrides are dotted keys parsed as YAML, anywhere on the line, e.g. {OVERRIDE_EXAMPLES[kind]}. "
            f"Keys of the config: {', '.join(keys)}. docs/config.md (section \"hybridflow {kind}\") lists every key.")


def parse_job_args(prog: str, description: str, argv: list[str]) -> argparse.Namespace:
    """The config file, the ``key=value`` overrides (in any position, before or after flags) and the flags."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=usage_epilog(prog.split()[-1]))
    parser.add_argument("config", nargs="?", help="YAML config file (optional when every key is given as an override)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--local", action="store_true", help="run every worker inside this process (no Ray; debugging)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML (loadable as a config file) and exit")
    # intermixed: `train cfg.yaml --local a=1` puts a=1 after a flag, which plain parse_args rejects
    args = parser.parse_intermixed_args(argv)
    if args.config is not None and "=" in args.config:  # no file, only overrides
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def _fail(prog: str, error: Exception) -> int:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


def _importable_working_directory() -> None:
    """``reward.function=my_module:fn`` should find ``my_module.py`` where the user runs the command, as
    ``python -m`` does; the console script's sys.path lacks the working directory."""
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")


def _read_config_file(path: str | None) -> None:
    """A missing or malformed YAML file is reported before the config classes (and torch) are imported."""
    if path is None:
        return
    from hybridflow.trainers.config.loader import load_yaml

    try:
        load_yaml(path)
    except ValueError:
        raise
    except Exception as error:  # yaml's parser errors carry the line and column
        raise ValueError(f"config file {path!r}: {error}") from None


def train_main(argv: list[str]) -> int:
    """`hybridflow train`: RL training (PPO, GRPO, RLOO, ReMax, REINFORCE++) from an RLConfig."""
    import json

    # arguments first: `--help` and a bad file answer before torch is imported
    args = parse_job_args("hybridflow train", "RL training from a YAML config; the trained models are exported "
                          "to OUTPUT_DIR/final/<role> (Hugging Face directories with tokenizer files).", argv)
    _importable_working_directory()
    try:
        _read_config_file(args.config)
    except ValueError as error:
        return _fail("hybridflow train", error)
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.config.loader import dump_yaml, to_plain

    try:
        config = load_rl_config(args.config, args.overrides)
    except ValueError as error:
        return _fail("hybridflow train", error)
    if args.print_config:
        derived = "\n".join(f"#   {line}" for line in json.dumps(to_plain(config.derived())).splitlines())
        print(dump_yaml(config) + "# derived sizes (not config keys):\n" + derived)
        return 0
    from hybridflow.trainers.rl import RLTrainer

    try:
        trainer = RLTrainer(config, mode="local" if args.local else None)
    except ValueError as error:  # datasets, reward function specs, model directories
        return _fail("hybridflow train", error)
    from hybridflow.controller.errors import WorkerError, WorkerTimeoutError, user_message
    from hybridflow.rewards.plugin import RewardError
    from hybridflow.trainers.checkpoint import CheckpointSaveError

    try:
        history = trainer.fit()
    except CheckpointSaveError as error:
        return _fail("hybridflow train", error)
    except (WorkerError, WorkerTimeoutError, RewardError) as error:
        # one line naming role, rank, method and cause; the full remote traceback goes to a file
        return _fail("hybridflow train", user_message(error, trainer.output_dir / "errors"))
    finally:
        trainer.shutdown()
    last = history[-1] if history else {}
    summary = {key: value for key, value in last.items() if key.startswith(("val/", "reward/score_mean"))}
    print(f"finished step {trainer.step}: {json.dumps(summary)}; metrics in {trainer.logger.path}; "
          f"models in {trainer.output_dir / 'final'}")
    return 0


def _supervised_main(kind: str, argv: list[str]) -> int:
    import json

    prog = f"hybridflow {kind}"
    description = ("Supervised fine-tuning (loss on response tokens)." if kind == "sft"
                   else "Reward-model training (Bradley-Terry on chosen/rejected pairs).")
    args = parse_job_args(prog, description, argv)
    _importable_working_directory()
    try:
        _read_config_file(args.config)
    except ValueError as error:
        return _fail(prog, error)
    from hybridflow.trainers.config.loader import dump_yaml
    from hybridflow.trainers.config.supervised import RMConfig, SFTConfig, load_supervised_config

    try:
        config = load_supervised_config(SFTConfig if kind == "sft" else RMConfig, args.config, args.overrides)
    except ValueError as error:
        return _fail(prog, error)
    if args.print_config:
        print(dump_yaml(config), end="")
        return 0
    from hybridflow.controller.errors import WorkerError, WorkerTimeoutError, user_message
    from hybridflow.trainers.supervised import run_supervised

    try:
        result = run_supervised(config, mode="local" if args.local else None)
    except (WorkerError, WorkerTimeoutError) as error:
        # one line naming role, rank, method and cause; the full remote traceback goes to a file
        return _fail(prog, user_message(error, Path(config.output_dir) / "errors"))
    except ValueError as error:
        return _fail(prog, error)
    print(f"{kind} finished: {json.dumps(result['final'])}; model in {result['model_dir']}")
    return 0


def sft_main(argv: list[str]) -> int:
    """`hybridflow sft`: next-token loss on prompt/response pairs, exported as a Hugging Face directory."""
    return _supervised_main("sft", argv)


def rm_main(argv: list[str]) -> int:
    """`hybridflow rm`: Bradley-Terry reward model on preference pairs, exported as a Hugging Face directory."""
    return _supervised_main("rm", argv)
