"""Activation checkpointing per decoder layer: keep each layer's input, recompute its inside in backward."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def apply_activation_checkpointing(stage: nn.Module) -> nn.Module:
    """Make every decoder layer of ``stage`` (a ``DecoderStage``) recompute its activations in backward.

    Each layer saves only its inputs during a forward with gradients; backward runs the layer again to get
    the rest (about one more forward of compute for activations of one layer instead of all). The
    non-reentrant torch checkpoint works with FSDP2, DTensor tensor parallelism, pipeline schedules and
    autocast, and restores the RNG state for dropout. The layer's own ``forward`` is wrapped in place, so
    parameter names (checkpoints, the hybrid engine) and the hooks FSDP2/TP add around ``__call__`` (outside
    the recomputed region) are unchanged. Forwards without gradients (log-probs, values) run as before.
    """
    for layer in stage.model.layers.values():
        layer.forward = _checkpointed(layer.forward)
    return stage


def _checkpointed(forward):
    def checkpointed_forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    checkpointed_forward.__wrapped__ = forward
    return checkpointed_forward
