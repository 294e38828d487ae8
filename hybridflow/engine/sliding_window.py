"""The KV cache of a sliding-window attention layer (Gemma 3's local layers) as a ring of ``window`` slots.

Shape legend: B rows, K key/value heads, W window (ring slots), S new positions, D head dim, L cache columns.

A query at cache column q of a sliding layer sees the keys at columns q - W < k <= q (transformers' sliding
mask counts columns, left padding included). Column c is kept in slot c % W: writing column c overwrites
column c - W, the first one that no later query sees, so the ring holds exactly what attention still needs and
its memory is bounded by the window whatever the sequence length.
"""

from __future__ import annotations

import torch


def ring_columns(last_column: torch.Tensor | int, window: int, device: torch.device) -> torch.Tensor:
    """The column each slot of the ring holds once column ``last_column`` is written ([W]; negative: empty)."""
    slots_W = torch.arange(window, device=device)
    return last_column - torch.remainder(last_column - slots_W, window)


def ring_key_valid(key_valid_BL: torch.Tensor, columns_W: torch.Tensor) -> torch.Tensor:
    """Which ring slots hold a real token ([B, W]): written (column >= 0) and not padding."""
    gathered_BW = key_valid_BL.gather(1, columns_W.clamp(min=0).expand(key_valid_BL.shape[0], -1))
    return gathered_BW & (columns_W >= 0)


def window_mask(key_valid_BL: torch.Tensor, start: int, num_new: int, window: int) -> torch.Tensor:
    """Mask [B, 1, S, W + S] of ``num_new`` queries at columns start.. over the ring (as it was before them) then
    their own keys: a key is visible if it is a real token within the window at or before the query (and a
    query always sees itself, so rows of left padding stay finite)."""
    device = key_valid_BL.device
    query_S = torch.arange(start, start + num_new, device=device)
    ring_W = ring_columns(start - 1, window, device)
    ring_BW = ring_key_valid(key_valid_BL, ring_W)
    ring_BSW = ring_BW[:, None, :] & (query_S[:, None] - ring_W[None, :] < window)[None]
    distance_SS = query_S[:, None] - query_S[None, :]
    new_SS = (distance_SS >= 0) & (distance_SS < window)
    new_BSS = (key_valid_BL[:, None, start:start + num_new] & new_SS[None]) | (distance_SS == 0)[None]
    return torch.cat([ring_BSW, new_BSS], dim=-1).unsqueeze(1)


def write_ring(ring_BKWD: torch.Tensor, new_BKSD: torch.Tensor, start: int) -> None:
    """Write the keys (or values) of columns start.. into their slots; only the last W can still be seen."""
    window, num_new = ring_BKWD.shape[2], new_BKSD.shape[2]
    keep = min(num_new, window)
    columns = torch.arange(start + num_new - keep, start + num_new, device=ring_BKWD.device)
    ring_BKWD.index_copy_(2, columns % window, new_BKSD[:, :, num_new - keep:])
