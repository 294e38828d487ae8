"""The RL driver on the built-in tiny model, in single-process mode: updates, variants, errors, resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.controller import local_mode
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows, sft_rows
from hybridflow.rewards import RewardError
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer, run_rl
from hybridflow.trainers.step import StepComponent

TASK = ArithmeticTaskConfig(max_digits=1)
# the CPU's default for this narrow model, pinned where a test compares passes to float rounding (a GPU's auto is bf16)
FP32 = ("actor.engine.dtype=float32", "reference.engine.dtype=float32", "critic.engine.dtype=float32")


def length_reward(prompt: str, response: str, **extra_fields) -> float:
    """A dense, learnable test reward: longer responses score higher."""
    return len(response) / 4.0


def failing_reward(prompt: str, response: str, **extra_fields) -> float:
    if prompt == extra_fields.get("poison"):
        raise RuntimeError("checker crashed")
    return 0.0


def nan_reward(prompt: str, response: str, **extra_fields) -> float:
    return math.nan


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rl_data")
    write_jsonl(directory / "train.jsonl", prompt_rows(32, split="train", seed=0, config=TASK))
    write_jsonl(directory / "val.jsonl", prompt_rows(4, split="eval", seed=0, config=TASK))
    return directory


def _config(data_dir, output_dir, *overrides):
    return load_rl_config(None, [
        f"data.train_path={data_dir / 'train.jsonl'}", f"data.val_path={data_dir / 'val.jsonl'}",
        "actor.model.builtin=arithmetic", f"reward.function={__file__}:length_reward",
        "actor.generation.max_new_tokens=4", "actor.engine.optim.lr=1e-3", "critic.engine.optim.lr=1e-3",
        "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
        "trainer.total_steps=2", "trainer.progress_bar=false", f"trainer.output_dir={output_dir}", *overrides])


def reproducible(name: str) -> bool:
    """Whether two runs of one seed must agree on metric ``name``: not the wall times, not the allocator's byte
    counts (they depend on what the process ran before), not the auto token budget (sized from the host's free
    memory as each run starts, which other processes move; a resumed run keeps its checkpoint's budget:
    tests/test_token_budget.py)."""
    return not name.startswith("time/") and not name.endswith(("allocated_bytes", "token_budget"))


def _run(config) -> list[dict]:
    return run_rl(config, mode="local", tensorboard=False)


def _export(trainer: RLTrainer, role: str, directory) -> dict[str, torch.Tensor]:
    trainer.groups[role].export_hf(str(directory))
    return load_file(str(directory / "model.safetensors"))


def test_ppo_steps_change_every_actor_and_critic_parameter(data_dir, tmp_path):
    config = _config(data_dir, tmp_path / "run", "actor.loss.entropy_coef=0.01", "reward.model.builtin=arithmetic",
                     "trainer.val_every=2", *FP32)
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            before = {role: _export(trainer, role, tmp_path / f"{role}_before") for role in ("actor", "critic")}
            history = trainer.fit()
            after = {role: _export(trainer, role, tmp_path / f"{role}_after") for role in ("actor", "critic")}
        finally:
            trainer.shutdown()
    for role in ("actor", "critic"):
        unchanged = [name for name, tensor in before[role].items() if torch.equal(tensor, after[role][name])]
        assert unchanged == [], f"{role} parameters not updated: {unchanged}"
    assert [record["step"] for record in history] == [0, 1, 2]  # step 0: validation before training
    assert sorted(key for key in history[0] if not key.startswith("time/")) == [
        "step", "val/function_mean", "val/response_length_mean", "val/score_mean"]
    # the reference is the initial actor; the old log-probs are the native rollout's (fp32, temperature 1),
    # which equal the reference forward's up to rounding
    assert history[1]["perf/old_log_prob_from_rollout"] == 1.0
    # (rounding: 1e-5 on a CPU; a GPU's decode and packed forward reduce in other orders, 3.5e-5 on an H100)
    assert abs(history[1]["kl/sequence_kl"]) < (1e-4 if torch.cuda.is_available() else 1e-5)
    assert abs(history[2]["kl/sequence_kl"]) > 1e-4
    assert 1.0 <= history[1]["response/length_mean"] <= 4.0
    assert "val/score_mean" in history[2] and "val/function_mean" in history[2]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]


def test_old_log_probs_come_from_the_native_fp32_rollout_only_where_they_equal_the_training_forwards(data_dir, tmp_path):
    recomputed = _run(_config(data_dir, tmp_path / "recompute", "actor.loss.old_log_probs=recompute",
                              "trainer.total_steps=1", *FP32))[0]
    assert recomputed["perf/old_log_prob_from_rollout"] == 0.0 and recomputed["perf/old_log_prob_skipped"] == 0.0
    assert recomputed["kl/sequence_kl"] == 0.0  # the reference forward is the old-log-prob forward's twin
    # what `auto` relies on: the native rollout's sampled log-probs are the training forward's up to rounding
    assert recomputed["rollout/logprob_abs_diff_max"] < 1e-5
    default = _run(_config(data_dir, tmp_path / "auto", "trainer.total_steps=1", *FP32))[0]
    assert default["perf/old_log_prob_from_rollout"] == 1.0 and "rollout/logprob_abs_diff_max" not in default
    # at another temperature the training forward divides the logits by it too: the same distribution
    tempered = _run(_config(data_dir, tmp_path / "tempered", "actor.generation.temperature=0.7",
                            "actor.loss.old_log_probs=recompute", "trainer.total_steps=1", *FP32))[0]
    assert tempered["rollout/logprob_abs_diff_max"] < 1e-5
    assert tempered["kl/sequence_kl"] == 0.0  # the reference scores at the rollout's temperature as well
    tempered_auto = _run(_config(data_dir, tmp_path / "tempered_auto", "actor.generation.temperature=0.7",
                                 "trainer.total_steps=1", *FP32))[0]
    assert tempered_auto["perf/old_log_prob_from_rollout"] == 1.0
    # bf16 rollouts (the GPU default) are another precision: recomputed
    bf16 = _run(_config(data_dir, tmp_path / "bf16", "actor.engine.dtype=bfloat16", "trainer.total_steps=1"))[0]
    assert bf16["perf/old_log_prob_from_rollout"] == 0.0 and "rollout/logprob_abs_diff_max" in bf16
    forced = _run(_config(data_dir, tmp_path / "forced", "actor.engine.dtype=bfloat16",
                          "actor.loss.old_log_probs=rollout", "trainer.total_steps=1"))[0]
    assert forced["perf/old_log_prob_from_rollout"] == 1.0


class RecordingComponent(StepComponent):
    """Records which hook the step calls, in order; adds a metric, a validation score and checkpoint state."""

    state_key = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def score_futures(self, batch):
        self.calls.append("score_futures")
        return []

    def adjust_scores(self, batch, scores_B):
        self.calls.append("adjust_scores")
        return scores_B

    def estimator_inputs(self, experience):
        self.calls.append("estimator_inputs")
        return {}

    def adjust_advantages(self, batch, result):
        self.calls.append("adjust_advantages")
        return result

    def loss_mask(self, batch, mask_BT):
        self.calls.append("loss_mask")
        return mask_BT

    def update_futures(self, batch):
        self.calls.append("update_futures")
        return []

    def after_actor_update(self, batch):
        self.calls.append("after_actor_update")
        return [{"recording/after_actor_update": 1.0}]

    def after_step(self, batch):
        self.calls.append("after_step")

    def metrics(self, results):
        self.calls.append("metrics")
        return {"recording/samples": float(len(results.batch))}

    def validation_scores(self, batch):
        self.calls.append("validation_scores")
        return {"val/recorded": torch.ones(len(batch))}

    def state_dict(self):
        self.calls.append("state_dict")
        return {"calls": len(self.calls)}


def test_a_step_calls_a_components_hooks_in_the_documented_order(data_dir, tmp_path):
    config = _config(data_dir, tmp_path / "run", "trainer.total_steps=1", "trainer.val_every=1",
                     "trainer.val_before_train=false", "trainer.save_every=1")
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            recording = RecordingComponent()
            trainer.components.append(recording)
            history = trainer.fit()
        finally:
            trainer.shutdown()
    assert recording.calls == ["score_futures", "adjust_scores", "estimator_inputs", "adjust_advantages", "loss_mask",
                               "update_futures", "after_actor_update", "after_step", "metrics", "validation_scores",
                               "state_dict"]
    assert history[0]["recording/samples"] == 8.0 and history[0]["recording/after_actor_update"] == 1.0
    assert history[0]["val/recorded"] == 1.0
    driver = json.loads((tmp_path / "run" / "checkpoints" / "step_000001" / "driver.json").read_text())
    assert driver["recording"] == {"calls": 11}


def test_old_log_probs_from_the_rollout_with_tis_are_refused_naming_the_key(data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"config key actor.loss.old_log_probs got 'rollout'; allowed: 'auto' or "
                                         r"'recompute' with tis_cap set"):
        _config(data_dir, tmp_path, "actor.loss.old_log_probs=rollout", "actor.loss.tis_cap=2.0")
    with pytest.raises(ValueError, match=r"config key actor.loss.old_log_probs got 'sampler' \(str\); allowed: one of "
                                         r"'auto', 'recompute', 'rollout'"):
        _config(data_dir, tmp_path, "actor.loss.old_log_probs=sampler")


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "remax", "reinforce_plus_plus"])
def test_critic_free_estimators_run_without_a_critic(data_dir, tmp_path, estimator):
    config = _config(data_dir, tmp_path, f"algorithm.advantage_estimator={estimator}", "trainer.total_steps=1")
    assert "critic" not in config.active_roles
    history = _run(config)
    assert not any(name.startswith("critic/") for name in history[0])
    assert history[0]["actor/grad_norm"] > 0


def test_kl_as_loss_and_adaptive_controller_are_logged(data_dir, tmp_path):
    history = _run(_config(data_dir, tmp_path, "algorithm.kl_mode=loss", "algorithm.kl_controller=adaptive",
                           "algorithm.kl_target=0.01", "algorithm.kl_horizon=10"))
    assert "actor/kl_loss" in history[0]
    assert history[0]["kl/coef"] != 0.05  # adapted after step 1 (KL 0 < target: the coefficient shrinks)
    assert history[0]["kl/coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 10))


def test_ptx_rows_add_a_next_token_step_after_the_ppo_update(data_dir, tmp_path):
    write_jsonl(tmp_path / "ptx.jsonl", sft_rows(8, split="train", seed=1, config=TASK))
    history = _run(_config(data_dir, tmp_path, "actor.loss.ptx_coef=0.5", f"data.ptx_path={tmp_path / 'ptx.jsonl'}",
                           "trainer.total_steps=1"))
    assert history[0]["actor/ptx_loss"] == pytest.approx(0.5 * history[0]["actor/ptx_nll"], rel=1e-5)
    assert history[0]["actor/ptx_nll"] > 0


def test_resume_from_checkpoint_continues_identically(data_dir, tmp_path):
    straight = _run(_config(data_dir, tmp_path / "straight", "trainer.total_steps=3"))
    _run(_config(data_dir, tmp_path / "resumed", "trainer.total_steps=2", "trainer.save_every=2"))
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == "step_000002"
    # a checkpoint of the driver before the step components (issue 32) held every optional part's key, null
    # when off: such a checkpoint resumes as well
    driver = tmp_path / "resumed" / "checkpoints" / "step_000002" / "driver.json"
    state = json.loads(driver.read_text())
    assert set(state) == {"step", "config", "best", "loader", "kl_controller", "signal"}
    driver.write_text(json.dumps({**state, "ptx_loader": None, "lagrange": None}))
    resumed = _run(_config(data_dir, tmp_path / "resumed", "trainer.total_steps=3"))
    assert [record["step"] for record in resumed] == [1, 2, 3]
    for name, value in straight[2].items():
        if reproducible(name):
            assert resumed[2][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_a_resumed_run_plans_with_the_token_budget_its_checkpoint_recorded(data_dir, tmp_path, monkeypatch):
    from hybridflow.engine import token_budget

    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 200 * 2**20)
    first = _run(_config(data_dir, tmp_path / "run", "trainer.total_steps=1", "trainer.save_every=1"))
    # other processes freed some memory meanwhile: a new run sizes a larger budget, the resumed one keeps its own
    monkeypatch.setattr(token_budget, "free_memory_bytes", lambda device: 230 * 2**20)
    new = _run(_config(data_dir, tmp_path / "new", "trainer.total_steps=1"))
    resumed = _run(_config(data_dir, tmp_path / "run", "trainer.total_steps=2"))
    for role in ("actor", "critic"):
        assert new[0][f"{role}/token_budget"] > first[0][f"{role}/token_budget"], role
        assert resumed[1][f"{role}/token_budget"] == first[0][f"{role}/token_budget"], role


def test_reward_function_exception_names_the_sample(data_dir, tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "poison": "2+2="}]
    write_jsonl(tmp_path / "poisoned.jsonl", rows)
    config = _config(data_dir, tmp_path, f"data.train_path={tmp_path / 'poisoned.jsonl'}", "data.val_path=null",
                     f"reward.function={__file__}:failing_reward", "batch.prompts_per_step=2",
                     "batch.samples_per_prompt=1", "batch.mini_batch_size=2", "data.shuffle=false")
    with pytest.raises(RewardError, match=r"raised RuntimeError on sample 1 \(prompt '2\+2='\): checker crashed"):
        _run(config)


def test_non_finite_reward_names_the_sample(data_dir, tmp_path):
    config = _config(data_dir, tmp_path, f"reward.function={__file__}:nan_reward", "data.shuffle=false")
    with pytest.raises(RewardError, match=r"returned nan on sample 0 \(prompt '.*'\); rewards must be finite"):
        _run(config)


def test_dataset_without_the_prompt_field_fails_before_workers_start(data_dir, tmp_path):
    write_jsonl(tmp_path / "bad.jsonl", [{"question": "1+1="}])
    config = _config(data_dir, tmp_path, f"data.train_path={tmp_path / 'bad.jsonl'}")
    with pytest.raises(ValueError, match=r"config key data\.train_path: row 0 of .*bad\.jsonl' has neither the prompt "
                                         r"field 'prompt' \(data\.prompt_key\) nor 'messages'"):
        RLTrainer(config, tensorboard=False)


def test_missing_dataset_file_is_a_clear_error(data_dir, tmp_path):
    config = _config(data_dir, tmp_path, f"data.train_path={tmp_path / 'absent.jsonl'}")
    with pytest.raises(ValueError, match=r"absent\.jsonl"):
        RLTrainer(config, tensorboard=False)


class _RecordingTrainer:
    """Stands in for RLTrainer in ``run_rl``: records how it was built and whether it was shut down."""

    built: list[tuple] = []
    shut_down: list[bool] = []
    fit_error: Exception | None = None

    def __init__(self, config, *, mode=None, tensorboard=True):
        self.built.append((config, mode, tensorboard))

    def fit(self) -> list[dict]:
        if self.fit_error is not None:
            raise self.fit_error
        return [{"step": 1}, {"step": 2}]

    def shutdown(self) -> None:
        self.shut_down.append(True)


def test_run_rl_passes_mode_and_tensorboard_on_returns_the_history_and_shuts_down_after_a_failed_fit(monkeypatch):
    from hybridflow.trainers import rl

    monkeypatch.setattr(rl, "RLTrainer", _RecordingTrainer)
    monkeypatch.setattr(_RecordingTrainer, "built", [])
    monkeypatch.setattr(_RecordingTrainer, "shut_down", [])
    assert run_rl("config", mode="local", tensorboard=False) == [{"step": 1}, {"step": 2}]
    assert _RecordingTrainer.built == [("config", "local", False)] and _RecordingTrainer.shut_down == [True]
    monkeypatch.setattr(_RecordingTrainer, "fit_error", RewardError("reward function crashed"))
    with pytest.raises(RewardError, match="reward function crashed"):
        run_rl("other")
    assert _RecordingTrainer.built[1] == ("other", None, True) and _RecordingTrainer.shut_down == [True, True]


def test_a_one_device_run_not_connected_to_ray_builds_its_workers_in_the_driver_by_default(data_dir, tmp_path,
                                                                                           monkeypatch):
    import ray
    import ray._private.utils

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("HYBRIDFLOW_LOCAL", raising=False)
    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda temp_dir=None: None)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # other tests of the session may have started Ray
    trainer = RLTrainer(_config(data_dir, tmp_path / "run"), tensorboard=False)  # placement.runtime: auto
    try:
        assert [pool.mode for pool in trainer.pools] == ["local"]
    finally:
        trainer.shutdown()
