"""ResourcePool: a set of device slots across nodes, reserved as a Ray placement group (or the driver itself)."""

from __future__ import annotations

import os

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from hybridflow.controller.local import local_mode_enabled
from hybridflow.controller.ray_reaper import start_reaper

MODES = ("ray", "local")
MIN_LOCAL_CPU_SLOTS = 32


def _local_cpu_slots() -> int | None:
    """Logical CPUs of a Ray started on demand: on a machine without GPUs a slot is a CPU process, and
    small test models oversubscribe the cores on purpose, so offer at least MIN_LOCAL_CPU_SLOTS."""
    if torch.cuda.is_available():
        return None  # Ray's own count; slots are GPUs there
    return max(os.cpu_count() or 1, MIN_LOCAL_CPU_SLOTS)


def running_cluster_address() -> str | None:
    """The cluster a bare ``ray.init()`` joins: RAY_ADDRESS, else the one ``ray start`` recorded on this machine."""
    from ray._private.utils import read_ray_address  # the file ray.init() itself reads; no public accessor

    return os.environ.get("RAY_ADDRESS") or read_ray_address()


RUNTIMES = ("auto", "ray", "local")


def runtime_mode(runtime: str, pools: list[list[int]], *, mode: str | None = None) -> str | None:
    """The ``mode`` of a run's pools (``pools``: devices per node of each pool in use) under a config's
    ``runtime`` (auto | ray | local); ``mode``, when the caller chose one (``--local``), wins.

    ``auto`` is ``local`` when the run is one process anyway (one pool of one device on one node) and
    the driver is not connected to Ray (no ``ray.init()`` before, no RAY_ADDRESS, no ``ray start`` on
    this machine), else None: ``ResourcePool``'s own rule (``local_mode()`` / HYBRIDFLOW_LOCAL, else Ray).
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if mode is not None or runtime != "auto":
        return mode or runtime
    one_process = len(pools) == 1 and list(pools[0]) == [1]
    connected = ray.is_initialized() or running_cluster_address() is not None
    return "local" if one_process and not connected else None


def ray_init_options() -> dict:
    """Arguments of the on-demand ``ray.init``: join a running cluster as it is, or size a new local one.

    Ray refuses resource counts when it joins a cluster (the cluster's nodes declared theirs).
    """
    options = {"include_dashboard": False, "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1"}}}
    if running_cluster_address() is None:
        options["num_cpus"] = _local_cpu_slots()
    return options


class ResourcePool:
    """Device slots per node: ``ResourcePool([4])`` is 4 slots on one node, ``[8, 8]`` two nodes of 8.

    A slot is one GPU (plus one CPU) on a GPU cluster, one CPU elsewhere. The pool reserves one
    placement-group bundle per node holding all that node's slots; with several nodes the bundles
    are STRICT_SPREAD, so node i's slots are on one machine and no two entries share a machine.
    Worker groups built on the same pool instance are colocated (``WorkerGroup.colocate``); different
    pool instances hold disjoint reservations and run concurrently.

    In single-process mode (``mode="local"``, or ``local_mode()`` / HYBRIDFLOW_LOCAL=1 with
    ``mode=None``) nothing is reserved: every group on the pool has one rank, in the driver's process.
    """

    def __init__(self, devices_per_node: list[int], *, name: str | None = None, use_gpu: bool | None = None,
                 mode: str | None = None, max_processes_per_slot: int = 1,
                 placement_timeout_s: float = 60.0) -> None:
        if (not isinstance(devices_per_node, (list, tuple)) or not devices_per_node
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in devices_per_node)):
            raise ValueError(f"devices_per_node must be a non-empty list of positive integers, "
                             f"got {devices_per_node!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
        if not isinstance(max_processes_per_slot, int) or max_processes_per_slot < 1:
            raise ValueError(f"max_processes_per_slot must be a positive integer, got {max_processes_per_slot!r}")
        if use_gpu not in (None, True, False):
            raise ValueError(f"use_gpu must be True, False or None (detect), got {use_gpu!r}")
        if not isinstance(placement_timeout_s, (int, float)) or placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s must be a positive number of seconds, got {placement_timeout_s!r}")
        self.devices_per_node = list(devices_per_node)
        self.name = name or f"pool{id(self):x}"
        self._named = name is not None
        self.mode = mode or ("local" if local_mode_enabled() else "ray")
        self.max_processes_per_slot = max_processes_per_slot
        self._groups_per_slot = 0
        self._placement_group: PlacementGroup | None = None
        self.use_gpu = False
        if self.mode == "ray":
            self.use_gpu = self._reserve(use_gpu, placement_timeout_s)

    @property
    def is_local(self) -> bool:
        return self.mode == "local"

    @property
    def world_size(self) -> int:
        """Ranks a worker group on this pool gets: all slots, or 1 in single-process mode."""
        return 1 if self.is_local else sum(self.devices_per_node)

    @property
    def placement_group(self) -> PlacementGroup:
        assert self._placement_group is not None, "a local pool reserves nothing"
        return self._placement_group

    def slots(self) -> list[tuple[int, int]]:
        """(bundle index = node entry, local rank on that node) for every rank, in rank order."""
        return [(node, local) for node, count in enumerate(self.devices_per_node) for local in range(count)]

    def claim_processes(self, count: int = 1) -> None:
        """Account for a new process per slot; more than ``max_processes_per_slot`` would never be scheduled."""
        if self._groups_per_slot + count > self.max_processes_per_slot:
            raise ValueError(
                f"{self._label} already hosts {self._groups_per_slot} process(es) per slot and "
                f"allows max_processes_per_slot={self.max_processes_per_slot}; colocate the roles in one "
                f"process with WorkerGroup.colocate(pool, {{...}}) or raise max_processes_per_slot")
        self._groups_per_slot += count

    def release_processes(self, count: int = 1) -> None:
        """A group on this pool was shut down: its processes no longer occupy the slots."""
        self._groups_per_slot = max(0, self._groups_per_slot - count)

    def _reserve(self, use_gpu: bool | None, timeout_s: float) -> bool:
        if not ray.is_initialized():
            starts_a_cluster = running_cluster_address() is None
            context = ray.init(**ray_init_options())
            if starts_a_cluster:  # ours to clean up, even if this driver is killed
                start_reaper(node_id=ray.get_runtime_context().get_node_id(),
                             session_dir=context.address_info["session_dir"])
        cluster_gpus = ray.cluster_resources().get("GPU", 0)
        if use_gpu is None:
            use_gpu = cluster_gpus > 0
        elif use_gpu and cluster_gpus == 0:
            raise ValueError(f"use_gpu=True but the Ray cluster has no GPUs ({ray.cluster_resources()}); "
                             f"allowed: use_gpu=False or None (slots are CPUs then)")
        self._check_capacity("GPU" if use_gpu else "CPU")
        bundles = [{"CPU": float(n), "GPU": float(n)} if use_gpu else {"CPU": float(n)}
                   for n in self.devices_per_node]
        strategy = "STRICT_SPREAD" if len(bundles) > 1 else "STRICT_PACK"
        group = placement_group(bundles, strategy=strategy, name=self.name)
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise RuntimeError(
                f"{self._label} could not reserve {self.devices_per_node} "
                f"{'GPUs' if use_gpu else 'CPU slots'} per node ({strategy}) within {timeout_s:g} s; "
                f"cluster has {ray.cluster_resources()}, available {ray.available_resources()}") from None
        self._placement_group = group
        return use_gpu

    @property
    def _label(self) -> str:
        return f"resource pool {self.name!r}" if self._named else "a resource pool"

    def _check_capacity(self, resource: str) -> None:
        """Fail at once, not after the placement timeout, when no set of live nodes could ever hold the pool."""
        capacities = sorted((int(node["Resources"].get(resource, 0)) for node in ray.nodes() if node.get("Alive")),
                            reverse=True)
        wanted = sorted(self.devices_per_node, reverse=True)
        if len(wanted) > len(capacities) or any(need > have for need, have in zip(wanted, capacities)):
            unit = "GPUs" if resource == "GPU" else "CPU slots"
            raise ValueError(
                f"{self._label} asks for {self.devices_per_node} {unit} per node (each entry on its own node), "
                f"but the Ray cluster's {len(capacities)} node(s) have {capacities} {unit} in total; ask for at most "
                f"that many per node (a cluster that autoscales must have its nodes started first)")

    def release(self) -> None:
        """Give the reservation back to Ray (its worker groups must be shut down first)."""
        if self._placement_group is not None:
            remove_placement_group(self._placement_group)
            self._placement_group = None

    def __repr__(self) -> str:
        return f"ResourcePool({self.devices_per_node}, name={self.name!r}, mode={self.mode!r})"
