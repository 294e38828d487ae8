"""Weight sync from the training pool to a rollout pool: bucketed packing in the generation dtype, a version, and
per-tensor checksums that the receiving replica verifies.

The trainer packs its full weights (Hugging Face names) cast to the generation dtype into flat buckets of at
most ``bucket_bytes`` (``plan_buckets``, the hybrid engine's bucketing), each bucket one contiguous buffer so
that the transfer layer moves a few large objects instead of hundreds of small ones. Every tensor carries a
checksum computed on the bytes the trainer sends; the replica recomputes it on the tensors it holds after
unpacking and refuses to generate with weights that differ.

The checksum is exact and cheap (``tensor_checksum``): the tensor's raw bytes read as int64 words and summed in
61 lanes in one pass, without conversion or a copy to the host (it runs where the tensor lives); integer sums
do not depend on the reduction order, so trainer and replica agree bit for bit on any thread count. It catches
any single changed value and values swapped between lanes; docs/async.md states its measured cost.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from hybridflow.engine.hybrid_engine import plan_buckets

LANES = 61
"""Lanes of the checksum's lane-weighted sum (a prime: weight matrices' rows rarely align with it)."""


class WeightMismatchError(RuntimeError):
    """A rollout replica holds weights that differ from the trainer's (names the tensor and the replica)."""


def tensor_checksum(tensor: torch.Tensor) -> tuple[int, int]:
    """(sum of ``tensor``'s bytes read as int64 words, the sum of its LANES lane sums weighted by lane), exact.

    One pass over the tensor, no conversion: the words form a [N / LANES, LANES] view summed over rows (integer
    sums wrap modulo 2**64 and do not depend on the reduction order, so both sides agree bit for bit); the
    lane weights catch two values swapped between lanes."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 8:
        raw = torch.cat([raw, raw.new_zeros(8 - raw.numel() % 8)])
    words = raw.view(torch.int64)
    body = words.numel() - words.numel() % LANES
    lanes = words[:body].view(-1, LANES).sum(0).tolist() if body else [0] * LANES
    tail = int(words[body:].sum())
    total = (sum(lanes) + tail) % 2**64
    weighted = (sum((lane_index + 1) * lane for lane_index, lane in enumerate(lanes)) + (LANES + 1) * tail) % 2**64
    return total, weighted


@dataclass
class WeightBucket:
    """Consecutive tensors packed into one flat buffer."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    flat: torch.Tensor


@dataclass
class WeightPayload:
    """What a sync moves: the buckets, the version the weights are, and the trainer's checksum of each tensor."""

    version: int
    buckets: list[WeightBucket]
    checksums: dict[str, tuple[int, int]] = field(default_factory=dict)
    pack_seconds: float = 0.0
    checksum_seconds: float = 0.0

    @property
    def num_bytes(self) -> int:
        return sum(bucket.flat.numel() * bucket.flat.element_size() for bucket in self.buckets)


def pack_weights(state: dict[str, torch.Tensor], *, version: int, dtype: torch.dtype, bucket_bytes: int,
                 checksums: bool = True) -> WeightPayload:
    """``state`` (name -> full tensor) cast to ``dtype`` and packed into buckets, with per-tensor checksums."""
    start = time.perf_counter()
    names = list(state)
    tensors = [state[name].detach().to(dtype) for name in names]
    sizes = [t.numel() * t.element_size() for t in tensors]
    buckets = []
    for span in plan_buckets(sizes, bucket_bytes):
        members = [tensors[index] for index in span]
        flat = torch.cat([t.reshape(-1) for t in members]).cpu()
        buckets.append(WeightBucket([names[index] for index in span], [tuple(t.shape) for t in members], flat))
    packed = time.perf_counter()
    sums = {name: tensor_checksum(tensor) for name, tensor in zip(names, tensors)} if checksums else {}
    return WeightPayload(version=version, buckets=buckets, checksums=sums, pack_seconds=packed - start,
                         checksum_seconds=time.perf_counter() - packed)


def unpack_weights(payload: WeightPayload, *, device: torch.device) -> dict[str, torch.Tensor]:
    """The payload's tensors by name on ``device``: views of one buffer per bucket."""
    weights = {}
    for bucket in payload.buckets:
        flat = bucket.flat.to(device)
        sizes = [math.prod(shape) for shape in bucket.shapes]
        for name, piece, shape in zip(bucket.names, flat.split(sizes), bucket.shapes):
            weights[name] = piece.view(shape)
    return weights


def verify_weights(weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, int]], *, version: int,
                   replica: str) -> None:
    """WeightMismatchError naming the first tensor whose checksum (or presence) differs from the trainer's."""
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise WeightMismatchError(f"weight sync of version {version}: {replica} lacks tensor {missing[0]!r} "
                                  f"({len(missing)} missing)")
    for name, checksum in expected.items():
        held = tensor_checksum(weights[name])
        if held != tuple(checksum):
            raise WeightMismatchError(
                f"weight sync of version {version}: tensor {name!r} on {replica} has checksum {held}, the trainer "
                f"sent {tuple(checksum)}; the rollout would generate with weights the trainer does not hold")
