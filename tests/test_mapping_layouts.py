"""The planner's training layouts (hybridflow.mapping.layouts): names equal to the engine's, the facts each holds."""

from __future__ import annotations

import pytest

from hybridflow.mapping import Cluster, RoleStrategy, Workload, load_hardware, model_spec
from hybridflow.mapping.layouts import TRAINING_LAYOUTS, FsdpModel, ThreeDModel, training_layout
from hybridflow.mapping.simulator import Simulator


def test_the_planner_knows_exactly_the_layouts_the_engine_trains_with():
    from hybridflow.engine.config import LAYOUT_TRAITS
    from hybridflow.engine.layouts import TRAINING_LAYOUTS as ENGINE_LAYOUTS

    assert tuple(TRAINING_LAYOUTS) == tuple(ENGINE_LAYOUTS)
    for name, model in TRAINING_LAYOUTS.items():
        assert model.name == name
        # the planner refuses p, t > 1 exactly where the engine's config does
        assert model.data_parallel_only == LAYOUT_TRAITS[name].data_parallel_only


def test_a_strategy_resolves_its_layout_name_through_the_registry_and_refuses_an_unknown_one():
    assert isinstance(RoleStrategy(layout="fsdp").layout_model, FsdpModel)
    assert isinstance(RoleStrategy(layout="3d", tp_size=2).layout_model, ThreeDModel)
    assert training_layout("3d") is TRAINING_LAYOUTS["3d"]
    with pytest.raises(ValueError, match=r"RoleStrategy.layout must be one of \('fsdp', '3d'\), got 'megatron'"):
        RoleStrategy(layout="megatron")
    with pytest.raises(ValueError, match=r"layout 'fsdp' needs pp_size = tp_size = 1, got pp_size=1, tp_size=2"):
        RoleStrategy(layout="fsdp", tp_size=2)


def test_describe_names_the_layout_and_its_model_parallel_sizes():
    assert RoleStrategy(layout="fsdp").describe() == "fsdp"
    assert RoleStrategy(layout="3d", pp_size=2, tp_size=4).describe() == "3d p2 t4"
    assert RoleStrategy(layout="3d", pp_size=2, tp_size=4, generation_pp_size=1,
                        generation_tp_size=2).describe() == "3d p2 t4 gen p1 t2"


def test_fsdp_shards_state_over_every_rank_and_computes_the_whole_model_while_3d_shards_over_t_p():
    fsdp, three_d = RoleStrategy(layout="fsdp"), RoleStrategy(layout="3d", pp_size=2, tp_size=4)
    assert fsdp.layout_model.state_shards(fsdp, 16) == 16 and fsdp.layout_model.compute_shards(fsdp) == 1
    assert three_d.layout_model.state_shards(three_d, 16) == 8 and three_d.layout_model.compute_shards(three_d) == 8
    assert fsdp.layout_model.gathered_layers == 2 and three_d.layout_model.gathered_layers == 0


def test_only_fsdp_holds_gathered_layers_beside_its_activations():
    spec = model_spec("llama-7b")
    simulator = Simulator(workload=Workload(prompts_per_step=64, prompt_length=512, response_length=512),
                          cluster=Cluster(num_devices=8, devices_per_node=8, hardware=load_hardware("a100-80g")))
    # inference with t = 1 on both: the same activations and logits, fsdp adds two gathered bf16 layers
    fsdp = simulator.transient_bytes(spec, "lm", RoleStrategy(layout="fsdp"), trained=False, num_devices=8)
    three_d = simulator.transient_bytes(spec, "lm", RoleStrategy(layout="3d"), trained=False, num_devices=8)
    assert fsdp - three_d == pytest.approx(2 * spec.params_per_layer * 2)
