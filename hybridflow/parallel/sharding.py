"""The tensor-parallel shard contract for the supported decoder families (``hybridflow.models.families``).

One table says along which dimension each Hugging Face parameter is split over tensor-parallel
ranks, so the training layout (DTensor plans), the generation engine and the 3D-HybridEngine agree
on what a rank's local shard is: shard ``i`` of ``tp_size`` is the i-th equal chunk along that dim.

- column-parallel (output features split, dim 0): q/k/v projections, MLP gate/up, their biases;
- row-parallel (input features split, dim 1): attention output and MLP down projections;
- vocabulary-parallel (dim 0): input embedding and the output head (tied or not);
- everything else (norms, q/k head norms, row-parallel biases, value/score heads) is replicated;
- a LoRA adapter on a layer (``<layer>.lora_A.weight`` [r, in], ``<layer>.lora_B.weight`` [out, r]) is split so
  that B A is split as the layer's weight: B along dim 0 of a column-parallel layer, A along dim 1 of a
  row-parallel one, the other factor replicated (``models/lora.py``).
"""

from __future__ import annotations

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
LORA_SPLIT = {("column", "lora_B"): 0, ("row", "lora_A"): 1}
"""(kind of the adapted layer, adapter factor) -> the factor's split dim; the other factors are replicated."""
HEAD_NORMS = ("q_norm", "k_norm")
"""Norms over one attention head's features (Qwen3): replicated, applied to each rank's own heads."""


def tp_shard_dim(param_name: str) -> int | None:
    """The dim along which ``param_name`` (a Hugging Face parameter name) is split, or None if replicated.

    >>> tp_shard_dim("model.layers.0.self_attn.q_proj.weight"), tp_shard_dim("model.norm.weight")
    (0, None)
    """
    parts = param_name.split(".")
    if len(parts) < 2:
        return None
    module, kind = parts[-2], parts[-1]
    if module in ("lora_A", "lora_B"):
        layer = parts[-3] if len(parts) >= 3 else ""
        parallel = "column" if layer in COLUMN_PARALLEL else "row" if layer in ROW_PARALLEL else None
        return LORA_SPLIT.get((parallel, module))
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL:
        return 1 if kind == "weight" else None
    if module in VOCAB_PARALLEL and kind == "weight":
        return 0
    return None
