"""Optimizer, learning-rate schedule and global gradient-norm clipping over sharded parameters."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from hybridflow.engine.config import OptimConfig


def build_optimizer(module: nn.Module, config: OptimConfig, *, total_steps: int | None) -> torch.optim.Optimizer:
    """AdamW over the module's trainable parameters (plain tensors or DTensors), as PyTorch's fused kernel.

    The fused kernel updates each parameter in one pass over its weight, gradient and moments; PyTorch's
    default on CPU (one parameter at a time, a dozen elementwise passes) is several times slower: 348 against
    67 ms per step over SmolLM2-135M's 272 tensors, 1.5 against 0.4 ms over the tiny model's 39, 2 threads
    (``python benchmarks/bench_engine.py --model both --optimizer``). The same update, rounded in another order.
    The kernel takes one kind of tensor per call, so plain tensors and the DTensors of each device mesh (expert
    parallel mixes them: ``parallel/expert_parallel.py``) form separate parameter groups.
    """
    config.check_schedule(total_steps)
    kinds: dict[object, list[nn.Parameter]] = {}
    for param in module.parameters():
        if param.requires_grad:
            kinds.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    params = next(iter(kinds.values()), []) if len(kinds) <= 1 else [{"params": group} for group in kinds.values()]
    return torch.optim.AdamW(params, lr=lr_at(0, config, total_steps), betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, fused=True)


def lr_at(step: int, config: OptimConfig, total_steps: int | None) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of a run of ``total_steps``: linear warmup, then
    constant/linear/cosine decay to 0 at ``total_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / (config.warmup_steps + 1)
    if config.lr_schedule == "constant":
        return config.lr
    decay_steps = max(total_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / decay_steps, 1.0)
    if config.lr_schedule == "linear":
        return config.lr * (1.0 - progress)
    return config.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def global_grad_norm(params: list[nn.Parameter], *, shard_group, stage_group) -> torch.Tensor:
    """2-norm of the whole model's gradient, identical on every rank.

    ``shard_group``: the ranks a sharded (``Shard`` DTensor) gradient is split over (tp ranks in the
    3d layout, dp ranks under FSDP); replicated gradients count once. ``stage_group``: the pipeline
    stages, whose parameters are disjoint. Either may be None (not split).
    """
    device = params[0].device if params else torch.device("cpu")
    sharded_sq = torch.zeros((), dtype=torch.float64, device=device)
    replicated_sq = torch.zeros((), dtype=torch.float64, device=device)
    for param in params:
        if param.grad is None:
            continue
        grad = param.grad
        if isinstance(grad, DTensor):
            local_sq = grad.to_local().double().pow(2).sum()
            if any(isinstance(p, Shard) for p in grad.placements):
                sharded_sq += local_sq
            else:
                replicated_sq += local_sq
        else:
            replicated_sq += grad.double().pow(2).sum()
    if shard_group is not None:
        dist.all_reduce(sharded_sq, group=shard_group)
    total_sq = sharded_sq + replicated_sq
    if stage_group is not None:
        dist.all_reduce(total_sq, group=stage_group)
    return total_sq.sqrt().float()


def clip_gradients(params: list[nn.Parameter], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale gradients in place so their global norm is at most ``max_norm`` (as torch's clip_grad_norm_)."""
    coef = min(1.0, max_norm / (float(total_norm) + 1e-6))
    if coef == 1.0:
        return
    for param in params:
        if param.grad is not None:
            param.grad.mul_(coef)


class OptimizerOffload:
    """Moves an optimizer's state (AdamW moments) to host memory and back, around generation.

    The state tensors stay the same objects (DTensor wrappers and the optimizer's references intact): their
    device storage is copied into a host buffer and resized to 0 bytes, which returns the memory to the
    allocator for the KV cache; ``reload`` resizes it back and copies the bytes in. Host buffers are pinned on
    CUDA (asynchronous copies back) and kept between rollouts. State already on the CPU (a CPU run, FSDP CPU
    offload) is left alone, so on a CPU machine this is a no-op; ``include_cpu=True`` moves it anyway (tests).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, include_cpu: bool = False) -> None:
        self.optimizer = optimizer
        self.include_cpu = include_cpu
        self._host: dict[tuple[int, str], torch.Tensor] = {}  # (id of the parameter, state name) -> host bytes
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (local state tensor, its host copy)

    def state_tensors(self) -> list[tuple[tuple[int, str], torch.Tensor]]:
        """((id of the parameter, state name), local tensor) of the state this offload moves, one per storage."""
        tensors, seen = [], set()
        for param, state in self.optimizer.state.items():
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                local = value.to_local() if isinstance(value, DTensor) else value
                if local.device.type == "cpu" and not self.include_cpu:
                    continue
                storage = local.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue
                seen.add(storage.data_ptr())
                tensors.append(((id(param), name), local))
        return tensors

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def offload(self) -> int:
        """Copy the state to host memory and free its device storage; the bytes freed."""
        if self._offloaded:
            raise RuntimeError("optimizer state offloaded twice without reload in between")
        freed = 0
        for key, local in self.state_tensors():
            storage = local.untyped_storage()
            host = self._host.get(key)
            if host is None or host.numel() != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=local.device.type == "cuda")
                self._host[key] = host
            host.copy_(_storage_bytes_view(local))
            freed += storage.nbytes()
            storage.resize_(0)
            self._offloaded.append((local, host))
        return freed

    def reload(self) -> None:
        """Give the state its device storage back, with the bytes it had (no-op when nothing is offloaded)."""
        for local, host in self._offloaded:
            local.untyped_storage().resize_(host.numel())
            _storage_bytes_view(local).copy_(host, non_blocking=host.is_pinned())
        self._offloaded = []


def _storage_bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``tensor`` as a 1-D uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
