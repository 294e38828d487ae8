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

    def device_counts(self) -> list[int]:
        """Device counts a colocated set may get: divisors of the node size, then whole nodes."""
        within_node = [n for n in range(1, self.node_size + 1) if self.node_size % n == 0]
        whole_nodes = list(range(2 * self.node_size, self.num_devices + 1, self.node_size))
        return within_node + whole_nodes

    def pool_nodes(self, num_devices: int) -> list[int]:
        """Devices per node of a pool of ``num_devices`` (the config's ``placement.pools`` value)."""
        if num_devices <= self.node_size:
            return [num_devices]
        assert num_devices % self.node_size == 0, num_devices
        return [self.node_size] * (num_devices // self.node_size)

    def fits_nodes(self, counts: list[int]) -> bool:
        """Whether pools of these sizes pack into the nodes (sub-node pools first-fit, largest first)."""
        if sum(counts) != self.num_devices:
            return False
        node = self.node_size
        whole = sum(count // node for count in counts if count >= node)
        if any(count >= node and count % node for count in counts):
            return False
        free_nodes = self.num_devices // node - whole
        partial: list[int] = []  # free devices of the nodes sub-node pools have started
        for count in sorted((count for count in counts if count < node), reverse=True):
            slot = next((i for i, space in enumerate(partial) if space >= count), None)
            if slot is not None:
                partial[slot] -= count
            elif free_nodes > 0:
                free_nodes -= 1
                partial.append(node - count)
            else:
                return False
        return True
