"""Multi-turn episodes on the rollout pool (issues 33 and 34): the pipelined schedule runs a step's episodes on the
rollout replicas exactly as it runs single responses (docs/async.md, "Episodes on the rollout pool")."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from test_agents_episodes import chat_tokenizer
from test_async import _learning_metrics, _train

from hybridflow.agents import TurnResult
from hybridflow.data import write_jsonl
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "episodes" / "long_tail_env.py"
sys.path.append(str(EXAMPLE.parent))
from long_tail_env import LongTailEnvironment  # noqa: E402
SPLIT = ("placement.pools={trainer: [1], gen: [1]}", "placement.roles={actor: trainer, rollout: gen}")
ASYNC = (*SPLIT, "async.max_staleness=1", "actor.loss.tis_cap=2.0")
STEPS, PROMPTS, SAMPLES = 4, 2, 2


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A chat tokenizer and rows of the long-tail environment whose episodes take 1 to 4 turns (tools answer at
    once: the test is about the schedule and the tokens, not the clock)."""
    directory = tmp_path_factory.mktemp("async_agents")
    chat_tokenizer().save_pretrained(directory / "tokenizer")
    turns = [1, 3, 2, 4, 1, 2, 3, 1, 2, 4, 1, 3]
    write_jsonl(directory / "train.jsonl", [{"prompt": f"item {index}", "turns": count, "tool_s": 0.0}
                                            for index, count in enumerate(turns)])
    return directory


def _config(directory, output_dir, *overrides):
    return load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", "actor.model.tiny={}",
        f"actor.model.tokenizer_path={directory / 'tokenizer'}", f"env.class={EXAMPLE}:LongTailEnvironment",
        "env.max_episode_tokens=256", "env.decode_chunk_tokens=8", "env.record_every=0",
        "actor.generation.max_new_tokens=6", "actor.engine.optim.lr=1e-3", "actor.engine.dtype=float32",
        "reference.engine.dtype=float32", "algorithm.advantage_estimator=grpo",
        f"batch.prompts_per_step={PROMPTS}", f"batch.samples_per_prompt={SAMPLES}",
        f"batch.mini_batch_size={PROMPTS * SAMPLES}", f"trainer.total_steps={STEPS}", "trainer.progress_bar=false",
        f"trainer.output_dir={output_dir}", *overrides])


def _run(config) -> tuple[list[dict], list]:
    """A whole local run: its metrics per step and the batch each step trained (after the update)."""
    trainer = RLTrainer(config, mode="local", tensorboard=False)
    batches = []
    learn = trainer.learn

    def keeping_learn(experience, **kwargs):
        metrics = learn(experience, **kwargs)
        batches.append(experience.batch)
        return metrics

    trainer.learn = keeping_learn
    try:
        return trainer.fit(), batches
    finally:
        trainer.shutdown()


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory):
    """GRPO on episodes, k = 1, a checkpoint every 2 steps, run to the end without a stop."""
    config = _config(inputs, tmp_path_factory.mktemp("whole"), *ASYNC, "trainer.save_every=2",
                     "actor.loss.old_log_probs=recompute")
    return _run(config)


def test_episodes_on_a_rollout_pool_follow_the_pipelined_schedule_and_train_the_sampled_tokens(uninterrupted):
    history, batches = uninterrupted
    # step s trains version s - 1 on episodes the pool ran with version max(0, s - 2)
    assert [metrics["async/weight_version"] for metrics in history] == [0, 1, 2, 3]
    assert [metrics["async/staleness_max"] for metrics in history] == [0, 1, 1, 1]
    for step, batch in enumerate(batches, start=1):
        assert batch["policy_version"].tolist() == [max(0, step - 2)] * PROMPTS * SAMPLES
    records = [record for batch in batches for record in batch["episode"]]
    turns = [record["turns"] for record in records]
    assert min(turns) == 1 and max(turns) >= 3  # episodes of very different lengths
    assert all((record["observation_tokens"] > 0) == (record["turns"] > 1) for record in records)
    assert all(np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0 for metrics in history)
    # token-exact: the trained ids are the prompt, sampled and observation ids the replica recorded, the loss mask is
    # 1 exactly on the sampled ones ...
    for batch in batches:
        P = batch["prompts"].shape[1]
        for row, record in enumerate(batch["episode"]):
            real = batch["attention_mask"][row].bool()
            assert batch["input_ids"][row][real].tolist() == record["prompt_ids"] + record["response_ids"]
            assert batch["response_mask"][row][real[P:]].tolist() == record["loss_mask"]
            assert batch["response_mask"][row][~real[P:]].sum() == 0
    # ... and the training forward over them gives back the log-probs the replica sampled with (step 1 trains the
    # version that generated its episodes)
    assert history[0]["rollout/logprob_abs_diff_max"] < 1e-5
    assert history[1]["rollout/logprob_abs_diff_max"] > 1e-4  # stale by one update: the weights moved


def test_zero_staleness_episodes_on_a_rollout_pool_train_exactly_like_the_colocated_episodes(inputs, tmp_path,
                                                                                            monkeypatch):
    # a wave of turns waits for every environment step still running, so the waves (and their sampling noise) do
    # not depend on thread timing; turns end within one decode chunk (8 >= 6 tokens)
    monkeypatch.setattr("hybridflow.agents.runner.WAVE_GRACE_S", 60.0)
    colocated, colocated_batches = _run(_config(inputs, tmp_path / "colocated", "trainer.total_steps=2"))
    split, split_batches = _run(_config(inputs, tmp_path / "split", *SPLIT, "trainer.total_steps=2"))
    for expected, got in zip(colocated_batches, split_batches):
        assert got["input_ids"].tolist() == expected["input_ids"].tolist()
    for step, (expected, got) in enumerate(zip(_learning_metrics(colocated), _learning_metrics(split)), start=1):
        shared = sorted(set(expected) & set(got) - {name for name in expected if name.startswith("rollout/")})
        assert {"actor/pg_loss", "actor/grad_norm", "agent/turns_mean", "reward/score_mean"} <= set(shared)
        for name in shared:
            assert got[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), (step, name)
        assert got["async/staleness_max"] == 0


def test_a_resumed_episode_run_on_a_rollout_pool_trains_every_prompt_exactly_once(inputs, tmp_path, uninterrupted):
    _, batches = uninterrupted
    prompts = [str(prompt) for batch in batches for prompt in batch["raw_prompt"]]
    config = _config(inputs, tmp_path / "run", *ASYNC, "trainer.save_every=2", "actor.loss.old_log_probs=recompute")
    _, before_kill = _train(config, stop_after=3)  # step 3 trained, then lost: step 2's checkpoint holds batch 3
    after, after_resume = _train(config)
    samples = PROMPTS * SAMPLES
    assert len(before_kill) == 3 * samples and len(after) == STEPS - 2
    kept = before_kill[:2 * samples]
    assert kept + after_resume == prompts  # every prompt trained once, in the uninterrupted run's steps
    assert [metrics["async/staleness_max"] for metrics in after] == [1, 1]


@pytest.mark.slow
def test_on_ray_the_environments_run_in_the_rollout_process(inputs, tmp_path):
    """Two processes: the replica runs the episodes (environment, tools, tokenizer) in its own process."""
    config = _config(inputs, tmp_path / "ray", *ASYNC, "placement.runtime=ray", "trainer.total_steps=2",
                     f"env.class={__file__}:PidEnvironment")
    trainer = RLTrainer(config, tensorboard=False)
    batches = []
    learn = trainer.learn
    trainer.learn = lambda experience, **kwargs: (batches.append(experience.batch), learn(experience, **kwargs))[1]
    try:
        history = trainer.fit()
        rollout_pid = trainer.groups["rollout"].pids[0]
        assert rollout_pid != trainer.groups["actor"].pids[0]
    finally:
        trainer.shutdown()
    assert [metrics["async/staleness_max"] for metrics in history] == [0, 1]
    tool_pids = {message["content"] for batch in batches for record in batch["episode"]
                 for message in record["messages"] if message["role"] == "tool"}
    assert tool_pids == {f"pid {rollout_pid}"}


class PidEnvironment(LongTailEnvironment):
    """The long-tail environment whose tool answers with the id of the process that runs it."""

    def step(self, turn):
        result = super().step(turn)
        return result if result.done else TurnResult([{"role": "tool", "content": f"pid {os.getpid()}"}])
