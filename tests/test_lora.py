"""LoRA (actor.lora, critic.lora): only the adapters train and are saved, the reference is the base model with the
adapters off, generation and export see W + scale B A, layouts equal one process (tiny model, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.engine.decoder import DecoderStage
from hybridflow.engine.generation import GenerationEngine, SamplingConfig
from hybridflow.models import build_tiny_model
from hybridflow.models.lora import is_adapter_parameter
from hybridflow.models.lora_config import LoraConfig
from hybridflow.parallel.launch import run_distributed
from hybridflow.parallel.sharding import tp_shard_dim
from test_engine_layouts import GLOBAL_ROWS, make_batch, token_nll_loss
from test_trainer import data_dir  # noqa: F401 (the built-in task's prompt files, a fixture)

OPTIM = OptimConfig(lr=1e-2, eps=1e-4)
LORA = LoraConfig(rank=4, alpha=8.0)


def lora_engine(lora: LoraConfig = LORA, head: str = "lm", **layout) -> TrainingEngine:
    return TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM, dtype="float32", **layout),
                          lambda: build_tiny_model(head=head), head=head, lora=lora, total_steps=8)


def base_engine() -> TrainingEngine:
    return TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM, dtype="float32"), lambda: build_tiny_model(),
                          trainable=False)


def parameters(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in engine.model.named_parameters()}


@pytest.fixture(scope="module")
def trained():
    """A LoRA engine before and after two steps (the second moves A too: after the first B is no longer 0)."""
    engine = lora_engine()
    before = parameters(engine)
    losses = [engine.train_step(make_batch(), token_nll_loss)["loss"] for _ in range(2)]
    return engine, before, losses


def test_only_adapter_parameters_require_grad_reach_the_optimizer_and_change(trained):
    engine, before, losses = trained
    trainable = {name for name, param in engine.model.named_parameters() if param.requires_grad}
    adapters = {name for name in before if is_adapter_parameter(name)}
    # A and B on the 7 projections of every layer
    assert trainable == adapters and len(adapters) == 2 * 7 * engine.hf_config.num_hidden_layers
    optimized = {id(param) for group in engine.optimizer.param_groups for param in group["params"]}
    assert optimized == {id(param) for name, param in engine.model.named_parameters() if name in adapters}
    after = parameters(engine)
    assert all(not torch.equal(after[name], before[name]) for name in adapters)
    assert all(torch.equal(after[name], before[name]) for name in before if name not in adapters)
    assert losses[1] < losses[0]


def test_adapters_start_as_lora_init_the_base_model_exactly(trained):
    engine = lora_engine()
    batch = make_batch()
    torch.testing.assert_close(engine.forward(batch)["logprobs"], base_engine().forward(batch)["logprobs"],
                               atol=0, rtol=0)
    lora_B = [param for name, param in engine.model.named_parameters() if name.endswith("lora_B.weight")]
    assert lora_B and all(float(param.detach().abs().max()) == 0 for param in lora_B)


def test_reference_log_probs_with_adapters_off_equal_the_base_models(trained):
    engine, _, _ = trained
    batch = make_batch()
    with engine.adapters_disabled():
        reference = engine.forward(batch)["logprobs"]
    torch.testing.assert_close(reference, base_engine().forward(batch)["logprobs"], atol=0, rtol=0)
    assert (engine.forward(batch)["logprobs"] - reference).abs().max() > 1e-3  # the adapters are back on


def peft_merged(engine: TrainingEngine, directory) -> torch.nn.Module:
    """The base model with ``engine``'s adapter exported and loaded by PEFT."""
    from peft import PeftModel

    engine.export_adapter(str(directory))
    return PeftModel.from_pretrained(build_tiny_model(), str(directory)).eval()


def test_export_writes_peft_adapter_files_that_peft_loads_to_the_same_log_probs(trained, tmp_path):
    engine, _, _ = trained
    model = peft_merged(engine, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                       "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    batch = make_batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    response_logits = logits[:, -batch["responses"].shape[1] - 1:-1].float()
    logprobs = torch.log_softmax(response_logits, -1).gather(-1, batch["responses"][..., None])[..., 0]
    mask = batch["response_mask"].bool()
    ours = engine.forward(batch)["logprobs"]
    torch.testing.assert_close(ours[mask], logprobs[mask], atol=2e-5, rtol=0)


def test_merged_export_loads_with_from_pretrained_as_peft_merges_it(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    engine, _, _ = trained
    engine.export_hf(str(tmp_path / "merged"))
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).state_dict()
    expected = peft_merged(engine, tmp_path / "adapter").merge_and_unload().state_dict()
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(exported[name], tensor, atol=1e-6, rtol=0)


def test_generation_shards_hold_merged_weights_and_greedy_decode_equals_peft_merged_generate(trained, tmp_path):
    engine, before, _ = trained
    shards = engine.local_shards()
    assert not any(is_adapter_parameter(name) for name in shards)
    merged_model = peft_merged(engine, tmp_path / "adapter").merge_and_unload()
    expected_state = merged_model.state_dict()
    for name, shard in shards.items():
        torch.testing.assert_close(shard.cpu(), expected_state[name], atol=1e-6, rtol=0)
    assert all(torch.equal(param, before[name]) for name, param in engine.model.named_parameters()
               if not is_adapter_parameter(name))  # merging never writes the trained base weights
    prompts_BP = make_batch()["input_ids"][:, :6]
    mask_BP = torch.ones_like(prompts_BP)
    out = GenerationEngine(DecoderStage.from_state_dict(engine.hf_config, shards)).generate(
        prompts_BP, mask_BP, SamplingConfig(max_new_tokens=5, greedy=True))
    with torch.no_grad():
        expected = merged_model.generate(prompts_BP, attention_mask=mask_BP, max_new_tokens=5, do_sample=False,
                                         pad_token_id=0, eos_token_id=None)[:, 6:]
    assert torch.equal(out["responses"].cpu(), expected)


def test_checkpoint_holds_only_adapter_tensors_and_resume_is_exact(tmp_path):
    engine = lora_engine()
    batch = make_batch()
    engine.train_step(batch, token_nll_loss)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    straight = [engine.train_step(batch, token_nll_loss)["loss"] for _ in range(2)]
    keys = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = {key.removeprefix("model.") for key in keys if key.startswith("model.")}
    assert model_keys == {name for name, _ in engine.model.named_parameters() if is_adapter_parameter(name)}
    assert all(is_adapter_parameter(key.removeprefix("optim.").rsplit(".", 1)[0]) for key in keys
               if key.startswith("optim."))
    resumed = lora_engine()
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.step == 1
    assert [resumed.train_step(batch, token_nll_loss)["loss"] for _ in range(2)] == straight
    final, again = parameters(engine), parameters(resumed)
    assert all(torch.equal(final[name], again[name]) for name in final)
    with pytest.raises(ValueError, match="holds LoRA adapters but this engine trains full weights"):
        TrainingEngine(EngineConfig(micro_batch_tokens=24, optim=OPTIM), lambda: build_tiny_model()).load_checkpoint(
            str(tmp_path / "ckpt"))


def test_a_critic_with_lora_trains_its_adapters_and_its_new_value_head_and_exports_both_for_peft(tmp_path):
    from peft import PeftModel

    engine = lora_engine(head="value")
    trainable = {name for name, param in engine.model.named_parameters() if param.requires_grad}
    head = {name for name, _ in engine.model.named_parameters() if name.startswith("score.")}
    assert head and {name for name in trainable if not is_adapter_parameter(name)} == head
    batch = make_batch()
    returns_BT = torch.randn(batch["response_mask"].shape, generator=torch.Generator().manual_seed(0))
    values_batch = {**batch, "returns": returns_BT}

    def value_loss(outputs, micro_batch):
        error = (outputs["values"] - micro_batch["returns"]) * micro_batch["response_mask"]
        return error.pow(2).sum() / micro_batch["num_tokens_global"], {}

    for _ in range(2):
        engine.train_step(values_batch, value_loss)
    engine.export_adapter(str(tmp_path / "critic"))
    model = PeftModel.from_pretrained(build_tiny_model(head="value"), str(tmp_path / "critic")).eval()
    with torch.no_grad():
        values = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
    mask = batch["response_mask"].bool()
    ours = engine.forward(batch)["values"]
    torch.testing.assert_close(ours[mask], values[:, -mask.shape[1] - 1:-1][mask], atol=2e-5, rtol=0)


# ----- layouts -----------------------------------------------------------------------------------------
LAYOUTS = {"fsdp2": dict(layout="fsdp"), "tp2": dict(layout="3d", tp_size=2), "pp2": dict(layout="3d", pp_size=2)}


def train_lora_layouts(rank, world_size, names, checkpoint_dir):
    """Per layout: the two losses, the full adapter state and this rank's merged local shards; each layout's
    checkpoint after its two steps under ``checkpoint_dir/<layout>``."""
    from hybridflow.engine.lora import adapter_state

    batch = make_batch()
    results = {}
    for name in names:
        engine = lora_engine(**LAYOUTS[name])
        rows = GLOBAL_ROWS // engine.layout.dp_size
        local = {key: value[engine.coords.dp_rank * rows:(engine.coords.dp_rank + 1) * rows]
                 for key, value in batch.items()}
        losses = [engine.train_step(local, token_nll_loss)["loss"] for _ in range(2)]
        results[name] = (losses, adapter_state(engine.model), engine.local_shards())
        engine.save_checkpoint(f"{checkpoint_dir}/{name}")
    return results


@pytest.mark.parametrize("names", [
    ("fsdp2", "tp2"), pytest.param(("pp2",), marks=pytest.mark.slow)], ids=["fsdp2_tp2", "pp2"])
def test_lora_layouts_on_two_ranks_equal_one_process_and_their_checkpoints_load_on_one(tmp_path, names):
    from hybridflow.engine.lora import adapter_state

    engine = lora_engine()
    expected_losses = [engine.train_step(make_batch(), token_nll_loss)["loss"] for _ in range(2)]
    expected_adapters, expected_shards = adapter_state(engine.model), engine.local_shards()
    ranks = run_distributed(train_lora_layouts, 2, names, str(tmp_path), timeout_s=600)
    for name in names:
        losses = ranks[0][name][0]
        adapters = {**ranks[0][name][1], **ranks[1][name][1]}  # pp2: each stage holds its layers' adapters
        assert losses == pytest.approx(expected_losses, rel=1e-5), name
        assert adapters.keys() == expected_adapters.keys(), name
        for key, tensor in expected_adapters.items():
            torch.testing.assert_close(adapters[key], tensor, atol=1e-5, rtol=1e-4, msg=f"{name} {key}")
        resumed = lora_engine()  # each layout's adapter checkpoint, resharded onto one process
        resumed.load_checkpoint(str(tmp_path / name))
        assert resumed.step == 2
        for key, tensor in adapter_state(resumed.model).items():
            torch.testing.assert_close(tensor, adapters[key], atol=0, rtol=0, msg=f"{name} checkpoint {key}")
    for name, cut in (("fsdp2", lambda key: 0), ("tp2", tp_shard_dim)):
        if name not in names:
            continue
        shards = [ranks[rank][name][2] for rank in range(2)]
        for key, tensor in expected_shards.items():
            dim = cut(key)
            full = shards[0][key] if dim is None else torch.cat([part[key] for part in shards], dim=dim)
            torch.testing.assert_close(full, tensor, atol=1e-5, rtol=1e-4, msg=f"{name} {key}")


# ----- the RL run ------------------------------------------------------------------------------------------
def _grpo_config(data_dir, output_dir, *overrides):
    from test_trainer import _config

    return _config(data_dir, output_dir, "algorithm.advantage_estimator=grpo", "actor.lora.rank=4",
                   "actor.lora.alpha=8", "actor.engine.dtype=float32", *overrides)


def test_grpo_train_with_actor_lora_scores_against_the_base_model_and_exports_a_peft_adapter(data_dir, tmp_path):
    from peft import PeftModel

    from hybridflow.controller import local_mode
    from hybridflow.models import build_model
    from hybridflow.protocol import DataProto
    from hybridflow.trainers.build import model_config_of
    from hybridflow.trainers.rl import RLTrainer
    from hybridflow.workers import AdapterReferenceWorker

    config = _grpo_config(data_dir, tmp_path / "run", "actor.lora.export_merged=true")
    assert config.active_roles == ("actor", "reference")
    base = TrainingEngine(EngineConfig(micro_batch_tokens=64, dtype="float32"),
                          lambda: build_model(model_config_of(config.actor.model)), trainable=False)
    rows = {key: value % base.hf_config.vocab_size if key in ("input_ids", "responses") else value
            for key, value in make_batch().items()}
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            assert trainer.groups["reference"].worker_cls is AdapterReferenceWorker
            history = trainer.fit()
            reference = trainer.groups["reference"].compute_ref_log_prob(DataProto.from_dict(tensors=rows))
        finally:
            trainer.shutdown()
    # step 1 samples from the base model itself (B = 0): its KL to the reference is 0 up to the rollout's
    # rounding; then the adapters move the policy away
    assert abs(history[0]["kl/sequence_kl"]) < 1e-5 and history[1]["actor/kl_loss"] > 1e-5
    assert history[0]["rollout/lora_sync_bytes_adapter"] < history[0]["rollout/lora_sync_bytes_merged"] / 10
    # after training, the reference role still scores with the base model, bit for bit
    torch.testing.assert_close(reference["ref_logprobs"], base.forward(rows)["logprobs"], atol=0, rtol=0)
    final = tmp_path / "run" / "final" / "actor"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    assert (final / "merged" / "model.safetensors").is_file()
    PeftModel.from_pretrained(build_model(model_config_of(config.actor.model)), str(final))


def test_a_lora_run_resumes_from_its_adapter_checkpoint_identically(data_dir, tmp_path):
    from test_trainer import _run, reproducible

    straight = _run(_grpo_config(data_dir, tmp_path / "straight", "trainer.total_steps=3"))
    _run(_grpo_config(data_dir, tmp_path / "resumed", "trainer.total_steps=2", "trainer.save_every=2"))
    saved = FileSystemReader(str(tmp_path / "resumed" / "checkpoints" / "step_000002" / "actor")).read_metadata()
    assert all(is_adapter_parameter(key.split(".", 1)[1].rsplit(".", 1)[0] if key.startswith("optim.")
                                    else key.split(".", 1)[1]) for key in saved.state_dict_metadata)
    resumed = _run(_grpo_config(data_dir, tmp_path / "resumed", "trainer.total_steps=3"))
    assert [record["step"] for record in resumed] == [1, 2, 3]
    for name, value in straight[2].items():
        if reproducible(name):
            assert resumed[2][name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    # `hybridflow export RUN_DIR --merged` of that checkpoint: the adapter, and the merged model beside it
    from hybridflow.trainers.export import export_main

    assert export_main([str(tmp_path / "resumed"), "--step", "2", "--out", str(tmp_path / "out"), "--merged"]) == 0
    assert (tmp_path / "out" / "actor" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "out" / "actor" / "merged" / "model.safetensors").is_file()


# ----- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "message"), [
    ("actor.lora.rank=0", r"config key actor.lora.rank got 0; allowed: an integer >= 1"),
    ("actor.lora.alpha=-1", r"config key actor.lora.alpha got -1.0; allowed: a finite number > 0"),
    ("actor.lora.dropout=1.0", r"config key actor.lora.dropout got 1.0; allowed: a number in \[0, 1\)"),
    ("critic.lora.rank=-2", r"config key critic.lora.rank got -2"),
    ("actor.lora.vllm_sync=merge", r"config key actor.lora.vllm_sync got 'merge' \(str\); allowed: one of 'adapter', "
                                   r"'merged'"),
    ("reference.lora.rank=8", r"config key reference.lora is not allowed here: the reference is frozen"),
    ("reward.lora.rank=8", r"config key reward.lora is not allowed here: the reward model is frozen"),
])
def test_bad_lora_configs_are_refused_naming_the_key(data_dir, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        _grpo_config(data_dir, tmp_path, override)


def test_a_lora_actor_refuses_a_separate_reference_model_or_pool(data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"config key reference.model got '<set>'; allowed: null with actor.lora"):
        _grpo_config(data_dir, tmp_path, "reference.model.builtin=arithmetic")
    with pytest.raises(ValueError, match=r"config key placement.roles.reference got 'ref'; allowed: the actor's pool "
                                         r"'global' with actor.lora"):
        _grpo_config(data_dir, tmp_path, "placement.pools={global: [1], ref: [1]}", "placement.roles.reference=ref")


def test_a_target_matching_no_module_is_refused_before_any_model_is_built_naming_the_modules_there(data_dir,
                                                                                                   tmp_path):
    from hybridflow.trainers.preflight import preflight

    config = _grpo_config(data_dir, tmp_path, "actor.lora.target_modules=[q_proj, qkv_proj]")
    with pytest.raises(ValueError, match=r"config key actor.lora.target_modules: 'qkv_proj' matches no module of the "
                                         r"model; the linear layers that can be adapted are named \['down_proj', "
                                         r"'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        preflight(config)
    with pytest.raises(ValueError, match=r"'embed_tokens' matches only \['model.embed_tokens'\], which are not linear"):
        preflight(_grpo_config(data_dir, tmp_path, "actor.lora.target_modules=[embed_tokens]"))


def test_a_frozen_engine_or_role_refuses_a_lora_config():
    from hybridflow.models import ModelConfig
    from hybridflow.workers import EngineSpec, ReferenceWorker

    with pytest.raises(ValueError, match="inference-only engine"):
        TrainingEngine(EngineConfig(), lambda: build_tiny_model(), trainable=False, lora=LORA)
    spec = EngineSpec(model=ModelConfig(tiny={}), engine=EngineConfig(), lora=LORA)
    with pytest.raises(ValueError, match="ReferenceWorker was given a LoRA config, but it is a frozen role"):
        ReferenceWorker(spec)


# ----- vLLM: tests/test_lora_vllm.py ---------------------------------------------------------------------


# ----- Ray, two ranks --------------------------------------------------------------------------------------
def _ray_grpo(data_dir, directory, *overrides):
    """Two greedy REINFORCE++ steps with actor.lora on Ray: (history, merged actor weights exported after). Greedy,
    so that two generation replicas sample as one does; not GRPO, whose advantages are 0 on identical samples."""
    from hybridflow.engine.weights import read_safetensors
    from hybridflow.trainers.rl import RLTrainer

    config = _grpo_config(data_dir, directory / "run", "algorithm.advantage_estimator=reinforce_plus_plus",
                          "actor.generation.greedy=true", "batch.mini_batch_size=8",
                          "trainer.val_every=0", "trainer.resume=false", "actor.lora.export_merged=true", *overrides)
    trainer = RLTrainer(config, mode="ray", tensorboard=False)
    try:
        history = trainer.fit()
    finally:
        trainer.shutdown()
    return history, read_safetensors(str(directory / "run" / "final" / "actor" / "merged"))


@pytest.mark.slow
def test_two_rank_fsdp_lora_actor_with_its_adapter_reference_on_ray_equals_one_rank(ray_session, data_dir,
                                                                                      tmp_path):
    expected, expected_weights = _ray_grpo(data_dir, tmp_path / "one", "placement.pools={all: [1]}")
    history, weights = _ray_grpo(data_dir, tmp_path / "two", "placement.pools={all: [2]}")
    assert history[1]["kl/sequence_kl"] > 1e-6  # the adapter reference scored the moved policy on both ranks
    for record, reference in zip(history, expected):
        for name, value in reference.items():
            if not name.startswith(("time/", "rollout/")) and not name.endswith("token_budget"):
                assert record[name] == pytest.approx(value, rel=1e-5, abs=1e-5), (record["step"], name)
    for name, tensor in expected_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-4, msg=name)
