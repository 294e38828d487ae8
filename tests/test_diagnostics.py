"""Learning-signal diagnostics: tied groups, the sampled entropy, the policy-gradient share, the no-signal warning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.controller import local_mode
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.diagnostics import LearningSignalMonitor, group_signal_metrics, sampled_entropy
from hybridflow.trainers.rl import RLTrainer
from hybridflow.workers.actor import pg_grad_share

TASK = ArithmeticTaskConfig(max_digits=1)


def constant_reward(prompt: str, response: str, **extra_fields) -> float:
    return 0.0


def length_reward(prompt: str, response: str, **extra_fields) -> float:
    return len(response) / 4.0


def test_group_metrics_split_tied_groups_into_all_correct_and_all_wrong():
    scores_B = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    metrics = group_signal_metrics(scores_B, np.array([7, 7, 8, 8, 9, 9, 3, 3]))
    assert metrics == {"signal/tied_groups": 0.75, "signal/all_correct_groups": 0.25, "signal/all_wrong_groups": 0.5}


def test_group_metrics_of_graded_rewards_count_exact_ties_only():
    metrics = group_signal_metrics(torch.tensor([0.5, 0.5, 0.2, 0.3, 0.7, 0.7 + 1e-6]), np.array([0, 0, 1, 1, 2, 2]))
    assert metrics == {"signal/tied_groups": pytest.approx(1 / 3)}


def test_group_metrics_are_empty_without_groups_of_two():
    assert group_signal_metrics(torch.tensor([1.0, 0.0]), np.array([0, 1])) == {}


def test_sampled_entropy_is_the_mean_negative_logprob_of_real_tokens():
    logprobs_BT = torch.tensor([[-1.0, -3.0], [-2.0, -100.0]])
    assert sampled_entropy(logprobs_BT, torch.tensor([[1, 1], [1, 0]])) == pytest.approx(2.0)


def test_pg_grad_share_weighs_the_two_terms_gradients_on_the_logprobs():
    logprobs_BT = torch.zeros(2, 3, requires_grad=True)
    pg = (logprobs_BT * torch.tensor([[3.0, 0, 0], [0, 0, 0]])).sum()  # gradient norm 3
    kl = (logprobs_BT * torch.tensor([[0, 0, 0], [0, 1.0, 0]])).sum()  # gradient norm 1
    assert float(pg_grad_share(logprobs_BT, pg, kl)) == pytest.approx(0.75)
    assert logprobs_BT.grad is None  # nothing accumulated into the leaves


def test_monitor_warns_from_the_patience_th_step_without_signal_and_resets_on_signal():
    monitor = LearningSignalMonitor(patience=2)
    tied = {"signal/tied_groups": 1.0, "signal/all_wrong_groups": 1.0, "signal/all_correct_groups": 0.0}
    assert monitor.observe(1, dict(tied)) is None
    message = monitor.observe(2, dict(tied))
    assert "no learning signal for 2 steps" in message and "answer format" in message
    assert "temperature" in message and "optim.lr" in message
    assert monitor.observe(3, {"signal/tied_groups": 0.5}) is None
    assert monitor.steps_without_signal == 0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("signal_data")
    write_jsonl(directory / "train.jsonl", prompt_rows(32, split="train", seed=0, config=TASK))
    return directory


def _fit(data_dir, output_dir, reward: str, *overrides) -> list[dict]:
    config = load_rl_config(None, [
        f"data.train_path={data_dir / 'train.jsonl'}", "actor.model.builtin=arithmetic",
        f"reward.function={__file__}:{reward}", "algorithm.advantage_estimator=grpo",
        "actor.generation.max_new_tokens=4", "actor.engine.optim.lr=1e-3", "batch.prompts_per_step=2",
        "batch.samples_per_prompt=4", "batch.mini_batch_size=8", "trainer.progress_bar=false",
        f"trainer.output_dir={output_dir}", *overrides])
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            return trainer.fit()
        finally:
            trainer.shutdown()


def test_a_run_with_a_constant_reward_says_so_within_a_few_steps(data_dir, tmp_path, capsys):
    history = _fit(data_dir, tmp_path / "run", "constant_reward", "trainer.total_steps=3",
                   "trainer.warn_no_signal_steps=2")
    out = capsys.readouterr().out
    assert [record["signal/tied_groups"] for record in history] == [1.0, 1.0, 1.0]
    assert [record["signal/all_wrong_groups"] for record in history] == [1.0, 1.0, 1.0]
    assert [record["signal/steps_without_signal"] for record in history] == [1.0, 2.0, 3.0]
    warnings = [line for line in out.splitlines() if line.startswith("WARNING: no learning signal")]
    assert len(warnings) == 2 and "step 2" in warnings[0]
    # the one-line log summarises the signal of every step
    step_lines = [line for line in out.splitlines() if line.startswith("[rl] step")]
    assert len(step_lines) == 3 and all("tied_groups 1" in line for line in step_lines)
    # the KL term is all that pushes: the policy-gradient term's share is 0
    assert all(record["actor/pg_grad_share"] == 0.0 for record in history)


def test_a_run_with_a_varying_reward_logs_signal_and_no_warning(data_dir, tmp_path, capsys):
    history = _fit(data_dir, tmp_path / "run", "length_reward", "trainer.total_steps=1")
    assert "WARNING" not in capsys.readouterr().out
    record = history[-1]
    assert record["signal/tied_groups"] < 1.0 and "signal/all_wrong_groups" not in record
    assert record["signal/steps_without_signal"] == 0.0
    assert record["signal/entropy"] > 0 and 0.0 <= record["actor/clip_fraction"] <= 1.0
    assert 0.0 < record["actor/pg_grad_share"] <= 1.0


def test_the_kl_to_an_identical_reference_is_zero_before_the_first_update_in_bf16(data_dir, tmp_path):
    # the reference holds fp32 weights computing in bf16 by autocast, as the actor does; held in bf16 it gave
    # kl/sequence_kl -7.8e-4 here (and -0.055 on SmolLM2-135M with 16 new tokens)
    history = _fit(data_dir, tmp_path / "run", "length_reward", "trainer.total_steps=1", "batch.mini_batch_size=8",
                   "algorithm.kl_mode=loss", "actor.engine.dtype=bfloat16", "reference.engine.dtype=bfloat16",
                   "actor.loss.old_log_probs=recompute")  # the training forward's log-probs, not the sampler's
    record = history[-1]
    assert abs(record["kl/sequence_kl"]) < 1e-6
    assert record["actor/kl_loss"] == 0.0


def test_off_a_terminal_a_long_phase_prints_at_once_then_a_line_every_few_seconds():
    import io
    import time

    from hybridflow.trainers.metrics import Heartbeat

    stream = io.StringIO()
    heartbeat = Heartbeat("rl", every_s=0.2, progress_bar=False, stream=stream)
    with heartbeat.phase("validation", total=4):
        assert stream.getvalue() == "[rl] validation (0/4)...\n"  # from the first second
        heartbeat.advance(3)
        assert heartbeat.describe().startswith("validation (3/4, ")
        time.sleep(0.5)
    with heartbeat.phase("step 1/2: generate", announce=False):
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "[rl] validation (0/4)..."
    assert sum(line.startswith("[rl] validation (3/4, ") for line in lines) >= 2
    assert [line for line in lines if "generate" in line] == ["[rl] step 1/2: generate (0 s)"]
    assert heartbeat.describe() is None  # no phase runs


def test_a_run_says_what_it_does_before_its_first_step(data_dir, tmp_path, capsys):
    _fit(data_dir, tmp_path / "run", "length_reward", "trainer.total_steps=1",
         f"data.val_path={data_dir / 'train.jsonl'}", "trainer.val_every=1")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == ["[rl] reading and tokenizing the prompts...",
                         "[rl] starting the workers and loading the models (actor, reference)...",
                         "[rl] validation after step 0 (32 held-out prompts, greedy), batches (0/16)..."]
    assert lines[-1].startswith("[rl] exporting the trained models to ")
