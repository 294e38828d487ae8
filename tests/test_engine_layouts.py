"""Every parallel layout of the training engine matches a single process: losses, updated weights,
checkpoints resharded across layouts, and Hugging Face export (tiny model, gloo processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.engine import EngineConfig, OptimConfig, TrainingEngine
from hybridflow.models import build_tiny_model
from hybridflow.parallel.launch import run_distributed

GLOBAL_ROWS = 8
PROMPT_LEN, RESPONSE_LEN = 6, 5
NUM_STEPS = 2
# eps well above the gradient noise: Adam's first step is ~lr*sign(g), which would turn float
# rounding in tiny gradients into lr-sized weight differences
OPTIM = OptimConfig(lr=1e-3, eps=1e-4, lr_schedule="linear", warmup_steps=1)
TOTAL_STEPS = 4  # the run's optimizer steps: the linear schedule decays to 0 there
WORLD2_LAYOUTS = {
    "dp2": dict(layout="3d"),
    "fsdp2": dict(layout="fsdp"),
    "fsdp2_offload": dict(layout="fsdp", fsdp_cpu_offload=True),
    "tp2": dict(layout="3d", tp_size=2),
    "pp2": dict(layout="3d", pp_size=2),
    "pp2_gpipe": dict(layout="3d", pp_size=2, pipeline_schedule="gpipe"),
    "pp2_tied": dict(layout="3d", pp_size=2, tie_word_embeddings=True),
}
WORLD4_LAYOUTS = {
    "tp2_dp2": dict(layout="3d", tp_size=2),
    "tp2_pp2": dict(layout="3d", tp_size=2, pp_size=2),
}


def make_batch() -> dict[str, torch.Tensor]:
    """Left-padded prompts and right-padded responses of varied lengths (seeded)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (GLOBAL_ROWS, PROMPT_LEN + RESPONSE_LEN), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(GLOBAL_ROWS):
        left = int(torch.randint(0, PROMPT_LEN - 1, (1,), generator=generator))
        right = int(torch.randint(0, RESPONSE_LEN, (1,), generator=generator))
        mask[row, :left] = 0
        if right:
            mask[row, -right:] = 0
    return dict(input_ids=ids, attention_mask=mask, responses=ids[:, -RESPONSE_LEN:],
                response_mask=mask[:, -RESPONSE_LEN:])


def token_nll_loss(outputs, micro_batch):
    """Mean negative log-likelihood of response tokens over the whole mini-batch (sum / global count)."""
    mask = micro_batch["response_mask"]
    loss = -(outputs["logprobs"] * mask).sum() / micro_batch["num_tokens_global"]
    return loss, {"entropy": (outputs["entropy"] * mask).sum() / mask.sum().clamp(min=1)}


def build_engine(tie_word_embeddings: bool = False, **layout) -> TrainingEngine:
    config = EngineConfig(micro_batch_tokens=24, optim=OPTIM, **layout)
    return TrainingEngine(config, lambda: build_tiny_model(tie_word_embeddings=tie_word_embeddings),
                          total_steps=TOTAL_STEPS)


def rank_slice(engine: TrainingEngine, batch: dict) -> dict:
    rows = GLOBAL_ROWS // engine.layout.dp_size
    start = engine.coords.dp_rank * rows
    return {key: value[start:start + rows] for key, value in batch.items()}


def as_numpy(state: dict) -> dict:
    return {name: tensor.numpy() for name, tensor in state.items()}


def describe_local_shards(engine: TrainingEngine) -> dict:
    """name -> (local shape, shares storage with the live parameter) for this rank."""
    params = dict(engine.model.named_parameters())
    described = {}
    for name, shard in engine.local_shards().items():
        live = params[name].to_local() if hasattr(params[name], "to_local") else params[name]
        described[name] = (tuple(shard.shape), shard.data_ptr() == live.data_ptr())
    return described


def train_layouts(rank, world_size, layouts, checkpoint_dir, export_dir):
    """Train each layout NUM_STEPS steps; returns {name: (losses, full weights on rank 0)} + resume runs."""
    batch = make_batch()
    results = {}
    for name, layout in layouts.items():
        engine = build_engine(**layout)
        # rank 0 holds the first rows of the batch in every layout
        initial_logprobs = engine.forward(rank_slice(engine, batch))["logprobs"].numpy()
        losses = []
        for step in range(NUM_STEPS):
            losses.append(engine.train_step(rank_slice(engine, batch), token_nll_loss)["loss"])
            if step == 0 and checkpoint_dir and name in ("tp2", "pp2_tied"):
                engine.save_checkpoint(f"{checkpoint_dir}_{name}")
        results[name] = (losses, as_numpy(engine.full_state_dict()), initial_logprobs)
        if name in ("tp2", "pp2"):
            results[f"local_shards_{name}"] = describe_local_shards(engine)
        if export_dir and name == "pp2":
            engine.export_hf(export_dir)
    if checkpoint_dir:
        # a checkpoint written under tp2 after one step, resumed under fsdp2 and pp2
        for name in ("fsdp2", "pp2"):
            engine = build_engine(**layouts[name])
            engine.load_checkpoint(f"{checkpoint_dir}_tp2")
            loss = engine.train_step(rank_slice(engine, batch), token_nll_loss)["loss"]
            results[f"resume_{name}"] = ([loss], as_numpy(engine.full_state_dict()), engine.step)
    return results


def single_process_run(tie_word_embeddings: bool = False):
    engine = build_engine(tie_word_embeddings)
    batch = make_batch()
    initial_logprobs = engine.forward(batch)["logprobs"].numpy()
    losses = [engine.train_step(batch, token_nll_loss)["loss"] for _ in range(NUM_STEPS)]
    return losses, as_numpy(engine.full_state_dict()), initial_logprobs


@pytest.fixture(scope="module")
def reference():
    """Single-process losses of NUM_STEPS steps and the weights after them."""
    return single_process_run()


@pytest.fixture(scope="module")
def reference_tied():
    """The same with tied input/output embeddings."""
    return single_process_run(tie_word_embeddings=True)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_world2")
    results = run_distributed(train_layouts, 2, WORLD2_LAYOUTS, str(root / "ckpt"), str(root / "export"),
                              timeout_s=500)
    return results[0], root, results


@pytest.fixture(scope="module")
def world4():
    return run_distributed(train_layouts, 4, WORLD4_LAYOUTS, None, None, timeout_s=500)[0]


def assert_same_weights(expected: dict, actual: dict) -> None:
    assert set(actual) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], value, rtol=0, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("name", list(WORLD2_LAYOUTS))
def test_two_rank_layout_gives_single_process_logprobs_losses_and_weights(name, reference, reference_tied, world2):
    if name.endswith("_tied"):
        reference = reference_tied
    losses, weights, logprobs = world2[0][name]
    np.testing.assert_allclose(logprobs, reference[2][:len(logprobs)], rtol=0, atol=2e-6)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_same_weights(reference[1], weights)


@pytest.mark.parametrize("name", list(WORLD4_LAYOUTS))
def test_four_rank_layout_gives_single_process_logprobs_losses_and_weights(name, reference, world4):
    losses, weights, logprobs = world4[name]
    np.testing.assert_allclose(logprobs, reference[2][:len(logprobs)], rtol=0, atol=2e-6)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_same_weights(reference[1], weights)


@pytest.mark.parametrize("name", ["fsdp2", "pp2"])
def test_checkpoint_saved_under_tp2_resumes_identically_under_another_layout(name, reference, world2):
    losses, weights, step = world2[0][f"resume_{name}"]
    assert step == NUM_STEPS
    np.testing.assert_allclose(losses, reference[0][1:], rtol=1e-5)
    assert_same_weights(reference[1], weights)


def test_tied_embedding_checkpoint_saved_under_pp2_resumes_in_a_single_process(reference_tied, world2):
    engine = build_engine(tie_word_embeddings=True)
    engine.load_checkpoint(str(world2[1] / "ckpt_pp2_tied"))
    loss = engine.train_step(make_batch(), token_nll_loss)["loss"]
    assert loss == pytest.approx(reference_tied[0][1], rel=1e-5)
    assert_same_weights(reference_tied[1], as_numpy(engine.full_state_dict()))


def test_local_shards_follow_the_tp_shard_contract_and_share_storage(world2):
    from hybridflow.parallel.sharding import tp_shard_dim

    full = build_tiny_model().state_dict()
    for rank_results in world2[2]:
        shards = rank_results["local_shards_tp2"]
        assert set(shards) == set(full)
        for name, (shape, shares_storage) in shards.items():
            expected = list(full[name].shape)
            if tp_shard_dim(name) is not None:
                expected[tp_shard_dim(name)] //= 2
            assert shape == tuple(expected) and shares_storage, name


def test_local_shards_of_a_pipeline_stage_hold_its_layers_under_global_indices(world2):
    first, last = (rank_results["local_shards_pp2"] for rank_results in world2[2])
    layers = lambda shards: sorted({int(n.split(".")[2]) for n in shards if n.startswith("model.layers.")})
    assert layers(first) == [0, 1] and layers(last) == [2, 3]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert "lm_head.weight" in last and "model.norm.weight" in last and "model.embed_tokens.weight" not in last


def test_export_from_pipeline_layout_loads_with_from_pretrained_and_reproduces_logits(reference, world2):
    from transformers import AutoModelForCausalLM

    export = world2[1] / "export"
    # one file per stage, written by that stage, and the index: nothing was gathered across stages
    assert sorted(p.name for p in export.glob("*.safetensors*")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    exported = AutoModelForCausalLM.from_pretrained(str(export))
    expected = build_tiny_model()
    expected.load_state_dict({name: torch.from_numpy(value) for name, value in reference[1].items()})
    batch = make_batch()
    with torch.no_grad():
        got = exported(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        want = expected(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
