"""Colocation: several roles in one process per slot, each with its own class and its own group view."""

from __future__ import annotations

import os
import sys

import pytest
import ray.cloudpickle
import torch

from hybridflow.controller import ResourcePool, Worker, WorkerGroup, register
from hybridflow.protocol import DataProto

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ActorRole(Worker):
    def __init__(self, init_value: float) -> None:
        self.weights = torch.full((4,), init_value + self.rank)

    @register("ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()

    @register("ONE_TO_ALL")
    def bump(self) -> int:
        self.weights += 1
        return self.weights.data_ptr()


class CriticRole(Worker):
    def __init__(self, *, scale: float) -> None:
        self.scale = scale

    @register("ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()

    @register("ONE_TO_ALL")
    def peek_actor(self) -> tuple[list[float], int]:
        """Read the colocated actor's weights in place: same process, same memory, no copy."""
        weights = self.colocated_role("actor").weights
        return weights.tolist(), weights.data_ptr()

    @register("DP_PROTO")
    def values(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict({"values": batch["x"] * self.scale})


@pytest.fixture(scope="module")
def colocated(ray_session):
    pool = ResourcePool([2], name="colocation")
    views = WorkerGroup.colocate(pool, {"actor": (ActorRole, (10.0,)), "critic": (CriticRole, (), {"scale": 2.0})})
    yield pool, views
    views["actor"].shutdown()
    pool.release()


def test_colocated_roles_share_one_process_per_slot(colocated):
    _, views = colocated
    actor_pids, critic_pids = views["actor"].pid(), views["critic"].pid()
    assert actor_pids == critic_pids == views["actor"].pids
    assert len(set(actor_pids)) == 2
    assert os.getpid() not in actor_pids


def test_a_colocated_role_reads_the_other_roles_tensors_in_place(colocated):
    _, views = colocated
    pointers = views["actor"].bump()
    seen = views["critic"].peek_actor()
    assert [weights for weights, _ in seen] == [[11.0] * 4, [12.0] * 4]
    assert [pointer for _, pointer in seen] == pointers


def test_each_view_exposes_only_its_own_roles_methods(colocated):
    _, views = colocated
    assert hasattr(views["actor"], "bump") and not hasattr(views["actor"], "values")
    assert views["critic"].values(DataProto.from_dict({"x": torch.arange(3.0)}))["values"].tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="not a method registered"):
        views["critic"].call("bump")


def test_a_second_process_per_slot_on_a_full_pool_is_a_value_error_pointing_to_colocate(colocated):
    pool, _ = colocated
    with pytest.raises(ValueError, match="colocate"):
        WorkerGroup(pool, CriticRole, scale=1.0)
