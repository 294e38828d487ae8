"""One config per component: YAML round trips, generated docs, derived keys, new knobs, CLI frictions."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import yaml

from hybridflow.cli import main
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.generation import GenerationConfig, SamplingConfig, process_logits, sample_tokens
from hybridflow.engine.generation_config import GenerationTokens
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.config.rl import RLConfig, load_rl_config
from hybridflow.trainers.config.loader import build_dataclass
from hybridflow.workers.spec import UpdateSizes

BASE = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score"]

# A non-default value in every section (cost included), so a field lost on the way fails the round trip.
EVERY_SECTION = """
data: {train_path: t.jsonl, val_path: v.jsonl, prompt_key: question, max_prompt_tokens: 32, shuffle: false}
actor:
  model: {builtin: arithmetic, attn_implementation: eager}
  engine:
    micro_batch_tokens: 512
    dtype: bfloat16
    fsdp_cpu_offload: true
    num_threads: 2
    optim: {lr: 3.0e-4, eps: 1.0e-6, lr_schedule: cosine, warmup_steps: 2, grad_clip: null, betas: [0.8, 0.9]}
  loss: {ppo_epochs: 2, clip_ratio: 0.1, entropy_coef: 0.01}
  generation: {max_new_tokens: 7, min_new_tokens: 1, top_k: 5, repetition_penalty: 1.2, suppress_tokens: [0],
               stop: ["\\n"], use_model_defaults: false}
  hybrid_engine: {strategy: vanilla}
reference: {engine: {micro_batch_tokens: 256}}
critic: {engine: {optim: {lr: 2.0e-5}}, loss: {value_clip: 0.0}}
reward: {function: 'pkg.mod:score', model: {builtin: arithmetic}, model_weight: 0.5}
cost: {model: {builtin: arithmetic}, limit: 0.5, lambda_lr: 0.05, critic: {loss: {ppo_epochs: 2}}}
algorithm: {gamma: 0.99, kl_coef: 0.1, kl_controller: adaptive}
batch: {prompts_per_step: 4, samples_per_prompt: 2, mini_batch_size: 4}
placement: {pools: {global: [1]}, hardware: h100-80g}
trainer: {total_steps: 3, seed: 5, tensorboard: false, output_dir: runs/x, val_every: 1}
"""


def test_every_section_round_trips_yaml_to_objects_to_print_config_to_yaml(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(EVERY_SECTION)
    config = load_rl_config(path)
    assert main(["train", str(path), "--print-config"]) == 0
    printed = capsys.readouterr().out
    reloaded = build_dataclass(RLConfig, yaml.safe_load(printed))
    assert reloaded == config
    given = yaml.safe_load(EVERY_SECTION)
    shown = yaml.safe_load(printed)
    for section, values in given.items():  # every key the user wrote shows with its value
        for key, value in values.items():
            if not isinstance(value, dict):
                assert shown[section][key] == value, f"{section}.{key}"
    assert shown["actor"]["engine"]["optim"]["grad_clip"] is None
    assert config.actor.engine.dtype == "bfloat16" and config.actor.generation.stop == ("\n",)


def test_supervised_configs_round_trip_through_print_config(capsys):
    from hybridflow.trainers.supervised import RMConfig, SFTConfig

    for kind, cls in (("sft", SFTConfig), ("rm", RMConfig)):
        assert main([kind, "model.builtin=arithmetic", "data.train_path=x.jsonl", "engine.optim.lr=1e-3",
                     "data.max_response_tokens=9", "--print-config"]) == 0
        reloaded = build_dataclass(cls, yaml.safe_load(capsys.readouterr().out))
        assert reloaded.engine.optim.lr == 1e-3 and reloaded.data.max_response_tokens == 9


def test_docs_config_md_holds_the_current_generated_key_reference():
    from hybridflow.trainers.config.docs import DOC_PATH, with_reference

    text = DOC_PATH.read_text()
    assert with_reference(text) == text, "docs/config.md is stale: run python -m hybridflow.trainers.config.docs"


def test_the_generated_reference_lists_every_knob_with_its_role_default():
    from hybridflow.trainers.config.docs import render_reference

    reference = render_reference()
    for key in ("actor.engine.dtype", "actor.engine.fsdp_cpu_offload", "actor.engine.pipeline_schedule",
                "actor.engine.optim.eps", "actor.engine.optim.lr_schedule", "actor.engine.num_threads",
                "actor.model.attn_implementation", "actor.generation.repetition_penalty", "trainer.tensorboard",
                "trainer.wandb_project", "actor.hybrid_engine.strategy", "cost.critic.loss.value_clip"):
        assert f"| `{key}` |" in reference, key
    assert "| `actor.engine.optim.lr` | float | `1.0e-06` |" in reference
    assert "| `critic.engine.optim.lr` | float | `1.0e-05` |" in reference


@pytest.mark.parametrize("key", ["actor.loss.mini_batch_size", "actor.loss.kl_loss_coef",
                                 "actor.loss.max_response_length", "critic.loss.mini_batch_size",
                                 "critic.loss.max_response_length"])
def test_the_update_sizes_and_kl_loss_weight_are_build_arguments_not_loss_keys(key):
    # the trainer takes them from batch.mini_batch_size, algorithm.kl_coef and actor.generation.max_new_tokens
    # (ActorSpec/CriticSpec .sizes, ActorSpec.kl_loss_coef); a YAML naming them fails as any unknown key
    section = key.rsplit(".", 1)[0]
    allowed = "clip_ratio, clip_ratio_high" if section == "actor.loss" else "loss_aggregation, on_non_finite"
    with pytest.raises(ValueError, match=rf"unknown config key {re.escape(key)}; allowed keys here: .*{allowed}"):
        load_rl_config(None, [*BASE, f"{key}=3"])


def test_runtime_values_of_the_rollout_are_no_config_keys():
    # runtime values of the rollout (samples per prompt, seed, token ids) are no config keys at all
    with pytest.raises(ValueError, match=r"unknown config key actor\.generation\.samples_per_prompt; allowed keys "
                                         r"here: backend, greedy, max_new_tokens"):
        load_rl_config(None, [*BASE, "actor.generation.samples_per_prompt=3"])


@pytest.mark.parametrize("key", ["actor.engine.seed", "critic.engine.optim.total_steps", "actor.model.head",
                                 "reward.model.seed"])
def test_the_runs_seed_step_count_and_head_are_build_arguments_not_config_keys(key):
    # the trainer passes them to the engine (EngineSpec.seed/total_steps/head); a YAML cannot name them
    with pytest.raises(ValueError, match=rf"unknown config key {re.escape(key)}; allowed keys here: "):
        load_rl_config(None, [*BASE, f"{key}=3"])


def test_float16_compute_is_refused_for_want_of_loss_scaling():
    with pytest.raises(ValueError, match=r"config key actor\.engine: engine\.dtype got 'float16', which needs loss "
                                         r"scaling"):
        load_rl_config(None, [*BASE, "actor.engine.dtype=float16"])
    assert EngineConfig(dtype="bfloat16").resolve_dtype(None) == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's rule; CUDA resolves auto by the GPU")
def test_auto_dtype_on_cpu_is_bf16_only_with_bf16_instructions_and_a_wide_enough_model(monkeypatch):
    from hybridflow import device

    monkeypatch.setenv(device.CPU_DTYPE_ENV, "auto")
    wide, narrow = device.CPU_BF16_MIN_HIDDEN, device.CPU_BF16_MIN_HIDDEN - 1
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert EngineConfig().resolve_dtype(wide) == torch.bfloat16 and EngineConfig().resolve_dtype(None) == torch.bfloat16
    assert EngineConfig().resolve_dtype(narrow) == torch.float32  # autocast's casts outweigh the faster matmuls
    assert EngineConfig(dtype="float32").resolve_dtype(wide) == torch.float32  # an explicit dtype is kept
    assert EngineConfig(dtype="bfloat16").resolve_dtype(narrow) == torch.bfloat16
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)  # AVX2 only: bf16 emulated, slower
    assert EngineConfig().resolve_dtype(wide) == torch.float32
    monkeypatch.setenv(device.CPU_DTYPE_ENV, "bfloat16")
    assert EngineConfig().resolve_dtype(narrow) == torch.bfloat16
    monkeypatch.setenv(device.CPU_DTYPE_ENV, "half")
    with pytest.raises(ValueError, match=r"HYBRIDFLOW_CPU_DTYPE must be 'auto', 'float32' or 'bfloat16', got 'half'"):
        EngineConfig().resolve_dtype(None)


def test_grad_clip_zero_is_refused_in_favour_of_null():
    with pytest.raises(ValueError,
                       match=r"optim\.grad_clip must be a finite number > 0 or None \(no clipping\), got 0\.0"):
        load_rl_config(None, [*BASE, "actor.engine.optim.grad_clip=0"])
    assert load_rl_config(None, [*BASE, "actor.engine.optim.grad_clip=null"]).actor.engine.optim.grad_clip is None


def test_overrides_are_accepted_after_flags(capsys):
    assert main(["train", *BASE[:1], "--print-config", *BASE[1:], "trainer.total_steps=3"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["total_steps"] == 3


# ---- the sampler's new options ------------------------------------------------------------------
def test_suppressed_tokens_are_never_sampled_and_logprobs_stay_those_of_the_model():
    logits_BV = torch.tensor([[5.0, 0.0, 0.0, 0.0]]).repeat(64, 1)
    generator = torch.Generator().manual_seed(0)
    tokens_B, logprobs_B = sample_tokens(logits_BV, GenerationConfig(suppress_tokens=(0,)).resolved(), generator)
    assert not (tokens_B == 0).any()
    torch.testing.assert_close(logprobs_B, torch.log_softmax(logits_BV, -1)[0, 1].expand(64))


def test_min_new_tokens_masks_end_tokens_only_before_the_minimum():
    config = GenerationConfig(min_new_tokens=2).resolved()
    logits_BV = torch.zeros(1, 4)
    end_ids = torch.tensor([3])
    assert process_logits(logits_BV, config, history_BL=None, step=1, end_ids=end_ids)[0, 3] == float("-inf")
    assert process_logits(logits_BV, config, history_BL=None, step=2, end_ids=end_ids)[0, 3] == 0.0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    config = GenerationConfig(repetition_penalty=2.0).resolved()
    logits_BV = torch.tensor([[4.0, -4.0, 4.0]])
    processed = process_logits(logits_BV, config, history_BL=torch.tensor([[0, 1, 1]]), step=0, end_ids=None)
    assert processed.tolist() == [[2.0, -8.0, 4.0]]


def test_model_generation_config_fills_the_defaults_but_not_the_values_set_by_the_user():
    config = GenerationConfig(top_k=7, stop=("##",))
    model = {"eos_token_id": [2, 9], "temperature": 0.6, "top_k": 50, "top_p": 0.9, "suppress_tokens": [1]}
    resolved = config.with_model_defaults(model)
    assert (resolved.temperature, resolved.top_k, resolved.top_p) == (0.6, 7, 0.9)
    tokens = GenerationTokens.build(config, eos_token_id=2, pad_token_id=None, model_defaults=model,
                                    encode=lambda text: [5, 5])
    assert (tokens.eos_token_ids, tokens.pad_token_id, tokens.stop_sequences) == ((2, 9), 2, ((5, 5),))
    assert resolved.suppress_tokens == (1,)
    off = GenerationConfig(use_model_defaults=False).with_model_defaults(model)
    assert (off.temperature, off.top_k, off.top_p, off.repetition_penalty) == (1.0, 0, 1.0, 1.0)
    off_tokens = GenerationTokens.build(off, eos_token_id=3, pad_token_id=0, model_defaults=model)
    assert (off_tokens.eos_token_ids, off_tokens.pad_token_id) == ((3,), 0)


def test_a_sampling_value_the_user_wrote_is_kept_even_when_it_equals_the_default():
    model = {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.3}
    written = GenerationConfig(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    resolved = written.with_model_defaults(model)
    assert (resolved.temperature, resolved.top_k, resolved.top_p, resolved.repetition_penalty) == (1.0, 0, 1.0, 1.0)
    unset = GenerationConfig().with_model_defaults(model)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.repetition_penalty) == (0.6, 50, 0.9, 1.3)
    assert GenerationConfig().temperature is None and GenerationConfig().resolved().temperature == 1.0


def test_resuming_a_checkpoint_whose_config_was_saved_with_the_old_sampling_defaults_reports_no_change():
    from hybridflow.trainers.checkpoint import config_changes

    old = {"actor": {"generation": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}}}
    unset = {"actor": {"generation": {"temperature": None, "top_k": None, "top_p": None, "repetition_penalty": None}}}
    assert config_changes(old, unset) == ([], [])
    assert config_changes(unset, unset) == ([], [])
    changed = {"actor": {"generation": {"temperature": 0.7, "top_k": None, "top_p": None, "repetition_penalty": None}}}
    assert config_changes(old, changed)[1] == ["actor.generation.temperature: 1.0 -> 0.7"]
    assert config_changes(unset, {"actor": {"generation": {**unset["actor"]["generation"], "top_k": 0}}})[1] == [
        "actor.generation.top_k: None -> 0"]


def test_stop_strings_end_a_response_and_min_new_tokens_delays_the_end():
    from hybridflow.engine.decoder import DecoderStage
    from hybridflow.engine.generation import GenerationEngine
    from hybridflow.models import ModelConfig, build_model

    model = build_model(ModelConfig(tiny={"vocab_size": 32}), seed=0)
    engine = GenerationEngine(DecoderStage.from_state_dict(model.config, model.state_dict()))
    prompts = torch.tensor([[1, 2, 3]])
    mask = torch.ones_like(prompts)
    free = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=6, greedy=True))["responses"][0].tolist()
    stop = tuple(free[1:3])
    stopped = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=6, greedy=True,
                                                              stop_sequences=(stop,)))
    assert stopped["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 0]
    assert stopped["responses"][0, :3].tolist() == free[:3]
    late = engine.generate(prompts, mask, SamplingConfig(max_new_tokens=6, greedy=True,
                                                           eos_token_ids=(free[0],), min_new_tokens=3))
    assert late["response_mask"][0, :3].tolist() == [1, 1, 1] and late["responses"][0, 0].item() != free[0]


# ---- CLI frictions --------------------------------------------------------------------------------
def test_data_command_writes_the_example_prompt_files(tmp_path, capsys):
    assert main(["data", "arithmetic", "--out", str(tmp_path), "--train", "5", "--eval", "3", "--sft", "2"]) == 0
    lines = {name: (tmp_path / name).read_text().splitlines() for name in ("train.jsonl", "eval.jsonl", "sft.jsonl")}
    assert [len(rows) for rows in lines.values()] == [5, 3, 2]
    assert set(json.loads(lines["sft.jsonl"][0])) >= {"prompt", "response"}


def test_bf16_training_through_the_cli_with_a_reward_module_from_the_working_directory(tmp_path, monkeypatch,
                                                                                        capsys):
    """`hybridflow train cfg.yaml --local key=value`: overrides after the flag, a `module:function` reward
    found in the working directory (not on sys.path), and bf16 compute on the tiny model."""
    task = ArithmeticTaskConfig(max_digits=1)
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0, config=task))
    (tmp_path / "my_reward_module.py").write_text(
        "def length(prompt, response, **fields):\n    return len(response) / 4.0\n")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "data": {"train_path": "train.jsonl"}, "actor": {"model": {"builtin": "arithmetic"},
                                                         "generation": {"max_new_tokens": 3}},
        "reward": {"function": "my_reward_module:length"}, "algorithm": {"advantage_estimator": "grpo"},
        "batch": {"prompts_per_step": 2, "samples_per_prompt": 2, "mini_batch_size": 4},
        "trainer": {"total_steps": 5, "progress_bar": False, "tensorboard": False, "output_dir": "out"}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", ".", str(tmp_path))])
    assert main(["train", "run.yaml", "--local", "trainer.total_steps=1", "actor.engine.dtype=bfloat16",
                 "reference.engine.dtype=bfloat16"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1]
    assert math_isfinite(records[0]["actor/pg_loss"]) and records[0]["actor/grad_norm"] > 0


def math_isfinite(value: float) -> bool:
    return value == value and abs(value) != float("inf")


def test_the_estimator_table_and_the_config_literal_name_the_same_estimators():
    import typing

    from hybridflow.trainers.advantage import ESTIMATORS, AlgorithmSection

    hints = typing.get_type_hints(AlgorithmSection)
    assert set(typing.get_args(hints["advantage_estimator"])) == set(ESTIMATORS)
    assert [name for name, estimator in ESTIMATORS.items() if estimator.traits.needs_critic] == ["gae"]
    assert [name for name, estimator in ESTIMATORS.items() if estimator.traits.group_based] == ["grpo", "dr_grpo", "rloo"]
    assert [name for name, estimator in ESTIMATORS.items() if estimator.traits.baseline_generation] == ["remax"]
    assert AlgorithmSection(advantage_estimator="remax").estimator is ESTIMATORS["remax"].traits
    with pytest.raises(ValueError, match=r"advantage_estimator got 'vtrace'; allowed: gae, grpo"):
        AlgorithmSection(advantage_estimator="vtrace")


def test_a_plan_made_for_another_workload_is_refused_and_a_matching_one_is_applied_by_typed_replacement():
    from dataclasses import replace

    from hybridflow.mapping import Plan, PoolPlan, RoleStrategy
    from hybridflow.trainers.auto_mapping import apply_plan, workload_of

    config = load_rl_config(None, [*BASE, "algorithm.advantage_estimator=grpo", "batch.prompts_per_step=8",
                                          "batch.samples_per_prompt=2"])
    plan = Plan(pools=(PoolPlan(name="all", roles=("actor", "reference"), devices_per_node=(4,)),),
                strategies={"actor": RoleStrategy(layout="3d", tp_size=2, generation_pp_size=1, generation_tp_size=1),
                            "reference": RoleStrategy(layout="fsdp")}, workload=workload_of(config))
    applied = apply_plan(config, plan)
    assert applied.placement.pools == {"all": [4]} and applied.placement.mapping == "manual"
    assert (applied.actor.engine.layout, applied.actor.engine.tp_size, applied.actor.hybrid_engine.tp_size) == \
        ("3d", 2, 1)
    assert applied.actor.engine.optim == config.actor.engine.optim
    with pytest.raises(ValueError, match="the plan was made for"):
        apply_plan(config, replace(plan, workload=replace(plan.workload, prompts_per_step=16)))


def test_project_license_is_an_spdx_string_not_the_deprecated_table():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


@pytest.mark.parametrize("fails", [False, True])
def test_install_script_shows_one_line_per_step_and_only_the_real_errors(tmp_path, fails):
    import subprocess
    from pathlib import Path

    fake_python = tmp_path / "venv" / "bin" / "python"
    fake_python.parent.mkdir(parents=True)
    fake_python.write_text("#!/usr/bin/env bash\n"
                           "if [ \"$1\" = -c ]; then echo 'torch 2.13.0'; exit 0; fi\n"
                           "for i in 1 2 3 4 5; do echo \"WARNING: noisy line $i\"; done\n"
                           + ("echo 'ERROR: No matching distribution found for torch==2.13.0' >&2; exit 1\n" if fails
                              else "exit 0\n"))
    fake_python.chmod(0o755)
    script = Path(__file__).parents[1] / "scripts" / "install.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HYBRIDFLOW_VENV": str(tmp_path / "venv")})
    assert "WARNING" not in result.stdout + result.stderr
    if fails:
        assert result.returncode == 1
        assert "ERROR: No matching distribution found for torch==2.13.0" in result.stderr
    else:
        assert result.returncode == 0
        assert result.stdout.count("  ok  ") == 3 and "torch 2.13.0" in result.stdout


def test_the_example_configs_load_with_the_unified_keys():
    from pathlib import Path

    examples = Path(__file__).parents[1] / "examples"
    arithmetic = load_rl_config(examples / "arithmetic_ppo.yaml")
    assert arithmetic.actor.engine.optim.lr == 1.0e-4 and arithmetic.critic.engine.optim.lr == 1.0e-3
    smollm2 = load_rl_config(examples / "smollm2_gsm8k" / "config.yaml",
                             ["data.train_path=t.jsonl", "data.val_path=v.jsonl", "actor.model.path=/models/smollm2"])
    assert smollm2.actor.loss.clip_ratio == 0.2 and smollm2.actor.engine.optim.warmup_steps == 2


def test_asking_for_wandb_without_it_installed_names_the_key(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from hybridflow.trainers.metrics import MetricsLogger

    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"trainer\.wandb_project got 'demo' but wandb is not installed"):
            MetricsLogger(tmp_path, tensorboard=False, wandb_project="demo")
    else:
        pytest.skip("wandb is installed here; the error path cannot run")


def test_each_transition_strategy_setting_names_one_class():
    import typing

    from hybridflow.engine.hybrid_engine import TRANSITION_STRATEGIES, HybridEngineConfig

    hints = typing.get_type_hints(HybridEngineConfig)
    assert set(typing.get_args(hints["strategy"])) == set(TRANSITION_STRATEGIES)
    assert all(cls.name == name for name, cls in TRANSITION_STRATEGIES.items())
    assert TRANSITION_STRATEGIES["vanilla"].generation_grouping == "vanilla"


def test_role_specs_pass_each_role_its_head_the_runs_seed_and_its_optimizer_step_count():
    from hybridflow.trainers.build import role_specs

    config = load_rl_config(None, [*BASE, "trainer.seed=5", "trainer.total_steps=3", "batch.prompts_per_step=4",
                                   "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
                                   "actor.loss.ppo_epochs=2", "critic.engine.optim.lr_schedule=cosine"])
    specs = role_specs(config)
    assert config.derived().mini_batches_per_epoch == 2
    assert (specs.actor.engine.head, specs.actor.engine.seed, specs.actor.engine.total_steps) == ("lm", 5, 3 * 2 * 2)
    critic_engine = specs.critic.engine
    assert (critic_engine.head, critic_engine.seed, critic_engine.total_steps) == ("value", 5, 3 * 2)
    assert (specs.reference.head, specs.reference.seed, specs.reference.total_steps) == ("lm", 5, None)
    assert specs.actor.engine.engine == config.actor.engine  # the user's section, as written
    assert specs.actor.loss == config.actor.loss and specs.critic.loss == config.critic.loss  # as written, too
    sizes = UpdateSizes(mini_batch_size=4, max_response_length=config.actor.generation.max_new_tokens)
    assert specs.actor.sizes == specs.critic.sizes == sizes
    assert specs.actor.kl_loss_coef == 0.0  # gae: the KL shapes the reward


@pytest.mark.parametrize("overrides, coef", [(["algorithm.advantage_estimator=grpo"], 0.02),
                                             (["algorithm.kl_mode=loss"], 0.02),
                                             (["algorithm.advantage_estimator=grpo", "algorithm.kl_mode=reward"], 0.0),
                                             (["algorithm.advantage_estimator=grpo", "algorithm.kl_mode=none"], 0.0)])
def test_the_actor_gets_the_kl_coefficient_as_its_loss_weight_only_when_the_kl_goes_in_the_loss(overrides, coef):
    from hybridflow.trainers.build import role_specs

    config = load_rl_config(None, [*BASE, "algorithm.kl_coef=0.02", "batch.samples_per_prompt=2", *overrides])
    assert role_specs(config).actor.kl_loss_coef == coef


def test_a_warmup_longer_than_the_run_is_refused_before_any_worker_starts():
    from hybridflow.trainers.build import role_specs

    config = load_rl_config(None, [*BASE, "trainer.total_steps=2", "batch.prompts_per_step=4",
                                   "batch.samples_per_prompt=1", "batch.mini_batch_size=4",
                                   "actor.engine.optim.warmup_steps=5", "actor.engine.optim.lr_schedule=linear"])
    with pytest.raises(ValueError, match=r"optim.warmup_steps 5 exceeds the run's 2 optimizer steps"):
        role_specs(config)


def test_an_engine_spec_refuses_a_head_no_role_has():
    from hybridflow.workers import EngineSpec

    with pytest.raises(ValueError, match=r"EngineSpec.head must be one of \('lm', 'value', 'score'\), got 'reward'"):
        EngineSpec(model=ModelConfig(tiny={}), engine=EngineConfig(), head="reward")
