"""Command-line jobs: `hybridflow train|sft|rm CONFIG.yaml [key=value ...]`."""

from __future__ import annotations

import argparse
import json
import sys

USAGE_EPILOG = ("Overrides are dotted keys parsed as YAML, e.g. actor.optim.lr=1e-5 batch.prompts_per_step=64 "
                "placement.pools='{train: [8]}'. docs/config.md lists every key.")


def _parse(prog: str, description: str, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=USAGE_EPILOG)
    parser.add_argument("config", nargs="?", help="YAML config file (optional when every key is given as an override)")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides")
    parser.add_argument("--local", action="store_true", help="run every worker inside this process (no Ray; debugging)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    args = parser.parse_args(argv)
    if args.config is not None and "=" in args.config:  # no file, only overrides
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def _fail(prog: str, error: Exception) -> int:
    print(f"{prog}: error: {error}", file=sys.stderr)
    return 2


def train_main(argv: list[str]) -> int:
    """`hybridflow train`: RL training (PPO, GRPO, RLOO, ReMax, REINFORCE++) from an RLConfig."""
    from hybridflow.trainers.config import load_rl_config
    from hybridflow.trainers.config_loader import to_plain

    args = _parse("hybridflow train", "RL training from a YAML config.", argv)
    try:
        config = load_rl_config(args.config, args.overrides)
    except ValueError as error:
        return _fail("hybridflow train", error)
    if args.print_config:
        print(json.dumps({**to_plain(config), "derived": to_plain(config.derived())}, indent=2))
        return 0
    from hybridflow.trainers.ppo import RLTrainer

    try:
        trainer = RLTrainer(config, mode="local" if args.local else None)
    except ValueError as error:  # datasets, reward function specs, model directories
        return _fail("hybridflow train", error)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    last = history[-1] if history else {}
    summary = {key: value for key, value in last.items() if key.startswith(("val/", "reward/score_mean"))}
    print(f"finished step {trainer.step}: {json.dumps(summary)}; metrics in {trainer.logger.path}")
    return 0


def _supervised_main(kind: str, argv: list[str]) -> int:
    from hybridflow.trainers.config_loader import to_plain
    from hybridflow.trainers.supervised import RMConfig, SFTConfig, load_supervised_config, run_supervised

    prog = f"hybridflow {kind}"
    description = ("Supervised fine-tuning (loss on response tokens)." if kind == "sft"
                   else "Reward-model training (Bradley-Terry on chosen/rejected pairs).")
    args = _parse(prog, description, argv)
    try:
        config = load_supervised_config(SFTConfig if kind == "sft" else RMConfig, args.config, args.overrides)
    except ValueError as error:
        return _fail(prog, error)
    if args.print_config:
        print(json.dumps(to_plain(config), indent=2))
        return 0
    result = run_supervised(config, mode="local" if args.local else None)
    print(f"{kind} finished: {json.dumps(result['final'])}; model in {result['model_dir']}")
    return 0


def sft_main(argv: list[str]) -> int:
    """`hybridflow sft`: next-token loss on prompt/response pairs, exported as a Hugging Face directory."""
    return _supervised_main("sft", argv)


def rm_main(argv: list[str]) -> int:
    """`hybridflow rm`: Bradley-Terry reward model on preference pairs, exported as a Hugging Face directory."""
    return _supervised_main("rm", argv)
