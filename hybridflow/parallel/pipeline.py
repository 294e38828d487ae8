"""Pipeline stages cut from a Hugging Face decoder, and the torch.distributed.pipelining schedule over them.

Legend: N = packed tokens of one micro-batch, H = hidden size, V = vocabulary, O = head outputs.

A ``DecoderStage`` keeps the parameter names of the Hugging Face model (``model.layers.<global
index>...``, ``lm_head.weight``), so checkpoints and the 3D-HybridEngine see one naming whatever
the layout. Stage 0 holds the input embedding, the last stage the final norm and the output head.
Between stages travel the hidden states and the position ids; each stage finds the sequences of a
packed micro-batch from the position ids and attends within them without an N x N mask
(``hybridflow.models.packed_attention``; only ``eager`` builds the dense mask).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import Tensor, nn

from hybridflow.models.moe import GROUPED_EXPERTS
from hybridflow.models.packed_attention import dense_packed_bias, packed_attention_config, packed_attention_inputs
from hybridflow.parallel.layout import stage_layer_range

HEADS = ("lm", "value", "score")


def head_module(model: nn.Module, head: str) -> nn.Module:
    """The output head of ``model``: ``lm_head`` for 'lm', the scalar ``score`` head for 'value'/'score'."""
    name = "lm_head" if head == "lm" else "score"
    module = getattr(model, name, None)
    if not isinstance(module, nn.Module):
        raise ValueError(f"head={head!r} needs a model with a `{name}` module; {type(model).__name__} "
                         f"has none (use a *ForCausalLM for 'lm', a model with a scalar `score` head "
                         f"for 'value'/'score')")
    return module


def packed_attention_bias(position_ids_1N: Tensor, dtype: torch.dtype) -> Tensor:
    """Additive block-diagonal causal mask [1, 1, N, N] of a packed row (the eager reference)."""
    return dense_packed_bias(position_ids_1N, dtype)


class DecoderStage(nn.Module):
    """Layers ``layer_range`` of a decoder (plus the embedding on the first stage, norm + head on the last)."""

    def __init__(self, model: nn.Module, *, head: str, layer_range: range, is_first: bool, is_last: bool):
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        backbone = model.model
        self.head_name = head
        self.is_first, self.is_last = is_first, is_last
        self.config = model.config
        # an empty shell keeps the `model.` prefix of the Hugging Face names
        self.model = nn.Module()
        self.model.embed_tokens = backbone.embed_tokens if is_first else None
        self.model.layers = nn.ModuleDict({str(i): backbone.layers[i] for i in layer_range})
        self.model.norm = backbone.norm if is_last else None
        self.model.rotary_emb = backbone.rotary_emb
        # the stage's attention modules read a config whose sdpa attends within packed sequences
        attention_config = packed_attention_config(model.config)
        self.attn_implementation = attention_config._attn_implementation
        experts_config = copy.copy(model.config)
        experts_config._experts_implementation = GROUPED_EXPERTS  # one batched matmul, not a loop over experts
        for layer in self.model.layers.values():
            layer.self_attn.config = attention_config
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is not None:
                experts.config = experts_config
        layer_types = getattr(model.config, "layer_types", None)
        self.layer_types = {str(i): layer_types[i] if layer_types else None for i in layer_range}
        """Layer (its global index as a string) -> its layer type, None for models without them."""
        if is_last:
            setattr(self, "lm_head" if head == "lm" else "score", head_module(model, head))

    @property
    def head(self) -> nn.Module:
        return self.lm_head if self.head_name == "lm" else self.score

    def forward(self, tokens: Tensor, position_ids_1N: Tensor,
                head_positions_K: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """First stage: tokens are ids [1, N]; later stages: hidden states [1, N, H].

        Returns (hidden_1NH, position_ids_1N) for the next stage, or the head output on the last
        stage: logits [1, N, V] ('lm') or scalars [1, N] ('value'/'score'); with ``head_positions_K``
        only at those packed positions ([1, K, ...]): the output head of a large vocabulary is the
        largest matmul of a small model, and the prompt's positions are never read.
        """
        hidden_1NH = self.model.embed_tokens(tokens) if self.is_first else tokens
        inputs = {kind: self._layer_inputs(kind, hidden_1NH, position_ids_1N)
                  for kind in set(self.layer_types.values())}
        for index, layer in self.model.layers.items():
            mask, rotary, attention_kwargs = inputs[self.layer_types[index]]
            hidden_1NH = layer(hidden_1NH, attention_mask=mask, position_ids=position_ids_1N,
                               position_embeddings=rotary, **attention_kwargs)
        if not self.is_last:
            return hidden_1NH, position_ids_1N
        if head_positions_K is not None:
            hidden_1NH = hidden_1NH[:, head_positions_K]
        out_1NO = self.head(self.model.norm(hidden_1NH))
        if self.head_name == "lm":
            cap = getattr(self.config, "final_logit_softcapping", None)  # Gemma 3, applied outside its lm_head
            return out_1NO if cap is None else torch.tanh(out_1NO / cap) * cap
        # a scalar head's last dim is 1; copy out of it so FSDP2 never hands autograd a view
        return out_1NO[..., 0].clone()

    def _layer_inputs(self, layer_type: str | None, hidden_1NH: Tensor, position_ids_1N: Tensor):
        """(mask, rotary (cos, sin), attention kwargs) of the layers of ``layer_type``: Gemma 3 has one rotary
        embedding per layer type, and its sliding layers attend within a window."""
        window = self.config.sliding_window if layer_type == "sliding_attention" else None
        mask, attention_kwargs = packed_attention_inputs(position_ids_1N, self.attn_implementation,
                                                         hidden_1NH.dtype, window)
        rotary_emb = self.model.rotary_emb
        rotary = (rotary_emb(hidden_1NH, position_ids_1N, layer_type) if hasattr(rotary_emb, "rope_type")
                  and isinstance(rotary_emb.rope_type, dict) else rotary_emb(hidden_1NH, position_ids_1N))
        return mask, rotary, attention_kwargs


def build_stage(model: nn.Module, *, head: str, pp_size: int, pp_rank: int) -> DecoderStage:
    """Cut stage ``pp_rank`` of ``pp_size`` out of a full model (the layers of other stages are dropped)."""
    num_layers = len(model.model.layers)
    if pp_size > num_layers:
        raise ValueError(f"pp_size {pp_size} is larger than the model's {num_layers} layers; "
                         f"allowed: 1..{num_layers}")
    layer_range = stage_layer_range(num_layers, pp_size, pp_rank)
    return DecoderStage(model, head=head, layer_range=layer_range,
                        is_first=pp_rank == 0, is_last=pp_rank == pp_size - 1)


def build_pipeline_stage(stage: DecoderStage, *, pp_rank: int, pp_size: int, group, device: torch.device,
                         num_tokens: int, hidden_size: int, vocab_size: int, compute_dtype: torch.dtype):
    """Wrap ``stage`` for torch.distributed.pipelining with static shapes: every micro-batch is [1, num_tokens].

    Declaring the shapes skips the runtime shape inference (an extra forward per step); the engine
    pads every packed micro-batch to the token budget under pipeline parallelism.
    """
    from torch.distributed.pipelining import PipelineStage

    def empty(*shape, dtype):
        return torch.zeros(shape, dtype=dtype, device=device)

    positions = empty(1, num_tokens, dtype=torch.long)
    hidden = empty(1, num_tokens, hidden_size, dtype=torch.float32).requires_grad_(True)
    inputs = (empty(1, num_tokens, dtype=torch.long), positions) if stage.is_first else (hidden, positions)
    if not stage.is_last:
        outputs = (hidden, positions)
    elif stage.head_name == "lm":
        outputs = (empty(1, num_tokens, vocab_size, dtype=compute_dtype),)
    else:
        outputs = (empty(1, num_tokens, dtype=compute_dtype),)
    return PipelineStage(stage, pp_rank, pp_size, device, input_args=inputs, output_args=outputs, group=group)


def build_schedule(pipeline_stage, *, num_micro_batches: int, loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
                   schedule: str = "1f1b"):
    """A torch.distributed.pipelining schedule running ``pipeline_stage`` for one step of ``num_micro_batches``.

    ``loss_fn(output, target)`` runs on the last stage per micro-batch; it must already be
    normalised over the whole batch, so the schedule does not rescale gradients.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    schedule_cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    return schedule_cls(pipeline_stage, n_microbatches=num_micro_batches, loss_fn=loss_fn, scale_grads=False)
