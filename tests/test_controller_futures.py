"""Futures: chaining calls between groups of different DP sizes without routing data through the driver."""

from __future__ import annotations

import os
import sys
import time

import pytest
import ray.cloudpickle
import torch

from hybridflow.controller import (
    Future,
    ResourcePool,
    Worker,
    WorkerError,
    WorkerGroup,
    driver_fetch_stats,
    lazy_fetch_stats,
    register,
    reset_driver_fetch_stats,
)
from hybridflow.parallel.layout import ParallelLayout
from hybridflow.protocol import DataProto

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOKENS = 512  # per generated row: makes the payload large next to everything else the driver sees


def prompts(count: int) -> DataProto:
    return DataProto.from_dict({"prompt_id": torch.arange(count)})


def expected_tokens(prompt_ids: list[int], samples: int = 1) -> torch.Tensor:
    ids = torch.tensor(prompt_ids).repeat_interleave(samples)
    return ids[:, None] * 10_000 + torch.arange(TOKENS)[None, :]


class StageWorker(Worker):
    """A stand-in for generation (expands prompts into long rows) and for scoring (reads them)."""

    @register("ONE_TO_ALL", declares_layout=True)
    def declare(self, tp: int) -> None:
        self.set_parallel_layout(ParallelLayout.for_world(self.world_size, tp_size=tp))

    @register("DP_PROTO", blocking=False)
    def generate(self, batch: DataProto, samples: int = 1) -> DataProto:
        ids = batch["prompt_id"].repeat_interleave(samples)
        return DataProto.from_dict({"prompt_id": ids, "tokens": ids[:, None] * 10_000 + torch.arange(TOKENS)[None, :]})

    @register("3D_PROTO", blocking=False)
    def generate_3d(self, batch: DataProto) -> DataProto:
        return self.generate(batch)

    @register("DP_METRICS")
    def score(self, batch: DataProto) -> dict:
        """What this rank received."""
        return {"prompt_ids": batch["prompt_id"].tolist(), "tokens_ok": bool(
            torch.equal(batch["tokens"], batch["prompt_id"][:, None] * 10_000 + torch.arange(TOKENS)[None, :]))}

    @register("ONE_TO_ALL")
    def objects_fetched(self) -> int:
        """Source outputs this process has fetched so far to resolve future arguments."""
        return lazy_fetch_stats().objects

    @register("DP_PROTO")
    def passthrough(self, batch: DataProto) -> DataProto:
        return batch

    @register("ONE_TO_ALL", blocking=False)
    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register("ONE_TO_ALL", blocking=False)
    def busy_interval(self, seconds: float) -> tuple[float, float]:
        start = time.time()
        time.sleep(seconds)
        return start, time.time()

    @register("ONE_TO_ALL")
    def count_lists(self, value: list) -> int:
        return len(value)

    @register("ONE_TO_ALL", blocking=False)
    def wait_for(self, path: str, seconds: float = 60.0) -> bool:
        """Hold this rank until ``path`` exists (True) or ``seconds`` pass (False)."""
        deadline = time.monotonic() + seconds
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    @register("ONE_TO_ALL")
    def redeclare_unflagged(self) -> None:
        """Declares the layout it already has, without ``declares_layout``: refused after the call."""
        self.set_parallel_layout(self.parallel_layout)


@pytest.fixture
def driver_unpickled_bytes(monkeypatch) -> list[int]:
    """Tensor bytes of every DataProto deserialized in the driver process during the test.

    Independent of the controller's own accounting: whatever route a batch takes into the driver
    (ray.get, a future, an object reference), it arrives through DataProto.__setstate__.
    """
    sizes: list[int] = []
    original = DataProto.__setstate__

    def counting_setstate(self, state: dict) -> None:
        original(self, state)
        sizes.append(sum(t.numel() * t.element_size() for t in (self.batch[k] for k in self.batch.keys()))
                     if self.batch is not None else 0)

    monkeypatch.setattr(DataProto, "__setstate__", counting_setstate)
    return sizes


@pytest.fixture(scope="module")
def groups(ray_session):
    pool4, pool2 = ResourcePool([4], name="futures4"), ResourcePool([2], name="futures2")
    dp4 = WorkerGroup(pool4, StageWorker, name="dp4", timeout_s=120)
    dp2 = WorkerGroup(pool2, StageWorker, name="dp2", timeout_s=120)
    yield dp4, dp2
    for group in (dp4, dp2):
        group.shutdown()
    pool4.release()
    pool2.release()


def test_chaining_dp4_into_dp2_moves_no_batch_bytes_through_the_driver(groups, driver_unpickled_bytes):
    dp4, dp2 = groups
    dp4.declare(1)
    before = dp2.objects_fetched()
    reset_driver_fetch_stats()
    future = dp4.generate(prompts(8))
    assert isinstance(future, Future)
    metrics = dp2.score(future)
    assert driver_fetch_stats().bytes == 0
    assert driver_unpickled_bytes == []
    assert [m["prompt_ids"] for m in metrics] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert all(m["tokens_ok"] for m in metrics)
    # destination rank j fetched exactly source chunks 2j and 2j+1
    assert [after - b for after, b in zip(dp2.objects_fetched(), before)] == [2, 2]


def test_a_blocking_call_fetches_exactly_the_batch_into_the_driver(groups, driver_unpickled_bytes):
    dp4, _ = groups
    dp4.declare(1)
    reset_driver_fetch_stats()
    batch = dp4.generate(prompts(8)).get()
    assert torch.equal(batch["tokens"], expected_tokens(list(range(8))))
    assert driver_fetch_stats().bytes == batch.nbytes == 8 * (TOKENS + 1) * 8
    # the same bytes, seen where they arrive: one chunk of two rows from each of the four ranks
    assert driver_unpickled_bytes == [2 * (TOKENS + 1) * 8] * 4


def test_chaining_dp2_into_dp4_gives_each_destination_rank_its_slice_of_one_source_chunk(groups,
                                                                                         driver_unpickled_bytes):
    dp4, dp2 = groups
    dp4.declare(1)
    before = dp4.objects_fetched()
    reset_driver_fetch_stats()
    metrics = dp4.score(dp2.generate(prompts(8)))
    assert driver_fetch_stats().bytes == 0
    assert driver_unpickled_bytes == []
    assert [m["prompt_ids"] for m in metrics] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(m["tokens_ok"] for m in metrics)
    # destination rank i fetched only source chunk i // 2
    assert [after - b for after, b in zip(dp4.objects_fetched(), before)] == [1, 1, 1, 1]


def test_padding_survives_a_chain_of_dp4_dp2_dp4_with_seven_rows(groups):
    dp4, dp2 = groups
    dp4.declare(1)
    first = dp4.generate(prompts(7))          # padded to 8 on dp4
    second = dp2.passthrough.future(first)    # 7 real rows -> 8 on dp2
    final = dp4.passthrough.future(second).get()
    assert final["prompt_id"].tolist() == list(range(7))
    assert torch.equal(final["tokens"], expected_tokens(list(range(7))))


def test_samples_per_prompt_padding_is_dropped_exactly_through_a_chain(groups):
    dp4, dp2 = groups
    dp4.declare(1)
    out = dp2.passthrough(dp4.generate(prompts(5), samples=3))
    assert out["prompt_id"].tolist() == [p for p in range(5) for _ in range(3)]


def test_a_3d_source_feeds_a_dp_destination_from_its_tp_rank_zero_outputs(groups):
    dp4, dp2 = groups
    dp4.declare(2)  # (p, t, d) = (1, 2, 2): outputs read from ranks 0 and 2
    metrics = dp2.score(dp4.generate_3d(prompts(6)))
    assert [m["prompt_ids"] for m in metrics] == [[0, 1, 2], [3, 4, 5]]
    dp4.declare(1)


def test_a_future_of_a_list_collecting_protocol_reaches_every_rank_whole(groups):
    dp4, dp2 = groups
    naps = dp4.nap(0.0)
    assert dp2.count_lists(naps) == [4, 4]
    assert naps.get() == [0, 1, 2, 3]


def test_groups_on_different_pools_run_at_the_same_time(groups):
    dp4, dp2 = groups
    first, second = dp4.busy_interval(1.5), dp2.busy_interval(1.5)
    intervals = first.get() + second.get()
    # every rank of both groups was busy at one common moment: the calls overlapped, none waited
    assert max(start for start, _ in intervals) < min(end for _, end in intervals)


def test_a_layout_driven_call_is_submitted_while_an_earlier_call_still_runs(groups, tmp_path):
    """Only ``declares_layout`` calls hold back a layout-driven submission: the asynchronous schedules submit the
    next generation while the previous one runs. The held call is released only after the submission returned,
    so a submission that waited for it would leave ``wait_for`` to time out (False)."""
    dp4, _ = groups
    dp4.declare(1)
    release = tmp_path / "release"
    held = dp4.wait_for(str(release))
    generated = dp4.generate(prompts(8))
    release.touch()
    assert held.get() == [True] * 4
    assert torch.equal(generated.get()["tokens"], expected_tokens(list(range(8))))


def test_a_method_that_changes_the_layout_without_declares_layout_fails_naming_itself(groups):
    dp4, _ = groups
    dp4.declare(1)
    with pytest.raises(WorkerError,
                       match=r"StageWorker.redeclare_unflagged declared a new layout .*declares_layout=True"):
        dp4.redeclare_unflagged()
    dp4.declare(1)
    assert dp4.passthrough(prompts(4))["prompt_id"].tolist() == [0, 1, 2, 3]
