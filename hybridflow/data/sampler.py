"""A seeded, resumable order over dataset rows: one seed gives one sequence of batches; a saved state continues it."""

from __future__ import annotations

import torch


class ResumableSampler:
    """Hands out batches of row indices epoch after epoch.

    Each epoch is a permutation drawn from a generator seeded by (seed, epoch), so the order does
    not depend on how many batches were drawn before. A batch never spans two epochs: the tail of
    an epoch shorter than the batch is skipped. `state_dict()` is (epoch, position); loading it
    into a sampler with the same seed and size continues with exactly the batches the original
    would have produced.
    """

    def __init__(self, num_rows: int, *, seed: int, shuffle: bool = True) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def next_indices(self, batch_size: int) -> list[int]:
        """The next `batch_size` row indices, moving to the next epoch when this one has too few left."""
        if not 1 <= batch_size <= self.num_rows:
            raise ValueError(f"batch_size must lie in [1, {self.num_rows}] (the dataset's rows), got {batch_size}")
        if self.position + batch_size > self.num_rows:
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        indices = self._order[self.position : self.position + batch_size]
        self.position += batch_size
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed or state["num_rows"] != self.num_rows:
            raise ValueError(
                f"sampler state was saved with seed={state['seed']}, num_rows={state['num_rows']}; this sampler "
                f"has seed={self.seed}, num_rows={self.num_rows}, so resuming would not continue the same order"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
