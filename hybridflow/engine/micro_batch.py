"""Token-budget micro-batching with padding removed: rows are packed into one sequence per micro-batch.

Legend: B = batch rows, S = sequence columns (prompt + response), T = response columns,
b = rows of one micro-batch, N = packed tokens of one micro-batch (real tokens, then filler).

A micro-batch holds whole rows (whole groups of ``group_size`` consecutive rows, e.g. the
chosen/rejected pair of a reward model). Its real tokens are concatenated into one row ``[1, N]``
with position ids restarting at each sequence; each sequence attends only to itself, found from
the position ids without an N x N mask (``hybridflow.models.packed_attention``), so packing is
exact and its cost does not grow with the token budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedMicroBatch:
    """One micro-batch: which rows it holds and their real tokens packed into one sequence."""

    rows_b: Tensor
    """Indices of the batch rows in this micro-batch (long, [b]); empty for a filler micro-batch."""
    input_ids_1N: Tensor
    """Real tokens of the rows, concatenated in row order, then filler tokens up to the packed length."""
    position_ids_1N: Tensor
    """Position of each token inside its own sequence (restarts at every sequence and at the filler)."""
    mask_bS: Tensor
    """Attention mask of the rows (bool, [b, S]): where the packed real tokens came from."""
    sequence_starts: Tensor
    """Packed index of each row's first real token (long, [b])."""
    num_real_tokens: int
    """Real tokens (the first num_real_tokens entries of the packed sequence)."""

    @property
    def is_filler(self) -> bool:
        """A micro-batch without rows (run only so that every rank issues the same collectives)."""
        return self.rows_b.numel() == 0

    @property
    def packed_length(self) -> int:
        return self.input_ids_1N.shape[1]


def default_position_ids(attention_mask_BS: Tensor) -> Tensor:
    """Position of every token among the real tokens of its row (HF convention), 0 on padding."""
    return (attention_mask_BS.long().cumsum(-1) - 1).clamp(min=0)


def plan_micro_batches(lengths_B: Tensor, *, token_budget: int, group_size: int = 1,
                       min_count: int = 0) -> list[list[int]]:
    """Split rows into micro-batches of at most ``token_budget`` real tokens (first-fit decreasing).

    Rows are kept in groups of ``group_size`` consecutive rows; each micro-batch lists its rows in
    ascending order. If fewer than ``min_count`` micro-batches result, the largest ones are split
    (a group is never split); the caller pads further with filler micro-batches if still short.
    """
    num_rows = lengths_B.shape[0]
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"group_size {group_size} must divide the batch of {num_rows} rows; "
                         f"allowed: divisors of {num_rows}")
    lengths = lengths_B.tolist()
    groups = [list(range(start, start + group_size)) for start in range(0, num_rows, group_size)]
    group_tokens = [sum(lengths[r] for r in group) for group in groups]
    longest = max(group_tokens, default=0)
    if longest > token_budget:
        raise ValueError(f"a group of {group_size} row(s) holds {longest} real tokens, more than "
                         f"micro_batch_tokens={token_budget}; allowed: micro_batch_tokens >= {longest}")
    bins: list[list[int]] = []
    bin_tokens: list[int] = []
    for index in sorted(range(len(groups)), key=lambda i: (-group_tokens[i], i)):
        for slot, used in enumerate(bin_tokens):
            if used + group_tokens[index] <= token_budget:
                bins[slot].append(index)
                bin_tokens[slot] += group_tokens[index]
                break
        else:
            bins.append([index])
            bin_tokens.append(group_tokens[index])
    while len(bins) < min_count and any(len(b) > 1 for b in bins):
        slot = max((s for s in range(len(bins)) if len(bins[s]) > 1), key=lambda s: bin_tokens[s])
        moved = bins[slot].pop()
        bin_tokens[slot] -= group_tokens[moved]
        bins.append([moved])
        bin_tokens.append(group_tokens[moved])
    return [sorted(row for g in b for row in groups[g]) for b in bins]


def pack_rows(rows: list[int], input_ids_BS: Tensor, attention_mask_BS: Tensor, position_ids_BS: Tensor,
              *, pad_to: int | None = None, pad_token_id: int = 0) -> PackedMicroBatch:
    """Pack the real tokens of ``rows`` into one sequence, adding filler up to ``pad_to`` tokens."""
    device = input_ids_BS.device
    rows_b = torch.tensor(rows, dtype=torch.long, device=device)
    mask_bS = attention_mask_BS[rows_b].bool()
    ids_N = input_ids_BS[rows_b][mask_bS]
    positions_N = position_ids_BS[rows_b][mask_bS]
    lengths_b = mask_bS.sum(-1)
    starts_b = torch.cumsum(lengths_b, 0) - lengths_b
    num_real = ids_N.numel()
    target = max(num_real, 1) if pad_to is None else pad_to
    if num_real > target:
        raise ValueError(f"micro-batch of {num_real} tokens does not fit pad_to={target}")
    filler = target - num_real
    if filler:
        # the filler is one more "sequence" (positions 0..filler-1) that nothing reads
        ids_N = torch.cat([ids_N, torch.full((filler,), pad_token_id, dtype=ids_N.dtype, device=device)])
        positions_N = torch.cat([positions_N, torch.arange(filler, dtype=positions_N.dtype, device=device)])
    return PackedMicroBatch(rows_b=rows_b, input_ids_1N=ids_N[None], position_ids_1N=positions_N[None],
                            mask_bS=mask_bS, sequence_starts=starts_b, num_real_tokens=num_real)


def shift_to_next_token(per_token_N: Tensor, packed: PackedMicroBatch) -> Tensor:
    """Move values computed at packed token n to token n+1 (the token they predict), 0 at sequence starts."""
    shifted_N = torch.zeros_like(per_token_N)
    shifted_N[1:] = per_token_N[:-1]
    shifted_N[packed.sequence_starts] = 0
    return shifted_N


def unpack_columns(per_token_N: Tensor, packed: PackedMicroBatch, num_columns: int) -> Tensor:
    """Scatter packed per-token values back to the rows' padded layout and keep the last ``num_columns``."""
    out_bS = per_token_N.new_zeros(packed.mask_bS.shape)
    out_bS = out_bS.masked_scatter(packed.mask_bS, per_token_N[: packed.num_real_tokens])
    return out_bS[:, -num_columns:]


def last_token_values(per_token_N: Tensor, packed: PackedMicroBatch) -> Tensor:
    """The value at each row's last real token ([b])."""
    lengths_b = packed.mask_bS.sum(-1)
    return per_token_N[packed.sequence_starts + lengths_b - 1]


def padding_ratio(real_tokens: int, computed_tokens: int) -> float:
    """Share of computed token slots that hold padding."""
    return 0.0 if computed_tokens == 0 else 1.0 - real_tokens / computed_tokens
