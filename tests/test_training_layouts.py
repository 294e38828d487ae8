"""Training layouts as objects (hybridflow.engine.layouts): the facts each one holds, no processes needed."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.config import EngineConfig
from hybridflow.engine.hybrid_engine import TRANSITION_STRATEGIES, FsdpGatherStrategy
from hybridflow.engine.layouts import TRAINING_LAYOUTS, FsdpLayout, ThreeDLayout, layout_class
from hybridflow.parallel.layout import ParallelLayout


def test_the_registry_resolves_each_engine_layout_name_and_names_the_field_for_an_unknown_one():
    assert layout_class("fsdp") is FsdpLayout and layout_class("3d") is ThreeDLayout
    assert all(cls.name == name for name, cls in TRAINING_LAYOUTS.items())
    with pytest.raises(ValueError, match=r"engine.layout must be one of \('fsdp', '3d'\), got 'megatron'"):
        layout_class("megatron")


def test_fsdp_shards_over_every_rank_scales_the_loss_by_dp_and_keeps_micro_batch_counts_equal():
    layout = FsdpLayout.for_world(EngineConfig(layout="fsdp"), 4)
    assert layout.ranks == ParallelLayout(dp_size=4)
    assert layout.loss_scale == 4.0 and layout.equal_micro_batch_counts
    assert layout.shard_group(dp_group="dp", tp_group="tp") == "dp"
    assert isinstance(layout.transition("hybrid"), FsdpGatherStrategy)
    assert isinstance(layout.transition("full_gather"), FsdpGatherStrategy)


def test_3d_fills_the_world_with_data_parallelism_and_sums_the_norm_over_tensor_parallel_shards():
    layout = ThreeDLayout.for_world(EngineConfig(layout="3d", tp_size=2, pp_size=2), 8)
    assert layout.ranks == ParallelLayout(pp_size=2, tp_size=2, dp_size=2)
    assert layout.loss_scale == 1.0 and not layout.equal_micro_batch_counts
    assert layout.shard_group(dp_group="dp", tp_group="tp") == "tp"
    for name, cls in TRANSITION_STRATEGIES.items():
        assert type(layout.transition(name)) is cls


def test_meta_init_is_refused_only_for_a_tied_embedding_under_fsdp_with_several_ranks():
    assert not FsdpLayout.meta_init_supported(tied_embeddings=True, world_size=2)
    assert FsdpLayout.meta_init_supported(tied_embeddings=True, world_size=1)
    assert FsdpLayout.meta_init_supported(tied_embeddings=False, world_size=2)
    assert ThreeDLayout.meta_init_supported(tied_embeddings=True, world_size=2)


def test_local_shards_of_unsharded_parameters_are_the_parameters_themselves():
    model = torch.nn.Linear(3, 2)
    for layout in (FsdpLayout(ParallelLayout()), ThreeDLayout(ParallelLayout())):
        shards = layout.local_shards(model, torch.device("cpu"))
        assert shards.keys() == {"weight", "bias"}
        assert all(shard.data_ptr() == getattr(model, name).data_ptr() for name, shard in shards.items())


def test_3d_without_data_parallel_replicas_leaves_gradients_alone():
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    ThreeDLayout(ParallelLayout()).reduce_gradients(params, None)
    assert all(p.grad is None for p in params)
