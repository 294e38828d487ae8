"""LoRA adapters on a Hugging Face decoder: inject them, initialise them, switch them off, merge them, and name
them as PEFT does.

Legend: O = out features, I = in features, R = LoRA rank.

The adapted layer keeps the base layer's parameters under their Hugging Face names (``...q_proj.weight``) and
adds ``...q_proj.lora_A.weight`` [R, I] and ``...q_proj.lora_B.weight`` [O, R]: PEFT's names without its
``base_model.model.`` prefix and adapter name. So the loader, the tensor-parallel shard table, checkpoints and
the 3D-HybridEngine keep reading the base weights by name, and an adapter file is PEFT's by a prefix.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from hybridflow.models.lora_config import LoraConfig

ADAPTER_MODULES = ("lora_A", "lora_B")
"""Child modules of an adapted layer that hold the adapter's weights."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a module name in an adapter file (``adapter_model.safetensors``)."""


class LoraLinear(nn.Linear):
    """``y = x W^T + b + scale * dropout(x) A^T B^T``; W and b are the base layer's own parameters."""

    def __init__(self, base: nn.Linear, config: LoraConfig) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: W and b are taken over, never allocated anew
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, config.rank, bias=False, **factory)
        self.lora_B = nn.Linear(config.rank, base.out_features, bias=False, **factory)
        self.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.scale = config.scale
        self.adapter_enabled = True

    def forward(self, x: Tensor) -> Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapter_enabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scale

    def delta_weight(self) -> Tensor:
        """scale * B A [O, I]: what merging adds to W."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scale


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct last names of the linear layers inside the decoder layers (what ``target_modules`` can name)."""
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and ".layers." in f".{name}" and name.rsplit(".", 1)[-1]
                   not in ADAPTER_MODULES})


def target_names(model: nn.Module, config: LoraConfig, *, key: str = "lora") -> list[str]:
    """Full names of the modules ``config.target_modules`` selects in ``model`` (PEFT's suffix match), checked:
    every entry must match at least one linear layer of the decoder layers, else ValueError naming ``key``."""
    modules = dict(model.named_modules())
    chosen: list[str] = []
    for target in config.target_modules:
        matches = [name for name in modules if name == target or name.endswith("." + target)]
        usable = [name for name in matches if isinstance(modules[name], nn.Linear) and ".layers." in f".{name}"]
        if not usable:
            what = (f"matches only {matches[:3]}, which are not linear layers of the decoder layers" if matches
                    else "matches no module of the model")
            raise ValueError(f"config key {key}.target_modules: {target!r} {what}; the linear layers that can be "
                             f"adapted are named {linear_module_names(model)}")
        chosen.extend(name for name in usable if name not in chosen)
    return chosen


def inject_lora(model: nn.Module, config: LoraConfig, *, key: str = "lora") -> list[str]:
    """Replace every targeted linear layer of ``model`` by a ``LoraLinear`` over the same parameters, in place;
    returns the adapted module names. Works on a model on the meta device (the adapters then are on meta too)."""
    names = target_names(model, config, key=key)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LoraLinear(getattr(parent, child), config))
    return names


def adapted_layers(model: nn.Module) -> Iterator[tuple[str, LoraLinear]]:
    """(name, layer) of every adapted layer of ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            yield name, module


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to a LoRA adapter (``...<layer>.lora_A.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_MODULES


def initial_adapter_weight(name: str, shape: torch.Size, *, seed: int) -> Tensor:
    """The initial full value of adapter parameter ``name``: A ~ U(-1/sqrt(I), 1/sqrt(I)) (PEFT's default,
    kaiming-uniform with a = sqrt(5)), B = 0. Drawn from a generator seeded by ``seed`` and the name, so every
    layout and every pipeline stage gets the same adapter."""
    if name.split(".")[-2] == "lora_B":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(shape[1])
    return torch.rand(shape, generator=generator) * (2 * bound) - bound


def mark_trainable(model: nn.Module, *, also: tuple[str, ...] = ()) -> None:
    """Freeze every parameter but the adapters' (and those under the top-level modules ``also``, e.g. a new
    value head)."""
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name) or name.split(".")[0] in also)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block ``model`` computes as its base model (every adapter switched off)."""
    layers = [layer for _, layer in adapted_layers(model)]
    previous = [layer.adapter_enabled for layer in layers]
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, previous):
            layer.adapter_enabled = enabled


def peft_name(name: str) -> str:
    """The key of parameter ``name`` in PEFT's ``adapter_model.safetensors``."""
    return PEFT_PREFIX + name


def peft_adapter_config(config: LoraConfig, *, base_model: str | None, modules_to_save: list[str] | None = None,
                        task_type: str = "CAUSAL_LM") -> dict:
    """The ``adapter_config.json`` PEFT writes for this adapter (``peft.LoraConfig(...).to_dict()`` fields)."""
    return {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
            "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
            "target_modules": list(config.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": modules_to_save, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}
