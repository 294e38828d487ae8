"""Safe-RLHF in the RL driver: the cost config, the combined advantages, two driver steps, lambda's direction, resume.

Shape legend: B = samples, T = response tokens.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hybridflow.algorithms import (gae_advantages, lagrange_multiplier_update, masked_whiten, safe_rlhf_advantages,
                                   scores_on_last_token)
from hybridflow.controller import local_mode
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows
from hybridflow.models.loader import build_model
from hybridflow.algorithms.lagrangian import LagrangeController
from hybridflow.protocol import DataProto
from hybridflow.trainers import components
from hybridflow.trainers.advantage import compute_advantages
from hybridflow.trainers.components import SafeRLHF
from hybridflow.trainers.build import COST_CRITIC_PREFIX, model_config_of, role_specs
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.config.rl import AlgorithmSection, CostSection, RLConfig, load_rl_config
from hybridflow.trainers.config.loader import build_dataclass, to_plain
from hybridflow.trainers.rl import RLTrainer
from test_trainer import reproducible

TASK = ArithmeticTaskConfig(max_digits=1)
BASE = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score",
        "cost.model.builtin=arithmetic"]


# 1. config ------------------------------------------------------------------------------------------------------


def test_cost_needs_the_gae_estimator_and_names_both_keys():
    with pytest.raises(ValueError, match=r"config key algorithm\.advantage_estimator got 'grpo'; allowed: 'gae' "
                                         r"when a cost section is set"):
        load_rl_config(None, BASE + ["algorithm.advantage_estimator=grpo"])


def test_auto_mapping_places_the_cost_model_and_the_cost_critic_too():
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    config = load_rl_config(None, BASE + ["placement.pools={cluster: [8]}", "placement.mapping=auto",
                                          "placement.hardware=a100-80g", "batch.prompts_per_step=64", "batch.mini_batch_size=16"])
    resolved, plan = resolve_auto_mapping(config)
    assert set(plan.strategies) == set(config.active_roles) >= {"cost", "cost_critic"}
    assert set(resolved.placement.roles) == set(config.active_roles)
    strategy = plan.strategies["cost_critic"]
    assert (resolved.cost.critic.engine.pp_size, resolved.cost.critic.engine.tp_size) == (strategy.pp_size,
                                                                                          strategy.tp_size)
    assert resolved.cost.limit == config.cost.limit and resolved.placement.mapping == "manual"
    assert resolved.derived().samples_per_step == 64


@pytest.mark.parametrize("values, message", [
    ({"lambda_init": 0}, r"config key cost\.lambda_init got 0\.0; allowed: a finite float > 0"),
    ({"lambda_lr": -0.5}, r"config key cost\.lambda_lr got -0\.5; allowed: a finite float > 0"),
    ({"lambda_max": 0.0}, r"config key cost\.lambda_max got 0\.0; allowed: a float > 0 or null"),
    ({"lambda_init": 2.0, "lambda_max": 1.0}, r"config key cost\.lambda_init got 2\.0; allowed: a float <= lambda_max"),
    ({"limit": math.inf}, r"config key cost\.limit got inf; allowed: a finite float"),
])
def test_cost_section_values_are_checked_naming_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        build_dataclass(CostSection, {"model": {"builtin": "arithmetic"}, **values}, path="cost")
    # Through the whole config the error still names the cost section before any worker starts.
    overrides = [f"cost.{name}={value}" for name, value in values.items()]
    with pytest.raises(ValueError, match=r"config key cost[ .]"):
        load_rl_config(None, BASE + overrides)


def test_cost_roles_are_active_placed_and_size_checked_like_the_critic():
    plain = load_rl_config(None, BASE[:-1])
    assert plain.cost is None and plain.active_roles == ("actor", "reference", "critic")
    config = load_rl_config(None, BASE + ["placement.pools={a: [1], b: [2]}",
                                          "placement.roles={cost: b, cost_critic: b}", "batch.mini_batch_size=4"])
    assert config.active_roles == ("actor", "reference", "critic", "cost", "cost_critic")
    assert config.engine_of("cost_critic") is config.cost.critic.engine
    assert config.derived().dp_sizes == {"actor": 1, "reference": 1, "critic": 1, "cost": 2, "cost_critic": 2}
    with pytest.raises(ValueError, match=r"batch\.mini_batch_size got 1; allowed: a multiple of cost_critic's "
                                         r"data-parallel size 2"):
        load_rl_config(None, BASE + ["placement.pools={a: [1], b: [2]}", "placement.roles={cost_critic: b}",
                                     "batch.mini_batch_size=1"])
    with pytest.raises(ValueError, match=r"config key cost\.critic\.engine\.tp_size got 2; allowed: pp_size \* "
                                         r"tp_size = 2 must divide the 1 devices"):
        load_rl_config(None, BASE + ["cost.critic.engine.layout=3d", "cost.critic.engine.tp_size=2"])


def test_cost_specs_use_a_score_head_and_a_prefixed_value_critic_on_the_actor_backbone():
    specs = role_specs(load_rl_config(None, BASE))
    assert specs.cost.engine.head == "score" and specs.cost.tokenizer is None
    cost_critic_model = specs.cost_critic.engine
    assert cost_critic_model.head == "value"
    assert cost_critic_model.model == specs.critic.engine.model  # null cost.critic.model: the actor's backbone
    assert specs.cost_critic.sizes == specs.critic.sizes == specs.actor.sizes  # one mini-batch for every update
    assert COST_CRITIC_PREFIX == "cost_"


def test_a_config_with_a_cost_section_round_trips_through_its_plain_dump():
    config = load_rl_config(None, BASE + ["cost.limit=0.5", "cost.lambda_max=10", "cost.critic.loss.value_clip=0"])
    assert build_dataclass(RLConfig, to_plain(config)) == config


# 2. advantages --------------------------------------------------------------------------------------------------


def _advantage_inputs():
    generator = torch.Generator().manual_seed(3)
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    tensors = {name: torch.randn(3, 4, generator=generator) for name in ("old", "ref", "values", "cost_values")}
    return mask_BT, tensors, torch.tensor([0.5, -1.0, 2.0]), torch.tensor([1.5, 0.2, -0.7])


def _safe_rlhf(algorithm: AlgorithmSection, lambda_init: float) -> SafeRLHF:
    """The component alone (no workers: only its advantage hook runs here)."""
    lagrange = LagrangeController(init_lambda=lambda_init, cost_limit=0.0, lr=0.1)
    return SafeRLHF(algorithm=algorithm, lagrange=lagrange, cost_model=None, cost_critic=None, samples_per_step=3)


def _cost_batch(mask_BT, tensors, costs_B, *, keys=("costs", "cost_values")) -> DataProto:
    available = {"response_mask": mask_BT, "costs": costs_B, "cost_values": tensors["cost_values"]}
    return DataProto.from_dict(tensors={"response_mask": mask_BT, **{key: available[key] for key in keys}},
                               non_tensors={"uid": np.arange(3)})


@pytest.mark.parametrize("whiten", [True, False])
def test_combined_advantages_equal_safe_rlhf_of_the_separately_computed_reward_and_cost_advantages(whiten):
    algorithm = AlgorithmSection(gamma=0.9, lam=0.8, whiten_advantages=whiten)
    mask_BT, tensors, scores_B, costs_B = _advantage_inputs()
    reward_only = compute_advantages(algorithm=algorithm, scores_B=scores_B, response_mask_BT=mask_BT,
                                     old_logprobs_BT=tensors["old"], ref_logprobs_BT=tensors["ref"],
                                     values_BT=tensors["values"], group_ids=[0, 1, 2], kl_coef=0.1)
    combined = _safe_rlhf(algorithm, 0.7).adjust_advantages(_cost_batch(mask_BT, tensors, costs_B), reward_only)
    # The cost side by hand: the cost on the last real token (no KL), GAE with the cost critic's values.
    cost_advantages_BT, cost_returns_BT = gae_advantages(scores_on_last_token(costs_B, mask_BT),
                                                         tensors["cost_values"], mask_BT, gamma=0.9, lam=0.8)
    if whiten:
        cost_advantages_BT = masked_whiten(cost_advantages_BT, mask_BT)
    torch.testing.assert_close(combined.extra_BT["cost_advantages"], cost_advantages_BT)
    torch.testing.assert_close(combined.extra_BT["cost_returns"], cost_returns_BT)
    torch.testing.assert_close(combined.advantages_BT,
                               safe_rlhf_advantages(reward_only.advantages_BT, cost_advantages_BT, 0.7))
    # The reward side is untouched: the critic's targets and the KL are those of plain PPO.
    assert combined.returns_BT is reward_only.returns_BT and combined.kl_BT is reward_only.kl_BT
    assert reward_only.extra_BT == {}


def test_with_unit_gamma_lambda_and_zero_cost_values_every_token_carries_its_responses_cost():
    algorithm = AlgorithmSection(gamma=1.0, lam=1.0, whiten_advantages=False, kl_mode="none")
    mask_BT, tensors, scores_B, costs_B = _advantage_inputs()
    zeros_BT = torch.zeros_like(mask_BT)
    reward_only = compute_advantages(algorithm=algorithm, scores_B=scores_B, response_mask_BT=mask_BT,
                                     old_logprobs_BT=tensors["old"], ref_logprobs_BT=None, values_BT=zeros_BT,
                                     group_ids=[0, 1, 2], kl_coef=0.0)
    result = _safe_rlhf(algorithm, 3.0).adjust_advantages(
        _cost_batch(mask_BT, {"cost_values": zeros_BT}, costs_B), reward_only)
    expected_BT = (scores_B[:, None] - 3.0 * costs_B[:, None]) / 4.0 * mask_BT
    torch.testing.assert_close(result.advantages_BT, expected_BT)
    torch.testing.assert_close(result.extra_BT["cost_returns"], costs_B[:, None] * mask_BT)


def test_a_batch_without_cost_values_is_an_error_naming_what_is_missing():
    mask_BT, tensors, scores_B, costs_B = _advantage_inputs()
    algorithm = AlgorithmSection()
    reward_only = compute_advantages(algorithm=algorithm, scores_B=scores_B, response_mask_BT=mask_BT,
                                     old_logprobs_BT=tensors["old"], ref_logprobs_BT=None, values_BT=tensors["values"],
                                     group_ids=[0, 1, 2], kl_coef=0.0)
    with pytest.raises(ValueError, match=r"need the batch's costs and cost_values .*; missing: cost_values"):
        _safe_rlhf(algorithm, 1.0).adjust_advantages(_cost_batch(mask_BT, tensors, costs_B, keys=("costs",)),
                                                     reward_only)


# 3. the driver --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Prompts and a tiny score-head cost model (seed 11, so it scores unlike the seed-0 reward model)."""
    directory = tmp_path_factory.mktemp("safe_rlhf")
    write_jsonl(directory / "train.jsonl", prompt_rows(32, split="train", seed=0, config=TASK))
    write_jsonl(directory / "val.jsonl", prompt_rows(4, split="eval", seed=0, config=TASK))
    cost_dir = directory / "cost_model"
    build_model(model_config_of(ModelConfig(builtin="arithmetic")), head="score", seed=11).save_pretrained(cost_dir)
    builtin_tokenizer().save_pretrained(cost_dir)
    return directory


def _config(assets, output_dir, *overrides):
    return load_rl_config(None, [
        f"data.train_path={assets / 'train.jsonl'}", f"data.val_path={assets / 'val.jsonl'}",
        "actor.model.builtin=arithmetic", "reward.model.builtin=arithmetic", f"cost.model.path={assets / 'cost_model'}",
        "actor.generation.max_new_tokens=4", "actor.engine.optim.lr=1e-3", "critic.engine.optim.lr=1e-3",
        "cost.critic.engine.optim.lr=1e-3", "batch.prompts_per_step=4", "batch.samples_per_prompt=2",
        "batch.mini_batch_size=4", "trainer.total_steps=2", "trainer.progress_bar=false",
        f"trainer.output_dir={output_dir}", *overrides])


def _export(trainer: RLTrainer, role: str, directory) -> dict[str, torch.Tensor]:
    trainer.groups[role].export_hf(str(directory))
    return load_file(str(directory / "model.safetensors"))


def _expected_lambdas(history: list[dict], config) -> list[float]:
    """lambda after each step, replayed with lagrange_multiplier_update from the logged mean costs."""
    log_lambda, lambdas = math.log(config.cost.lambda_init), []
    for record in history:
        log_lambda = lagrange_multiplier_update(log_lambda, record["cost/mean"], cost_limit=config.cost.limit,
                                                lr=config.cost.lambda_lr, max_lambda=config.cost.lambda_max)
        lambdas.append(math.exp(log_lambda))
    return lambdas


def test_two_safe_rlhf_steps_train_both_critics_and_raise_lambda_while_the_cost_exceeds_the_limit(
        assets, tmp_path, monkeypatch):
    multipliers = []

    def recording_safe_rlhf_advantages(reward_advantages_BT, cost_advantages_BT, lagrange_multiplier):
        multipliers.append(lagrange_multiplier)
        return safe_rlhf_advantages(reward_advantages_BT, cost_advantages_BT, lagrange_multiplier)

    monkeypatch.setattr(components, "safe_rlhf_advantages", recording_safe_rlhf_advantages)
    config = _config(assets, tmp_path / "run", "cost.limit=-2.0", "cost.lambda_lr=0.5", "trainer.val_every=2",
                     "trainer.val_before_train=false")
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            roles = ("critic", "cost_critic")
            before = {role: _export(trainer, role, tmp_path / f"{role}_before") for role in roles}
            history = trainer.fit()
            after = {role: _export(trainer, role, tmp_path / f"{role}_after") for role in roles}
        finally:
            trainer.shutdown()
    unchanged = [name for name, tensor in before["cost_critic"].items()
                 if torch.equal(tensor, after["cost_critic"][name])]
    assert unchanged == [], f"cost critic parameters not updated: {unchanged}"
    # Both critics start from the same value head; they regress different returns, so they part ways.
    assert not torch.equal(after["critic"]["score.weight"], after["cost_critic"]["score.weight"])
    for record in history:
        numbers = {name: value for name, value in record.items() if name != "step"}
        assert all(math.isfinite(value) for value in numbers.values()), numbers
        assert record["cost/min"] <= record["cost/mean"] <= record["cost/max"]
        assert {"cost_critic/loss", "cost_critic/grad_norm", "critic/loss"} <= set(record)
        assert record["cost/mean"] != pytest.approx(record["reward/model_mean"])  # a model of its own
    lambdas = _expected_lambdas(history, config)
    assert [record["lagrange/lambda"] for record in history] == pytest.approx(lambdas, rel=1e-12)
    assert 1.0 < lambdas[0] < lambdas[1]  # every mean cost is far above the limit -2
    assert multipliers == pytest.approx([1.0, lambdas[0]], rel=1e-12)  # a step uses the lambda before its update
    assert "val/cost_mean" in history[1] and "val/cost_mean" not in history[0]


def test_lagrange_controller_has_the_kl_controllers_interface_and_steps_like_the_dual_update():
    from hybridflow.algorithms.lagrangian import LagrangeController

    controller = LagrangeController(init_lambda=2.0, cost_limit=1.0, lr=0.1, max_lambda=3.0)
    assert controller.value == pytest.approx(2.0, rel=1e-12)
    controller.update(1.5, 8)
    expected = lagrange_multiplier_update(math.log(2.0), 1.5, cost_limit=1.0, lr=0.1, max_lambda=3.0)
    assert controller.log_lambda == expected and controller.value == pytest.approx(math.exp(expected), rel=1e-12)
    restored = LagrangeController(init_lambda=1.0, cost_limit=1.0, lr=0.1)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    with pytest.raises(ValueError, match="init_lambda 4.0 exceeds max_lambda 3.0"):
        LagrangeController(init_lambda=4.0, cost_limit=1.0, lr=0.1, max_lambda=3.0)


def test_lambda_falls_while_the_cost_is_below_the_limit_and_resumes_from_the_checkpoint(assets, tmp_path):
    def run(total_steps: int, *overrides) -> tuple[list[dict], float]:
        config = _config(assets, tmp_path / "run", "cost.limit=2.0", f"trainer.total_steps={total_steps}", *overrides)
        with local_mode():
            trainer = RLTrainer(config, tensorboard=False)
            try:
                (safe_rlhf,) = [component for component in trainer.components if isinstance(component, SafeRLHF)]
                resumed_log_lambda = safe_rlhf.lagrange.log_lambda
                return trainer.fit(), resumed_log_lambda
            finally:
                trainer.shutdown()

    history, initial_log_lambda = run(2, "trainer.save_every=2")
    assert initial_log_lambda == 0.0  # lambda_init 1
    config = _config(assets, tmp_path / "unused", "cost.limit=2.0")
    lambdas = _expected_lambdas(history, config)
    assert [record["lagrange/lambda"] for record in history] == pytest.approx(lambdas, rel=1e-12)
    assert 1.0 > lambdas[0] > lambdas[1]  # every mean cost is far below the limit 2
    driver = json.loads((tmp_path / "run" / "checkpoints" / "step_000002" / "driver.json").read_text())
    assert math.exp(driver["lagrange"]["log_lambda"]) == pytest.approx(lambdas[1], rel=1e-12)
    resumed, resumed_log_lambda = run(3)
    assert resumed_log_lambda == driver["lagrange"]["log_lambda"]
    assert [record["step"] for record in resumed] == [1, 2, 3]
    log_lambda = lagrange_multiplier_update(driver["lagrange"]["log_lambda"], resumed[2]["cost/mean"], cost_limit=2.0, lr=0.1)
    assert resumed[2]["lagrange/lambda"] == pytest.approx(math.exp(log_lambda), rel=1e-12)


def test_cost_roles_on_their_own_ray_pool_match_the_single_process_run(assets, tmp_path, ray_session):
    def run(name: str, mode: str, *placement: str) -> list[dict]:
        trainer = RLTrainer(_config(assets, tmp_path / name, "data.val_path=null", *placement), mode=mode,
                            tensorboard=False)
        try:
            return trainer.fit()
        finally:
            trainer.shutdown()

    # old log-probs recomputed: the native rollout's own (the default) differ from the training forward by rounding
    # that depends on each process's thread count, which differs between these two layouts (ratio 1 +- 1e-7)
    recompute = "actor.loss.old_log_probs=recompute"
    single = run("local", "local", recompute)
    split = run("ray", "ray", recompute, "placement.pools={policy: [1], safety: [1]}",
                "placement.roles={actor: policy, reference: policy, critic: policy, reward: safety, cost: safety, "
                "cost_critic: safety}")
    # the rollout-vs-training mismatch metrics are that rounding itself (~1e-7, thread-count dependent): each run's
    # must be rounding-sized, not equal to the other's
    rounding = ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/sequence_kl")
    for step_single, step_split in zip(single, split, strict=True):
        assert step_split.keys() == step_single.keys()
        for name, value in step_single.items():
            if name in rounding:
                assert abs(value) < 1e-5 and abs(step_split[name]) < 1e-5, name
            elif reproducible(name):
                assert step_split[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name
