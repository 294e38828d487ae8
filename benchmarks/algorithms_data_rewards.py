"""Timings of the driver-side pieces: advantage estimators, dataset tokenization, and sandboxed code rewards.

Run: python benchmarks/algorithms_data_rewards.py  (CPU only, about half a minute).
"""

from __future__ import annotations

import time

import torch

from hybridflow.algorithms import gae_advantages, grpo_advantages, reinforce_plus_plus_advantages
from hybridflow.data import PromptDataset
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows
from hybridflow.rewards import RuleReward, SandboxConfig, code_reward, run_python


def best_of(repeats: int, function) -> float:
    """Fastest wall time (seconds) of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def bench_advantages() -> None:
    torch.manual_seed(0)
    for batch, tokens in ((256, 128), (256, 512), (1024, 1024)):
        rewards_BT = torch.randn(batch, tokens)
        values_BT = torch.randn(batch, tokens)
        mask_BT = torch.ones(batch, tokens)
        gae = best_of(3, lambda: gae_advantages(rewards_BT, values_BT, mask_BT, gamma=1.0, lam=0.95))
        rpp = best_of(3, lambda: reinforce_plus_plus_advantages(rewards_BT, mask_BT))
        groups = torch.arange(batch) // 8
        grpo = best_of(3, lambda: grpo_advantages(rewards_BT[:, 0], groups, mask_BT))
        print(f"advantages B={batch:5d} T={tokens:5d}: gae {gae * 1e3:8.1f} ms   "
              f"reinforce++ {rpp * 1e3:8.1f} ms   grpo {grpo * 1e3:6.2f} ms")


def bench_dataset() -> None:
    tokenizer = builtin_tokenizer()
    rows = prompt_rows(20000, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=4))
    seconds = best_of(2, lambda: PromptDataset(rows, tokenizer, max_prompt_tokens=32))
    print(f"PromptDataset: {len(rows)} prompts tokenized in {seconds:.2f} s ({len(rows) / seconds:,.0f} prompts/s)")
    dataset = PromptDataset(rows, tokenizer, max_prompt_tokens=32)
    batch_seconds = best_of(5, lambda: dataset.batch(range(256)))
    print(f"PromptDataset.batch(256): {batch_seconds * 1e3:.1f} ms")


def bench_rewards() -> None:
    reward = RuleReward("arithmetic")
    prompts = [row["prompt"] for row in prompt_rows(4096, split="train", seed=1, config=ArithmeticTaskConfig())]
    seconds = best_of(3, lambda: reward.score_batch(prompts, ["42"] * len(prompts)))
    print(f"arithmetic checker: {len(prompts)} samples in {seconds * 1e3:.1f} ms")
    config = SandboxConfig(timeout_s=5.0)
    run_python("pass", config=config)  # first call probes unshare / privilege drop once
    single = best_of(5, lambda: run_python("print(sum(range(1000)))", config=config))
    print(f"sandbox: one run (start interpreter, run, clean up) {single * 1e3:.0f} ms")
    tests = [f"assert add({i}, {i}) == {2 * i}" for i in range(8)]
    program = "def add(a, b):\n    return a + b\n"
    reward_seconds = best_of(3, lambda: code_reward("p", program, tests=tests, sandbox=config))
    print(f"code_reward with 8 tests: {reward_seconds * 1e3:.0f} ms ({8 / reward_seconds:.1f} test runs/s)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    bench_advantages()
    bench_dataset()
    bench_rewards()
