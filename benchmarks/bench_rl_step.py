"""Time of one RL step on the built-in tiny model (single-process mode), by stage: `python benchmarks/bench_rl_step.py`.

Prints generate / score (old + reference log-probs, values, reward model) / update seconds per step,
averaged over steps 2..N (step 1 pays one-off warm-up, e.g. vLLM's engine start), for PPO (with critic and
reward model) and GRPO.

`--model smollm2 --backends native vllm` times GRPO steps of the SmolLM2 example (examples/smollm2_gsm8k:
its config, two-term arithmetic prompts, the math reward) with each rollout backend, one after the other in
this process; every response is exactly `--new-tokens` long (min_new_tokens = max_new_tokens) so both
backends generate the same number of tokens. Needs the converted checkpoint, reasoning-gym, and vLLM.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import run_rl


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "smollm2_gsm8k"


def smollm2_setup(directory: Path, *, num_train: int, new_tokens: int) -> tuple[Path, list[str]]:
    """The SmolLM2 example's config file and overrides: its model, arithmetic prompts, fixed-length responses."""
    from hybridflow.models import smollm2_path

    if smollm2_path() is None:
        raise SystemExit("SmolLM2-135M-Instruct is not converted: run python scripts/get_smollm2.py")
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run as example
    finally:
        sys.path.remove(str(EXAMPLE))
    train_path, _ = example.write_prompts(directory, num_train=num_train, num_eval=1, problems="arithmetic")
    return example.CONFIG, [f"actor.model.path={smollm2_path()}", f"data.train_path={train_path}",
                            "trainer.val_every=0", "trainer.save_every=0", "trainer.resume=false",
                            "trainer.overwrite=true",
                            f"actor.generation.max_new_tokens={new_tokens}", f"actor.generation.min_new_tokens={new_tokens}"]


def measure(estimator: str, *, steps: int, prompts: int, samples: int, directory: Path, config_path: Path | None = None,
            model: list[str] | None = None, backend: str = "native") -> dict[str, float]:
    extra = ["reward.model.builtin=arithmetic"] if estimator == "gae" else []
    if model is None:
        model = [f"data.train_path={directory / 'train.jsonl'}", "actor.model.builtin=arithmetic",
                 "reward.function=arithmetic", "actor.generation.max_new_tokens=6"]
    config = load_rl_config(config_path, [
        *model, f"algorithm.advantage_estimator={estimator}", f"actor.generation.backend={backend}",
        f"batch.prompts_per_step={prompts}", f"batch.samples_per_prompt={samples}",
        f"batch.mini_batch_size={prompts * samples}", f"trainer.total_steps={steps}", "trainer.progress_bar=false",
        f"trainer.output_dir={directory / f'{estimator}_{backend}'}", *extra])
    history = run_rl(config, mode="local", tensorboard=False)
    timed = history[1:] if len(history) > 1 else history
    times = {name: statistics.mean(record[f"time/{name}_s"] for record in timed) for name in ("generate", "score", "update")}
    if backend == "vllm":  # the in-place weight copy into vLLM, part of generate
        times["vllm_load"] = statistics.mean(record["time/rollout_vllm_load_s"] for record in timed)
    times["response_tokens"] = statistics.mean(record["response/length_mean"] for record in timed) * prompts * samples
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch compute threads (1 is fastest at this size)")
    parser.add_argument("--model", choices=["builtin", "smollm2"], default="builtin",
                        help="smollm2: GRPO only, the SmolLM2 example's config (see the module docstring)")
    parser.add_argument("--backends", nargs="+", choices=["native", "vllm"], default=["native"],
                        help="rollout backends, timed one after the other in this process")
    parser.add_argument("--new-tokens", type=int, default=64, help="--model smollm2: tokens per response")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        directory = Path(directory)
        config_path, model = None, None
        if args.model == "smollm2":
            config_path, model = smollm2_setup(directory, num_train=args.prompts * args.steps,
                                               new_tokens=args.new_tokens)
        else:
            write_jsonl(directory / "train.jsonl", prompt_rows(args.prompts * args.steps, split="train", seed=0,
                                                               config=ArithmeticTaskConfig()))
        for estimator in (("grpo",) if args.model == "smollm2" else ("gae", "grpo")):
            for backend in args.backends:
                times = measure(estimator, steps=args.steps, prompts=args.prompts, samples=args.samples,
                                directory=directory, config_path=config_path, model=model, backend=backend)
                tokens = times.pop("response_tokens")
                load = times.pop("vllm_load", None)
                total = sum(times.values())
                print(f"{estimator:5s} {backend:6s} samples/step={args.prompts * args.samples:4d}  "
                      + "  ".join(f"{name}={seconds:.2f}s" for name, seconds in times.items())
                      + f"  total={total:.2f}s  generate {tokens / times['generate']:.0f} tok/s"
                      + (f" (vLLM weight load {load:.2f}s of it)" if load is not None else ""), flush=True)


if __name__ == "__main__":
    main()
