"""The command line every side of the suite takes (run.py passes the same flags to each); stdlib only, so
TRL's venv imports it too."""

from __future__ import annotations

import argparse


def side_parser(*, score_model: bool = False, threads: bool = False, runtime: bool = False) -> argparse.ArgumentParser:
    """The shared workload flags, plus ``--score-dir``/``--kl-coef`` (PPO), ``--threads`` (TRL) or ``--runtime``
    (hybridflow) where the side takes them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    if score_model:
        parser.add_argument("--score-dir", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts-per-step", type=int, required=True)
    parser.add_argument("--samples-per-prompt", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--min-new-tokens", type=int, default=0,
                        help="end tokens cannot be sampled before this many (= --max-new-tokens: fixed-length completions)")
    parser.add_argument("--lr", type=float, required=True)
    if score_model:
        parser.add_argument("--kl-coef", type=float, required=True)
    if threads:
        parser.add_argument("--threads", type=int, required=True)
        parser.add_argument("--no-gradient-checkpointing", action="store_true",
                            help="turn off TRL's activation checkpointing (on by default in TRL 1.16's GRPOConfig)")
        parser.add_argument("--bf16", action="store_true",
                            help="TRL's bf16=True (autocast over fp32 weights) instead of the suite's fp32")
    parser.add_argument("--output-dir", required=True)
    if runtime:
        parser.add_argument("--runtime", choices=("auto", "ray", "local"), default="auto",
                            help="placement.runtime (default auto: in the driver's process for this one-device run)")
        parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                            help="extra config overrides after the workload's (e.g. actor.engine.dtype=float32)")
    return parser
