"""Single controller: resource pools, workers, worker groups, transfer protocols, futures, colocation."""

from hybridflow.controller.errors import WorkerError, WorkerLostError, WorkerTimeoutError
from hybridflow.controller.future import (
    DRIVER_ACTIVITY,
    DriverFetchStats,
    Future,
    driver_fetch_stats,
    lazy_fetch_stats,
    reset_driver_fetch_stats,
)
from hybridflow.controller.liveness import LivenessMonitor
from hybridflow.controller.local import local_mode, local_mode_enabled
from hybridflow.controller.protocols import (
    Dispatch,
    GroupMesh,
    Protocol,
    broadcast,
    get_protocol,
    protocol_names,
    register_protocol,
    split_arguments,
)
from hybridflow.controller.register import register
from hybridflow.controller.resource_pool import ResourcePool, runtime_mode
from hybridflow.controller.worker import Worker
from hybridflow.controller.worker_group import WorkerGroup

__all__ = [
    "DRIVER_ACTIVITY",
    "Dispatch", "DriverFetchStats", "Future", "GroupMesh", "LivenessMonitor", "Protocol", "ResourcePool", "Worker",
    "WorkerError", "WorkerGroup", "WorkerLostError", "WorkerTimeoutError", "broadcast", "driver_fetch_stats",
    "get_protocol", "lazy_fetch_stats",
    "local_mode",
    "local_mode_enabled", "protocol_names", "register", "register_protocol", "reset_driver_fetch_stats",
    "runtime_mode", "split_arguments",
]
