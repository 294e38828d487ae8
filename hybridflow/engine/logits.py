"""Per-token log-probs and entropy from LM logits, in fp32 chunks so N x V never exists in fp32 at once.

Legend: N = packed tokens of one micro-batch, V = vocabulary, C = tokens of one chunk.

A micro-batch of 16k tokens over a 128k vocabulary has 2G logits: one fp32 copy is 8 GB and a
plain ``log_softmax(logits.float())`` holds two or three of them, and autograd's own backward of it
makes several more (the softmax, the gather's zero-filled gradient, the slices' zero-filled
gradients). Here one autograd function does both directions chunk by chunk: forward keeps only the
log-partition per token, backward writes d(logits) straight into the one gradient buffer autograd
needs anyway (softmax, scale, the target's +1, all in place). The chunks are small enough to stay
in the CPU's cache (``CACHE_ELEMENTS``), so each pass over the logits reads memory about once.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

CACHE_ELEMENTS = 2 ** 20
"""Elements of one chunk (4 MiB in fp32): C = CACHE_ELEMENTS // V rows, at least one."""
DTENSOR_CHUNK_TOKENS = 2048


def _chunk_rows(vocab: int, chunk_tokens: int | None) -> int:
    return chunk_tokens if chunk_tokens is not None else max(1, CACHE_ELEMENTS // max(vocab, 1))


def _scaled(logits_CV: Tensor, temperature: float) -> Tensor:
    """The chunk in fp32 divided by the temperature (a view of fp32 logits at temperature 1)."""
    logits_CV = logits_CV.float()
    return logits_CV / temperature if temperature != 1.0 else logits_CV


class _TokenLogprobs(torch.autograd.Function):
    """(logprobs_N, entropy_N or an empty tensor) of softmax(logits / T); see token_logprobs_and_entropy."""

    @staticmethod
    def forward(ctx, logits_NV: Tensor, next_ids_N: Tensor, temperature: float, want_entropy: bool,
                rows: int) -> tuple[Tensor, Tensor]:
        num_tokens = logits_NV.shape[0]
        logz_N = torch.empty(num_tokens, dtype=torch.float32, device=logits_NV.device)
        logprobs_N = torch.empty_like(logz_N)
        entropy_N = torch.empty_like(logz_N) if want_entropy else logz_N.new_empty(0)
        for start in range(0, num_tokens, rows):
            end = min(start + rows, num_tokens)
            z_CV = _scaled(logits_NV[start:end], temperature)
            logp_CV = torch.log_softmax(z_CV, dim=-1)  # one fused pass; the chunk stays in cache
            ids_C1 = next_ids_N[start:end, None]
            logprobs_C = logp_CV.gather(-1, ids_C1)[:, 0]
            logprobs_N[start:end] = logprobs_C
            logz_N[start:end] = z_CV.gather(-1, ids_C1)[:, 0] - logprobs_C
            if want_entropy:
                entropy_N[start:end] = -(logp_CV.exp() * logp_CV).sum(-1)
        ctx.save_for_backward(logits_NV, next_ids_N, logz_N, entropy_N)
        ctx.temperature, ctx.want_entropy, ctx.rows = temperature, want_entropy, rows
        ctx.mark_non_differentiable(*(() if want_entropy else (entropy_N,)))
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_logprobs_N: Tensor | None, grad_entropy_N: Tensor | None):
        logits_NV, next_ids_N, logz_N, entropy_N = ctx.saved_tensors
        temperature, rows = ctx.temperature, ctx.rows
        grad_NV = torch.empty_like(logits_NV)
        in_place = grad_NV.dtype == torch.float32
        if grad_logprobs_N is None:
            grad_logprobs_N = torch.zeros_like(logz_N)
        with_entropy = ctx.want_entropy and grad_entropy_N is not None
        for start in range(0, logits_NV.shape[0], rows):
            end = min(start + rows, logits_NV.shape[0])
            z_CV = _scaled(logits_NV[start:end], temperature)
            logz_C, g_lp_C = logz_N[start:end], grad_logprobs_N[start:end]
            # d logp(target) / dz = onehot - p;  d H / dz = p (E_p[z] - z), E_p[z] = logZ - H;  d/dlogits = d/dz / T
            probs_CV = torch.softmax(z_CV, dim=-1)  # one fused pass over the cached chunk
            out_CV = grad_NV[start:end] if in_place else None
            if with_entropy:
                mean_z_C = logz_C - entropy_N[start:end]
                coef_CV = (mean_z_C[:, None] - z_CV).mul_(grad_entropy_N[start:end, None]).sub_(g_lp_C[:, None])
                probs_CV = torch.mul(probs_CV, coef_CV, out=out_CV)
            else:
                probs_CV = torch.mul(probs_CV, -g_lp_C[:, None], out=out_CV)
            probs_CV.scatter_add_(1, next_ids_N[start:end, None], g_lp_C[:, None].to(probs_CV.dtype))
            if temperature != 1.0:
                probs_CV.div_(temperature)
            if not in_place:
                grad_NV[start:end] = probs_CV
        return grad_NV, None, None, None, None


def _chunk_outputs(logits_CV: Tensor, next_ids_C: Tensor, want_entropy: bool,
                   temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Plain autograd on one chunk: the path for DTensor logits."""
    logits_CV = _scaled(logits_CV, temperature)
    logz_C = torch.logsumexp(logits_CV, dim=-1)
    logprobs_C = logits_CV.gather(-1, next_ids_C[:, None])[:, 0] - logz_C
    if not want_entropy:
        return logprobs_C, logprobs_C.new_zeros(())
    probs_CV = torch.softmax(logits_CV, dim=-1)
    entropy_C = logz_C - (probs_CV * logits_CV).sum(-1)
    return logprobs_C, entropy_C


def token_logprobs_and_entropy(logits_NV: Tensor, next_ids_N: Tensor, *, want_entropy: bool = True,
                               chunk_tokens: int | None = None,
                               temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """``log p(next_ids_N[i] | ...)`` for every row of ``logits_NV`` (fp32, [N]) and its entropy ([N] or None).

    Equal to ``log_softmax(logits.float() / temperature)`` gathered at ``next_ids_N`` (and
    ``-(p log p).sum(-1)`` of that distribution), values and gradients, to fp32 rounding, for any
    ``chunk_tokens`` (rows per chunk; default: a chunk of about ``CACHE_ELEMENTS`` logits).
    ``temperature``: the sampling temperature the tokens were drawn at (the tempered distribution is the
    policy that generated them).
    """
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    if not isinstance(logits_NV, DTensor):
        logprobs_N, entropy_N = _TokenLogprobs.apply(logits_NV, next_ids_N, float(temperature), want_entropy,
                                                     _chunk_rows(logits_NV.shape[-1], chunk_tokens))
        return logprobs_N, (entropy_N if want_entropy else None)
    rows = chunk_tokens or DTENSOR_CHUNK_TOKENS
    grad = torch.is_grad_enabled() and logits_NV.requires_grad
    logprobs, entropies = [], []
    for start in range(0, logits_NV.shape[0], rows):
        piece_CV, ids_C = logits_NV[start:start + rows], next_ids_N[start:start + rows]
        if grad and logits_NV.shape[0] > rows:
            lp_C, ent_C = checkpoint(_chunk_outputs, piece_CV, ids_C, want_entropy, temperature, use_reentrant=False)
        else:
            lp_C, ent_C = _chunk_outputs(piece_CV, ids_C, want_entropy, temperature)
        logprobs.append(lp_C)
        entropies.append(ent_C)
    logprobs_N = torch.cat(logprobs)
    return logprobs_N, (torch.cat(entropies) if want_entropy else None)
