"""Bucketed transitions (actor.hybrid_engine.bucket_mb): the same generation weights and bytes as one collective
per parameter, in far fewer collectives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hybridflow.engine.hybrid_engine import HybridEngine, HybridEngineConfig, cut_training_shards, plan_buckets
from hybridflow.parallel.launch import run_distributed
from hybridflow.parallel.layout import ParallelLayout
from test_hybrid_engine import CASES, WORLD, portable, tensors, tiny_hf_config, tiny_model

PER_PARAMETER, SMALL, UNBOUNDED = 0.0, 0.05, 256.0
"""bucket_mb values: one collective per parameter; ~51 KiB (several buckets per group: the tiny model's
tensors are 8-64 KiB); everything of a group and source in one bucket."""
BUCKETS = (PER_PARAMETER, SMALL, UNBOUNDED)
LAYOUTS = CASES + [("llama", 2, 2, 1, 2, "vanilla")]
"""Every case of the transition tests, plus vanilla cutting a tg = 2 shard out of a pipeline-gathered model (its
received replicated tensors must not keep whole buckets alive)."""


class CollectiveLog:
    """Wraps dist.all_gather and dist.broadcast of this process: records (op, group ranks, source, numel)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._originals = (dist.all_gather, dist.broadcast)

    def __enter__(self) -> "CollectiveLog":
        all_gather, broadcast = self._originals

        def logged_all_gather(tensor_list, tensor, group=None, async_op=False):
            self.calls.append(("all_gather", tuple(dist.get_process_group_ranks(group)), None, tensor.numel()))
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)

        def logged_broadcast(tensor, src, group=None, async_op=False):
            self.calls.append(("broadcast", tuple(dist.get_process_group_ranks(group)), src, tensor.numel()))
            return broadcast(tensor, src=src, group=group, async_op=async_op)

        dist.all_gather, dist.broadcast = logged_all_gather, logged_broadcast
        return self

    def __exit__(self, *exc) -> None:
        dist.all_gather, dist.broadcast = self._originals


def _transitions_per_bucket_size(rank: int, world_size: int) -> list[dict]:
    results = []
    for family, p, t, pg, tg, strategy in LAYOUTS:
        config = tiny_hf_config(family)
        state_dict = tiny_model(family).state_dict()
        layout = ParallelLayout.for_world(world_size, pp_size=p, tp_size=t)
        by_bucket = {}
        for bucket_mb in BUCKETS:
            shards = cut_training_shards(state_dict, config, layout, rank)
            engine = HybridEngine(config, layout, HybridEngineConfig(pp_size=pg, tp_size=tg, strategy=strategy,
                                                                     bucket_mb=bucket_mb))
            with CollectiveLog() as log:
                going = engine.to_generation(shards)
            weights = {name: [piece.clone() for piece in pieces]
                       for name, pieces in engine.shard.weights.items()}
            by_bucket[bucket_mb] = dict(weights=weights, calls=log.calls, stats=going,
                                        element_size=next(iter(shards.values())).element_size())
            engine.to_training()
        results.append(by_bucket)
    return portable(results)


@pytest.fixture(scope="module")
def bucket_results():
    return tensors(run_distributed(_transitions_per_bucket_size, WORLD, timeout_s=240))


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["-".join(map(str, c)) for c in LAYOUTS])
def test_bucketed_transitions_give_bitwise_the_generation_weights_and_bytes_of_per_parameter_ones(bucket_results,
                                                                                                    index):
    for rank, rank_results in enumerate(bucket_results):
        reference = rank_results[index][PER_PARAMETER]
        for bucket_mb in (SMALL, UNBOUNDED):
            result = rank_results[index][bucket_mb]
            assert result["weights"].keys() == reference["weights"].keys()
            for name, pieces in reference["weights"].items():
                assert len(result["weights"][name]) == len(pieces), (rank, bucket_mb, name)
                for got, want in zip(result["weights"][name], pieces):
                    assert got.dtype == want.dtype and torch.equal(got, want), (rank, bucket_mb, name)
            for field in ("bytes_received", "bytes_sent", "param_bytes", "peak_param_bytes"):
                assert getattr(result["stats"], field) == getattr(reference["stats"], field), (rank, bucket_mb, field)


def _expected_bucket_count(per_parameter_calls: list[tuple], element_size: int, bucket_mb: float) -> int:
    """Collectives after bucketing: per (op, group, source), the buckets that the per-parameter payloads fill."""
    sizes: dict[tuple, list[int]] = {}
    for op, group, src, numel in per_parameter_calls:
        sizes.setdefault((op, group, src), []).append(numel * element_size)
    return sum(len(plan_buckets(s, int(bucket_mb * 2**20))) for s in sizes.values())


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=["-".join(map(str, c)) for c in LAYOUTS])
def test_bucketing_issues_one_collective_per_bucket_per_group_and_source(bucket_results, index):
    for rank, rank_results in enumerate(bucket_results):
        per_parameter = rank_results[index][PER_PARAMETER]
        unbounded, small = rank_results[index][UNBOUNDED], rank_results[index][SMALL]
        keys = {(op, group, src) for op, group, src, _ in per_parameter["calls"]}
        # unbounded buckets: exactly one collective per group and source
        assert len(unbounded["calls"]) == len(keys), (rank, unbounded["calls"])
        assert {(op, group, src) for op, group, src, _ in unbounded["calls"]} == keys
        # same payload in total, in as many collectives as the small buckets need
        for result in (unbounded, small):
            assert sum(c[3] for c in result["calls"]) == sum(c[3] for c in per_parameter["calls"])
            assert result["stats"].collectives == len(result["calls"])
        assert len(small["calls"]) == _expected_bucket_count(per_parameter["calls"], per_parameter["element_size"],
                                                             SMALL)
        assert per_parameter["stats"].collectives == len(per_parameter["calls"])


def test_per_parameter_transitions_of_a_tensor_parallel_layout_use_many_more_collectives_than_buckets(bucket_results):
    index = LAYOUTS.index(("llama", 1, 4, 1, 2, "hybrid"))  # 4 decoder layers x 7 tp-sharded matrices + head
    for rank_results in bucket_results:
        per_parameter = rank_results[index][PER_PARAMETER]["stats"].collectives
        unbounded = rank_results[index][UNBOUNDED]["stats"].collectives
        assert per_parameter == 4 * 7 + 2 and unbounded == 1


def test_buckets_are_consecutive_and_hold_at_most_the_bucket_size_unless_one_item_is_larger():
    assert plan_buckets([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert plan_buckets([4, 10, 3, 3, 3], 8) == [range(0, 1), range(1, 2), range(2, 4), range(4, 5)]
    assert plan_buckets([4, 4, 4], 0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert plan_buckets([4, 4, 4], 1 << 30) == [range(0, 3)]
    assert plan_buckets([], 8) == []


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "256", True])
def test_an_invalid_bucket_size_is_rejected_with_the_field_named(value):
    with pytest.raises(ValueError, match="bucket_mb"):
        HybridEngineConfig(bucket_mb=value)
