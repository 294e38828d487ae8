"""Padding token-id lists into batch tensors: prompts left-padded, responses right-padded (the sequence convention).

Shape legend: B = batch, P = prompt tokens, T = response tokens, S = P + T.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def left_pad(
    sequences: Sequence[Sequence[int]], *, pad_token_id: int, length: int | None = None
) -> tuple[Tensor, Tensor]:
    """Left-pad to `length` (default: the longest) -> (ids_BP, mask_BP), mask 1 on real tokens."""
    return _pad(sequences, pad_token_id=pad_token_id, length=length, left=True)


def right_pad(
    sequences: Sequence[Sequence[int]], *, pad_token_id: int, length: int | None = None
) -> tuple[Tensor, Tensor]:
    """Right-pad to `length` (default: the longest) -> (ids_BT, mask_BT), mask 1 on real tokens."""
    return _pad(sequences, pad_token_id=pad_token_id, length=length, left=False)


def _pad(sequences, *, pad_token_id: int, length: int | None, left: bool) -> tuple[Tensor, Tensor]:
    longest = max((len(sequence) for sequence in sequences), default=0)
    length = longest if length is None else length
    assert length >= longest, f"padding length {length} is shorter than a sequence of {longest}"
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        if not sequence:
            continue
        columns = slice(length - len(sequence), length) if left else slice(0, len(sequence))
        ids[row, columns] = torch.tensor(list(sequence), dtype=torch.long)
        mask[row, columns] = 1
    return ids, mask


def prompt_response_tensors(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    response_length: int | None = None,
) -> dict[str, Tensor]:
    """The sequence-batch tensors for prompt + response pairs.

    Returns `prompts` [B, P] (left-padded), `responses` [B, T] (right-padded), `input_ids` [B, S],
    `attention_mask` [B, S], `response_mask` [B, T] and `position_ids` [B, S]
    (= clamp(cumsum(attention_mask) - 1, min=0)).
    """
    prompts_BP, prompt_mask_BP = left_pad(prompt_ids, pad_token_id=pad_token_id)
    responses_BT, response_mask_BT = right_pad(response_ids, pad_token_id=pad_token_id, length=response_length)
    attention_mask_BS = torch.cat([prompt_mask_BP, response_mask_BT], dim=1)
    return {
        "prompts": prompts_BP,
        "responses": responses_BT,
        "input_ids": torch.cat([prompts_BP, responses_BT], dim=1),
        "attention_mask": attention_mask_BS,
        "response_mask": response_mask_BT,
        "position_ids": (attention_mask_BS.cumsum(dim=1) - 1).clamp(min=0),
    }
