"""Drawing batches from any dataset of this package (prompts, SFT or preference pairs) in a seeded, resumable order."""

from __future__ import annotations

from hybridflow.data.sampler import ResumableSampler


class BatchLoader:
    """Draws `batch_size` rows per call as a DataProto; `state_dict()` lets a resumed run see the same order.

    `dataset` is any object with `__len__`, `batch(indices) -> DataProto` and `source_name`
    (PromptDataset, SFTDataset, PreferenceDataset).
    """

    def __init__(self, dataset, *, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if not 1 <= batch_size <= len(dataset):
            raise ValueError(
                f"batch_size must lie in [1, {len(dataset)}] (the rows of {dataset.source_name} after "
                f"filtering), got {batch_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = ResumableSampler(len(dataset), seed=seed, shuffle=shuffle)

    @property
    def epoch(self) -> int:
        """Completed passes over the dataset."""
        return self.sampler.epoch

    def next_batch(self):
        """The next `batch_size` rows as a DataProto."""
        return self.dataset.batch(self.sampler.next_indices(self.batch_size))

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)
