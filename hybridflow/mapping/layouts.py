"""Training layouts as the planner models them: what fsdp and 3d change in a role's memory and seconds.

The planner's counterpart of hybridflow.engine.layouts (the planner sits beside the engine and does not
import it; tests/test_mapping_layouts.py keeps the names equal to the engine's ``TRAINING_LAYOUTS``).
``RoleStrategy.layout`` names one entry of ``TRAINING_LAYOUTS``; the simulator asks that entry, never the
name, over how many ranks the weights and optimizer state are split, how many whole layers a rank gathers
while computing, what communication a training or inference pass and an update pay, what the actor holds
beside its training state while generating and what the train -> generate transition costs.

Symbols as in hybridflow.mapping.simulator: L layers, e bytes per element, p/t/d training sizes,
pg/tg generation sizes, n devices of the role's pool.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, ClassVar

from hybridflow.mapping.model_spec import ModelSpec
from hybridflow.parallel.layout import GenerationLayout, ParallelLayout

if TYPE_CHECKING:
    from hybridflow.mapping.simulator import Simulator
    from hybridflow.mapping.strategy import RoleStrategy

# Per trained parameter, as hybridflow's training engine (engine/training.py) keeps them whatever the
# compute dtype: fp32 master weights and fp32 Adam moments, sharded like the weights (over t*p in the 3d
# layout, where each data-parallel replica holds its own optimizer; over all n ranks with fsdp), and fp32
# gradients, alive only from the first backward of an update to its optimizer step (the engine frees
# them after each step), so they count as training's working memory, not as resident state. The
# data-parallel reduction of 3d runs on the fp32 gradients. This is also the paper's setting ("BF16
# parameters with FP32 gradients and Adam states", section 8.1) except that Megatron keeps bf16 weights.
MASTER_WEIGHT_BYTES = 4
ADAM_STATE_BYTES = 4 + 4
GRADIENT_BYTES = 4


@functools.lru_cache(maxsize=4096)
def _groups_cross_nodes(world: int, pp_size: int, tp_size: int, generation_pp_size: int,
                        generation_tp_size: int, node_size: int) -> bool:
    train = ParallelLayout.for_world(world, pp_size=pp_size, tp_size=tp_size)
    layout = GenerationLayout(train=train, pp_size=generation_pp_size, tp_size=generation_tp_size)
    return any(len({rank // node_size for rank in group}) > 1 for group in layout.micro_dp_groups())


def micro_dp_groups_cross_nodes(num_devices: int, strategy: "RoleStrategy", node_size: int) -> bool:
    """Whether the 3D-HybridEngine's all-gather groups (micro-DP groups) of ``strategy`` on a pool of
    ``num_devices`` leave a node, with ranks numbered as hybridflow.parallel.layout numbers them."""
    # groups lie inside one training replica (p t consecutive ranks), so the pattern of node crossings
    # repeats every lcm(p t, node size) ranks: that many ranks decide it
    world = min(num_devices, math.lcm(strategy.model_parallel_size, node_size))
    return _groups_cross_nodes(world, strategy.pp_size, strategy.tp_size, strategy.generation_pp_size,
                               strategy.generation_tp_size, node_size)


class LayoutModel:
    """One training layout's cost model; subclasses set the traits and the communication formulas."""

    name: ClassVar[str] = ""
    data_parallel_only: ClassVar[bool] = False
    """The layout shards over data parallel ranks only: p = t = 1."""
    gathered_layers: ClassVar[int] = 0
    """Decoder layers whose whole parameters a rank holds beside its shard while it computes."""

    def check(self, strategy: "RoleStrategy") -> None:
        """Raise ValueError unless ``strategy``'s p and t are allowed in this layout."""
        if self.data_parallel_only and (strategy.pp_size, strategy.tp_size) != (1, 1):
            raise ValueError(f"RoleStrategy: layout {self.name!r} needs pp_size = tp_size = 1, got "
                             f"pp_size={strategy.pp_size}, tp_size={strategy.tp_size}")

    def describe(self, strategy: "RoleStrategy") -> str:
        """The training part of ``RoleStrategy.describe``: 'fsdp', '3d p2 t4'."""
        return self.name if self.data_parallel_only else f"{self.name} p{strategy.pp_size} t{strategy.tp_size}"

    def state_shards(self, strategy: "RoleStrategy", num_devices: int) -> int:
        """Ranks a role's weights, optimizer state and gradients are split over."""
        raise NotImplementedError

    def compute_shards(self, strategy: "RoleStrategy") -> int:
        """Ranks one micro-batch's weights are split over while it computes (each streams 1/this of them)."""
        raise NotImplementedError

    def pass_seconds(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy", num_devices: int, *,
                     compute: float, passes: int, micro_batches: int, backward: bool, head: str) -> float:
        """Seconds of ``passes`` rounds of ``micro_batches`` micro-batches per rank computing for ``compute``
        seconds, with the communication this layout adds (or hides)."""
        raise NotImplementedError

    def gradient_sync_seconds(self, sim: "Simulator", spec: ModelSpec, head: str, strategy: "RoleStrategy",
                              num_devices: int) -> float:
        """Seconds of one update's gradient synchronization over the data-parallel ranks."""
        raise NotImplementedError

    def generation_extra_bytes(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy") -> float:
        """Per device: the generation weights the hybrid engine builds beside the training state."""
        raise NotImplementedError

    def transition_seconds(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy",
                           num_devices: int) -> float:
        """Seconds of the train -> generate transition (going back drops the extra copy: free)."""
        raise NotImplementedError


class FsdpModel(LayoutModel):
    """FSDP2 over all n ranks: every rank runs the whole model, gathering one unit (a layer) at a time."""

    name = "fsdp"
    data_parallel_only = True
    gathered_layers = 2  # the unit computing and the one FSDP2 prefetches

    def state_shards(self, strategy: "RoleStrategy", num_devices: int) -> int:
        return num_devices

    def compute_shards(self, strategy: "RoleStrategy") -> int:
        return 1

    def pass_seconds(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy", num_devices: int, *,
                     compute: float, passes: int, micro_batches: int, backward: bool, head: str) -> float:
        # each micro-batch gathers the parameters for forward (and again for backward), one collective per
        # FSDP unit (a decoder layer, plus the root); FSDP2 prefetches the next unit's while computing, so the
        # gathers hide behind compute
        collectives = passes * micro_batches * (2 if backward else 1)
        gathers = collectives * sim.all_gather_seconds(
            spec.num_params(head=head) * sim.element_bytes_of(spec), num_devices, num_devices,
            num_collectives=spec.num_layers + 1)
        # FSDP2's host work around each collective (hooks, copies into and out of the flat buffers) is serial
        # with compute and is not hidden by the prefetch
        return max(compute, gathers) + collectives * self.host_seconds(sim, spec, num_devices)

    def gradient_sync_seconds(self, sim: "Simulator", spec: ModelSpec, head: str, strategy: "RoleStrategy",
                              num_devices: int) -> float:
        # one reduce-scatter of the fp32 gradients per unit and update (accumulated over micro-batches)
        return sim.all_gather_seconds(spec.num_params(head=head) * GRADIENT_BYTES, num_devices, num_devices,
                                      num_collectives=spec.num_layers + 1) + self.host_seconds(sim, spec, num_devices)

    @staticmethod
    def host_seconds(sim: "Simulator", spec: ModelSpec, num_devices: int) -> float:
        """FSDP2's host seconds around one collective per unit (a decoder layer, plus the root) on
        ``num_devices`` ranks; none on one rank, where FSDP2 runs no collective."""
        return (spec.num_layers + 1) * sim.fsdp_collective_overhead_s if num_devices > 1 else 0.0

    def generation_extra_bytes(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy") -> float:
        return spec.num_params(head="lm") * sim.element_bytes_of(spec)  # a full compute-dtype copy

    def transition_seconds(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy",
                           num_devices: int) -> float:
        # every rank gathers the whole model, one unit at a time
        model_bytes = spec.num_params(head="lm") * sim.element_bytes_of(spec)
        return sim.all_gather_seconds(model_bytes, num_devices, num_devices, num_collectives=spec.num_layers + 1)


class ThreeDModel(LayoutModel):
    """Megatron-style p x t x d: weights and optimizer state sharded over t p, replicated over d."""

    name = "3d"

    def state_shards(self, strategy: "RoleStrategy", num_devices: int) -> int:
        return strategy.model_parallel_size

    def compute_shards(self, strategy: "RoleStrategy") -> int:
        return strategy.model_parallel_size

    def pass_seconds(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy", num_devices: int, *,
                     compute: float, passes: int, micro_batches: int, backward: bool, head: str) -> float:
        # per micro-batch and layer, tensor parallelism all-reduces the activations twice forward and twice
        # more backward; pipeline stages send activations (and their gradients back)
        workload = sim.workload
        activation_bytes = (workload.sequences_per_micro_batch * workload.sequence_length * spec.hidden_size
                            * sim.element_bytes_of(spec))
        bubble = (micro_batches + strategy.pp_size - 1) / micro_batches
        layers_per_stage = spec.num_layers / strategy.pp_size
        all_reduces = passes * micro_batches * layers_per_stage * (4 if backward else 2)
        tp_comm = all_reduces * sim.all_reduce_seconds(activation_bytes, strategy.tp_size, strategy.tp_size,
                                                       num_devices=num_devices)
        pp_comm = 0.0
        if strategy.pp_size > 1:
            sends = passes * micro_batches * (2 if backward else 1)
            pp_comm = sends * sim.send_seconds(activation_bytes / strategy.tp_size, strategy.model_parallel_size,
                                               num_devices)
        # 1F1B: each of the m + p - 1 slots of a stage is a micro-batch's whole forward/backward, its
        # tensor-parallel collectives and its sends included, so the bubble stretches all of them
        return (compute + tp_comm + pp_comm) * bubble

    def gradient_sync_seconds(self, sim: "Simulator", spec: ModelSpec, head: str, strategy: "RoleStrategy",
                              num_devices: int) -> float:
        # data-parallel all-reduce of each rank's fp32 gradient shard (sharded over t*p only)
        shard_bytes = spec.num_params(head=head) / strategy.model_parallel_size * GRADIENT_BYTES
        return sim.all_reduce_seconds(shard_bytes, strategy.dp_size(num_devices), num_devices)

    def generation_extra_bytes(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy") -> float:
        if sim.element_bytes_of(spec) == MASTER_WEIGHT_BYTES:
            # fp32: the training shard is one piece of the generation shard, used in place (zero redundancy):
            # only the gathered pieces are extra
            model_bytes = spec.num_params(head="lm") * sim.element_bytes_of(spec)
            return sim.generation_weight_bytes(spec, strategy) - model_bytes / strategy.model_parallel_size
        # bf16 generation from fp32 master weights: the hybrid engine casts into a new shard
        return sim.generation_weight_bytes(spec, strategy)

    def transition_seconds(self, sim: "Simulator", spec: ModelSpec, strategy: "RoleStrategy",
                           num_devices: int) -> float:
        # all-gather inside micro-DP groups of dg = t p / (tg pg) ranks: each rank receives
        # (t p - tg pg) / (tg pg t p) of the model (paper Table 2, HybridFlow row)
        train_size = strategy.model_parallel_size
        gen_size = strategy.generation_pp_size * strategy.generation_tp_size
        micro_dp_size = train_size // gen_size
        if micro_dp_size == 1:
            return 0.0
        model_bytes = spec.num_params(head="lm") * sim.element_bytes_of(spec)
        received = (train_size - gen_size) / (gen_size * train_size) * model_bytes
        # every micro-DP group gathers at once; which links it uses follows the project's rank order
        # (hybridflow.parallel.layout): with pg < p a group spans training stages t ranks apart
        crosses = micro_dp_groups_cross_nodes(num_devices, strategy, sim.cluster.node_size)
        bandwidth, latency = sim.link(crosses)
        return (micro_dp_size - 1) * latency + received / bandwidth


TRAINING_LAYOUTS: dict[str, LayoutModel] = {model.name: model for model in (FsdpModel(), ThreeDModel())}
"""``engine.layout`` (``RoleStrategy.layout``) -> its cost model; the names are the engine's."""


def training_layout(name: str) -> LayoutModel:
    """The cost model of layout ``name``; ValueError naming the allowed values."""
    if name not in TRAINING_LAYOUTS:
        raise ValueError(f"RoleStrategy.layout must be one of {tuple(TRAINING_LAYOUTS)}, got {name!r}")
    return TRAINING_LAYOUTS[name]
