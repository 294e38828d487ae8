"""Where the first RL steps' extra time goes: page faults, system time and resident memory per phase and step.

`python benchmarks/bench_step_faults.py --model smollm2 --steps 6` runs GRPO on benchmarks/vs_trl's assets
(32 prompts x 4 samples, exactly 32 new tokens, one mini-batch per step) in local mode, so the driver's own
resource counters (getrusage) cover the engines, and prints for each step's rollout (``generate``) and update
(``train``): seconds, minor page faults, user and system CPU seconds, and resident memory after it. A step
whose update takes much longer than the later ones while its system time is high is growing the process's
heap: memory it touches for the first time, which the kernel faults in page by page. The heap is already
kept between steps (``hybridflow.device.configure_host_allocator``, measured per training step against glibc's
defaults by ``bench_host_allocator.py``); this script shows what is left with it: the first steps' growth,
in the RL loop with the rollout between updates.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))

from assets import build_prompts, policy_dir  # noqa: E402

from hybridflow.engine.generation import GenerationEngine  # noqa: E402
from hybridflow.engine.training import TrainingEngine  # noqa: E402
from hybridflow.trainers.config.rl import load_rl_config  # noqa: E402
from hybridflow.trainers.rl import RLTrainer  # noqa: E402


def counted(name: str, method):
    """``method`` wrapped to print its seconds, minor faults, CPU seconds and resident memory per call."""

    def wrapper(*args, **kwargs):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        result = method(*args, **kwargs)
        seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        with open("/proc/self/statm") as statm:
            resident_gib = int(statm.read().split()[1]) * resource.getpagesize() / 2**30
        print(f"{name:8s} {seconds:7.3f} s  minor faults {after.ru_minflt - before.ru_minflt:9d}  "
              f"user {after.ru_utime - before.ru_utime:6.2f} s  system {after.ru_stime - before.ru_stime:6.2f} s  "
              f"resident {resident_gib:5.2f} GiB", flush=True)
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("tiny", "small", "smollm2"), default="smollm2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench_step_faults_"))
    policy = policy_dir(args.model, work / "models")
    prompts = build_prompts(work / "prompts.jsonl", 32 * args.steps)
    config = load_rl_config(None, [
        f"data.train_path={prompts}", "data.chat_template=never", f"actor.model.path={policy}",
        f"reward.function={HERE / 'vs_trl' / 'reward.py'}:addition_reward", "algorithm.advantage_estimator=grpo",
        "algorithm.kl_mode=none", "actor.generation.max_new_tokens=32", "actor.generation.min_new_tokens=32",
        "actor.generation.temperature=1.0", "actor.engine.optim.lr=1e-5", "batch.prompts_per_step=32",
        "batch.samples_per_prompt=4", "batch.mini_batch_size=128", f"trainer.total_steps={args.steps}",
        "trainer.progress_bar=false", f"trainer.output_dir={work / 'run'}"])
    GenerationEngine.generate = counted("generate", GenerationEngine.generate)
    TrainingEngine.train_step = counted("train", TrainingEngine.train_step)
    trainer = RLTrainer(config, tensorboard=False, mode="local")
    try:
        trainer.fit()
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
