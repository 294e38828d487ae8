"""Throughput defaults: worker threads follow the cores, and a provably redundant old-log-prob pass is skipped
with the same update as running it."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch

from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
from hybridflow.controller.host import driver_thread_limit, threads_per_worker, usable_cores
from hybridflow.controller.worker_group import _NODE_SHARES
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import run_rl
from hybridflow.trainers.redundant_passes import old_log_prob_is_redundant

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the Ray workers cannot import this module


def test_one_worker_uses_every_core_and_many_workers_split_them():
    assert threads_per_worker(1, cores=2) == 2
    assert threads_per_worker(2, cores=16) == 8
    assert threads_per_worker(4, cores=2) == 1


def test_the_drivers_omp_num_threads_caps_each_workers_share_of_the_cores():
    assert driver_thread_limit({}) is None
    assert driver_thread_limit({"OMP_NUM_THREADS": "1"}) == 1
    assert threads_per_worker(1, cores=2, limit=driver_thread_limit({"OMP_NUM_THREADS": "1"})) == 1
    assert threads_per_worker(2, cores=16, limit=4) == 4
    assert threads_per_worker(4, cores=2, limit=8) == 1


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_malformed_omp_num_threads_is_a_value_error_naming_the_variable(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS must be a positive integer, got '{value}'"):
        driver_thread_limit({"OMP_NUM_THREADS": value})


def test_zero_workers_per_node_is_a_value_error():
    with pytest.raises(ValueError, match="local_world_size"):
        threads_per_worker(0, cores=2)


def test_old_log_probs_are_redundant_only_for_one_epoch_of_one_mini_batch_without_kl_in_the_reward():
    assert old_log_prob_is_redundant(ppo_epochs=1, mini_batches_per_epoch=1, kl_in_reward=False)
    assert not old_log_prob_is_redundant(ppo_epochs=2, mini_batches_per_epoch=1, kl_in_reward=False)
    assert not old_log_prob_is_redundant(ppo_epochs=1, mini_batches_per_epoch=2, kl_in_reward=False)
    assert not old_log_prob_is_redundant(ppo_epochs=1, mini_batches_per_epoch=1, kl_in_reward=True)


def _grpo_history(directory, mini_batch_size: int, steps: int = 1, kl_mode: str = "none") -> list[dict]:
    overrides = [] if kl_mode == "none" else ["algorithm.kl_coef=0.1"]
    config = load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", "actor.model.builtin=arithmetic",
        "reward.function=arithmetic", "algorithm.advantage_estimator=grpo", f"algorithm.kl_mode={kl_mode}",
        "actor.generation.max_new_tokens=4", *overrides,
        "actor.engine.optim.lr=1e-3", "batch.prompts_per_step=4", "batch.samples_per_prompt=2",
        f"batch.mini_batch_size={mini_batch_size}", f"trainer.total_steps={steps}", "trainer.progress_bar=false",
        f"trainer.output_dir={directory / f'{mini_batch_size}-{kl_mode}'}"])
    return run_rl(config, mode="local", tensorboard=False)


def test_skipped_old_log_prob_pass_is_reported_and_gives_ratio_one(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig()))
    history = _grpo_history(tmp_path, mini_batch_size=8)
    metrics = history[0]
    assert metrics["perf/old_log_prob_skipped"] == 1.0
    assert metrics["actor/approx_kl"] == 0.0
    assert metrics["actor/clip_fraction"] == 0.0
    history = _grpo_history(tmp_path, mini_batch_size=4)
    assert history[0]["perf/old_log_prob_skipped"] == 0.0


def test_a_kl_loss_to_the_reference_keeps_the_skip_and_a_kl_penalty_in_the_reward_does_not(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig()))
    in_loss = _grpo_history(tmp_path, mini_batch_size=8, kl_mode="loss")[0]
    assert in_loss["perf/old_log_prob_skipped"] == 1.0
    assert in_loss["actor/approx_kl"] == 0.0
    # the KL to the reference is reported from the sampled log-probs: the policy and the reference start equal
    assert abs(in_loss["kl/sequence_kl"]) < 1e-4
    in_reward = _grpo_history(tmp_path, mini_batch_size=8, kl_mode="reward")[0]
    assert in_reward["perf/old_log_prob_skipped"] == 0.0
    assert abs(in_reward["kl/sequence_kl"]) < 1e-4


def test_detached_current_log_probs_as_old_give_the_plain_policy_gradient():
    import torch

    from hybridflow.algorithms import ppo_policy_loss

    generator = torch.Generator().manual_seed(0)
    logprobs = torch.randn(4, 6, generator=generator).requires_grad_(True)
    advantages = torch.randn(4, 6, generator=generator)
    result = ppo_policy_loss(logprobs, logprobs.detach(), advantages, clip_ratio_low=0.2, clip_ratio_high=0.2)
    (grad,) = torch.autograd.grad(result.loss_BT.sum(), logprobs)
    torch.testing.assert_close(grad, -advantages, rtol=0, atol=0)


class ThreadProbe(Worker):
    """A role that reports its process's torch threads and the cores it may use."""

    @register("ONE_TO_ALL")
    def threads(self) -> tuple[int, int]:
        return torch.get_num_threads(), usable_cores()


def test_worker_threads_split_a_nodes_cores_among_every_pools_processes_and_grow_back(ray_session, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # no driver cap: the share alone decides
    probe = ThreadProbe
    first_pool, second_pool = ResourcePool([1], mode="ray"), ResourcePool([1], mode="ray")
    first = WorkerGroup(first_pool, probe, name="first")
    second = None
    try:
        threads, cores = first.threads()[0]
        # the driver's processes on the node: this group's one, plus any an earlier test left running
        before = len(_NODE_SHARES.processes_on(first._hosts.nodes[0]))
        assert threads == max(1, cores // before)
        second = WorkerGroup(second_pool, probe, name="second")
        assert [group.threads()[0][0] for group in (first, second)] == [max(1, cores // (before + 1))] * 2
        second.shutdown()
        second = None
        assert first.threads()[0][0] == max(1, cores // before)  # the other pool's process is gone: its cores come back
    finally:
        for group in (first, second):
            if group is not None:
                group.shutdown()
        first_pool.release()
        second_pool.release()
