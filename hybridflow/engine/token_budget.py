"""The token budget ``micro_batch_tokens: auto`` resolves to: the activations that fit this rank's free memory.

A larger budget means fewer, larger micro-batches: never slower once packed attention costs no N x N mask
(fewer passes over the weights, fewer kernel launches), but its activations must fit. ``auto`` sizes the budget from a per-token estimate of
what one forward/backward keeps and the memory free when the engine first runs a batch (every role of a
colocated process is built by then), so a laptop, a 24 GiB CPU box and an 80 GB GPU each get what they hold.
"""

from __future__ import annotations

import os

import torch

AUTO_MEMORY_FRACTION = 0.5
"""Share of the free memory a micro-batch's activations may take: the rest is headroom for the allocator's
fragmentation, the optimizer's transient buffers and what other roles of the process allocate later
(the rollout's KV cache, a critic's activations)."""
AUTO_MIN_TOKENS = 512
"""Floor of an auto budget (a micro-batch smaller than this spends more on launches than it saves)."""
AUTO_MAX_TOKENS = 65536
"""Ceiling of an auto budget: past it a larger micro-batch gains nothing measurable on any device."""
AUTO_PIPELINE_MAX_TOKENS = 4096
"""Ceiling under pipeline parallelism, where every micro-batch is padded to the budget (static shapes of
torch.distributed.pipelining) and the schedule needs several micro-batches to fill its stages."""
AUTO_ROUNDING = 256
"""An auto budget is a multiple of this (steady shapes across machines of about the same memory)."""

# Elements one decoder layer keeps per token for backward, as hybridflow's stage runs it (HF Llama-family
# layers under autocast): 12 per hidden unit (norm inputs and outputs in fp32 and compute dtype, q/k/v,
# attention output and its log-sum-exp, residuals) and 6 per MLP unit (gate, up, their activation, the
# product, casts). Calibrated on peak RSS: width 256 x 4 layers in fp32 measured 161 KB/token
# (benchmarks/bench_activation_memory.py), SmolLM2-135M in bf16 about 1.6 MB/token (vs_trl's GRPO peak);
# this estimate gives 172 KB and 1.56 MB. The output head keeps about 3 fp32 values per vocabulary entry per
# token (logits, their log-softmax chunk, the gradient).
LAYER_ELEMENTS_PER_HIDDEN = 12
LAYER_ELEMENTS_PER_MLP = 6
HEAD_FP32_PER_VOCAB = 3


def activation_bytes_per_token(hf_config, *, compute_dtype: torch.dtype, trainable: bool,
                               activation_checkpointing: bool = False, tp_size: int = 1, pp_size: int = 1,
                               lm_head: bool = True) -> int:
    """Bytes one token of a micro-batch costs on one rank: the layers it keeps for backward and the head.

    Inference keeps no layer for backward: about one layer's worth is live at a time. Activation
    checkpointing keeps each layer's input (one hidden vector) and recomputes one layer at a time. Tensor
    parallelism splits the attention and MLP insides; a pipeline stage holds its share of the layers.
    """
    hidden = hf_config.hidden_size
    mlp = getattr(hf_config, "intermediate_size", 4 * hidden)
    element = torch.finfo(compute_dtype).bits // 8
    one_layer = (LAYER_ELEMENTS_PER_HIDDEN * hidden + LAYER_ELEMENTS_PER_MLP * mlp / tp_size) * element
    layers = -(-hf_config.num_hidden_layers // pp_size)
    if not trainable:
        kept = one_layer
    elif activation_checkpointing:
        kept = layers * hidden * element + one_layer
    else:
        kept = layers * one_layer
    head = HEAD_FP32_PER_VOCAB * 4 * hf_config.vocab_size / tp_size if lm_head else 0
    return int(kept + head)


def free_memory_bytes(device: torch.device) -> int:
    """Memory this rank may still allocate: the GPU's free memory plus what PyTorch's caching allocator holds
    unused (the rollout's freed KV cache, say), or on CPU the host's available memory (``MemAvailable``) split
    among the node's worker processes (``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        cached_unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached_unused
    sharing = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return host_available_bytes() // sharing


def host_available_bytes() -> int:
    """The kernel's estimate of memory available without swapping (``MemAvailable``; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def auto_token_budget(bytes_per_token: int, free_bytes: int, *, pending_bytes: int = 0,
                      pipeline: bool = False) -> int:
    """The budget ``auto`` resolves to: ``AUTO_MEMORY_FRACTION`` of the free memory (less ``pending_bytes``,
    state not allocated yet such as the optimizer's moments before the first step) over ``bytes_per_token``,
    rounded down to ``AUTO_ROUNDING`` and kept within ``[AUTO_MIN_TOKENS, AUTO_MAX_TOKENS]``
    (``AUTO_PIPELINE_MAX_TOKENS`` under pipeline parallelism)."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be > 0, got {bytes_per_token}")
    usable = AUTO_MEMORY_FRACTION * max(0, free_bytes - pending_bytes)
    tokens = int(usable // bytes_per_token) // AUTO_ROUNDING * AUTO_ROUNDING
    ceiling = AUTO_PIPELINE_MAX_TOKENS if pipeline else AUTO_MAX_TOKENS
    return min(ceiling, max(AUTO_MIN_TOKENS, tokens))


def resumed_token_budget(recorded: int | None, fresh: int, *, pipeline: bool = False) -> int:
    """The auto budget of a run resumed from a checkpoint whose engine had resolved ``recorded``, where this
    process resolves ``fresh``: the recorded one while its activations still fit all the free memory
    ``fresh`` was sized from (``fresh / AUTO_MEMORY_FRACTION``) and it is within this layout's ceiling, so a
    resumed run plans its micro-batches as the run it continues did although the host's free memory moved;
    ``fresh`` on a machine with much less memory, or under pipeline parallelism resumed from a larger budget."""
    ceiling = AUTO_PIPELINE_MAX_TOKENS if pipeline else AUTO_MAX_TOKENS
    if recorded is None or not 0 < recorded <= ceiling:
        return fresh
    return recorded if recorded <= fresh / AUTO_MEMORY_FRACTION else fresh
