"""`hybridflow data arithmetic --out DIR`: write the built-in task's prompt, SFT and preference files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def data_main(argv: list[str]) -> int:
    """Write ``train.jsonl`` / ``eval.jsonl`` (prompts), and with ``--sft`` / ``--pairs`` the other row kinds."""
    parser = argparse.ArgumentParser(prog="hybridflow data", description="Write the built-in task's data files.")
    parser.add_argument("task", choices=["arithmetic"], help="built-in task")
    parser.add_argument("--out", required=True, help="directory to write into (created if missing)")
    parser.add_argument("--train", type=int, default=2000, help="training prompts (default 2000)")
    parser.add_argument("--eval", type=int, default=100, help="held-out prompts (default 100)")
    parser.add_argument("--sft", type=int, default=0, help="also write sft.jsonl with this many prompt/response rows")
    parser.add_argument("--pairs", type=int, default=0,
                        help="also write pairs.jsonl with this many prompt/chosen/rejected rows")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem draw (default 0)")
    parser.add_argument("--min-digits", type=int, default=1, help="fewest digits of an operand (default 1)")
    parser.add_argument("--max-digits", type=int, default=2, help="most digits of an operand (default 2)")
    parser.add_argument("--reverse-answer", action="store_true",
                        help="write answers least-significant digit first (57+68= -> 521), as `hybridflow demo` "
                             "does: use it (with --min-digits 2) for prompts a demo model answers")
    args = parser.parse_args(argv)
    for name in ("train", "eval", "sft", "pairs"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} got {getattr(args, name)}; allowed: an integer >= 0")

    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, preference_rows, prompt_rows, sft_rows

    try:
        task = ArithmeticTaskConfig(min_digits=args.min_digits, max_digits=args.max_digits,
                                    reverse_answer=args.reverse_answer)
    except ValueError as error:
        parser.error(str(error))
    if not args.out.strip():  # Path("") is the current directory
        print("hybridflow data: error: --out got ''; allowed: a directory path", file=sys.stderr)
        return 2
    out = Path(args.out)
    for folder in (out, *out.parents):
        if folder.exists() and not folder.is_dir():
            print(f"hybridflow data: error: --out {str(args.out)!r} is a file, not a directory"
                  if folder == out else f"hybridflow data: error: --out {str(args.out)!r}: {str(folder)!r} is a file",
                  file=sys.stderr)
            return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"hybridflow data: error: --out {str(args.out)!r} cannot be created: {error.strerror or error}",
              file=sys.stderr)
        return 2
    files = {"train.jsonl": prompt_rows(args.train, split="train", seed=args.seed, config=task),
             "eval.jsonl": prompt_rows(args.eval, split="eval", seed=args.seed, config=task)}
    if args.sft:
        files["sft.jsonl"] = sft_rows(args.sft, split="train", seed=args.seed, config=task)
    if args.pairs:
        files["pairs.jsonl"] = preference_rows(args.pairs, split="train", seed=args.seed, config=task)
    for name, rows in files.items():
        try:
            write_jsonl(out / name, rows)
        except OSError as error:  # the file is written beside and renamed: nothing half-written stays
            print(f"hybridflow data: error: could not write {str(out / name)!r}: {error.strerror or error}; nothing "
                  f"was written under that name", file=sys.stderr)
            return 2
        print(f"wrote {len(rows)} rows to {out / name}")
    return 0
