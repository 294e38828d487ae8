"""A LoRA actor on the vLLM rollout without merging: vLLM holds the base weights (loaded once) and generates every
request with the adapter as a LoRA request; each weight sync hands it only A and B (``actor.lora.vllm_sync:
adapter``, docs/lora.md).

vLLM 0.32 takes an adapter only from a directory in PEFT's format (``LoRARequest.lora_path``; its worker reads
``adapter_config.json`` and ``adapter_model.safetensors``, slices the factors for its tensor-parallel rank and
scales B by alpha / r), and caches loaded adapters by their integer id. So a sync writes the adapter's tensors
(generation dtype) to a fresh directory, adds it under a new id (``LLMEngine.add_lora`` loads it at once), removes
the previous id, and deletes the directory: vLLM holds its own copy in its LoRA slots from then on.

Legend: O = out features, I = in features, R = LoRA rank.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

from hybridflow.models.lora import peft_adapter_config, peft_name
from hybridflow.models.lora_config import LoraConfig

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""


def vllm_lora_options(lora: LoraConfig, hf_config) -> dict:
    """``vllm.LLM`` keyword arguments for one adapter of ``lora``'s rank: LoRA slots of the smallest rank vLLM
    offers that holds it (a smaller adapter is zero-padded into the slot), one adapter at a time. ValueError for a
    model whose adapter the rollout cannot hand vLLM (checked before any engine is built)."""
    if getattr(hf_config, "num_experts", 0):
        # vLLM's LoRA wraps the fused-MoE layer and runs its experts with Triton kernels (TritonExperts), which
        # the CPU build lacks and whose weight layout the rollout's expert loading does not know
        raise ValueError(f"actor.lora.vllm_sync='adapter' on a mixture-of-experts model ({hf_config.model_type}): "
                         f"vLLM's LoRA replaces the fused-MoE experts the rollout loads; allowed: "
                         f"actor.lora.vllm_sync=merged (the rollout loads W + scale B A), or backend='native'")
    fits = [rank for rank in VLLM_LORA_RANKS if rank >= lora.rank]
    if not fits:
        raise ValueError(f"actor.lora.rank={lora.rank}: vLLM's LoRA supports ranks up to {VLLM_LORA_RANKS[-1]}; "
                         f"use actor.lora.vllm_sync=merged (the rollout loads the merged weights) or a smaller rank")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1, "max_cpu_loras": 1}


def vllm_lora_modules(llm) -> set[str]:
    """The Hugging Face module names (``q_proj``, ...) vLLM's model can carry an adapter on."""
    manager = llm.llm_engine.model_executor.driver_worker.worker.model_runner.lora_manager._adapter_manager
    modules = set()
    for module in manager.supported_lora_modules:
        modules.update(manager.packed_modules_mapping.get(module, [module]))
    return modules


def check_lora_targets(adapter_names, supported: set[str]) -> None:
    """ValueError naming the adapted modules vLLM cannot adapt (``adapter_names``: our adapter parameter names)."""
    adapted = {name.split(".")[-3] for name in adapter_names}
    unsupported = sorted(adapted - supported)
    if unsupported:
        raise ValueError(f"actor.lora.target_modules adapts {unsupported}, which vLLM's LoRA cannot carry for this "
                         f"model (it adapts {sorted(supported)}); set actor.lora.vllm_sync=merged (the rollout then "
                         f"loads W + scale B A) or target only those modules")


class VllmAdapter:
    """The adapter vLLM generates with: written per sync in PEFT's format, added under a new id, the old removed."""

    def __init__(self, lora: LoraConfig) -> None:
        self.lora = lora
        self.lora_id = 0
        self.request = None
        """The ``vllm.lora.request.LoRARequest`` every generate request carries (None before the first sync)."""
        self._root = tempfile.TemporaryDirectory(prefix="hybridflow-vllm-lora-")

    def load(self, llm, adapter: dict[str, torch.Tensor]) -> int:
        """Hand vLLM ``adapter`` (our parameter name -> full A [R, I] or B [O, R], generation dtype) as the adapter
        to generate with; returns its bytes."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        previous = self.request
        self.lora_id += 1
        directory = os.path.join(self._root.name, f"v{self.lora_id}")
        os.makedirs(directory)
        save_file({peft_name(name): tensor.contiguous() for name, tensor in adapter.items()},
                  os.path.join(directory, "adapter_model.safetensors"))
        with open(os.path.join(directory, "adapter_config.json"), "w") as handle:
            json.dump(peft_adapter_config(self.lora, base_model=None), handle)
        request = LoRARequest(f"hybridflow-actor-{self.lora_id}", self.lora_id, directory)
        try:
            llm.llm_engine.add_lora(request)  # read now: the directory is not needed afterwards
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if previous is not None:
            llm.llm_engine.remove_lora(previous.lora_int_id)
        self.request = request
        return sum(tensor.numel() * tensor.element_size() for tensor in adapter.values())

    def close(self) -> None:
        self._root.cleanup()
