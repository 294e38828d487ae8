"""Meta-device initialisation with sharded loading gives the same weights and the same step as building
the whole model first, under every layout; a new value head is the seeded one; gaps are errors."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import ModelConfig, build_model
from hybridflow.parallel.launch import run_distributed

LAYOUTS = {
    "single": (1, dict()),
    "fsdp2": (2, dict(layout="fsdp")),
    "tp2": (2, dict(layout="3d", tp_size=2)),
    "pp2": (2, dict(layout="3d", pp_size=2)),
    "tp2_pp2": (4, dict(layout="3d", tp_size=2, pp_size=2)),
}


def _save(tmp_path, *, tied: bool = False, head: str = "lm", dtype=torch.float32) -> str:
    model = build_model(ModelConfig(tiny={"tie_word_embeddings": tied}), head=head, seed=5)
    model.to(dtype).save_pretrained(tmp_path)
    return str(tmp_path)


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (4, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, 5:], response_mask=mask[:, 5:])


def _loss(outputs, micro_batch):
    key = "logprobs" if "logprobs" in outputs else "values"
    return -(outputs[key] * micro_batch["response_mask"]).sum() / micro_batch["num_tokens_global"], {}


def _weights_and_step(rank, world_size, path, head, layout, meta):
    config = EngineConfig(micro_batch_tokens=64, dtype="float32", optim=OptimConfig(lr=1e-2, eps=1e-4), **layout)
    model_config = ModelConfig(path=path)
    if meta:
        engine = TrainingEngine(config, lambda: build_model(model_config, head=head, seed=7, device="meta"),
                                head=head, weights_path=path, head_seed=7)
    else:
        engine = TrainingEngine(config, lambda: build_model(model_config, head=head, seed=7), head=head)
    before = engine.full_state_dict()
    loss = engine.train_step(_batch(), _loss)["loss"]
    return before, loss, engine.full_state_dict(), engine.ties_embeddings and engine.layout.pp_size == 1 and (
        engine.model.lm_head.weight is engine.model.model.embed_tokens.weight)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if LAYOUTS[n][0] > 2 else n for n in LAYOUTS])
def test_meta_init_with_sharded_load_equals_building_the_whole_model_under_each_layout(tmp_path, name):
    world_size, layout = LAYOUTS[name]
    path = _save(tmp_path)
    whole = run_distributed(_weights_and_step, world_size, path, "lm", layout, False)[0]
    sharded = run_distributed(_weights_and_step, world_size, path, "lm", layout, True)[0]
    for got, want in ((sharded[0], whole[0]), (sharded[2], whole[2])):
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[key], want[key]) for key in want), name
    assert sharded[1] == whole[1]


@pytest.mark.parametrize("name", ["single", pytest.param("tp2", marks=pytest.mark.slow), "pp2"])
def test_a_tied_embedding_is_loaded_once_and_stays_tied(tmp_path, name):
    world_size, layout = LAYOUTS[name]
    path = _save(tmp_path, tied=True)
    whole = run_distributed(_weights_and_step, world_size, path, "lm", layout, False)[0]
    sharded = run_distributed(_weights_and_step, world_size, path, "lm", layout, True)[0]
    assert all(torch.equal(sharded[2][key], whole[2][key]) for key in whole[2])
    if name == "single":
        assert sharded[3], "the output head must be the embedding's parameter after allocation"


def test_a_value_head_missing_from_an_lm_checkpoint_is_the_seeded_one_and_a_bf16_checkpoint_loads_exactly(tmp_path):
    path = _save(tmp_path, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="has no value head"):
        whole = _weights_and_step(0, 1, path, "value", {}, False)
    with pytest.warns(UserWarning, match="has no value head"):
        sharded = _weights_and_step(0, 1, path, "value", {}, True)
    assert all(torch.equal(sharded[0][key], whole[0][key]) for key in whole[0])
    assert sharded[1] == whole[1]


def test_a_checkpoint_missing_a_layer_weight_is_a_value_error_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _save(tmp_path)
    state = load_file(f"{path}/model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights .*model\.layers\.1\.mlp\.up_proj\.weight"):
        _weights_and_step(0, 1, path, "lm", {}, True)


def test_from_model_config_reads_a_checkpoint_on_meta_and_builds_a_tiny_model_whole(tmp_path):
    path = _save(tmp_path)
    engine = TrainingEngine.from_model_config(EngineConfig(dtype="float32"), ModelConfig(path=path))
    want = build_model(ModelConfig(path=path)).state_dict()
    got = engine.full_state_dict()
    assert all(torch.equal(got[key], want[key]) for key in got)
    tiny = TrainingEngine.from_model_config(EngineConfig(), ModelConfig(tiny={}), seed=2)
    assert tiny.full_state_dict().keys() == got.keys()


def _bf16_fsdp_step(rank, world_size):
    config = EngineConfig(layout="fsdp", micro_batch_tokens=64, dtype="bfloat16", optim=OptimConfig(lr=1e-2, eps=1e-4))
    engine = TrainingEngine(config, lambda: build_model(ModelConfig(tiny={}), seed=5))
    loss = engine.train_step(_batch(), _loss)["loss"]
    dtypes = {param.dtype for param in engine.model.parameters()}
    return loss, dtypes


def test_fsdp_with_bf16_compute_gathers_bf16_keeps_fp32_master_weights_and_matches_one_process():
    # MixedPrecisionPolicy: bf16 all-gather and forward, fp32 gradient reduction and master weights
    (loss_a, dtypes), (loss_b, _) = run_distributed(_bf16_fsdp_step, 2)
    single = TrainingEngine(EngineConfig(micro_batch_tokens=64, dtype="bfloat16", optim=OptimConfig(lr=1e-2, eps=1e-4)),
                            lambda: build_model(ModelConfig(tiny={}), seed=5))
    want = single.train_step(_batch(), _loss)["loss"]
    assert dtypes == {torch.float32}
    assert loss_a == loss_b
    assert loss_a == pytest.approx(want, rel=2e-2)


@pytest.mark.parametrize("meta", [False, True])
def test_an_inference_only_engine_holds_bf16_weights_without_optimizer_and_checkpoints_round_trip(tmp_path, meta):
    path = _save(tmp_path / "model")
    config = EngineConfig(micro_batch_tokens=64, dtype="bfloat16")
    model_config = ModelConfig(path=path)
    frozen = (TrainingEngine(config, lambda: build_model(model_config, device="meta"), weights_path=path,
                             trainable=False) if meta
              else TrainingEngine(config, lambda: build_model(model_config), trainable=False))
    trained = TrainingEngine(config, lambda: build_model(model_config))
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
    assert frozen.optimizer is None and not any(p.requires_grad for p in frozen.model.parameters())
    want = trained.forward(_batch(), outputs=("logprobs",))["logprobs"]
    got = frozen.forward(_batch(), outputs=("logprobs",))["logprobs"]
    torch.testing.assert_close(got, want, rtol=0, atol=0.1)  # bf16 weights vs fp32 masters under bf16 autocast
    with pytest.raises(ValueError, match=r"reference was built for inference only"):
        frozen.train_step(_batch(), _loss, context="reference")
    frozen.save_checkpoint(str(tmp_path / "ckpt"))
    again = TrainingEngine(config, lambda: build_model(ModelConfig(tiny={}), seed=99), trainable=False)
    again.load_checkpoint(str(tmp_path / "ckpt"))
    assert all(torch.equal(a, b) for a, b in zip(again.model.parameters(), frozen.model.parameters()))
