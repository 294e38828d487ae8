"""Transfer protocols: distribute/collect arithmetic on meshes, then on real 4- and 8-rank Ray worker groups."""

from __future__ import annotations

import sys

import pytest
import ray.cloudpickle
import torch
import torch.distributed as dist

from hybridflow.controller import (
    Dispatch,
    GroupMesh,
    ResourcePool,
    Worker,
    WorkerGroup,
    get_protocol,
    register,
    register_protocol,
)
from hybridflow.device import distributed_backend
from hybridflow.parallel.layout import GenerationLayout, ParallelLayout
from hybridflow.protocol import DataProto


# worker classes defined in a test module travel to the Ray workers by value (the module is not importable there)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def rows(count: int) -> DataProto:
    return DataProto.from_dict({"x": torch.arange(count, dtype=torch.float32)})


def mesh(pp: int, tp: int, dp: int, *, gen_pp: int | None = None, gen_tp: int | None = None) -> GroupMesh:
    layout = ParallelLayout(pp_size=pp, tp_size=tp, dp_size=dp)
    generation = None
    if gen_pp is not None:
        generation = GenerationLayout(train=layout, pp_size=gen_pp, tp_size=gen_tp)
    return GroupMesh(layout=layout, generation=generation)


def received_x(dispatch: Dispatch) -> list[list[float] | None]:
    return [None if call is None else call[0][0]["x"].tolist() for call in dispatch.calls]


# ---------------------------------------------------------------- protocol arithmetic (no processes)

def test_dp_proto_pads_ten_rows_to_twelve_and_gives_each_rank_three_consecutive_rows():
    dispatch = get_protocol("DP_PROTO").distribute(mesh(1, 1, 4), (rows(10),), {})
    assert dispatch.pad == 2
    assert received_x(dispatch) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]


def test_3d_proto_gives_every_rank_of_a_dp_group_the_same_chunk_on_a_2_2_2_layout():
    m = mesh(2, 2, 2)
    dispatch = get_protocol("3D_PROTO").distribute(m, (rows(6),), {})
    got = received_x(dispatch)
    for rank in range(8):
        assert got[rank] == ([0, 1, 2] if m.layout.coords(rank).dp_rank == 0 else [3, 4, 5])
    # collected from tp rank 0 of the last stage of each DP group: ranks 2 and 6
    assert get_protocol("3D_PROTO").source_ranks(m) == [2, 6]


def test_3d_proto_collect_concatenates_the_last_stage_outputs_and_drops_the_padding():
    m = mesh(2, 2, 2)
    outputs = [None] * 8
    outputs[2], outputs[6] = rows(3), DataProto.from_dict({"x": torch.tensor([3.0, 4.0, 0.0])})
    collected = get_protocol("3D_PROTO").collect(m, outputs, 1)
    assert collected["x"].tolist() == [0, 1, 2, 3, 4]


def test_3d_all_micro_dp_splits_by_generation_replica_and_collects_each_replicas_first_rank():
    m = mesh(2, 2, 2, gen_pp=1, gen_tp=2)  # dg = 2 replicas per training replica, 4 in all
    protocol = get_protocol("3D_ALL_MICRO_DP")
    dispatch = protocol.distribute(m, (rows(8),), {})
    got = received_x(dispatch)
    for rank in range(8):
        replica = m.generation.coords(rank).replica
        assert got[rank] == [2 * replica, 2 * replica + 1]
    heads = protocol.source_ranks(m)
    assert heads == [m.generation.replica_ranks(r)[0] for r in range(4)]
    assert all(m.generation.coords(h).gen_tp_rank == 0 and m.generation.coords(h).gen_pp_rank == 0 for h in heads)


def test_3d_all_micro_dp_without_a_generation_layout_is_a_value_error():
    with pytest.raises(ValueError, match="generation layout"):
        get_protocol("3D_ALL_MICRO_DP").distribute(mesh(1, 2, 2), (rows(4),), {})


def test_3d_pp_only_sends_everything_everywhere_and_collects_one_output_per_stage():
    m = mesh(2, 2, 2)
    protocol = get_protocol("3D_PP_ONLY")
    assert received_x(protocol.distribute(m, (rows(3),), {})) == [[0, 1, 2]] * 8
    assert protocol.collect(m, list(range(8)), 0) == [0, 2]


def test_rank_zero_calls_only_rank_zero():
    dispatch = get_protocol("RANK_ZERO").distribute(mesh(1, 1, 4), (rows(3),), {})
    assert received_x(dispatch) == [[0, 1, 2], None, None, None]


def test_all_to_all_needs_one_argument_per_rank():
    protocol = get_protocol("ALL_TO_ALL")
    assert [c[0] for c in protocol.distribute(mesh(1, 1, 4), ([10, 11, 12, 13],), {}).calls] == [
        (10,), (11,), (12,), (13,)]
    with pytest.raises(ValueError, match="one entry per rank"):
        protocol.distribute(mesh(1, 1, 4), ([10, 11],), {})


def test_dp_proto_on_a_tensor_parallel_layout_is_a_value_error_pointing_to_3d_proto():
    with pytest.raises(ValueError, match="3D_PROTO"):
        get_protocol("DP_PROTO").distribute(mesh(1, 2, 2), (rows(4),), {})


def test_split_arguments_of_different_lengths_is_a_value_error_naming_the_argument():
    with pytest.raises(ValueError, match="'other'"):
        get_protocol("DP_PROTO").distribute(mesh(1, 1, 2), (rows(4),), {"other": rows(5)})


def test_registering_a_protocol_name_twice_is_a_value_error():
    with pytest.raises(ValueError, match="already registered"):
        register_protocol("DP_PROTO", lambda *a: None, lambda *a: None)


def test_register_with_an_unknown_protocol_is_a_value_error_listing_the_known_ones():
    with pytest.raises(ValueError, match="DP_PROTO"):
        register("NO_SUCH_PROTOCOL")


# ---------------------------------------------------------------- on real worker groups

def _even_ranks_distribute(mesh: GroupMesh, args: tuple, kwargs: dict) -> Dispatch:
    return Dispatch(calls=[(args, kwargs) if rank % 2 == 0 else None for rank in range(mesh.world_size)])


def _sum_collect(mesh: GroupMesh, outputs: list, pad: int) -> int:
    return sum(output for output in outputs if output is not None)


register_protocol("TEST_EVEN_RANKS_SUM", _even_ranks_distribute, _sum_collect, uses_mesh=False)


class ProbeWorker(Worker):
    """Records what each rank received and tags rows with the rank that produced them."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.calls = 0

    def _tag(self, batch: DataProto) -> DataProto:
        self.calls += 1
        return DataProto.from_dict({"x": batch["x"].clone(),
                                    "rank": torch.full((len(batch),), self.rank + self.offset)})

    @register("ONE_TO_ALL", declares_layout=True)
    def declare(self, pp: int, tp: int, gen_pp: int | None = None, gen_tp: int | None = None) -> None:
        layout = ParallelLayout.for_world(self.world_size, pp_size=pp, tp_size=tp)
        generation = None if gen_pp is None else GenerationLayout(train=layout, pp_size=gen_pp, tp_size=gen_tp)
        self.set_parallel_layout(layout, generation)

    @register("ONE_TO_ALL")
    def whoami(self, token: str) -> tuple:
        return self.rank, self.world_size, token, self.calls

    @register("ONE_TO_ALL")
    def sum_of_ranks(self) -> tuple[str, int]:
        """All-reduce over the group's torch.distributed world: every rank must have joined it."""
        total = torch.tensor([self.rank], device=self.device)
        dist.all_reduce(total)
        return dist.get_backend(), int(total.item())

    @register("ONE_TO_ALL")
    def where_in_mesh(self) -> tuple:
        coords, layout = self.coords, self.generation_layout
        if layout is None:
            return (coords.dp_rank, coords.pp_rank, coords.tp_rank), None, None
        generation = layout.coords(self.rank)
        micro_dp_group = next(group for group in layout.micro_dp_groups() if self.rank in group)
        return ((coords.dp_rank, coords.pp_rank, coords.tp_rank), (generation.replica, generation.micro_dp_rank),
                micro_dp_group)

    @register("ALL_TO_ALL")
    def echo(self, value: int) -> int:
        return value * 100 + self.rank

    @register("DP_PROTO")
    def dp(self, batch: DataProto) -> DataProto:
        return self._tag(batch)

    @register("3D_PROTO")
    def three_d(self, batch: DataProto) -> DataProto:
        return self._tag(batch)

    @register("3D_PROTO")
    def two_per_row(self, batch: DataProto) -> DataProto:
        return self._tag(batch.repeat(2, interleave=True))

    @register("3D_ALL_MICRO_DP")
    def micro_dp(self, batch: DataProto) -> DataProto:
        return self._tag(batch)

    @register("3D_PP_ONLY")
    def stage(self, batch: DataProto) -> tuple:
        return self.coords.pp_rank, len(batch)

    @register("RANK_ZERO")
    def export(self, tag: str) -> str:
        self.calls += 1
        return f"{tag}@{self.rank}"

    @register("DP_METRICS")
    def update(self, batch: DataProto) -> dict:
        return {"dp_rank": self.coords.dp_rank, "rows": len(batch), "sum": float(batch["x"].sum())}

    @register("TEST_EVEN_RANKS_SUM")
    def rank_plus(self, value: int) -> int:
        return self.rank + value


def probe_group(world_size: int, offset: int):
    """A ProbeWorker group on its own pool, shut down when the module's tests are done."""
    pool = ResourcePool([world_size], name=f"protocols{world_size}")
    group = WorkerGroup(pool, ProbeWorker, offset, name=f"probe{world_size}", timeout_s=120)
    yield group
    group.shutdown()
    pool.release()


@pytest.fixture(scope="module")
def group4(ray_session):
    yield from probe_group(4, 0)


@pytest.fixture(scope="module")
def group8(ray_session):
    yield from probe_group(8, 1000)


def test_one_to_all_and_all_to_all_reach_every_rank_of_a_4_rank_group(group4):
    assert [out[:3] for out in group4.whoami("t")] == [(r, 4, "t") for r in range(4)]
    assert group4.echo([1, 2, 3, 4]) == [100, 201, 302, 403]


def test_every_rank_of_a_group_joins_one_torch_distributed_world_of_the_groups_size(group4, group8):
    backend = distributed_backend()  # gloo here (CPU), nccl on a GPU machine
    assert group4.sum_of_ranks() == [(backend, 0 + 1 + 2 + 3)] * 4
    assert group8.sum_of_ranks() == [(backend, sum(range(8)))] * 8


def test_dp_proto_on_layout_1_1_4_round_trips_seven_rows_exactly(group4):
    group4.declare(1, 1)
    out = group4.dp(rows(7))
    assert out["x"].tolist() == list(range(7))
    assert out["rank"].tolist() == [0, 0, 1, 1, 2, 2, 3]


def test_3d_proto_on_layout_1_2_2_collects_from_tp_rank_zero_of_each_dp_group(group4):
    group4.declare(1, 2)
    assert group4.mesh.layout == ParallelLayout(pp_size=1, tp_size=2, dp_size=2)
    out = group4.three_d(rows(5))
    assert out["x"].tolist() == list(range(5))
    assert out["rank"].tolist() == [0, 0, 0, 2, 2]


def test_3d_proto_drops_k_times_the_padding_when_a_method_returns_k_rows_per_input_row(group4):
    group4.declare(1, 2)
    out = group4.two_per_row(rows(3))
    assert out["x"].tolist() == [0, 0, 1, 1, 2, 2]


def test_rank_zero_runs_only_on_rank_zero(group4):
    before = [out[3] for out in group4.whoami("before")]
    assert group4.export("ckpt") == "ckpt@0"
    after = [out[3] for out in group4.whoami("after")]
    assert [a - b for a, b in zip(after, before)] == [1, 0, 0, 0]


def test_a_user_registered_protocol_runs_on_the_ranks_it_chose(group4):
    assert group4.rank_plus(10) == (0 + 10) + (2 + 10)


def test_3d_proto_on_layout_2_2_2_collects_from_the_last_stage(group8):
    group8.declare(2, 2)
    out = group8.three_d(rows(6))
    assert out["x"].tolist() == list(range(6))
    assert out["rank"].tolist() == [1002] * 3 + [1006] * 3


def test_3d_all_micro_dp_on_layout_2_2_2_with_generation_1_2_collects_one_output_per_replica(group8):
    group8.declare(2, 2, gen_pp=1, gen_tp=2)
    generation = group8.mesh.generation
    heads = [generation.replica_ranks(replica)[0] for replica in range(4)]
    out = group8.micro_dp(rows(7))
    assert out["x"].tolist() == list(range(7))
    assert out["rank"].tolist() == [1000 + heads[0]] * 2 + [1000 + heads[1]] * 2 + [1000 + heads[2]] * 2 + [
        1000 + heads[3]]


def test_workers_see_their_2_2_2_mesh_coordinates_and_micro_dp_groups(group8):
    group8.declare(2, 2)
    plain = group8.where_in_mesh()
    # rank = (dp * pp_size + pp) * tp_size + tp
    assert [coords for coords, _, _ in plain] == [(r // 4, r // 2 % 2, r % 2) for r in range(8)]
    assert [(generation, group) for _, generation, group in plain] == [(None, None)] * 8
    group8.declare(2, 2, gen_pp=1, gen_tp=2)
    hybrid = group8.where_in_mesh()
    # generation (pg, tg) = (1, 2): each training TP pair is a replica; the two stages of one training
    # replica hold the same generation shard, so the micro-DP groups pair rank r with rank r + 2
    assert [generation for _, generation, _ in hybrid] == [(0, 0), (0, 0), (1, 1), (1, 1),
                                                           (2, 0), (2, 0), (3, 1), (3, 1)]
    assert [group for _, _, group in hybrid] == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]


def test_3d_pp_only_on_layout_2_2_2_returns_one_output_per_pipeline_stage(group8):
    group8.declare(2, 2)
    assert group8.stage(rows(5)) == [(0, 5), (1, 5)]


def test_dp_metrics_returns_one_metrics_dict_per_dp_rank(group8):
    group8.declare(2, 2)
    metrics = group8.update(rows(4))
    assert metrics == [{"dp_rank": 0, "rows": 2, "sum": 1.0}, {"dp_rank": 1, "rows": 2, "sum": 5.0}]


def test_dp_proto_on_8_ranks_with_three_rows_pads_and_unpads_exactly(group8):
    group8.declare(1, 1)
    out = group8.dp(rows(3))
    assert out["x"].tolist() == [0, 1, 2]
    assert out["rank"].tolist() == [1000, 1001, 1002]
