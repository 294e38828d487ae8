"""Scoring ahead on the rollout pool (issue 34, docs/async.md "Scoring ahead on the rollout pool"): the reference
placed with the rollout replicas scores each batch there as soon as it is generated; the run trains exactly as
with the reference on the trainer's pool, and a resume from a checkpoint with or without those scores equals an
uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from hybridflow.trainers.pipelined import IN_FLIGHT_FILE, InFlight
from hybridflow.trainers.rl import RLTrainer

from test_async import _config, _learning_metrics, _train, data_dir  # noqa: F401 (data_dir: a fixture)



def length_reward(prompt: str, response: str, **extra_fields) -> float:
    """Differs between the samples of a prompt, so the actor moves away from the reference from step 1 on."""
    return len(response) / 4.0


POOLS = ("placement.pools={trainer: [1], gen: [1]}", "async.max_staleness=1", "actor.loss.tis_cap=2.0",
         f"reward.function={__file__}:length_reward")
REF_ON_TRAINER = (*POOLS, "placement.roles={actor: trainer, reference: trainer, rollout: gen}")
REF_ON_GEN = (*POOLS, "placement.roles={actor: trainer, reference: gen, rollout: gen}")


def _assert_same_learning(expected_history: list[dict], got_history: list[dict]) -> None:
    expected, got = _learning_metrics(expected_history), _learning_metrics(got_history)
    assert len(expected) == len(got)
    for step, (want, have) in enumerate(zip(expected, got), start=1):
        assert {"actor/pg_loss", "actor/kl_loss", "reward/score_mean"} <= set(want) == set(have), step
        for name, value in want.items():
            assert have[name] == pytest.approx(value, rel=1e-6, abs=1e-7), (step, name)


@pytest.fixture(scope="module")
def on_trainer(data_dir, tmp_path_factory):  # noqa: F811 (data_dir: the fixture)
    return _train(_config(data_dir, tmp_path_factory.mktemp("ref_trainer"), *REF_ON_TRAINER))


def test_the_reference_on_the_rollout_pool_trains_exactly_as_on_the_trainer_pool(
        data_dir, tmp_path, on_trainer):  # noqa: F811
    expected, expected_prompts = on_trainer
    got, got_prompts = _train(_config(data_dir, tmp_path / "ref_gen", *REF_ON_GEN))
    assert got_prompts == expected_prompts
    assert any(metrics["actor/kl_loss"] != 0 for metrics in expected)  # the reference's scores reach the loss
    _assert_same_learning(expected, got)


def test_a_reward_model_on_the_rollout_pool_scores_ahead_exactly_as_on_the_trainer_pool(
        data_dir, tmp_path):  # noqa: F811
    model = ("reward.model.builtin=arithmetic", "trainer.total_steps=2")
    expected, _ = _train(_config(data_dir, tmp_path / "trainer", *REF_ON_TRAINER, *model))
    config = _config(data_dir, tmp_path / "gen", *POOLS, *model,
                     "placement.roles={actor: trainer, reference: gen, reward: gen, rollout: gen}")
    assert config.placement.scoring_ahead == ("reference", "reward")
    got, _ = _train(config)
    assert all("reward/model_mean" in metrics for metrics in got)
    _assert_same_learning(expected, got)


@pytest.mark.parametrize("with_scores", [True, False], ids=["saved-with-scores", "saved-without-scores"])
def test_a_resumed_run_scoring_ahead_equals_the_uninterrupted_one(data_dir, tmp_path, on_trainer,  # noqa: F811
                                                                   with_scores):
    expected, prompts = on_trainer
    config = _config(data_dir, tmp_path / "run", *REF_ON_GEN, "trainer.save_every=2")
    _, before_kill = _train(config, stop_after=3)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002" / IN_FLIGHT_FILE
    state = torch.load(checkpoint, weights_only=False)
    assert state["scored_ahead_by"] == ["reference"]
    assert all("ref_logprobs" in item["scores"][0] for item in state["in_flight"])
    if not with_scores:  # as a run that did not score ahead wrote it: the resumed run scores the batch then
        torch.save({**state, "scored_ahead_by": [], "in_flight": [
            {**item, "scores": None} for item in state["in_flight"]]}, checkpoint)
    after, after_resume = _train(config)
    assert before_kill[:8] + after_resume == prompts
    _assert_same_learning(expected[2:], after)


def test_scoring_ahead_is_refused_for_trained_roles_and_streaming(data_dir, tmp_path):  # noqa: F811
    with pytest.raises(ValueError, match="placement.roles.rollout got 'gen'.*only reference and reward"):
        _config(data_dir, tmp_path, *POOLS, "placement.roles={actor: trainer, critic: gen, rollout: gen}",
                "algorithm.advantage_estimator=gae")
    with pytest.raises(ValueError, match="async.mode got 'streaming'; allowed: 'pipelined' with reference"):
        _config(data_dir, tmp_path, *REF_ON_GEN, "async.mode=streaming")


def test_on_ray_the_reference_scores_in_the_rollout_process_before_the_trainer_asks(
        data_dir, tmp_path, on_trainer, monkeypatch):  # noqa: F811
    """The reference shares the rollout replica's process; from step 2 on (k = 1) each batch's reference call was
    done when ``sample`` took the batch: it ran after the generation, queued before the weight sync ``sample``
    waits for (an ordering, not a timing)."""
    done_when_asked: list[bool] = []
    ahead = InFlight.ahead

    def recording_ahead(self):
        if self.scoring is not None:
            done_when_asked.append(all(future.done() for future in self.scoring))
        return ahead(self)

    monkeypatch.setattr(InFlight, "ahead", recording_ahead)
    config = _config(data_dir, tmp_path / "ray", *REF_ON_GEN, "placement.runtime=ray", "trainer.total_steps=3")
    trainer = RLTrainer(config, tensorboard=False)
    try:
        assert trainer.groups["reference"].pids == trainer.groups["rollout"].pids
        assert trainer.groups["reference"].pids != trainer.groups["actor"].pids
        assert set(trainer.pipeline.ahead) == {"reference"} and "reference" not in trainer.scorers
        history = trainer.fit()
    finally:
        trainer.shutdown()
    assert done_when_asked[1:] == [True, True]
    _assert_same_learning(on_trainer[0][:3], history)
