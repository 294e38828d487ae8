"""Packed attention without an N x N mask: the packed SDPA path equals the dense-mask reference and
each sequence run on its own, in values and gradients."""

from __future__ import annotations

import pytest
import torch

from hybridflow.models import ModelConfig, build_model
from hybridflow.models.packed_attention import PACKED_SDPA, packed_attention_inputs, packed_segments
from hybridflow.parallel.pipeline import build_stage

LENGTHS = (5, 1, 9, 3)


def packed_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (1, sum(LENGTHS)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return ids, positions


def stage_of(attn_implementation: str, *, num_key_value_heads: int = 2):
    model = build_model(ModelConfig(tiny={"num_key_value_heads": num_key_value_heads},
                                    attn_implementation=attn_implementation), seed=5)
    return build_stage(model, head="lm", pp_size=1, pp_rank=0).float()


def test_packed_segments_lists_each_sequence_start_length_and_padded_slot():
    segments = packed_segments(torch.tensor([[0, 1, 2, 0, 0, 1]]))
    assert segments.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert segments.max_length == 3
    assert segments.gather_index_sL.tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]
    assert segments.scatter_index_N.tolist() == [0, 1, 2, 3, 6, 7]


@pytest.mark.parametrize("num_key_value_heads", [2, 4])
def test_packed_sdpa_logits_equal_the_dense_mask_and_each_sequence_alone(num_key_value_heads):
    ids, positions = packed_inputs()
    sdpa, eager = stage_of("sdpa", num_key_value_heads=num_key_value_heads), \
        stage_of("eager", num_key_value_heads=num_key_value_heads)
    assert sdpa.attn_implementation == PACKED_SDPA
    with torch.no_grad():
        packed = sdpa(ids, positions)
        dense = eager(ids, positions)
        alone = torch.cat([sdpa(part, torch.arange(part.shape[1])[None])
                           for part in ids.split(list(LENGTHS), dim=1)], dim=1)
    torch.testing.assert_close(packed, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_packed_sdpa_gradients_equal_the_dense_mask():
    ids, positions = packed_inputs(1)
    grads = []
    for implementation in ("sdpa", "eager"):
        stage = stage_of(implementation)
        logits = stage(ids, positions)
        torch.log_softmax(logits, -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
        grads.append({name: p.grad.clone() for name, p in stage.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4)


def test_the_model_config_keeps_the_users_attention_choice():
    model = build_model(ModelConfig(tiny={}, attn_implementation="sdpa"), seed=5)
    build_stage(model, head="lm", pp_size=1, pp_rank=0)
    assert model.config._attn_implementation == "sdpa"


def test_flash_attention_gets_varlen_offsets_and_no_mask():
    _, positions = packed_inputs()
    mask, kwargs = packed_attention_inputs(positions, "flash_attention_2", torch.bfloat16)
    assert mask is None
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 5, 6, 15, 18]
    assert kwargs["cu_seq_lens_q"].dtype == torch.int32
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == 9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_sdpa_on_cuda_equals_the_dense_mask():
    ids, positions = packed_inputs(2)
    ids, positions = ids.to("cuda"), positions.to("cuda")
    with torch.no_grad():
        packed = stage_of("sdpa").to("cuda")(ids, positions)
        dense = stage_of("eager").to("cuda")(ids, positions)
    torch.testing.assert_close(packed, dense, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("short_max", [0, 128])
def test_packed_attention_under_cpu_bf16_autocast_matches_fp32_in_values_and_gradients(short_max, monkeypatch):
    """CPU SDPA is slower in bf16 than fp32 (backward most): under autocast the packed path runs short sequences
    as bf16 matmuls (short_max 128) and longer ones (short_max 0) through SDPA in fp32, never SDPA in bf16."""
    from hybridflow.models import packed_attention

    monkeypatch.setattr(packed_attention, "SHORT_SEQUENCE_MAX", short_max)
    seen = []
    sdpa = packed_attention.F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        seen.append(query.dtype)
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention", recording)
    ids, positions = packed_inputs(2)
    results, calls = [], []
    for autocast in (False, True):
        calls.append(len(seen))
        stage = stage_of("sdpa")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = stage(ids, positions)
        torch.log_softmax(logits.float(), -1)[0, :-1].gather(-1, ids[0, 1:, None]).sum().backward()
        results.append((logits.float(), {name: p.grad.clone() for name, p in stage.named_parameters()}))
    assert all(dtype == torch.float32 for dtype in seen)
    layers = calls[1]  # the fp32 forward calls SDPA once per layer
    assert layers > 0 and len(seen) - layers == (layers if short_max == 0 else 0)
    (fp32, fp32_grads), (bf16, bf16_grads) = results
    torch.testing.assert_close(bf16, fp32, atol=0.1, rtol=0.05)
    for name, grad in fp32_grads.items():
        assert torch.linalg.vector_norm(bf16_grads[name] - grad) <= 0.05 * torch.linalg.vector_norm(grad) + 1e-6, name
