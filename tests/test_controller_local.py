"""Single-process mode: the same driver program without Ray, every group in the driver's process."""

from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
import torch

from hybridflow.controller import ResourcePool, Worker, WorkerError, WorkerGroup, local_mode, register
from hybridflow.controller.local import local_mode_enabled
from hybridflow.protocol import DataProto

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module", autouse=True)
def driver_process_group():
    """Local mode gives the driver a torch.distributed world of one; leave the process as we found it."""
    import torch.distributed as dist

    was_initialized = dist.is_initialized()
    yield
    if dist.is_initialized() and not was_initialized:
        dist.destroy_process_group()


class Generator(Worker):
    @register("DP_PROTO", blocking=False)
    def generate(self, batch: DataProto) -> DataProto:
        ids = batch["prompt_id"].repeat_interleave(2)
        return DataProto.from_dict({"prompt_id": ids, "response": ids * 10 + torch.arange(len(ids)) % 2})

    @register("ONE_TO_ALL")
    def where(self) -> tuple[int, int]:
        return os.getpid(), self.world_size

    @register("ONE_TO_ALL")
    def explode(self) -> None:
        raise RuntimeError("inspect me with breakpoint()")

    @register("ONE_TO_ALL")
    def pause_here(self) -> str:
        local_name = "seen by the debugger"  # noqa: F841 (read from the frame by the test's hook)
        breakpoint()
        return "resumed"


class ShadowsTheGroup(Worker):
    @register("ONE_TO_ALL")
    def shutdown(self) -> None:
        pass


class BrokenInit(Worker):
    def __init__(self) -> None:
        raise OSError("checkpoint not found")


class Scorer(Worker):
    @register("DP_PROTO")
    def score(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict({"score": (batch["response"] % 10 == 1).float() + batch["prompt_id"]})


def driver_program(mode: str | None) -> torch.Tensor:
    """A two-role dataflow as a trainer would write it; nothing in it knows which mode runs it."""
    pool = ResourcePool([2], mode=mode, name=f"local-test-{mode}")
    groups = WorkerGroup.colocate(pool, {"generator": (Generator,), "scorer": (Scorer,)})
    try:
        rollouts = groups["generator"].generate(DataProto.from_dict({"prompt_id": torch.arange(5)}))
        return groups["scorer"].score(rollouts)["score"]
    finally:
        groups["generator"].shutdown()
        if not pool.is_local:
            pool.release()


def test_the_same_driver_program_gives_the_same_result_with_ray_and_in_one_process(ray_session):
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 5.0])
    assert torch.equal(driver_program("ray"), expected)
    assert torch.equal(driver_program("local"), expected)
    with local_mode():
        assert torch.equal(driver_program(None), expected)


def test_local_workers_run_in_the_driver_process_with_world_size_one():
    pool = ResourcePool([4], mode="local")
    group = WorkerGroup(pool, Generator)
    assert group.where() == [(os.getpid(), 1)]
    assert group.world_size == 1
    group.shutdown()
    WorkerGroup(pool, Scorer).shutdown()  # a shut-down group frees its slot for the next one


def test_local_mode_errors_name_the_role_and_chain_the_original_exception():
    group = WorkerGroup(ResourcePool([1], mode="local"), Generator, name="gen")
    with pytest.raises(WorkerError) as info:
        group.explode()
    assert (info.value.role, info.value.rank, info.value.method) == ("gen", 0, "explode")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_breakpoint_in_a_worker_method_stops_in_the_driver_process_in_the_methods_frame(monkeypatch):
    stops = []

    def debugger(*args, **kwargs) -> None:  # stands in for pdb: records where breakpoint() stopped
        frame = sys._getframe(1)
        stops.append((os.getpid(), frame.f_code.co_name, frame.f_locals.get("local_name")))

    monkeypatch.setattr(sys, "breakpointhook", debugger)
    group = WorkerGroup(ResourcePool([2], mode="local"), Generator)
    assert group.pause_here() == ["resumed"]
    assert stops == [(os.getpid(), "pause_here", "seen by the debugger")]
    group.shutdown()


def test_a_constructor_error_names_init_and_frees_the_slot_for_the_next_group():
    pool = ResourcePool([1], mode="local")
    with pytest.raises(WorkerError) as info:
        WorkerGroup(pool, BrokenInit, name="broken")
    assert (info.value.role, info.value.rank, info.value.method) == ("broken", 0, "__init__")
    assert "OSError: checkpoint not found" in info.value.remote_traceback
    assert WorkerGroup(pool, Scorer).world_size == 1


def test_a_worker_class_that_is_not_a_worker_or_shadows_a_group_method_is_a_value_error_before_it_starts():
    pool = ResourcePool([1], mode="local")
    with pytest.raises(ValueError, match="subclass of hybridflow.controller.Worker"):
        WorkerGroup(pool, dict)
    with pytest.raises(ValueError, match="ShadowsTheGroup.shutdown clashes with WorkerGroup.shutdown"):
        WorkerGroup.colocate(pool, {"fine": (Scorer,), "clash": (ShadowsTheGroup,)})
    WorkerGroup(pool, Scorer).shutdown()  # nothing was started, so the slot is still free


def test_the_environment_variable_switches_new_pools_to_local_mode(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_LOCAL", "1")
    assert local_mode_enabled()
    assert ResourcePool([8]).is_local
    monkeypatch.setenv("HYBRIDFLOW_LOCAL", "0")
    assert not local_mode_enabled()


def test_a_worker_built_by_hand_is_rank_zero_of_a_world_of_one_and_checks_its_layout():
    from hybridflow.parallel.layout import ParallelLayout

    worker = Scorer()
    assert (worker.rank, worker.world_size, worker.coords.dp_rank) == (0, 1, 0)
    with pytest.raises(ValueError, match="covers 2 ranks"):
        worker.set_parallel_layout(ParallelLayout(tp_size=2))
