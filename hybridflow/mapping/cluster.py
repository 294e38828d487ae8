"""Cluster: how many devices of which hardware profile, in nodes of how many."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.mapping.hardware import HardwareProfile


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """N devices of one type, ``devices_per_node`` to a node (fast links inside a node)."""

    num_devices: int
    """Devices (GPUs, or CPU processes) the iteration may use."""
    devices_per_node: int
    """Devices per node; tensor-parallel groups stay inside a node."""
    hardware: HardwareProfile
    """Device and link numbers."""

    def __post_init__(self) -> None:
        for name in ("num_devices", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Cluster.{name} must be a positive integer, got {value!r}")
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            raise ValueError(f"Cluster.num_devices {self.num_devices} must be a multiple of devices_per_node "
                             f"{self.devices_per_node} (whole nodes) or at most one node")

    @property
    def node_size(self) -> int:
        """Devices per node actually used (a cluster smaller than one node is one partial node)."""
        return min(self.devices_per_node, self.num_devices)

    def compute_share(self, busy_devices: int) -> float:
        """Share of one device's FLOP/s and memory bandwidth each process gets while ``busy_devices``
        processes compute at once (CPU profiles: they divide the node's cores; 1 for devices that do
        not share, and for processes that wait while others work)."""
        units = self.hardware.compute_units_per_node
        busy_per_node = min(self.node_size, max(1, busy_devices))
        return 1.0 if units == 0 else min(1.0, units / busy_per_node)

    def device_counts(self, granularity: str = "node") -> list[int]:
        """Device counts a colocated set may get: divisors of the node size, then (``granularity``, see
        GRANULARITIES) whole nodes, or whole nodes plus a divisor of a node."""
        check_granularity(granularity)
        node = self.node_size
        within_node = [n for n in range(1, node + 1) if node % n == 0]
        if granularity == "node":
            return within_node + list(range(2 * node, self.num_devices + 1, node))
        return within_node + [n for n in range(node + 1, self.num_devices + 1) if n % node in within_node + [0]]

    def pool_nodes(self, num_devices: int) -> list[int]:
        """Devices per node of a pool of ``num_devices`` (the config's ``placement.pools`` value): whole nodes
        first, then the part of a node left over; ranks are numbered in that order, so the simulator's links
        (rank // node size) hold for it."""
        if num_devices <= self.node_size:
            return [num_devices]
        whole, rest = divmod(num_devices, self.node_size)
        return [self.node_size] * whole + ([rest] if rest else [])

    def fits_nodes(self, counts: list[int]) -> bool:
        """Whether pools of these sizes pack into the nodes: each pool's whole nodes to itself, then the parts of
        a node (sub-node pools and what larger pools take beyond their whole nodes) first-fit, largest first, so
        a larger pool's partial node is shared with other pools' parts (never with its own whole nodes)."""
        if sum(counts) != self.num_devices:
            return False
        node = self.node_size
        free_nodes = self.num_devices // node - sum(count // node for count in counts)
        partial: list[int] = []  # free devices of the nodes the parts have started
        for count in sorted((count % node for count in counts if count % node), reverse=True):
            slot = next((i for i, space in enumerate(partial) if space >= count), None)
            if slot is not None:
                partial[slot] -= count
            elif free_nodes > 0:
                free_nodes -= 1
                partial.append(node - count)
            else:
                return False
        return True


GRANULARITIES = {
    "node": "below a node a divisor of the node size, above whole nodes (every allocation of the paper's findings)",
    "divisor": "also whole nodes plus a divisor of a node (12, 20, 24 GPUs ... with 8 per node); the partial node "
               "is shared with other pools' parts",
}
"""Allocation granularities of the search (``plan(..., granularity=...)``, ``hybridflow plan --granularity``)."""


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity (hybridflow plan --granularity) must be one of {', '.join(GRANULARITIES)}, "
                         f"got {granularity!r}")
