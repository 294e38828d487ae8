"""The flash_attention_2 path of a training stage, on the CPU: transformers' FA2 entry point is replaced by a
reference variable-length attention that records what the stage hands it (no 4-D mask, varlen offsets); and
the FSDP CPU-offload path hands generation weights on the compute device."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from hybridflow.models import ModelConfig, build_model
from hybridflow.parallel.pipeline import build_stage

LENGTHS = (5, 1, 9, 3)


def packed_row() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    return ids, torch.cat([torch.arange(n) for n in LENGTHS])[None]


def recording_varlen_attention(calls: list):
    """An FA2 stand-in with flash_attention_forward's signature: causal attention within each sequence that
    ``cu_seq_lens_q`` delimits; returns [1, N, heads, head_dim] as the FA2 path does."""

    def attention(module, query_1HND, key_1KND, value_1KND, attention_mask, *, dropout=0.0, scaling=None,
                  **kwargs):
        calls.append({"attention_mask": attention_mask, **kwargs})
        repeats = query_1HND.shape[1] // key_1KND.shape[1]
        key_1HND = key_1KND.repeat_interleave(repeats, dim=1)
        value_1HND = value_1KND.repeat_interleave(repeats, dim=1)
        bounds = kwargs["cu_seq_lens_q"].tolist()
        outs = [F.scaled_dot_product_attention(query_1HND[:, :, s:e], key_1HND[:, :, s:e], value_1HND[:, :, s:e],
                                               is_causal=True, scale=scaling) for s, e in zip(bounds, bounds[1:])]
        return torch.cat(outs, dim=2).transpose(1, 2), None

    return attention


def stage_with(attn_implementation: str):
    model = build_model(ModelConfig(tiny={"num_key_value_heads": 2}, attn_implementation="sdpa"), seed=5)
    # the model is built with sdpa (FA2 needs the flash-attn package at load); the stage reads this choice
    model.config._attn_implementation = attn_implementation
    return build_stage(model, head="lm", pp_size=1, pp_rank=0).float()


def test_flash_attention_2_stages_pass_no_mask_and_the_varlen_offsets_and_equal_packed_sdpa(monkeypatch):
    calls: list = []
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "flash_attention_2",
                        recording_varlen_attention(calls))
    ids, positions = packed_row()
    with torch.no_grad():
        flash = stage_with("flash_attention_2")(ids, positions)
        sdpa = stage_with("sdpa")(ids, positions)
    layers = len(stage_with("sdpa").model.layers)
    assert len(calls) == layers
    for call in calls:
        assert call["attention_mask"] is None  # FA2 cannot take a 4-D mask
        assert call["cu_seq_lens_q"].tolist() == call["cu_seq_lens_k"].tolist() == [0, 5, 6, 15, 18]
        assert call["cu_seq_lens_q"].dtype == torch.int32
        assert call["max_length_q"] == call["max_length_k"] == 9
    torch.testing.assert_close(flash, sdpa, rtol=1e-5, atol=1e-5)


def test_fsdp_training_shards_reach_the_generation_device_even_when_the_parameters_live_on_the_host():
    """Under FSDP CPU offload the parameters are host tensors; the hybrid engine must generate on the
    engine's device (stand-in here: the meta device) rather than quietly on the CPU."""
    from hybridflow.engine.layouts import FsdpLayout
    from hybridflow.parallel.layout import ParallelLayout

    model = torch.nn.Linear(3, 2)
    shards = FsdpLayout(ParallelLayout(dp_size=1)).local_shards(model, torch.device("meta"))
    assert shards.keys() == {"weight", "bias"}
    assert all(shard.device.type == "meta" and shard.shape == getattr(model, name).shape
               for name, shard in shards.items())
