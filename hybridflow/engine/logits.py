"""Per-token log-probs and entropy from LM logits, in fp32 chunks so N x V never exists in fp32 at once.

Legend: N = packed tokens of one micro-batch, V = vocabulary, C = tokens of one chunk.

A micro-batch of 16k tokens over a 128k vocabulary has 2G logits: one fp32 copy is 8 GB and a
plain ``log_softmax(logits.float())`` holds two or three of them. Here each chunk of C rows is
upcast, reduced to what is asked (the log-prob of the next token, the entropy) and freed, so the
extra memory is O(C x V) whatever N is. Under autograd each chunk is recomputed in backward from
the (low-precision) logits rather than kept (activation checkpointing per chunk).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK_TOKENS = 2048


def _chunk_outputs(logits_CV: Tensor, next_ids_C: Tensor, want_entropy: bool,
                   temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    logits_CV = logits_CV.float()
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    logz_C = torch.logsumexp(logits_CV, dim=-1)
    logprobs_C = logits_CV.gather(-1, next_ids_C[:, None])[:, 0] - logz_C
    if not want_entropy:
        return logprobs_C, logprobs_C.new_zeros(())
    probs_CV = torch.softmax(logits_CV, dim=-1)
    entropy_C = logz_C - (probs_CV * logits_CV).sum(-1)
    return logprobs_C, entropy_C


def token_logprobs_and_entropy(logits_NV: Tensor, next_ids_N: Tensor, *, want_entropy: bool = True,
                               chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                               temperature: float = 1.0) -> tuple[Tensor, Tensor | None]:
    """``log p(next_ids_N[i] | ...)`` for every row of ``logits_NV`` (fp32, [N]) and its entropy ([N] or None).

    Equal to ``log_softmax(logits.float() / temperature)`` gathered at ``next_ids_N`` (and
    ``-(p log p).sum(-1)`` of that distribution), to fp32 rounding, for any ``chunk_tokens``.
    ``temperature``: the sampling temperature the tokens were drawn at (the tempered distribution is the
    policy that generated them).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    grad = torch.is_grad_enabled() and logits_NV.requires_grad
    logprobs, entropies = [], []
    for start in range(0, logits_NV.shape[0], chunk_tokens):
        piece_CV, ids_C = logits_NV[start:start + chunk_tokens], next_ids_N[start:start + chunk_tokens]
        if grad and logits_NV.shape[0] > chunk_tokens:
            lp_C, ent_C = checkpoint(_chunk_outputs, piece_CV, ids_C, want_entropy, temperature, use_reentrant=False)
        else:
            lp_C, ent_C = _chunk_outputs(piece_CV, ids_C, want_entropy, temperature)
        logprobs.append(lp_C)
        entropies.append(ent_C)
    logprobs_N = torch.cat(logprobs)
    return logprobs_N, (torch.cat(entropies) if want_entropy else None)
