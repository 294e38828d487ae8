"""Ray started on demand by a pool, then a simulated two-node cluster that ResourcePool([2, 2]) joins, and a
pool of a whole node plus part of the other, [2, 1] (the pools `hybridflow plan --granularity divisor` writes).

The scenario runs in a subprocess (this file run as a script) so that its cluster never meets the
test session's own Ray instance: a process can only be connected to one Ray at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RESULT_PREFIX = "MULTINODE_RESULT "


@pytest.mark.slow
def test_a_pool_starts_ray_on_demand_and_a_two_node_pool_joins_a_cluster_with_two_ranks_per_node():
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1")
    completed = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=400, env=env)
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert completed.returncode == 0 and lines, completed.stdout[-3000:] + completed.stderr[-5000:]
    result = json.loads(lines[-1][len(RESULT_PREFIX):])
    nodes = result["node_ids"]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2]
    assert result["local_ranks"] == [0, 1, 0, 1]
    assert result["dp_x"] == list(range(7)) and result["dp_rank"] == [0, 0, 1, 1, 2, 2, 3]
    assert result["three_d_x"] == list(range(5)) and result["three_d_rank"] == [0, 0, 0, 2, 2]
    assert result["all_reduce"] == [4.0] * 4
    # before the cluster, with no Ray anywhere: the pool started a local Ray with a CPU slot per process
    assert result["on_demand_cpus"] == max(os.cpu_count() or 1, 32)
    assert result["on_demand_all_reduce"] == [2.0, 2.0]
    # a whole node then one rank of the other: ranks 0-1 share a node, rank 2 is alone on the other
    part_nodes = result["part_node_ids"]
    assert part_nodes[0] == part_nodes[1] != part_nodes[2] and result["part_local_ranks"] == [0, 1, 0]
    assert result["part_all_reduce"] == [3.0] * 3 and result["part_dp_x"] == list(range(5))


def _scenario() -> dict:
    import ray
    import torch
    import torch.distributed as dist
    from ray.cluster_utils import Cluster

    from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
    from hybridflow.parallel.layout import ParallelLayout
    from hybridflow.protocol import DataProto

    class NodeProbe(Worker):
        @register("ONE_TO_ALL")
        def where(self) -> tuple[str, int]:
            return self.node_id, self.local_rank

        @register("ONE_TO_ALL")
        def all_reduce(self) -> float:
            ones = torch.ones(1)
            dist.all_reduce(ones)
            return ones.item()

        @register("ONE_TO_ALL", declares_layout=True)
        def declare(self, tp: int) -> None:
            self.set_parallel_layout(ParallelLayout.for_world(self.world_size, tp_size=tp))

        @register("DP_PROTO")
        def dp(self, batch: DataProto) -> DataProto:
            return DataProto.from_dict({"x": batch["x"], "rank": torch.full((len(batch),), self.rank)})

        @register("3D_PROTO")
        def three_d(self, batch: DataProto) -> DataProto:
            return self.dp(batch)

    assert not ray.is_initialized()
    pool = ResourcePool([2], name="on-demand")
    group = WorkerGroup(pool, NodeProbe, timeout_s=180)
    on_demand = {"on_demand_cpus": ray.cluster_resources()["CPU"], "on_demand_all_reduce": group.all_reduce()}
    group.shutdown()
    pool.release()
    ray.shutdown()

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 100 * 2**20})
    cluster.add_node(num_cpus=2, object_store_memory=100 * 2**20)
    cluster.wait_for_nodes()
    # the driver does not call ray.init: the pool joins the running cluster as `hybridflow train` would
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        pool = ResourcePool([2, 2], name="two-nodes")
        assert ray.is_initialized() and len(ray.nodes()) == 2
        group = WorkerGroup(pool, NodeProbe, timeout_s=180)
        where = group.where()
        dp = group.dp(DataProto.from_dict({"x": torch.arange(7.0)}))
        group.declare(2)
        three_d = group.three_d(DataProto.from_dict({"x": torch.arange(5.0)}))
        result = {"node_ids": [node for node, _ in where], "local_ranks": [local for _, local in where],
                  "dp_x": dp["x"].tolist(), "dp_rank": dp["rank"].tolist(),
                  "three_d_x": three_d["x"].tolist(), "three_d_rank": three_d["rank"].tolist(),
                  "all_reduce": group.all_reduce(), **on_demand}
        group.shutdown()
        pool.release()
        part = ResourcePool([2, 1], name="node-and-part")
        group = WorkerGroup(part, NodeProbe, timeout_s=180)
        part_where = group.where()
        result.update(part_node_ids=[node for node, _ in part_where], part_local_ranks=[local for _, local in part_where],
                      part_all_reduce=group.all_reduce(),
                      part_dp_x=group.dp(DataProto.from_dict({"x": torch.arange(5.0)}))["x"].tolist())
        group.shutdown()
        part.release()
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_scenario()), flush=True)
