"""Resource pools: argument checks, and how a pool starts or joins Ray when none is connected yet."""

from __future__ import annotations

import os
import time

import pytest
import ray._private.utils

from hybridflow.controller import ResourcePool, Worker, WorkerGroup
from hybridflow.controller.resource_pool import MIN_LOCAL_CPU_SLOTS, ray_init_options, runtime_mode


@pytest.fixture
def no_recorded_cluster(monkeypatch):
    """Neither RAY_ADDRESS nor a cluster left by `ray start` on this machine."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda temp_dir=None: None)


def test_without_a_running_cluster_the_pool_starts_a_local_ray_with_a_cpu_slot_per_process(no_recorded_cluster):
    options = ray_init_options()
    assert options["num_cpus"] == max(os.cpu_count() or 1, MIN_LOCAL_CPU_SLOTS)
    assert options["runtime_env"] == {"env_vars": {"OMP_NUM_THREADS": "1"}}


def test_with_ray_address_set_the_pool_joins_that_cluster_without_declaring_resources(no_recorded_cluster,
                                                                                         monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert "num_cpus" not in ray_init_options()  # ray.init refuses resource counts when it joins a cluster


def test_after_ray_start_on_this_machine_the_pool_joins_that_cluster(no_recorded_cluster, monkeypatch):
    monkeypatch.setattr(ray._private.utils, "read_ray_address", lambda temp_dir=None: "10.0.0.1:6379")
    assert "num_cpus" not in ray_init_options()


@pytest.mark.parametrize("devices", [[], [0], [2, -1], "4", [True]])
def test_a_pool_with_a_bad_device_list_is_a_value_error(devices):
    with pytest.raises(ValueError, match="devices_per_node"):
        ResourcePool(devices, mode="local")


@pytest.mark.parametrize(("argument", "value"), [("mode", "cluster"), ("max_processes_per_slot", 0),
                                                 ("use_gpu", "yes"), ("placement_timeout_s", 0)])
def test_a_pool_argument_out_of_range_is_a_value_error_naming_it(argument, value):
    with pytest.raises(ValueError, match=argument):
        ResourcePool([1], **{"mode": "local", argument: value})


def test_use_gpu_on_a_cluster_without_gpus_is_a_value_error_not_a_placement_timeout(ray_session):
    with pytest.raises(ValueError, match="use_gpu=True"):
        ResourcePool([1], use_gpu=True, placement_timeout_s=1)


@pytest.mark.parametrize("devices", [[1000], [1] * 100], ids=["too_many_slots", "too_many_nodes"])
def test_more_slots_than_the_cluster_has_is_a_value_error_at_once_not_a_placement_timeout(ray_session, devices):
    import ray

    start = time.monotonic()
    with pytest.raises(ValueError) as info:
        ResourcePool(devices, placement_timeout_s=600)
    assert time.monotonic() - start < 60  # nowhere near the placement timeout
    capacities = sorted((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]), reverse=True)
    assert str(info.value) == (
        f"a resource pool asks for {devices} CPU slots per node (each entry on its own node), but the Ray "
        f"cluster's {len(capacities)} node(s) have {capacities} CPU slots in total; ask for at most that many "
        f"per node (a cluster that autoscales must have its nodes started first)")


@pytest.mark.parametrize(("argument", "value"), [("timeout_s", 0), ("timeout_s", -1.0), ("dist_timeout_s", 0),
                                                  ("watchdog_s", 0)])
def test_a_worker_group_timeout_that_is_not_positive_is_a_value_error_naming_it(argument, value):
    with pytest.raises(ValueError, match=argument):
        WorkerGroup(ResourcePool([1], mode="local"), Worker, **{argument: value})


@pytest.fixture
def not_connected(no_recorded_cluster, monkeypatch):
    """No cluster to join and no ``ray.init()`` before (whatever other tests of the session started)."""
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def test_runtime_auto_runs_a_one_device_run_in_the_driver_when_not_connected_to_ray(not_connected):
    assert runtime_mode("auto", [[1]]) == "local"


@pytest.mark.parametrize("pools", [[[2]], [[1, 1]], [[1], [1]]], ids=["two devices", "two nodes", "two pools"])
def test_runtime_auto_leaves_a_run_of_several_processes_to_ray(not_connected, pools):
    assert runtime_mode("auto", pools) is None


def test_runtime_auto_uses_ray_once_the_driver_has_joined_it_or_a_cluster_is_recorded(not_connected, monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert runtime_mode("auto", [[1]]) is None
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert runtime_mode("auto", [[1]]) is None


def test_an_explicit_runtime_or_mode_overrides_auto(not_connected):
    assert runtime_mode("ray", [[1]]) == "ray"
    assert runtime_mode("local", [[4]]) == "local"
    assert runtime_mode("auto", [[1]], mode="ray") == "ray"
    assert runtime_mode("ray", [[1]], mode="local") == "local"


def test_an_unknown_runtime_is_a_value_error_naming_the_allowed_values():
    with pytest.raises(ValueError, match=r"runtime must be one of auto, ray, local, got 'docker'"):
        runtime_mode("docker", [[1]])
