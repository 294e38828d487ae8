"""Errors: a failing rank, a call past its timeout, a hung collective and a killed worker all reach the driver."""

from __future__ import annotations

import inspect
import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import ray.cloudpickle
import torch
import torch.distributed as dist

from hybridflow.controller import (DRIVER_ACTIVITY, ResourcePool, Worker, WorkerError, WorkerGroup, WorkerLostError,
                                   WorkerTimeoutError, register)
from hybridflow.controller.errors import user_message
from hybridflow.controller.worker_group import DEFAULT_CALL_TIMEOUT_S

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FaultyWorker(Worker):
    @register("ONE_TO_ALL")
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"boom on rank {rank}")
        return self.rank

    @register("ONE_TO_ALL", blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register("ONE_TO_ALL")
    def lonely_all_reduce(self) -> int:
        if self.rank == 0:  # rank 1 never joins: a hung collective
            dist.all_reduce(torch.ones(1))
        return self.rank

    @register("ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def faulty(ray_session):
    pool = ResourcePool([2], name="errors")
    group = WorkerGroup(pool, FaultyWorker, name="faulty", timeout_s=60, dist_timeout_s=3)
    yield group
    group.shutdown()
    pool.release()


def test_an_exception_on_one_rank_names_role_rank_method_and_carries_the_remote_traceback(faulty):
    with pytest.raises(WorkerError) as info:
        faulty.fail_on(1)
    error = info.value
    assert (error.role, error.rank, error.method) == ("faulty", 1, "fail_on")
    assert "ValueError: boom on rank 1" in error.remote_traceback
    assert str(error).splitlines()[0] == "faulty.fail_on failed on rank 1: ValueError: boom on rank 1"
    assert "in fail_on" in error.remote_traceback
    assert faulty.fail_on(-1) == [0, 1]  # the group keeps working after a user exception


def test_a_call_past_its_timeout_is_a_timeout_error_naming_the_pending_ranks(faulty):
    future = faulty.sleep(2.0)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError) as info:
        future.get(timeout_s=0.5)
    assert time.monotonic() - start < 1.5  # the driver gave up long before the call could finish
    assert info.value.pending_ranks == [0, 1] and info.value.method == "sleep"
    assert future.get() == [0, 1]


def test_a_hung_collective_fails_within_the_process_group_timeout(faulty):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        faulty.lonely_all_reduce()
    assert time.monotonic() - start < 30.0
    assert (info.value.rank, info.value.method) == (0, "lonely_all_reduce")


def test_a_frozen_worker_is_reported_by_the_watchdog_then_times_out_naming_rank_and_pid(faulty, caplog):
    pids = faulty.pid()
    os.kill(pids[1], signal.SIGSTOP)
    activity = DRIVER_ACTIVITY.set(lambda: "step 3/20: generate (5 s)")  # what a trainer's heartbeat describes
    try:
        future = faulty.pid.future()
        with caplog.at_level(logging.WARNING, logger="hybridflow.controller"), \
                pytest.raises(WorkerTimeoutError) as info:
            future.get(timeout_s=2.0, watchdog_s=0.4)
    finally:
        os.kill(pids[1], signal.SIGCONT)
        DRIVER_ACTIVITY.reset(activity)
    assert info.value.pending_ranks == [1] and info.value.pids == [pids[1]]
    assert f"faulty.pid did not finish within 2 s on ranks [1] (pids [{pids[1]}])" in str(info.value)
    reports = [record.getMessage() for record in caplog.records if record.name == "hybridflow.controller"]
    assert reports and all(f"faulty.pid: still waiting for rank 1 (pid {pids[1]}) after" in r for r in reports)
    assert all(r.endswith("; the driver is at: step 3/20: generate (5 s)") for r in reports)
    assert future.get() == pids  # resumed, the worker answers


def test_worker_groups_wait_a_finite_time_by_default():
    for function in (WorkerGroup.__init__, WorkerGroup.colocate):
        assert inspect.signature(function).parameters["timeout_s"].default == DEFAULT_CALL_TIMEOUT_S == 3600.0


def test_a_killed_worker_is_an_error_naming_its_rank_not_a_hang(faulty):
    pids = faulty.pid()
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        faulty.fail_on(-1)
    assert time.monotonic() - start < 30.0
    assert info.value.rank == 1 and "died" in info.value.remote_traceback
    assert isinstance(info.value, WorkerLostError) and info.value.pid == pids[1]
    assert str(info.value).startswith(f"faulty rank 1 (pid {pids[1]} on host ")


def test_a_worker_error_reports_one_line_and_writes_the_full_traceback_to_a_file(tmp_path):
    remote = ('Traceback (most recent call last):\n  File "w.py", line 3, in update\n    step()\n'
              'ValueError: learning rate must be > 0, got -1\n')
    error = WorkerError(role="actor", rank=1, method="update", remote_traceback=remote)
    assert str(error).splitlines()[0] == "actor.update failed on rank 1: ValueError: learning rate must be > 0, got -1"
    message = error.report(tmp_path / "errors")
    assert "\n" not in message
    prefix = "actor.update failed on rank 1: ValueError: learning rate must be > 0, got -1 (full traceback: "
    assert message.startswith(prefix) and message.endswith(".txt)")
    path = message[len(prefix):-1]
    assert Path(path).parent == tmp_path / "errors" and remote in Path(path).read_text()
    assert user_message(error, tmp_path).startswith("actor.update failed on rank 1")
    timeout = WorkerTimeoutError(role="critic", method="values", pending_ranks=[0], timeout_s=5)
    assert user_message(timeout, tmp_path).startswith("critic.values did not finish within 5 s on ranks [0]")
