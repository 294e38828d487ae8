"""Row operations the transfer protocols apply to batches: count, split with padding, concat, slice."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.protocol import DataProto


def is_splittable(value: Any) -> bool:
    """Arguments that split protocols cut into per-rank chunks (everything else goes to every rank)."""
    return isinstance(value, DataProto)


def num_rows(value: Any) -> int | None:
    """Rows of a batch-like output (DataProto, tensor with a batch dim, list); None for anything else."""
    if isinstance(value, DataProto):
        return len(value)
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() > 0 else None
    if isinstance(value, list):
        return len(value)
    return None


def split_rows(batch: DataProto, num_chunks: int) -> tuple[list[DataProto], int]:
    """Pad ``batch`` to a multiple of ``num_chunks`` (repeating rows) and cut it; returns (chunks, pad rows)."""
    if len(batch) == 0:
        raise ValueError("cannot split an empty batch across ranks; got a DataProto with 0 rows")
    padded, pad_size = batch.pad_to_multiple(num_chunks)
    chunks = padded.chunk(num_chunks)
    assert len(chunks) == num_chunks, (len(chunks), num_chunks)
    return list(chunks), pad_size


def concat_rows(values: list[Any]) -> Any:
    """Concatenate per-rank outputs along the batch dimension, in the given order."""
    if not values:
        raise ValueError("nothing to concatenate: the protocol collected no outputs")
    if all(value is None for value in values):
        return None  # a method that returns nothing (a training step that keeps its metrics) collects to None
    first = values[0]
    if isinstance(first, DataProto):
        return DataProto.concat(values)
    if isinstance(first, torch.Tensor):
        return torch.cat(values, dim=0)
    if isinstance(first, list):
        return [item for value in values for item in value]
    raise ValueError(f"a concatenating protocol needs DataProto, tensor or list outputs, got {type(first).__name__}; "
                     f"return one of those or register the method with a protocol that collects a list")


def slice_rows(value: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a batch-like value."""
    return value[start:stop]


def drop_last_rows(value: Any, count: int) -> Any:
    """``value`` without its last ``count`` rows (the padding added by split_rows)."""
    if count == 0 or value is None:
        return value
    return value[: num_rows(value) - count]
