"""Configuration of the training/inference engine: parallel layout, micro-batching, precision, optimizer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class LayoutTraits:
    """What a config check needs to know of a training layout, without torch (the classes of
    hybridflow.engine.layouts carry theirs as ``traits``)."""

    data_parallel_only: bool
    """Parameters are sharded over data parallel ranks only, so pp_size = tp_size = 1."""
    cpu_offload: bool
    """Sharded parameters, gradients and optimizer state can live in CPU memory (``engine.fsdp_cpu_offload``)."""


LAYOUT_TRAITS: dict[str, LayoutTraits] = {
    "fsdp": LayoutTraits(data_parallel_only=True, cpu_offload=True),
    "3d": LayoutTraits(data_parallel_only=False, cpu_offload=False),
}
"""``engine.layout`` -> its traits; tests/test_config_light.py keeps it equal to ``TRAINING_LAYOUTS``."""
LAYOUTS = tuple(LAYOUT_TRAITS)
LR_SCHEDULES = ("constant", "linear", "cosine")
PIPELINE_SCHEDULES = ("1f1b", "gpipe")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # names only: this module stays importable without torch


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_non_negative(name: str, value: object) -> None:
    if not _is_finite_number(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _is_finite_number(value: object) -> bool:
    """An int or float that is not a bool, inf or nan (``lr=.inf`` would otherwise pass ``lr > 0``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with gradient clipping and a warmup + decay learning-rate schedule."""

    lr: float = 1e-5
    """Peak learning rate (reached at the end of warmup)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    weight_decay: float = 0.0
    """Decoupled weight decay applied to every parameter."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    grad_clip: float | None = 1.0
    """Clip the global gradient 2-norm (over all ranks and shards) to this value; None disables clipping."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warmup: constant, or linear or cosine to 0 at the run's last optimizer step (the trainer
    passes the engine its step count: ``TrainingEngine(..., total_steps=...)``)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""

    def check_schedule(self, total_steps: int | None) -> None:
        """Raise unless the schedule can run ``total_steps`` optimizer steps (the run's count, which the trainer
        derives and passes to the engine; None: unknown, enough for the constant schedule)."""
        if total_steps is None:
            if self.lr_schedule != "constant":
                raise ValueError(f"optim.lr_schedule={self.lr_schedule!r} needs the run's optimizer step count "
                                 f"(total_steps), given None; allowed: a positive integer")
            return
        _check_positive_int("total_steps", total_steps)
        if self.warmup_steps > total_steps:
            raise ValueError(f"optim.warmup_steps {self.warmup_steps} exceeds the run's {total_steps} optimizer "
                             f"steps; allowed: 0..{total_steps}")

    def __post_init__(self) -> None:
        if not _is_finite_number(self.lr) or self.lr <= 0:
            raise ValueError(f"optim.lr must be a finite number > 0, got {self.lr!r}")
        if (not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2
                or not all(_is_finite_number(b) and 0 <= b < 1 for b in self.betas)):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_non_negative("optim.weight_decay", self.weight_decay)
        if not _is_finite_number(self.eps) or self.eps <= 0:
            raise ValueError(f"optim.eps must be a finite number > 0, got {self.eps!r}")
        if self.grad_clip is not None and (not _is_finite_number(self.grad_clip) or self.grad_clip <= 0):
            raise ValueError(f"optim.grad_clip must be a finite number > 0 or None (no clipping), "
                             f"got {self.grad_clip!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if not isinstance(self.warmup_steps, int) or isinstance(self.warmup_steps, bool) or self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How one model is laid out over its worker group and how it trains."""

    layout: Literal["fsdp", "3d"] = "fsdp"
    """'fsdp': FSDP2 over all ranks; '3d': tensor x pipeline x data parallel (replicated over dp), or expert x data
    parallel for mixture-of-experts models (ep_size)."""
    pp_size: int = 1
    """Pipeline stages (3d only); must be <= the model's layers."""
    tp_size: int = 1
    """Tensor-parallel ranks (3d only); must divide the attention and key/value heads."""
    ep_size: int = 1
    """Expert-parallel ranks (3d only, with pp_size = tp_size = 1; mixture-of-experts models): each MoE layer's
    experts are split over ep_size consecutive ranks, which exchange tokens by all-to-all; the other parameters are
    replicated and data parallel over all ranks. Must divide the world size and the experts."""
    fsdp_cpu_offload: bool = False
    """FSDP only: keep sharded parameters, gradients and optimizer state in CPU memory."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of keeping them (torch's non-reentrant
    checkpoint per layer): activation memory of about one layer's inputs per layer, for about one extra
    forward of compute per step. Both layouts; inference-only roles never keep activations anyway."""
    micro_batch_tokens: int | Literal["auto"] = "auto"
    """Per-rank token budget of one forward/backward (real tokens; padding is removed). 'auto': what half of this
    rank's free memory holds at the first batch, from a per-token activation estimate, between 512 and 65536
    tokens (4096 at most with pp_size > 1, whose micro-batches are padded to the budget); never less than the
    longest sequence (``hybridflow.engine.token_budget``)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of forward/backward and generation (autocast): 'auto' is bf16 on GPUs that support it and on
    CPUs with bf16 instructions (AVX512-BF16 or AMX) for models at least 256 wide, fp32 elsewhere
    (``hybridflow.device.default_dtype``; docs/engines.md, "Precision"). Master weights, gradients and
    optimizer state stay fp32. 'float16' is refused (no loss scaling)."""
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    """Pipeline schedule of the 3d layout when pp_size > 1."""
    num_threads: int = 0
    """CPU threads of each worker process (torch.set_num_threads); 0 keeps the process's setting. Roles
    colocated in one process share it: the last role built sets it."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule (ignored by inference-only roles: reference, reward, cost)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts models (Qwen3-MoE): weight of the routers' load-balancing loss added to the training loss
    (``hybridflow.models.moe.load_balancing_loss`` per micro-batch, over all its tokens and MoE layers, weighted by
    the micro-batch's share of the loss's tokens; logged as ``router_aux_loss``). 0 disables it; pp_size 1 only."""

    def __post_init__(self) -> None:
        if not _is_finite_number(self.router_aux_loss_coef) or self.router_aux_loss_coef < 0:
            raise ValueError(f"engine.router_aux_loss_coef must be a finite number >= 0, got "
                             f"{self.router_aux_loss_coef!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"engine.layout must be one of {LAYOUTS}, got {self.layout!r}")
        _check_positive_int("engine.pp_size", self.pp_size)
        _check_positive_int("engine.tp_size", self.tp_size)
        _check_positive_int("engine.ep_size", self.ep_size)
        if self.ep_size != 1 and (self.layout, self.pp_size, self.tp_size) != ("3d", 1, 1):
            raise ValueError(f"engine.ep_size={self.ep_size} needs layout='3d' with pp_size=1 and tp_size=1, got "
                             f"layout={self.layout!r}, pp_size={self.pp_size}, tp_size={self.tp_size}; allowed: "
                             f"ep_size 1, or ep_size > 1 with layout='3d', pp_size=1, tp_size=1")
        traits = LAYOUT_TRAITS[self.layout]
        if traits.data_parallel_only and (self.pp_size, self.tp_size) != (1, 1):
            model_parallel = " or ".join(repr(name) for name, other in LAYOUT_TRAITS.items()
                                         if not other.data_parallel_only)
            raise ValueError(f"engine.pp_size/tp_size must be 1 with layout={self.layout!r}, got "
                             f"pp_size={self.pp_size}, tp_size={self.tp_size}; use layout={model_parallel} for them")
        if not isinstance(self.fsdp_cpu_offload, bool):
            raise ValueError(f"engine.fsdp_cpu_offload must be a bool, got {self.fsdp_cpu_offload!r}")
        if self.fsdp_cpu_offload and not traits.cpu_offload:
            offloading = " or ".join(repr(name) for name, other in LAYOUT_TRAITS.items() if other.cpu_offload)
            raise ValueError(f"engine.fsdp_cpu_offload=True needs layout={offloading}, got layout={self.layout!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"engine.activation_checkpointing must be a bool, got {self.activation_checkpointing!r}")
        budget = self.micro_batch_tokens
        if budget != "auto" and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ValueError(f"engine.micro_batch_tokens must be a positive integer or 'auto', got {budget!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"engine.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16":
            # fp16 gradients underflow without dynamic loss scaling, which this engine does not implement
            raise ValueError("engine.dtype got 'float16', which needs loss scaling (not implemented); allowed: "
                             "'auto', 'float32' or 'bfloat16' (bf16 has fp32's exponent range and needs none)")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"engine.pipeline_schedule must be one of {PIPELINE_SCHEDULES}, "
                             f"got {self.pipeline_schedule!r}")
        if not isinstance(self.num_threads, int) or isinstance(self.num_threads, bool) or self.num_threads < 0:
            raise ValueError(f"engine.num_threads must be an integer >= 0 (0 = unchanged), got {self.num_threads!r}")
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"engine.optim must be an OptimConfig, got {type(self.optim).__name__}")

    def resolve_dtype(self, hidden_size: int | None) -> "torch.dtype":
        """The compute dtype for a model ``hidden_size`` wide (None: any width): 'auto' resolved on this device
        (``default_dtype``). Each engine resolves it for its own model (``TrainingEngine.compute_dtype``)."""
        import torch

        from hybridflow.device import default_dtype

        return default_dtype(hidden_size) if self.dtype == "auto" else getattr(torch, self.dtype)
