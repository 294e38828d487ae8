"""Rank arithmetic of training and generation layouts (hybridflow.parallel.layout), no processes needed."""

from __future__ import annotations

import pytest

from hybridflow.parallel.layout import GenerationLayout, ParallelLayout, stage_layer_range


def paper_example(grouping: str) -> GenerationLayout:
    # paper section 5.3 / Figure 8: 8 GPUs, training 1-4-2 (p-t-d), generation 1-2-2-2 (pg-tg-dg-d)
    return GenerationLayout(train=ParallelLayout(pp_size=1, tp_size=4, dp_size=2), pp_size=1, tp_size=2,
                            grouping=grouping)


def test_paper_example_hybrid_grouping_gives_strided_generation_tp_and_consecutive_micro_dp_groups():
    layout = paper_example("hybrid")
    assert layout.tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.micro_dp_size == 2 and layout.num_replicas == 4


def test_paper_example_vanilla_grouping_gives_consecutive_generation_tp_and_strided_micro_dp_groups():
    layout = paper_example("vanilla")
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.micro_dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_hybrid_generation_shard_of_every_rank_contains_its_training_shard():
    # training tp shard i is chunk i of t; generation shard g is chunk g of tg = chunks g*t/tg .. of t
    for t, tg in [(4, 2), (4, 1), (2, 1), (8, 2)]:
        layout = GenerationLayout(train=ParallelLayout(tp_size=t, dp_size=2), tp_size=tg)
        ratio = t // tg
        for rank in range(layout.train.world_size):
            tp_rank = layout.train.coords(rank).tp_rank
            assert tp_rank // ratio == layout.coords(rank).gen_tp_rank


def test_replicas_partition_the_ranks_and_list_stage_major_members():
    layout = GenerationLayout(train=ParallelLayout(pp_size=2, tp_size=2, dp_size=2), pp_size=2, tp_size=1)
    replicas = [layout.replica_ranks(r) for r in range(layout.num_replicas)]
    assert sorted(rank for ranks in replicas for rank in ranks) == list(range(8))
    # generation pipelines take training stages at stride p/pg = 1 and micro-dp over the tp ranks
    assert replicas == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.pp_groups() == replicas
    assert layout.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_generation_stage_covers_consecutive_training_stages_under_hybrid_grouping():
    layout = GenerationLayout(train=ParallelLayout(pp_size=4, tp_size=1), pp_size=2)
    assert layout.stage_layers(8, 0) == range(0, 4)
    assert layout.stage_layers(8, 1) == range(4, 8)
    assert layout.pp_groups() == [[0, 2], [1, 3]]
    vanilla = GenerationLayout(train=ParallelLayout(pp_size=4, tp_size=1), pp_size=2, grouping="vanilla")
    with pytest.raises(ValueError, match="non-contiguous"):
        vanilla.stage_layers(8, 0)


def test_stage_layer_range_splits_layers_into_near_equal_consecutive_chunks():
    assert [stage_layer_range(10, 3, s) for s in range(3)] == [range(0, 4), range(4, 7), range(7, 10)]
    assert [stage_layer_range(4, 2, s) for s in range(2)] == [range(0, 2), range(2, 4)]
    assert stage_layer_range(5, 1, 0) == range(0, 5)


def test_rank_order_is_tp_fastest_then_pp_then_dp():
    layout = ParallelLayout(pp_size=2, tp_size=2, dp_size=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert all(layout.rank_of(**vars(layout.coords(r))) == r for r in range(8))


@pytest.mark.parametrize("build, message", [
    (lambda: ParallelLayout.for_world(6, tp_size=4), "divisible"),
    (lambda: ParallelLayout(tp_size=0), "tp_size"),
    (lambda: GenerationLayout(train=ParallelLayout(tp_size=4), tp_size=3), "divide"),
    (lambda: GenerationLayout(train=ParallelLayout(pp_size=2), pp_size=4), "divide"),
    (lambda: GenerationLayout(train=ParallelLayout(), grouping="zigzag"), "grouping"),
    (lambda: stage_layer_range(2, 3, 0), "larger"),
    (lambda: stage_layer_range(4, 2, 2), "pp_rank"),
    (lambda: ParallelLayout(dp_size=2).coords(2), "outside"),
])
def test_bad_layouts_are_rejected_with_a_value_error_that_names_the_problem(build, message):
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("rows,dp_size", [(8, 2), (5, 4), (6, 4), (7, 3), (1, 4), (64, 3)])
def test_fsdp_dp_shard_rows_are_torch_chunks_rows_and_empty_once_the_rows_run_out(rows, dp_size):
    import torch

    from hybridflow.parallel.fsdp import dp_shard_rows

    chunks = torch.arange(rows).chunk(dp_size)
    for dp_rank in range(dp_size):
        expected = chunks[dp_rank].tolist() if dp_rank < len(chunks) else []
        assert list(dp_shard_rows(rows, dp_size, dp_rank)) == expected


@pytest.mark.parametrize("grouping", ["hybrid", "vanilla"])
@pytest.mark.parametrize("p,t,d", [(1, 1, 4), (1, 4, 2), (2, 2, 2), (4, 1, 1)])
def test_one_rank_per_generation_replica_makes_every_rank_its_own_replica_holding_every_layer(grouping, p, t, d):
    layout = GenerationLayout(train=ParallelLayout(pp_size=p, tp_size=t, dp_size=d), grouping=grouping)
    assert layout.ranks_per_replica == 1 and layout.num_replicas == p * t * d
    assert [layout.coords(rank).replica for rank in range(p * t * d)] == list(range(p * t * d))
    assert layout.stage_layers(4, 0) == range(4)
