"""Training layouts as objects: what the fsdp and 3d layouts of ``TrainingEngine`` do differently.

``engine.layout: fsdp|3d`` names one of the classes in ``TRAINING_LAYOUTS``; the engine holds one
instance and asks it, never the name, how a stage is sharded, how the loss is scaled, which group
the gradient norm sums over, how data-parallel gradients are reduced, whether micro-batch counts
must agree across data-parallel ranks, whether meta init works, and what this rank hands the
3D-HybridEngine (its local shards and the transition that turns them into generation weights).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from hybridflow.engine.config import LAYOUT_TRAITS, LayoutTraits
from hybridflow.parallel.layout import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hybridflow.engine.config import EngineConfig
    from hybridflow.engine.hybrid_engine import TransitionStrategy


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's part of a (possibly DTensor) parameter or gradient."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TrainingLayout(ABC):
    """One training layout: its rank arithmetic (``ranks``) and the facts in which layouts differ."""

    name: ClassVar[str] = ""
    traits: ClassVar[LayoutTraits]
    """What configs check of this layout without torch (``engine.config.LAYOUT_TRAITS[name]``)."""
    equal_micro_batch_counts: ClassVar[bool] = False
    """Every data-parallel rank must run as many micro-batches per step (the max over ranks; short ranks run
    fillers), because each forward makes collectives over the data-parallel group."""

    def __init__(self, ranks: ParallelLayout) -> None:
        self.ranks = ranks
        """The (p, t, d) rank arithmetic of this layout (``TrainingEngine.layout``)."""

    @classmethod
    @abstractmethod
    def for_world(cls, config: "EngineConfig", world_size: int) -> "TrainingLayout":
        """This layout over ``world_size`` ranks with the sizes ``config`` asks for."""

    @classmethod
    def meta_init_supported(cls, *, tied_embeddings: bool, world_size: int) -> bool:
        """Whether a checkpoint can be read shard by shard onto a meta-initialised stage."""
        return True

    @classmethod
    def check_model(cls, model: nn.Module, config: "EngineConfig", world_size: int) -> None:
        """ValueError when this layout with ``config``'s sizes cannot lay ``model`` out over ``world_size`` ranks."""

    @abstractmethod
    def shard_stage(self, stage: nn.Module, mesh: "DeviceMesh | None", *, cpu_offload: bool,
                    compute_dtype: torch.dtype) -> nn.Module:
        """Lay this rank's pipeline stage (a ``DecoderStage``) out over ``mesh`` in place and return it."""

    @property
    def loss_scale(self) -> float:
        """Factor on each micro-batch loss before backward so that gradients come out summed over dp."""
        return 1.0

    @abstractmethod
    def shard_group(self, *, dp_group, tp_group):
        """The group over which a sharded gradient's squared norm is summed (None: nothing is sharded)."""

    def reduce_gradients(self, params: list[nn.Parameter], dp_group) -> None:
        """Sum gradients over data-parallel replicas after backward, where backward has not already."""

    @abstractmethod
    def local_shards(self, model: nn.Module, device: torch.device) -> dict[str, Tensor]:
        """HF parameter name -> this rank's local tensor on ``device`` (sharing the parameter's storage where
        it lives there): what ``HybridEngine.to_generation`` takes, cut as ``transition`` expects."""

    @abstractmethod
    def transition(self, strategy: str) -> "TransitionStrategy":
        """The hybrid engine's transition from this layout's local shards to generation weights;
        ``strategy`` is ``actor.hybrid_engine.strategy``."""


class FsdpLayout(TrainingLayout):
    """FSDP2 over all ranks: every parameter cut along dim 0 over d data-parallel ranks (p = t = 1)."""

    name = "fsdp"
    traits = LAYOUT_TRAITS[name]
    equal_micro_batch_counts = True  # FSDP all-gathers the parameters in every forward

    @classmethod
    def for_world(cls, config: "EngineConfig", world_size: int) -> "FsdpLayout":
        return cls(ParallelLayout(dp_size=world_size))

    @classmethod
    def meta_init_supported(cls, *, tied_embeddings: bool, world_size: int) -> bool:
        # FSDP2 owns a tied parameter pair and is not re-tied after allocation: such models are built whole
        return not (tied_embeddings and world_size > 1)

    def shard_stage(self, stage: nn.Module, mesh: "DeviceMesh | None", *, cpu_offload: bool,
                    compute_dtype: torch.dtype) -> nn.Module:
        if self.ranks.dp_size == 1:
            return stage
        from hybridflow.parallel.fsdp import apply_fsdp

        return apply_fsdp(stage, mesh["dp"], cpu_offload=cpu_offload,
                          param_dtype=None if compute_dtype == torch.float32 else compute_dtype)

    @property
    def loss_scale(self) -> float:
        # FSDP2 averages reduce-scattered gradients over dp; scaling each loss by dp makes that the needed sum
        return float(self.ranks.dp_size)

    def shard_group(self, *, dp_group, tp_group):
        return dp_group

    def local_shards(self, model: nn.Module, device: torch.device) -> dict[str, Tensor]:
        # dim-0 slices (parallel/fsdp.py, dp_shard_rows); under CPU offload they live in host memory and
        # go to the device that generates
        return {name: local_tensor(param).detach().to(device) for name, param in model.named_parameters()}

    def transition(self, strategy: str) -> "TransitionStrategy":
        # every strategy means the same here: generation needs the whole model (t = 1 so tg = 1) and each
        # rank holds 1/d of every parameter, so each gathers it from all d ranks (DeepSpeed-Chat's ZeRO gather)
        from hybridflow.engine.hybrid_engine import FsdpGatherStrategy

        return FsdpGatherStrategy()


class ThreeDLayout(TrainingLayout):
    """Tensor (DTensor) x pipeline x data parallel; replicas hold full copies of their (pp, tp) shard."""

    name = "3d"
    traits = LAYOUT_TRAITS[name]

    @classmethod
    def for_world(cls, config: "EngineConfig", world_size: int) -> "ThreeDLayout":
        if config.ep_size > 1:
            return ExpertParallelLayout.for_world(config, world_size)
        return cls(ParallelLayout.for_world(world_size, pp_size=config.pp_size, tp_size=config.tp_size))

    @classmethod
    def check_model(cls, model: nn.Module, config: "EngineConfig", world_size: int) -> None:
        if config.ep_size > 1:
            from hybridflow.parallel.expert_parallel import validate_ep_size

            validate_ep_size(model, config.ep_size, world_size)

    def shard_stage(self, stage: nn.Module, mesh: "DeviceMesh | None", *, cpu_offload: bool,
                    compute_dtype: torch.dtype) -> nn.Module:
        # the pipeline cut is already made (build_stage); parameters become DTensors on the tp mesh
        if self.ranks.tp_size > 1:
            from hybridflow.parallel.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(stage, mesh["tp"])
        return stage

    def shard_group(self, *, dp_group, tp_group):
        return tp_group

    def reduce_gradients(self, params: list[nn.Parameter], dp_group) -> None:
        if dp_group is None:
            return
        grads = []
        for param in params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(local_tensor(param.grad))
        # one flat all-reduce instead of one per parameter (collective latency dominates small tensors)
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        dist.all_reduce(flat, group=dp_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def local_shards(self, model: nn.Module, device: torch.device) -> dict[str, Tensor]:
        # the live tensor-parallel pieces of this rank's stage (the hybrid strategy reuses them in place)
        return {name: local_tensor(param).data for name, param in model.named_parameters()}

    def transition(self, strategy: str) -> "TransitionStrategy":
        from hybridflow.engine.hybrid_engine import TRANSITION_STRATEGIES

        return TRANSITION_STRATEGIES[strategy]()


class ExpertParallelLayout(ThreeDLayout):
    """The 3d layout with ``engine.ep_size`` > 1 (``parallel/expert_parallel.py``): the experts of every MoE layer
    split over ep_size ranks (tokens exchanged by all-to-all), everything else replicated and data parallel over all
    ranks (p = t = 1, d = world). Expert gradients are summed over the ranks holding the same experts, the others
    over all ranks. ``ThreeDLayout.for_world`` returns it; the planner models it as 3d (it does not price the
    all-to-all)."""

    equal_micro_batch_counts = True  # every forward of an MoE layer exchanges tokens within the ep group

    def __init__(self, ranks: ParallelLayout, ep_size: int) -> None:
        super().__init__(ranks)
        self.ep_size = ep_size
        self.ep_mesh = None  # built with the stage (shard_stage)
        self._expert_params: set[int] = set()

    @classmethod
    def for_world(cls, config: "EngineConfig", world_size: int) -> "ExpertParallelLayout":
        from hybridflow.parallel.expert_parallel import check_ep_world

        check_ep_world(config.ep_size, world_size)
        return cls(ParallelLayout(dp_size=world_size), config.ep_size)

    def shard_stage(self, stage: nn.Module, mesh: "DeviceMesh | None", *, cpu_offload: bool,
                    compute_dtype: torch.dtype) -> nn.Module:
        from hybridflow.parallel.expert_parallel import build_ep_mesh, shard_experts

        self.ep_mesh = build_ep_mesh(self.ep_size)
        self._expert_params = {id(param) for param in shard_experts(stage, self.ep_mesh)}
        return stage

    def shard_group(self, *, dp_group, tp_group):
        # expert gradients are Shard(0) DTensors split over the ep group; the rest is replicated
        return self.ep_mesh.get_group("ep")

    def reduce_gradients(self, params: list[nn.Parameter], dp_group) -> None:
        experts = [param for param in params if id(param) in self._expert_params]
        others = [param for param in params if id(param) not in self._expert_params]
        super().reduce_gradients(others, dp_group)
        if self.ep_mesh.size(0) > 1:
            super().reduce_gradients(experts, self.ep_mesh.get_group("edp"))

    def local_shards(self, model: nn.Module, device: torch.device) -> dict[str, Tensor]:
        # generation needs whole experts: each expert parameter is all-gathered over the ep group (a new tensor);
        # the replicated rest is the live parameters, as the 3d layout with t = p = 1 hands them over
        return {name: (param.full_tensor().detach() if isinstance(param, DTensor) else param.data)
                for name, param in model.named_parameters()}


TRAINING_LAYOUTS: dict[str, type[TrainingLayout]] = {cls.name: cls for cls in (FsdpLayout, ThreeDLayout)}
"""``engine.layout`` -> its class (the names and traits are ``engine.config.LAYOUT_TRAITS``)."""


def layout_class(name: str) -> type[TrainingLayout]:
    """The class of training layout ``name`` (``engine.layout``)."""
    if name not in TRAINING_LAYOUTS:
        raise ValueError(f"engine.layout must be one of {tuple(TRAINING_LAYOUTS)}, got {name!r}")
    return TRAINING_LAYOUTS[name]
