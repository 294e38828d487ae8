"""Config loading: YAML + dotted overrides, key and type checks, batch-size consistency, derived sizes."""

from __future__ import annotations

import dataclasses

import pytest

from hybridflow.trainers.config.rl import RLConfig, load_rl_config
from hybridflow.trainers.config.loader import apply_overrides, build_dataclass, to_plain
from hybridflow.trainers.config.supervised import SFTConfig

BASE = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score"]


def _load(*overrides: str) -> RLConfig:
    return load_rl_config(None, BASE + list(overrides))


def test_yaml_file_and_overrides_combine_with_overrides_winning(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_path: a.jsonl\nactor:\n  model: {builtin: arithmetic}\n  engine: {optim: {lr: 0.001}}\n"
                    "reward: {function: 'm:f'}\nbatch: {prompts_per_step: 4, samples_per_prompt: 2, mini_batch_size: 4}\n")
    config = load_rl_config(path, ["actor.engine.optim.lr=1e-5", "actor.generation.top_k=5"])
    assert config.actor.engine.optim.lr == 1e-5
    assert config.actor.generation.top_k == 5
    assert config.batch.prompts_per_step == 4
    assert config.data.train_path == "a.jsonl"


def test_derived_sizes_follow_from_pools_and_parallel_sizes():
    config = _load("placement.pools={a: [4], b: [2]}", "placement.roles={actor: a, reference: a, critic: b}",
                   "actor.engine.layout=3d", "actor.engine.tp_size=2", "actor.hybrid_engine.tp_size=1",
                   "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=4")
    derived = config.derived()
    assert derived.samples_per_step == 8
    assert derived.mini_batches_per_epoch == 2
    assert derived.dp_sizes == {"actor": 2, "reference": 4, "critic": 2}
    assert derived.generation_replicas == 4


def test_unknown_key_names_the_dotted_key_and_the_allowed_keys():
    with pytest.raises(ValueError, match=r"unknown config key actor\.engine\.optim\.lrr; allowed keys here: betas, "
                                         r"eps, grad_clip, lr, lr_schedule, warmup_steps, weight_decay"):
        _load("actor.engine.optim.lrr=1e-5")


def test_wrong_type_names_the_key_the_value_and_the_allowed_type():
    with pytest.raises(ValueError, match=r"config key batch\.prompts_per_step got 'many' \(str\); allowed: int"):
        _load("batch.prompts_per_step=many")
    with pytest.raises(ValueError, match=r"config key algorithm\.kl_controller got 'pid'.*'fixed', 'adaptive'"):
        _load("algorithm.kl_controller=pid")
    with pytest.raises(ValueError, match=r"config key trainer\.resume got 1 \(int\); allowed: bool"):
        _load("trainer.resume=1")


def test_out_of_range_value_names_the_full_dotted_key():
    with pytest.raises(ValueError,
                       match=r"config key actor\.engine\.optim: optim\.lr must be a finite number > 0, got -1\.0"):
        _load("actor.engine.optim.lr=-1")
    with pytest.raises(ValueError, match=r"config key actor\.generation: top_p must be in \(0, 1\], got 1\.5"):
        _load("actor.generation.top_p=1.5")


def test_missing_required_key_is_named():
    with pytest.raises(ValueError, match=r"config key data\.train_path is required but missing"):
        load_rl_config(None, ["actor.model.builtin=arithmetic", "reward.function=m:f"])


def test_mini_batch_must_divide_the_samples_per_step():
    with pytest.raises(ValueError, match=r"batch\.mini_batch_size got 3; allowed: a divisor of "
                                         r"prompts_per_step \* samples_per_prompt = 8"):
        _load("batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=3")


def test_mini_batch_must_be_a_multiple_of_the_actor_data_parallel_size():
    with pytest.raises(ValueError, match=r"batch\.mini_batch_size got 2; allowed: a multiple of actor's "
                                         r"data-parallel size 4"):
        _load("placement.pools.global=[4]", "batch.prompts_per_step=8", "batch.mini_batch_size=2")


def test_model_parallel_size_must_divide_the_pool():
    with pytest.raises(ValueError, match=r"actor\.engine\.tp_size got 2; allowed: pp_size \* tp_size = 2 must "
                                         r"divide the 3 devices of pool 'global'"):
        _load("placement.pools.global=[3]", "actor.engine.layout=3d", "actor.engine.tp_size=2")


def test_fsdp_layout_rejects_model_parallel_sizes():
    with pytest.raises(ValueError, match=r"config key critic\.engine: engine\.pp_size/tp_size must be 1 with layout='fsdp'"):
        _load("critic.engine.pp_size=2")


def test_generation_sizes_must_divide_training_sizes():
    with pytest.raises(ValueError, match=r"actor\.hybrid_engine\.tp_size got 2; allowed: a divisor of "
                                         r"actor\.engine\.tp_size=1"):
        _load("actor.hybrid_engine.tp_size=2")


def test_role_on_unknown_pool_and_unknown_role_are_rejected():
    with pytest.raises(ValueError, match=r"placement\.roles\.critic got 'gpu'; allowed: global"):
        _load("placement.roles.critic=gpu")
    with pytest.raises(ValueError, match=r"placement\.roles got 'judge'; allowed: actor, reference, critic, reward"):
        _load("placement.roles.judge=global")


def test_reward_needs_a_model_or_a_well_formed_function():
    with pytest.raises(ValueError, match=r"config key reward\.function got 'bad spec:x'; allowed: 'package.module:function'"):
        _load("reward.function=bad spec:x")
    with pytest.raises(ValueError, match=r"config key reward\.model got None"):
        load_rl_config(None, ["data.train_path=t.jsonl", "actor.model.builtin=arithmetic"])


def test_model_source_needs_exactly_one_of_path_or_builtin():
    with pytest.raises(ValueError, match=r"actor\.model\.path needs exactly one of path, tiny and builtin"):
        _load("actor.model.path=/models/x")


def test_an_override_of_one_model_source_replaces_the_source_the_yaml_set(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: {train_path: a.jsonl}\nactor:\n  model: {builtin: arithmetic, dtype: float32}\n"
                    "reward: {model: {path: /models/rm}}\n")
    config = load_rl_config(path, ["actor.model.path=/models/sft", "reward.model.tiny={}"])
    assert (config.actor.model.path, config.actor.model.builtin, config.actor.model.dtype) == ("/models/sft", None, "float32")
    assert (config.reward.model.path, config.reward.model.tiny) == (None, {})


def test_two_model_sources_given_as_overrides_are_still_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data: {train_path: a.jsonl}\nactor: {model: {builtin: arithmetic}}\nreward: {function: 'm:f'}\n")
    with pytest.raises(ValueError, match=r"actor\.model\.path needs exactly one of path, tiny and builtin; "
                                         r"got path='/a', tiny=\{\}, builtin=None"):
        load_rl_config(path, ["actor.model.path=/a", "actor.model.tiny={}"])


def test_setting_a_model_source_to_null_leaves_the_other_sources_alone():
    data = {"model": {"path": "/a"}}
    assert apply_overrides(data, ["model.builtin=null"], SFTConfig) == {"model": {"path": "/a", "builtin": None}}
    assert apply_overrides(data, ["model.builtin=arithmetic"], SFTConfig) == {"model": {"builtin": "arithmetic"}}
    assert apply_overrides(data, ["model.builtin=arithmetic"]) == {"model": {"path": "/a", "builtin": "arithmetic"}}


def test_ptx_coefficient_needs_a_ptx_dataset():
    with pytest.raises(ValueError, match=r"config key actor\.loss\.ptx_coef got 0\.5; allowed: 0 unless data\.ptx_path"):
        _load("actor.loss.ptx_coef=0.5")
    assert _load("actor.loss.ptx_coef=0.5", "data.ptx_path=p.jsonl").actor.loss.ptx_coef == 0.5


def test_critic_free_estimator_drops_the_critic_from_active_roles():
    grpo = _load("algorithm.advantage_estimator=grpo", "batch.samples_per_prompt=2")
    assert grpo.active_roles == ("actor", "reference")
    assert _load("algorithm.kl_mode=none").active_roles == ("actor", "critic")
    assert _load("reward.model.builtin=arithmetic").active_roles == ("actor", "reference", "critic", "reward")


def test_config_is_frozen_and_overrides_do_not_touch_the_input():
    config = _load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch.mini_batch_size = 2  # type: ignore[misc]
    data = {"actor": {"engine": {"optim": {"lr": 1.0}}}}
    assert apply_overrides(data, ["actor.engine.optim.lr=2.0"]) == {"actor": {"engine": {"optim": {"lr": 2.0}}}}
    assert data == {"actor": {"engine": {"optim": {"lr": 1.0}}}}


def test_plain_dump_round_trips_through_the_loader():
    config = _load("actor.engine.optim.lr=3e-4", "placement.pools={a: [2]}", "batch.mini_batch_size=4")
    rebuilt = build_dataclass(RLConfig, to_plain(config))
    assert rebuilt == config


def test_auto_mapping_places_every_active_role_within_the_given_devices():
    from hybridflow.trainers.auto_mapping import resolve_auto_mapping

    config = _load("reward.model.builtin=arithmetic", "placement.pools={cluster: [8]}", "placement.mapping=auto",
                   "placement.hardware=a100-80g", "batch.prompts_per_step=64", "batch.mini_batch_size=16")
    resolved, plan = resolve_auto_mapping(config)
    assert plan is not None and config.placement.mapping == "auto"  # the user's config is untouched
    assert resolved.placement.mapping == "manual"
    assert set(resolved.placement.roles) == set(config.active_roles)
    assert sum(resolved.placement.pool_size(pool) for pool in resolved.placement.pools) <= 8
    assert resolved.derived().samples_per_step == 64  # sizes stay consistent under the chosen layouts
    assert resolved.actor.engine.optim == config.actor.engine.optim
    manual, no_plan = resolve_auto_mapping(_load())
    assert no_plan is None and manual == _load()


def test_train_command_reports_config_errors_before_starting_anything(capsys):
    from hybridflow.cli import main

    assert main(["train", *BASE, "actor.engine.optim.lrr=1"]) == 2
    assert "unknown config key actor.engine.optim.lrr" in capsys.readouterr().err
    assert main(["sft", "model.builtin=arithmetic", "data.train_path=x.jsonl", "batch_size=0"]) == 2
    assert "config key batch_size got 0" in capsys.readouterr().err


def test_print_config_shows_the_resolved_config_as_yaml_with_the_derived_sizes(capsys):
    import yaml

    from hybridflow.cli import main

    assert main(["train", *BASE, "batch.samples_per_prompt=4", "--print-config"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed["batch"]["samples_per_prompt"] == 4
    assert '"samples_per_step": 32' in out.split("# derived sizes")[1]


def test_full_gather_transition_needs_generation_pp_and_tp_of_one():
    from hybridflow.engine.hybrid_engine import HybridEngineConfig

    assert HybridEngineConfig(strategy="full_gather").strategy == "full_gather"
    with pytest.raises(ValueError, match="full_gather.*pp_size and tp_size must be 1"):
        HybridEngineConfig(strategy="full_gather", tp_size=2)


def test_a_section_set_in_part_keeps_its_roles_own_defaults():
    # the actor's engine defaults to lr 1e-6 (the critic's to 1e-5): setting another engine key must not reset it
    config = _load("actor.engine.micro_batch_tokens=512", "critic.engine.optim.weight_decay=0.1")
    assert config.actor.engine.optim.lr == 1e-6 and config.actor.engine.micro_batch_tokens == 512
    assert _load().actor.engine.optim.lr == 1e-6
    assert _load("actor.engine.optim.betas=[0.8, 0.9]").actor.engine.optim.lr == 1e-6
    assert _load("actor.engine.optim.lr=3e-5").actor.engine.optim.lr == 3e-5
