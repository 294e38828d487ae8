"""hybridflow's side: the RL trainer at its default settings on the shared assets (``--runtime ray`` forces Ray).

The config states only the workload (model, data, reward, algorithm, batch sizes, lengths, learning
rate); no performance knob. Prints one JSON line per step, like trl_grpo.py.
"""

from __future__ import annotations

import json
import os
import resource
import time
from pathlib import Path

from side_args import side_parser


def worker_usage() -> tuple[float, float]:
    """(resident GiB, CPU seconds so far) of the Ray worker processes (the driver's are counted separately)."""
    import psutil

    rss = cpu = 0.0
    for process in psutil.process_iter(["cmdline", "memory_info", "cpu_times"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if cmdline.startswith("ray::WorkerHost") and process.info["memory_info"] is not None:
            rss += process.info["memory_info"].rss
            cpu += process.info["cpu_times"].user + process.info["cpu_times"].system
    return rss / 2**30, cpu


def main() -> None:
    args = side_parser(runtime=True).parse_args()

    from hybridflow.trainers.config.rl import load_rl_config

    samples = args.prompts_per_step * args.samples_per_prompt
    config = load_rl_config(None, [
        # the prompt file's raw text, as TRL feeds a plain "prompt" field (it templates only chat rows)
        f"data.train_path={args.prompts}", "data.chat_template=never", f"actor.model.path={args.model_dir}",
        f"reward.function={Path(__file__).parent / 'reward.py'}:addition_reward",
        "algorithm.advantage_estimator=grpo", "algorithm.kl_mode=none",
        f"actor.generation.max_new_tokens={args.max_new_tokens}",
        f"actor.generation.min_new_tokens={args.min_new_tokens}", "actor.generation.temperature=1.0",
        f"actor.engine.optim.lr={args.lr}", f"batch.prompts_per_step={args.prompts_per_step}",
        f"batch.samples_per_prompt={args.samples_per_prompt}", f"batch.mini_batch_size={samples}",
        f"trainer.total_steps={args.steps}", "trainer.progress_bar=false", f"trainer.output_dir={args.output_dir}",
        "trainer.overwrite=true", *args.set])  # the run directory is scratch: each run starts it over
    run_trainer(config, runtime=args.runtime)


def run_trainer(config, *, runtime: str) -> None:
    """Build RLTrainer from ``config`` with ``placement.runtime=runtime`` and print one JSON line per step."""
    from dataclasses import replace

    from hybridflow.trainers.rl import RLTrainer

    config = replace(config, placement=replace(config.placement, runtime=runtime))
    peak = {"worker": 0.0}
    last = {"t": time.perf_counter(), "cpu": 0.0}

    def on_step(step: int, metrics: dict) -> None:
        now = time.perf_counter()
        rss, worker_cpu = worker_usage()
        peak["worker"] = max(peak["worker"], rss)
        cpu = time.process_time() + worker_cpu
        print(json.dumps({
            "step_s": now - last["t"], "cpu_s": cpu - last["cpu"], "generate_s": metrics["time/generate_s"], "score_s": metrics["time/score_s"],
            "update_s": metrics["time/update_s"], "completion_length": metrics["response/length_mean"],
            "old_log_prob_skipped": metrics.get("perf/old_log_prob_skipped", 0.0),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 + peak["worker"],
            "load": os.getloadavg()[0]}), flush=True)
        last["t"], last["cpu"] = time.perf_counter(), cpu

    start = time.perf_counter()
    trainer = RLTrainer(config, tensorboard=False)
    print(json.dumps({"startup_s": time.perf_counter() - start}), flush=True)
    last["t"], last["cpu"] = time.perf_counter(), time.process_time() + worker_usage()[1]
    try:
        trainer.fit(on_step=on_step)
    finally:
        trainer.shutdown()


if __name__ == "__main__":
    main()
