"""Tests of the local multi-process launcher and the device/backend choice."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridflow import device
from hybridflow.parallel.launch import run_distributed


def _all_reduce_rank_plus_one(rank: int, world_size: int) -> float:
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    return value.item()


def _report_backend_and_threads(rank: int, world_size: int) -> tuple[str, int, int]:
    return dist.get_backend(), torch.get_num_threads(), dist.get_world_size()


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("rank one refuses")
    return rank


def test_run_distributed_returns_results_in_rank_order_after_a_collective():
    assert run_distributed(_all_reduce_rank_plus_one, 3) == [6.0, 6.0, 6.0]


def test_each_rank_uses_the_device_backend_and_one_thread():
    results = run_distributed(_report_backend_and_threads, 2)
    assert results == [(device.distributed_backend(), 1, 2)] * 2


def test_an_exception_on_one_rank_reaches_the_caller_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1(.|\n)*KeyError(.|\n)*rank one refuses"):
        run_distributed(_fail_on_rank_one, 2)


def test_world_size_below_one_is_rejected():
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_all_reduce_rank_plus_one, 0)


def test_cpu_machine_picks_cpu_gloo_and_fp32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("HYBRIDFLOW_BACKEND", raising=False)
    assert device.device_type() == "cpu"
    assert device.distributed_backend() == "gloo"
    assert device.default_dtype() == torch.float32
    assert device.current_device(3) == torch.device("cpu")


def test_backend_override_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDFLOW_BACKEND", "gloo")
    assert device.distributed_backend() == "gloo"


def _return_a_tensor(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def test_ranks_may_return_tensors_after_their_process_exits():
    results = run_distributed(_return_a_tensor, 2)
    assert [r.tolist() for r in results] == [[0.0] * 3, [1.0] * 3]


def test_a_gpu_machine_picks_the_mixed_backend_so_cpu_tensors_still_have_a_collective(monkeypatch):
    # plain nccl fails on every CPU tensor (FSDP CPU offload, object collectives); gloo carries those
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("HYBRIDFLOW_BACKEND", raising=False)
    assert device.distributed_backend() == "cpu:gloo,cuda:nccl"


def test_more_ranks_than_gpus_is_refused_with_an_error_naming_the_counts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    device.require_devices(1)
    with pytest.raises(device.NotEnoughDevicesError, match=r"needs 4 processes, one per GPU, but this machine has 1"):
        device.require_devices(4, what="the actor group")
    with pytest.raises(device.NotEnoughDevicesError, match="run_distributed"):
        run_distributed(_all_reduce_rank_plus_one, 2)


def test_cpu_machines_never_refuse_several_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device.require_devices(8)


def test_tf32_is_allowed_only_on_cuda_under_bf16_compute_and_true_fp32_is_kept_otherwise(monkeypatch):
    before = torch.get_float32_matmul_precision()
    try:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        assert device.configure_matmul_precision(torch.bfloat16) == "highest"
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert device.configure_matmul_precision(torch.bfloat16) == "high"
        assert torch.get_float32_matmul_precision() == "high"
        assert device.configure_matmul_precision(torch.float32) == "highest"
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
