"""Command-line jobs: `hybridflow train|sft|rm CONFIG.yaml [key=value ...] [--local] [--print-config]`."""

from __future__ import annotations

import argparse
import sys

from hybridflow.trainers.boundary import (RunInterrupted, errors_directory, hard_exits_reported, run_guarded,
                                          signals_stop_the_run)

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
    for extra in args.overrides:
        if "=" not in extra and extra.endswith((".yaml", ".yml")):
            parser.error(f"a second config file {extra!r} after {args.config!r}: one config file is read; merge them, "
                         f"or give the second one's keys as key.path=value overrides")
    return args


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

    _check_utf8(path)
    try:
        load_yaml(path)
    except ValueError:
        raise
    except Exception as error:  # yaml's parser errors carry the line and column
        raise ValueError(f"config file {path!r}: {error}") from None


def _check_utf8(path: str) -> None:
    """A config file that is not UTF-8 (a Latin-1 editor's) named with its line, not as a codec's byte offset."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except OSError:
        return  # load_yaml names a missing file or a directory
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[:error.start].count(b"\n") + 1
        raise ValueError(f"config file {path!r} line {line} is not UTF-8 text (byte {raw[error.start]:#04x}); "
                         f"re-save the file as UTF-8") from None


def check_ray_address(environ=None, *, timeout_s: float = 3.0) -> None:
    """ValueError when RAY_ADDRESS names a ``host:port`` where nothing listens: ``ray.init`` would otherwise retry
    for minutes, printing only its own connection warnings."""
    import os
    import socket

    address = (os.environ if environ is None else environ).get("RAY_ADDRESS", "").strip()
    if not address or address in ("auto", "local") or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"environment variable RAY_ADDRESS={address!r}: the port {port!r} is not a number; allowed: "
                         f"host:port of a running Ray cluster's head, or unset it")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        reason = error.strerror or str(error)
        raise ValueError(f"environment variable RAY_ADDRESS={address!r}: nothing answers there ({reason}); start the "
                         f"cluster (`ray start --head`), fix the address, unset RAY_ADDRESS, or run with --local") \
            from None


def _last_checkpoint_note(trainer) -> str:
    """Where a stopped run can resume from, for the one line a signal or a hard exit ends the run with."""
    return "no run had started" if trainer is None else trainer.resume_note()


def _stop_at_step_end(trainer, request: dict):
    """``fit``'s ``on_step``: after the step a first signal arrived in (``trainer.save_on_signal``), save a
    checkpoint (unless the step just saved one) and stop."""
    def on_step(step: int, metrics: dict) -> None:
        if "signal" not in request:
            return
        latest = trainer.checkpointer.latest()
        saved = latest if latest is not None and latest.name == f"step_{step:06d}" else trainer.save_checkpoint()
        raise RunInterrupted(request["signal"], saved=saved)
    return on_step


def train_main(argv: list[str]) -> int:
    """`hybridflow train`: RL training (PPO, GRPO, RLOO, ReMax, REINFORCE++) from an RLConfig."""
    prog = "hybridflow train"
    # arguments first: `--help` and a bad file answer before torch is imported
    args = parse_job_args(prog, "RL training from a YAML config; the trained models are exported "
                          "to OUTPUT_DIR/final/<role> (Hugging Face directories with tokenizer files).", argv)
    _importable_working_directory()
    run: dict = {"output_dir": None, "trainer": None}

    def body() -> int:
        import json

        _read_config_file(args.config)
        from hybridflow.trainers.config.rl import load_rl_config
        from hybridflow.trainers.config.loader import dump_yaml, to_plain

        config = load_rl_config(args.config, args.overrides)
        run["output_dir"] = config.trainer.output_dir
        if args.print_config:
            derived = "\n".join(f"#   {line}" for line in json.dumps(to_plain(config.derived())).splitlines())
            print(dump_yaml(config) + "# derived sizes (not config keys):\n" + derived)
            return 0
        from hybridflow.trainers.preflight import warn_local_pools
        from hybridflow.trainers.rl import RLTrainer

        if args.local:
            warn_local_pools(config)
        else:
            check_ray_address()
        with signals_stop_the_run(graceful=lambda: config.trainer.save_on_signal and run["trainer"] is not None) \
                as request, hard_exits_reported(prog, lambda: _last_checkpoint_note(run["trainer"])):
            trainer = run["trainer"] = RLTrainer(config, mode="local" if args.local else None)
            request["reinstall"]()  # ray.init (under Ray) replaced the SIGTERM handler
            try:
                history = trainer.fit(on_step=_stop_at_step_end(trainer, request))
            finally:
                trainer.shutdown()
        last = history[-1] if history else {}
        summary = {key: value for key, value in last.items() if key.startswith(("val/", "reward/score_mean"))}
        print(f"finished step {trainer.step}: {json.dumps(summary)}; metrics in {trainer.logger.path}; "
              f"models in {trainer.output_dir / 'final'}")
        return 0

    return run_guarded(prog, body, errors_dir=lambda: errors_directory(run["output_dir"]),
                       interrupted=lambda error: _last_checkpoint_note(run["trainer"]))


def _supervised_main(kind: str, argv: list[str]) -> int:
    prog = f"hybridflow {kind}"
    description = ("Supervised fine-tuning (loss on response tokens)." if kind == "sft"
                   else "Reward-model training (Bradley-Terry on chosen/rejected pairs).")
    args = parse_job_args(prog, description, argv)
    _importable_working_directory()
    run: dict = {"output_dir": None}

    def body() -> int:
        import json

        _read_config_file(args.config)
        from hybridflow.trainers.config.loader import dump_yaml
        from hybridflow.trainers.config.supervised import RMConfig, SFTConfig, load_supervised_config

        config = load_supervised_config(SFTConfig if kind == "sft" else RMConfig, args.config, args.overrides)
        run["output_dir"] = config.output_dir
        if args.print_config:
            print(dump_yaml(config), end="")
            return 0
        from hybridflow.trainers.supervised import run_supervised

        if not args.local:
            check_ray_address()

        with signals_stop_the_run(), hard_exits_reported(prog):
            result = run_supervised(config, mode="local" if args.local else None)
        print(f"{kind} finished: {json.dumps(result['final'])}; model in {result['model_dir']}")
        return 0

    return run_guarded(prog, body, errors_dir=lambda: errors_directory(run["output_dir"]),
                       interrupted=lambda error: f"{kind} runs keep no checkpoint: run it again with overwrite=true "
                                                 f"to train from the start (its output_dir now holds this run's "
                                                 f"metrics)")


def sft_main(argv: list[str]) -> int:
    """`hybridflow sft`: next-token loss on prompt/response pairs, exported as a Hugging Face directory."""
    return _supervised_main("sft", argv)


def rm_main(argv: list[str]) -> int:
    """`hybridflow rm`: Bradley-Terry reward model on preference pairs, exported as a Hugging Face directory."""
    return _supervised_main("rm", argv)
