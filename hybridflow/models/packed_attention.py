"""Attention inside the sequences of a packed micro-batch, without an N x N mask.

Legend: N = packed tokens, s = sequences in the pack, L = longest sequence, H = query heads,
K = key/value heads, D = head dim.

A packed micro-batch is one row ``[1, N]`` holding several sequences back to back; a token may
attend only to earlier tokens of its own sequence. A dense block-diagonal mask costs N x N per
head and layer (quadratic in the token budget). Instead:

- ``sdpa`` (the default): the attention inputs are gathered into a right-padded ``[s, H, L, D]``
  batch and run through ``scaled_dot_product_attention(is_causal=True)``. Right padding needs no
  mask: a real query at position i only sees keys 0..i, all real; padded queries are dropped when
  the output is scattered back. Cost s x L x L instead of N x N, and SDPA keeps its fused kernel.
- ``flash_attention_2``: the variable-length kernel through transformers' ``cu_seq_lens_*`` kwargs.
- ``eager``: the dense additive mask (the reference the others are tested against).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_SDPA = "hybridflow_packed_sdpa"
"""Name under which the packed SDPA function is registered with transformers' AttentionInterface."""


@dataclass(frozen=True)
class PackedSegments:
    """Where each sequence of a packed row lies (derived from its position ids)."""

    cu_seqlens: Tensor
    """Packed index where each sequence starts, then N (int32, [s + 1]): flash-attention's varlen format."""
    max_length: int
    """Longest sequence (L)."""
    gather_index_sL: Tensor
    """Packed index of position l of sequence i (long, [s, L]); past a sequence's end it repeats its last token."""
    scatter_index_N: Tensor
    """Flat index i * L + l of every packed token in the padded [s, L] layout (long, [N])."""


def sequence_starts(position_ids_1N: Tensor) -> Tensor:
    """True where a new sequence starts: wherever the position does not continue the previous one (bool, [N])."""
    positions_N = position_ids_1N[0]
    starts_N = torch.ones_like(positions_N, dtype=torch.bool)
    starts_N[1:] = positions_N[1:] != positions_N[:-1] + 1
    return starts_N


def packed_segments(position_ids_1N: Tensor) -> PackedSegments:
    """The sequences of a packed row, found from its position ids alone."""
    starts_N = sequence_starts(position_ids_1N)
    num_tokens = starts_N.numel()
    device = starts_N.device
    segment_N = torch.cumsum(starts_N.long(), 0) - 1
    start_index_s = starts_N.nonzero()[:, 0]
    lengths_s = torch.diff(start_index_s, append=torch.tensor([num_tokens], device=device))
    max_length = int(lengths_s.max())
    within_N = torch.arange(num_tokens, device=device) - start_index_s[segment_N]
    offsets_L = torch.arange(max_length, device=device)
    gather_sL = start_index_s[:, None] + torch.minimum(offsets_L[None, :], lengths_s[:, None] - 1)
    cu_seqlens = torch.cat([start_index_s, torch.tensor([num_tokens], device=device)]).to(torch.int32)
    return PackedSegments(cu_seqlens=cu_seqlens, max_length=max_length, gather_index_sL=gather_sL,
                          scatter_index_N=segment_N * max_length + within_N)


def dense_packed_bias(position_ids_1N: Tensor, dtype: torch.dtype, sliding_window: int | None = None) -> Tensor:
    """Additive block-diagonal causal mask [1, 1, N, N]: 0 where attending is allowed, dtype-min elsewhere
    (with ``sliding_window`` only the keys fewer than that many tokens back)."""
    segment_N = torch.cumsum(sequence_starts(position_ids_1N).long(), 0)
    index_N = torch.arange(segment_N.numel(), device=segment_N.device)
    allowed_NN = (segment_N[:, None] == segment_N[None, :]) & local_causal(index_N, sliding_window)
    bias_NN = torch.zeros(allowed_NN.shape, dtype=dtype, device=segment_N.device)
    bias_NN.masked_fill_(~allowed_NN, torch.finfo(dtype).min)
    return bias_NN[None, None]


def local_causal(index_N: Tensor, sliding_window: int | None) -> Tensor:
    """[N, N] True where query i may see key j: j <= i, and i - j < ``sliding_window`` when one is given (the
    window counts the query itself, as transformers' sliding masks do)."""
    distance_NN = index_N[:, None] - index_N[None, :]
    allowed_NN = distance_NN >= 0
    return allowed_NN if sliding_window is None else allowed_NN & (distance_NN < sliding_window)


SHORT_SEQUENCE_MAX = 128
"""Longest sequence of a packed micro-batch for which half-precision attention on CPU runs as two batched
matmuls (``causal_matmul_attention``) rather than fp32 SDPA."""


def cpu_half_attention(query: Tensor) -> bool:
    """Whether this attention call, on CPU, gets half-precision inputs or runs under autocast (which would cast
    SDPA's inputs to bf16): then it stays out of SDPA's bf16 kernel, with autocast off around it.

    PyTorch's CPU flash-attention kernel is slower in bf16 than in fp32, backward most of all: 3.1x on the
    3.2 M-parameter model's packed batch (128 sequences x 8 heads x 38 tokens x 32), forward + backward
    (`python benchmarks/bench_precision.py --attention`). Short sequences (up to ``SHORT_SEQUENCE_MAX``) skip the
    kernel for two bf16 batched matmuls and an fp32 softmax, faster still; longer ones run SDPA in fp32.
    """
    return query.device.type == "cpu" and (query.dtype in (torch.bfloat16, torch.float16)
                                           or torch.is_autocast_enabled("cpu"))


def causal_matmul_attention(query_sHLD: Tensor, key_sHLD: Tensor, value_sHLD: Tensor,
                            scaling: float | None, sliding_window: int | None = None) -> Tensor:
    """Causal attention as (Q K^T) and (P V) batched matmuls in the inputs' dtype, the softmax in fp32.

    Holds the [s, H, L, L] probabilities for backward, so it is for short sequences only (on the
    RL batches of benchmarks/vs_trl, L = 38: 2.5x faster than fp32 SDPA forward + backward).
    """
    length, head_dim = query_sHLD.shape[-2], query_sHLD.shape[-1]
    scale = head_dim ** -0.5 if scaling is None else scaling
    future_LL = ~local_causal(torch.arange(length, device=query_sHLD.device), sliding_window)
    scores_sHLL = (query_sHLD @ key_sHLD.transpose(-1, -2)).float() * scale
    probs_sHLL = scores_sHLL.masked_fill(future_LL, float("-inf")).softmax(-1).to(query_sHLD.dtype)
    return probs_sHLL @ value_sHLD


def packed_sdpa_attention(module, query_1HND: Tensor, key_1KND: Tensor, value_1KND: Tensor,
                          attention_mask: Tensor | None, *, dropout: float = 0.0, scaling: float | None = None,
                          packed_segments: PackedSegments | None = None, sliding_window: int | None = None,
                          **kwargs):
    """transformers attention function: SDPA per sequence of a packed row (plain SDPA without ``packed_segments``);
    a sliding-window layer (``sliding_window``, Gemma 3's local layers) sees only the keys inside its window.

    Returns the output as transformers expects it, ``[1, N, H, D]``, and no weights.
    """
    if packed_segments is None:
        return sdpa_attention_forward(module, query_1HND, key_1KND, value_1KND, attention_mask,
                                      dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs)
    gather_sL = packed_segments.gather_index_sL
    num_seqs, max_length = gather_sL.shape
    flat_gather = gather_sL.reshape(-1)

    def padded(x_1HND: Tensor) -> Tensor:  # [1, H, N, D] -> [s, H, L, D]
        x_sLHD = x_1HND[0].transpose(0, 1).index_select(0, flat_gather)
        return x_sLHD.view(num_seqs, max_length, *x_sLHD.shape[1:]).transpose(1, 2)

    query_sHLD, key_sKLD, value_sKLD = padded(query_1HND), padded(key_1KND), padded(value_1KND)
    num_heads, num_kv_heads = query_sHLD.shape[1], key_sKLD.shape[1]
    if num_kv_heads != num_heads:
        # grouped-query attention: expand the key/value heads (SDPA's enable_gqa falls back to math on CPU)
        repeats = num_heads // num_kv_heads
        key_sKLD = key_sKLD.repeat_interleave(repeats, dim=1)
        value_sKLD = value_sKLD.repeat_interleave(repeats, dim=1)
    # right padding needs no mask under plain causal attention; a window adds its band (a bool mask: allowed)
    window_LL = (None if sliding_window is None or sliding_window >= max_length
                 else local_causal(torch.arange(max_length, device=query_sHLD.device), sliding_window))
    causal = {"is_causal": True} if window_LL is None else {"attn_mask": window_LL}
    if cpu_half_attention(query_sHLD):
        half = query_sHLD.dtype if query_sHLD.dtype != torch.float32 else torch.get_autocast_dtype("cpu")
        with torch.autocast("cpu", enabled=False):
            if max_length <= SHORT_SEQUENCE_MAX and dropout == 0.0:
                out_sHLD = causal_matmul_attention(query_sHLD.to(half), key_sKLD.to(half), value_sKLD.to(half),
                                                   scaling, sliding_window)
            else:
                out_sHLD = F.scaled_dot_product_attention(query_sHLD.float(), key_sKLD.float(), value_sKLD.float(),
                                                          dropout_p=dropout, scale=scaling, **causal)
        out_sHLD = out_sHLD.to(query_sHLD.dtype)
    else:
        out_sHLD = F.scaled_dot_product_attention(query_sHLD, key_sKLD, value_sKLD, dropout_p=dropout,
                                                  scale=scaling, **causal)
    out_NHD = out_sHLD.transpose(1, 2).reshape(num_seqs * max_length, num_heads, -1)
    return out_NHD.index_select(0, packed_segments.scatter_index_N)[None], None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)


def packed_attention_config(hf_config):
    """The config a training stage's attention modules read: sdpa becomes the packed SDPA function.

    A copy, so the model's own config (exported with checkpoints) keeps the user's choice.
    """
    if hf_config._attn_implementation != "sdpa":
        return hf_config
    packed = copy.copy(hf_config)
    packed._attn_implementation = PACKED_SDPA
    return packed


def packed_attention_inputs(position_ids_1N: Tensor, attn_implementation: str, dtype: torch.dtype,
                            sliding_window: int | None = None) -> tuple[Tensor | None, dict]:
    """(attention_mask, extra layer kwargs) that make ``attn_implementation`` attend within packed sequences
    (for the layers of ``sliding_window``: eager needs its own mask; the others get the window from the layer)."""
    if attn_implementation == "eager":
        return dense_packed_bias(position_ids_1N, dtype, sliding_window), {}
    segments = packed_segments(position_ids_1N)
    if attn_implementation == PACKED_SDPA:
        return None, {"packed_segments": segments}
    if attn_implementation.startswith("flash_attention"):
        return None, {"cu_seq_lens_q": segments.cu_seqlens, "cu_seq_lens_k": segments.cu_seqlens,
                      "max_length_q": segments.max_length, "max_length_k": segments.max_length}
    raise ValueError(f"attn_implementation {attn_implementation!r} cannot attend within packed sequences; "
                     f"allowed: 'sdpa', 'eager', 'flash_attention_2'")
