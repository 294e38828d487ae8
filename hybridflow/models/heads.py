"""Scalar heads of critic, reward and cost models: deterministic initialisation and where a sequence is read.

Shapes: B = batch, S = sequence length (prompt + response), H = hidden size.
"""

from __future__ import annotations

import torch

# Name of the scalar head inside transformers' ``*ForTokenClassification`` models (every family).
SCALAR_HEAD = "score"


def init_scalar_head(head: torch.nn.Linear, *, seed: int) -> None:
    """Initialise a new value/score head in place: weight ~ N(0, 1/(H+1)^2), bias 0, from ``seed``.

    Small but non-zero, so the first update already reaches the backbone (a zero head would give it
    zero gradient) while the initial values stay near 0. The generator is local, so every rank that
    passes the same seed gets the same head and nobody's random stream moves.
    """
    hidden_size = head.in_features
    generator = torch.Generator(device="cpu").manual_seed(seed)
    weight = torch.randn(head.weight.shape, generator=generator, dtype=torch.float32) / (hidden_size + 1)
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.zero_()


def last_token_index(attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """Index of the last real (mask 1) token of each row: LongTensor[B]; 0 for a row with no real token.

    Works for left padding, right padding and both at once (prompt left-padded, response
    right-padded), which is where a reward/cost model's sequence score is read.
    """
    if attention_mask_BS.dim() != 2:
        raise ValueError(f"attention_mask must be [B, S], got shape {tuple(attention_mask_BS.shape)}")
    seq_len = attention_mask_BS.shape[1]
    positions_BS = torch.arange(seq_len, device=attention_mask_BS.device).expand_as(attention_mask_BS)
    real_positions_BS = torch.where(attention_mask_BS.bool(), positions_BS, torch.zeros_like(positions_BS))
    return real_positions_BS.max(dim=1).values.long()
