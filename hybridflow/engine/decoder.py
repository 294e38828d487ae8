"""A compact Llama-family decoder for generation, tensor-parallel over explicit groups, weights held as pieces.

Why our own forward instead of the Hugging Face module: the 3D-HybridEngine keeps the actor's
generation weights as *pieces* (the rank's own training shard, reused in place, plus the pieces
gathered from its micro-DP group). A column-parallel projection is computed piecewise and its
outputs concatenated; a row-parallel projection splits its input at the piece boundaries and sums
the partial products, then all-reduces over the generation tensor-parallel group (Megatron style).
No concatenated copy of the weights ever exists, so no rank holds a redundant copy.

Supported families: Llama, Qwen2 (q/k/v biases), Mistral (full attention), Qwen3 (per-head q/k RMSNorm before
the rotation), Qwen3-MoE (top-k routed experts, ``models/moe.py``), Gemma 3 text ((1 + w) norms around both
blocks, scaled embeddings, local and global rotary bases, sliding-window layers whose KV cache is a ring of the
window, ``engine/sliding_window.py``, final logit softcapping): RMSNorm, rotary embeddings as the HF config
describes them (rope_theta and the static rope scalings that transformers implements), grouped-query attention,
gated MLP, tied or untied output head.

Shape legend: B batch rows (the active ones), S positions in this forward, L cache positions,
H hidden size, I local intermediate features, Nq / Nkv local query / key-value heads, D head dim,
V vocabulary (Vl the local slice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.engine.sliding_window import ring_columns, ring_key_valid, window_mask, write_ring
from hybridflow.models.moe import grouped_experts, route

Pieces = list[torch.Tensor]
"""One parameter as consecutive pieces along its tensor-parallel dim (a single piece when whole)."""

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
HIDDEN_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True, kw_only=True)
class DecoderSpec:
    """The architecture numbers of a Llama-family decoder, read from its Hugging Face config."""

    vocab_size: int
    """V: rows of the input embedding and of the output head."""
    hidden_size: int
    """H: width of the residual stream."""
    num_layers: int
    """Decoder layers of the whole model."""
    num_heads: int
    """Query heads of the whole model."""
    num_kv_heads: int
    """Key/value heads of the whole model (grouped-query attention when fewer than num_heads)."""
    head_dim: int
    """D: width of one attention head."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool
    """Whether the output head reuses the input embedding matrix."""
    intermediate_size: int = 0
    """I: width of the gated MLP (memory estimates only; the weights carry their own shapes)."""
    hidden_act: str = "silu"
    """The gate's activation: "silu" or "gelu_pytorch_tanh" (Gemma 3)."""
    norm_weight_offset: float = 0.0
    """Added to every RMSNorm weight, the product taken in fp32 (Gemma 3 stores w for a scale of 1 + w)."""
    embedding_scale: float | None = None
    """Factor on the input embeddings (Gemma 3: sqrt(hidden_size))."""
    attention_scale: float | None = None
    """Scale of the attention scores (None: head_dim ** -0.5; Gemma 3: query_pre_attn_scalar ** -0.5)."""
    final_logit_softcapping: float | None = None
    """Logits become cap * tanh(logits / cap) (Gemma 3 when set)."""
    sliding_window: int | None = None
    """Keys a sliding-window layer sees, its own position included (None: no sliding layers)."""
    layer_types: tuple[str, ...] = ()
    """Per layer "full_attention" or "sliding_attention" (empty: every layer full)."""
    experts_per_token: int = 0
    """K of a mixture-of-experts model (Qwen3-MoE; 0: dense)."""
    normalize_top_k: bool = False
    """Whether an MoE token's K expert weights are renormalised to sum to one (``norm_topk_prob``)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.hidden_act not in HIDDEN_ACTIVATIONS:
            raise ValueError(f"hidden activation {self.hidden_act!r} is not supported by the generation decoder; "
                             f"allowed: {tuple(HIDDEN_ACTIVATIONS)}")

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    @classmethod
    def from_hf(cls, hf_config) -> "DecoderSpec":
        """Read the numbers from a transformers config of a supported family."""
        window = getattr(hf_config, "sliding_window", None)
        layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
        if SLIDING_ATTENTION not in layer_types:
            if window is not None and getattr(hf_config, "use_sliding_window", True):
                raise ValueError(f"sliding_window={window} on every layer: sliding-window attention is supported by "
                                 "the generation decoder only on the layers of layer_types; allowed: None")
            window = None
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (an embedding model) cannot generate; allowed: False")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        gemma = hf_config.model_type == "gemma3_text"
        return cls(vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size,
                   num_layers=hf_config.num_hidden_layers, num_heads=hf_config.num_attention_heads,
                   num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                   head_dim=head_dim, rms_norm_eps=hf_config.rms_norm_eps,
                   tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                   intermediate_size=getattr(hf_config, "intermediate_size", 0) or 0,
                   hidden_act=getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "silu"),
                   norm_weight_offset=1.0 if gemma else 0.0,
                   embedding_scale=hf_config.hidden_size ** 0.5 if gemma else None,
                   attention_scale=hf_config.query_pre_attn_scalar ** -0.5 if gemma else None,
                   final_logit_softcapping=getattr(hf_config, "final_logit_softcapping", None),
                   sliding_window=window, layer_types=layer_types,
                   experts_per_token=getattr(hf_config, "num_experts_per_tok", 0) or 0,
                   normalize_top_k=bool(getattr(hf_config, "norm_topk_prob", False)))

    def check_tp_size(self, tp_size: int) -> None:
        """ValueError unless heads, key/value heads and vocabulary divide evenly over ``tp_size`` ranks."""
        for name, count in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                            ("vocab_size", self.vocab_size)):
            if count % tp_size:
                raise ValueError(f"generation tp_size {tp_size} does not divide the model's {name} {count}; "
                                 f"allowed: a divisor of {count}")


def rope_inverse_frequencies(hf_config, layer_type: str = FULL_ATTENTION) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2], attention scaling) exactly as transformers computes them for this config (for the layers
    of ``layer_type`` where the config has one rotary embedding per layer type, as Gemma 3's local and global)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    per_layer_type = isinstance(params.get(layer_type), dict)
    params = params[layer_type] if per_layer_type else params
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported by the generation decoder; "
                         f"allowed: {_STATIC_ROPE_TYPES}")
    if rope_type == "default":
        spec = DecoderSpec.from_hf(hf_config)
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        exponents = torch.arange(0, spec.head_dim, 2, dtype=torch.int64).float() / spec.head_dim
        return 1.0 / (theta ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    extra = {"layer_type": layer_type} if per_layer_type else {}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, **extra)
    return inv_freq.float(), float(scaling)


class TensorParallelGroup:
    """The generation tensor-parallel group of one rank: all-reduce of partial sums, gather of vocab slices."""

    def __init__(self, group=None, *, size: int = 1, rank: int = 0) -> None:
        self.group, self.size, self.rank = group, size, rank

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def gather_last_dim(self, local: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return local
        slices = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(slices, local.contiguous(), group=self.group)
        return torch.cat(slices, dim=-1)


class KVCache:
    """Keys and values of one stage's layers for the active rows, preallocated to the final length; a
    sliding-window layer's as a ring of its window (``engine/sliding_window.py``) when the window is shorter."""

    def __init__(self, *, windows: list[int | None], batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device,
                 rotary: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.windows = windows
        """Per layer slot: the ring's size for a sliding layer whose window is below ``max_len``, else None."""
        self.max_len = max_len
        shapes = [(batch, kv_heads, window or max_len, head_dim) for window in windows]
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.length = 0
        self.rotary = rotary
        """Per layer type (cos, sin) [max_len, D] of every position the cache can hold (``DecoderStage.rotary_table``):
        a decode step looks its rows up instead of recomputing them."""

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def keep_rows(self, keep_B: torch.Tensor) -> None:
        """Drop finished rows: later steps compute only the rows still generating."""
        self.keys = [k[keep_B] for k in self.keys]
        self.values = [v[keep_B] for v in self.values]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


FEATURE_MAJOR_MAX_ROWS = 256
"""On CPU, fp32 projections of at most this many rows (decode steps) by a weight of at least
``FEATURE_MAJOR_MIN_WEIGHT`` elements are computed as ``weight @ x^T`` and transposed back: the same product
as ``F.linear``'s ``x @ weight^T``, with the weight's long side as the GEMM's row dimension, which this CPU's
BLAS runs faster at few rows (``python benchmarks/bench_generation.py --smollm2 --feature-major-ab``); from 512 rows it is
no faster, so prefills and training keep ``F.linear``."""

FEATURE_MAJOR_MIN_WEIGHT = 2**18
"""Smaller weights keep ``F.linear``: their products are fast either way and the transposing copy costs more
than it saves (SmolLM2's 576 x 192 k/v projections, and a 3.2 M-parameter model's decode, were slower with it)."""

HEAD_CHUNK_ROWS = 4096
"""Vocabulary rows of the output head computed per product in the feature-major form (each chunk's
transposed logits stay in cache while they are copied into the row-major result)."""


def _feature_major(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // x.shape[-1]
    return (x.device.type == "cpu" and x.dtype == torch.float32 and 0 < rows <= FEATURE_MAJOR_MAX_ROWS
            and weight.numel() >= FEATURE_MAJOR_MIN_WEIGHT)


def project(x_XK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` ([..., K] -> [..., N], row-major); see ``FEATURE_MAJOR_MAX_ROWS`` for how."""
    if not _feature_major(x_XK, weight_NK):
        return F.linear(x_XK, weight_NK)
    x_MK = x_XK.reshape(-1, x_XK.shape[-1])
    return (weight_NK @ x_MK.t()).t().contiguous().view(*x_XK.shape[:-1], weight_NK.shape[0])


def head_logits(hidden_BH: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """Row-major logits ``hidden @ weight^T`` [B, V]; in the feature-major form chunk by chunk of the
    vocabulary."""
    if not _feature_major(hidden_BH, weight_VH):
        return F.linear(hidden_BH, weight_VH)
    logits_BV = hidden_BH.new_empty((hidden_BH.shape[0], weight_VH.shape[0]))
    hidden_HB = hidden_BH.t()
    for start in range(0, weight_VH.shape[0], HEAD_CHUNK_ROWS):
        chunk_CH = weight_VH[start:start + HEAD_CHUNK_ROWS]
        logits_BV[:, start:start + chunk_CH.shape[0]] = (chunk_CH @ hidden_HB).t()
    return logits_BV


CPU_DECODE_MATMUL_ATTENTION = True
"""On CPU, decode steps (one query per row) attend with two batched matmuls in every precision, not only in half
precision: in fp32 no slower than PyTorch's CPU SDPA kernel at one query, faster at longer caches (the 64-wide
model of benchmarks/vs_trl at batch 128: 1.00-1.03x the SDPA decode at 32 new tokens, 1.10x at 128; ``python
benchmarks/bench_generation.py --model narrow --batch 128 --prompt-len 7 --new-tokens 32 --decode-attention-ab``)."""


CPU_DECODE_BIAS = True
"""fp32 decode steps on CPU pass their key mask to every layer as one additive bias built per step
(``decode_bias``, ``_biased_decode_attention``): ``python benchmarks/bench_generation.py --model narrow --batch 128
--prompt-len 7 --new-tokens 32 --decode-bias-ab``."""


def grouped_matmul_attention(x: torch.Tensor, num_queries: int) -> bool:
    """Whether ``attention`` computes in batched matmuls rather than SDPA: on CPU in half precision, and for
    one query per row (a decode step) in any precision (``CPU_DECODE_MATMUL_ATTENTION``)."""
    return x.device.type == "cpu" and (x.dtype in (torch.bfloat16, torch.float16)
                                       or (num_queries == 1 and CPU_DECODE_MATMUL_ATTENTION))


def attention(q_BNSD: torch.Tensor, keys_BKLD: torch.Tensor, values_BKLD: torch.Tensor, mask_B1SL: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Attention of N query heads over K key/value heads (grouped when K < N) under a boolean mask.

    SDPA, except for half precision on CPU: PyTorch's CPU SDPA kernel is several times slower in bf16 than in
    fp32 there (decode at batch 32, 96 cached positions: 1.6 ms against 0.26 ms per layer), so each group of
    N // K query heads is multiplied with its key/value head as two batched bf16 matmuls, with the softmax in
    fp32 (0.23 ms; `python benchmarks/bench_precision.py --attention`). The mask always lets a query see
    itself, so no row is fully masked.
    """
    num_heads, num_kv_heads = q_BNSD.shape[1], keys_BKLD.shape[1]
    if mask_B1SL.dtype != torch.bool:
        return _biased_decode_attention(q_BNSD, keys_BKLD, values_BKLD, mask_B1SL, scale)
    if not grouped_matmul_attention(q_BNSD, q_BNSD.shape[2]):
        return F.scaled_dot_product_attention(q_BNSD, keys_BKLD, values_BKLD, attn_mask=mask_B1SL, scale=scale,
                                              enable_gqa=num_heads != num_kv_heads)
    B, _, S, D = q_BNSD.shape
    L, group = keys_BKLD.shape[2], num_heads // num_kv_heads
    q_BKXD = q_BNSD.reshape(B, num_kv_heads, group * S, D)  # X = (query head within the group, position)
    scores_BKGSL = (q_BKXD @ keys_BKLD.transpose(-1, -2)).float().mul_(scale).view(B, num_kv_heads, group, S, L)
    scores_BKGSL.masked_fill_(~mask_B1SL.unsqueeze(1), torch.finfo(torch.float32).min)
    probs_BKXL = scores_BKGSL.softmax(-1).to(q_BNSD.dtype).view(B, num_kv_heads, group * S, L)
    return (probs_BKXL @ values_BKLD).view(B, num_heads, S, D)


def decode_bias(mask_B11L: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """A decode step's boolean key mask as the additive fp32 bias ``attention`` takes instead ([B*K, 1, L]: 0
    where a key is visible, fp32's lowest elsewhere): built once per step and shared by every layer."""
    B, L = mask_B11L.shape[0], mask_B11L.shape[-1]
    bias_BK1L = torch.zeros(B, num_kv_heads, 1, L, dtype=torch.float32, device=mask_B11L.device)
    return bias_BK1L.masked_fill_(~mask_B11L, torch.finfo(torch.float32).min).view(B * num_kv_heads, 1, L)


def _biased_decode_attention(q_BN1D: torch.Tensor, keys_BKLD: torch.Tensor, values_BKLD: torch.Tensor,
                             bias_X1L: torch.Tensor, scale: float) -> torch.Tensor:
    """fp32 grouped attention of one query per row with the mask as an additive bias (``decode_bias``): the
    scale and the mask ride in one ``baddbmm``: three ops instead of five, the same values bit for bit (the
    masked scores' exponentials are 0 either way, the visible ones get + 0.0)."""
    B, num_heads, _, D = q_BN1D.shape
    num_kv_heads, L = keys_BKLD.shape[1], keys_BKLD.shape[2]
    group = num_heads // num_kv_heads
    q_XGD = q_BN1D.reshape(B * num_kv_heads, group, D)
    scores_XGL = torch.baddbmm(bias_X1L, q_XGD, keys_BKLD.view(B * num_kv_heads, L, D).transpose(-1, -2),
                               alpha=scale)
    out_XGD = scores_XGL.softmax(-1) @ values_BKLD.view(B * num_kv_heads, L, D)
    return out_XGD.view(B, num_heads, 1, D)


class DecoderStage:
    """The layers of one generation pipeline stage on one tensor-parallel rank, computed from weight pieces.

    ``weights`` maps Hugging Face parameter names (of this stage only) to their pieces; for a
    tensor-parallel parameter the pieces concatenated along ``tp_shard_dim`` are this rank's
    generation shard, which is chunk ``tp.rank`` of ``tp.size``.
    """

    def __init__(self, spec: DecoderSpec, hf_config, weights: dict[str, Pieces], *, layers: range,
                 has_embedding: bool, has_final_norm: bool, has_head: bool,
                 tp: TensorParallelGroup | None = None) -> None:
        self.spec, self.weights, self.layers = spec, weights, layers
        self.tp = tp or TensorParallelGroup()
        spec.check_tp_size(self.tp.size)
        self.has_embedding, self.has_final_norm, self.has_head = has_embedding, has_final_norm, has_head
        self.local_heads = spec.num_heads // self.tp.size
        self.local_kv_heads = spec.num_kv_heads // self.tp.size
        self.vocab_start = self.tp.rank * (spec.vocab_size // self.tp.size)
        self._check_weights()
        any_piece = next(iter(weights.values()))[0]
        self.dtype, self.device = any_piece.dtype, any_piece.device
        self.layer_types = sorted({spec.layer_type(layer) for layer in layers} | {FULL_ATTENTION})
        # once, not a host-to-device copy per decode step
        self.rope = {kind: (inv_freq.to(self.device), scaling) for kind in self.layer_types
                     for inv_freq, scaling in [rope_inverse_frequencies(hf_config, kind)]}
        self.activation = HIDDEN_ACTIVATIONS[spec.hidden_act]
        self.sandwich_norms = any(name.endswith("pre_feedforward_layernorm.weight") for name in weights)
        """Gemma 3: the attention and MLP outputs are normalised again before the residual add."""
        self.moe_layers = [layer for layer in layers if f"model.layers.{layer}.mlp.gate.weight" in weights]
        """This stage's mixture-of-experts layers (Qwen3-MoE; dense layers such as ``mlp_only_layers`` excluded)."""
        self.num_experts = (weights[f"model.layers.{self.moe_layers[0]}.mlp.gate.weight"][0].shape[0]
                            if self.moe_layers else 0)
        self.routing: list[torch.Tensor] | None = None
        """While a list (routing replay, ``generation.RoutingRecorder``): every MoE layer appends the experts its
        router chose for each token of the forward, [B, S, K], in layer order."""

    @classmethod
    def from_state_dict(cls, hf_config, state_dict: dict[str, torch.Tensor]) -> "DecoderStage":
        """The whole model on one process, each parameter a single piece (no copy of the tensors)."""
        spec = DecoderSpec.from_hf(hf_config)
        weights = {name: [tensor.detach()] for name, tensor in state_dict.items()
                   if name.startswith("model.") or name.startswith("lm_head.")}
        return cls(spec, hf_config, weights, layers=range(spec.num_layers),
                   has_embedding=True, has_final_norm=True, has_head=True)

    def _check_weights(self) -> None:
        names = [f"model.layers.{i}.{m}.weight" for i in self.layers for m in
                 ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj")]
        for i in self.layers:
            moe = f"model.layers.{i}.mlp.gate.weight" in self.weights
            names += ([f"model.layers.{i}.mlp.experts.{m}" for m in ("gate_up_proj", "down_proj")] if moe
                      else [f"model.layers.{i}.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")])
        if self.has_embedding or (self.has_head and self.spec.tie_word_embeddings):
            names.append("model.embed_tokens.weight")
        if self.has_final_norm:
            names.append("model.norm.weight")
        if self.has_head and not self.spec.tie_word_embeddings:
            names.append("lm_head.weight")
        missing = [n for n in names if n not in self.weights]
        assert not missing, f"decoder stage is missing weights {missing[:4]}"

    # ----- building blocks -------------------------------------------------------------------------
    def _column(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Column-parallel projection: the local output features, piece by piece."""
        biases = self.weights.get(f"{name}.bias")
        weights = self.weights[f"{name}.weight"]
        if len(weights) == 1:
            return project(x, weights[0]) if biases is None else project(x, weights[0]) + biases[0]
        outs = [project(x, w) if biases is None else project(x, w) + biases[i] for i, w in enumerate(weights)]
        return torch.cat(outs, dim=-1)

    def _row(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Row-parallel projection: partial sums over the local input features, all-reduced over tp."""
        weights = self.weights[f"{name}.weight"]
        if len(weights) == 1:
            partial = project(x, weights[0])
        else:
            inputs = x.split([w.shape[1] for w in weights], dim=-1)
            partial = project(inputs[0], weights[0])
            for inp, w in zip(inputs[1:], weights[1:]):
                partial = partial + project(inp, w)
        out = self.tp.all_reduce(partial)
        bias = self.weights.get(f"{name}.bias")
        return out + bias[0] if bias is not None else out

    def _rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """Hugging Face's RMSNorm: normalised in fp32, cast back, then scaled (``F.rms_norm`` without a weight is
        the same fp32 arithmetic, bit for bit on CPU, in one kernel instead of five)."""
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.spec.rms_norm_eps)
        if self.spec.norm_weight_offset:  # Gemma 3: (x * (1 + w)) in fp32, then cast
            return (normed * (self.spec.norm_weight_offset + self.weights[name][0].float())).to(x.dtype)
        return self.weights[name][0] * normed.to(x.dtype)

    def embed(self, ids_BS: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each piece looks up the ids in its vocabulary range; sum over tp."""
        pieces = self.weights["model.embed_tokens.weight"]
        embedded_BSH = self._embed_lookup(ids_BS, pieces)
        if self.spec.embedding_scale is None:
            return embedded_BSH
        # as transformers: the fp32 scale cast to the weights' dtype first
        return embedded_BSH * torch.tensor(self.spec.embedding_scale, dtype=torch.float32).to(pieces[0].dtype)

    def _embed_lookup(self, ids_BS: torch.Tensor, pieces: Pieces) -> torch.Tensor:
        if self.tp.size == 1 and len(pieces) == 1:  # the whole vocabulary in one piece: a plain lookup
            return F.embedding(ids_BS, pieces[0])
        out = None
        start = self.vocab_start
        for w in pieces:
            inside = (ids_BS >= start) & (ids_BS < start + w.shape[0])
            rows = F.embedding((ids_BS - start).clamp(0, w.shape[0] - 1), w) * inside.unsqueeze(-1).to(w.dtype)
            out = rows if out is None else out + rows
            start += w.shape[0]
        return self.tp.all_reduce(out)

    def head(self, hidden_BH: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [B, V] in fp32: local vocabulary slices, gathered over tp."""
        name = "model.embed_tokens.weight" if self.spec.tie_word_embeddings else "lm_head.weight"
        pieces = self.weights[name]
        local = (head_logits(hidden_BH, pieces[0]) if len(pieces) == 1
                 else torch.cat([head_logits(hidden_BH, w) for w in pieces], dim=-1))
        logits_BV = self.tp.gather_last_dim(local.float())
        cap = self.spec.final_logit_softcapping
        return logits_BV if cap is None else torch.tanh(logits_BV / cap) * cap

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(hidden, "model.norm.weight")

    def rotary_table(self, positions: torch.Tensor,
                     layer_type: str = FULL_ATTENTION) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [*positions.shape, D] of the rotary embedding of ``layer_type`` layers at ``positions``, in
        the stage's dtype."""
        inv_freq, scaling = self.rope[layer_type]
        freqs = positions.float().unsqueeze(-1) * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)

    def _rope(self, positions_BS: torch.Tensor, cache: KVCache) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type (cos, sin) [B, 1, S, D] at ``positions_BS``: rows of the cache's tables (the same values:
        a table is this computation at every position)."""
        return {kind: (cos_LD[positions_BS].unsqueeze(1), sin_LD[positions_BS].unsqueeze(1))
                for kind, (cos_LD, sin_LD) in cache.rotary.items()}

    def _layer(self, hidden_BSH: torch.Tensor, layer: int, attend, *, static_shapes: bool = False) -> torch.Tensor:
        """One decoder layer around ``attend(normed_BSH) -> [B, S, H]``: pre-norm residual blocks, and with
        sandwich norms (Gemma 3) the attention and MLP outputs normalised again before each residual add.
        ``static_shapes``: no shape may depend on the data (``_experts``), for CUDA graph capture."""
        prefix = f"model.layers.{layer}"
        attended_BSH = attend(self._rms_norm(hidden_BSH, f"{prefix}.input_layernorm.weight"))
        if self.sandwich_norms:
            attended_BSH = self._rms_norm(attended_BSH, f"{prefix}.post_attention_layernorm.weight")
            hidden_BSH = hidden_BSH + attended_BSH
            mlp_BSH = self._mlp(self._rms_norm(hidden_BSH, f"{prefix}.pre_feedforward_layernorm.weight"), layer,
                                static_shapes=static_shapes)
            return hidden_BSH + self._rms_norm(mlp_BSH, f"{prefix}.post_feedforward_layernorm.weight")
        hidden_BSH = hidden_BSH + attended_BSH
        return hidden_BSH + self._mlp(self._rms_norm(hidden_BSH, f"{prefix}.post_attention_layernorm.weight"), layer,
                                      static_shapes=static_shapes)

    @property
    def attention_scale(self) -> float:
        return self.spec.attention_scale or self.spec.head_dim ** -0.5

    def _queries_keys_values(self, x_BSH: torch.Tensor, prefix: str, cos, sin):
        """(q [B, Nq, S, D], k [B, Nkv, S, D], v [B, Nkv, S, D]) of one attention layer: projected, each head
        RMS-normalised where the family has q/k norms (Qwen3), then rotated."""
        B, S, _ = x_BSH.shape
        D = self.spec.head_dim
        q_BSND = self._column(x_BSH, f"{prefix}.q_proj").view(B, S, self.local_heads, D)
        k_BSND = self._column(x_BSH, f"{prefix}.k_proj").view(B, S, self.local_kv_heads, D)
        v_BNSD = self._column(x_BSH, f"{prefix}.v_proj").view(B, S, self.local_kv_heads, D).transpose(1, 2)
        if f"{prefix}.q_norm.weight" in self.weights:
            q_BSND = self._rms_norm(q_BSND, f"{prefix}.q_norm.weight")
            k_BSND = self._rms_norm(k_BSND, f"{prefix}.k_norm.weight")
        q_BNSD, k_BNSD = q_BSND.transpose(1, 2), k_BSND.transpose(1, 2)
        q_BNSD = q_BNSD * cos + _rotate_half(q_BNSD) * sin
        k_BNSD = k_BNSD * cos + _rotate_half(k_BNSD) * sin
        return q_BNSD, k_BNSD, v_BNSD

    def _attention(self, x_BSH: torch.Tensor, layer: int, slot: int, cache: KVCache,
                   cos, sin, mask_B1SL: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSH.shape
        D = self.spec.head_dim
        prefix = f"model.layers.{layer}.self_attn"
        q_BNSD, k_BNSD, v_BNSD = self._queries_keys_values(x_BSH, prefix, cos, sin)
        if cache.windows[slot] is not None:  # mask_B1SL: sliding_window.window_mask over the ring, then the new keys
            keys_BKXD = torch.cat([cache.keys[slot], k_BNSD], dim=2)
            values_BKXD = torch.cat([cache.values[slot], v_BNSD], dim=2)
            out_BNSD = attention(q_BNSD, keys_BKXD, values_BKXD, mask_B1SL, self.attention_scale)
            write_ring(cache.keys[slot], k_BNSD, cache.length)
            write_ring(cache.values[slot], v_BNSD, cache.length)
            return self._row(out_BNSD.transpose(1, 2).reshape(B, S, self.local_heads * D), f"{prefix}.o_proj")
        end = cache.length + S
        cache.keys[slot][:, :, cache.length:end] = k_BNSD
        cache.values[slot][:, :, cache.length:end] = v_BNSD
        if mask_B1SL.shape[-1] == end:
            keys_BKLD, values_BKLD = cache.keys[slot][:, :, :end], cache.values[slot][:, :, :end]
        else:  # the whole preallocated cache, the positions from ``end`` on masked (forward_layers)
            keys_BKLD, values_BKLD = cache.keys[slot], cache.values[slot]
        # grouped-query attention without expanding the cache to every query head (that would copy the
        # whole KV cache once per layer per decode step)
        out_BNSD = attention(q_BNSD, keys_BKLD, values_BKLD, mask_B1SL, self.attention_scale)
        out_BSX = out_BNSD.transpose(1, 2).reshape(B, S, self.local_heads * D)
        return self._row(out_BSX, f"{prefix}.o_proj")

    def _attention_at(self, x_B1H: torch.Tensor, layer: int, slot: int, cache: KVCache, cos, sin,
                      mask_B11L: torch.Tensor, index_1: torch.Tensor) -> torch.Tensor:
        """One decode position with static shapes: write its key/value at ``index_1`` (a device tensor) and
        attend over the whole preallocated cache under ``mask_B11L``; no Python-side length, so a CUDA
        graph can replay it."""
        B = x_B1H.shape[0]
        D = self.spec.head_dim
        prefix = f"model.layers.{layer}.self_attn"
        q_BN1D, k_BK1D, v_BK1D = self._queries_keys_values(x_B1H, prefix, cos, sin)
        window = cache.windows[slot]
        slot_1 = index_1 if window is None else torch.remainder(index_1, window)  # a ring: mask_B11L is its own
        cache.keys[slot].index_copy_(2, slot_1, k_BK1D)
        cache.values[slot].index_copy_(2, slot_1, v_BK1D)
        out_BN1D = attention(q_BN1D, cache.keys[slot], cache.values[slot], mask_B11L, self.attention_scale)
        return self._row(out_BN1D.transpose(1, 2).reshape(B, 1, self.local_heads * D), f"{prefix}.o_proj")

    def decode_layers_at(self, hidden_B1H: torch.Tensor, positions_B1: torch.Tensor, cache: KVCache,
                         key_valid_BL: torch.Tensor, index_1: torch.Tensor) -> torch.Tensor:
        """``forward_layers`` for one new position per row at cache slot ``index_1``, with static shapes.

        ``key_valid_BL`` spans the whole cache and must already mark the new position valid; rows that
        finished keep computing (their outputs are ignored), so the batch never changes shape.
        """
        masks = {None: key_valid_BL[:, None, None, :]}
        for window in set(cache.windows) - {None}:  # the ring's slots, once this position is written
            masks[window] = ring_key_valid(key_valid_BL, ring_columns(index_1, window, index_1.device))[:, None, None]
        rotary = self._rope(positions_B1, cache)
        for slot, layer in enumerate(self.layers):
            cos, sin = rotary[self.spec.layer_type(layer)]
            mask_B11L = masks[cache.windows[slot]]
            hidden_B1H = self._layer(hidden_B1H, layer, lambda normed: self._attention_at(
                normed, layer, slot, cache, cos, sin, mask_B11L, index_1), static_shapes=True)
        return hidden_B1H

    def _experts(self, x_BSH: torch.Tensor, prefix: str, *, static_shapes: bool = False) -> torch.Tensor:
        """A mixture-of-experts MLP (Qwen3-MoE): route each token to its top-k experts and run them as one grouped
        computation (``models/moe.py``). Its weights are replicated over tensor-parallel ranks, so each rank
        computes the whole block and nothing is reduced."""
        x_TH = x_BSH.reshape(-1, x_BSH.shape[-1])
        _, weights_TK, experts_TK = route(x_TH, self.weights[f"{prefix}.gate.weight"][0], self.spec.experts_per_token,
                                          self.spec.normalize_top_k)
        if self.routing is not None:
            self.routing.append(experts_TK.view(*x_BSH.shape[:2], -1))
        out_TH = grouped_experts(x_TH, experts_TK, weights_TK, self.weights[f"{prefix}.experts.gate_up_proj"][0],
                                 self.weights[f"{prefix}.experts.down_proj"][0], self.activation,
                                 static_shapes=static_shapes)
        return out_TH.view(x_BSH.shape)

    def _mlp(self, x_BSH: torch.Tensor, layer: int, *, static_shapes: bool = False) -> torch.Tensor:
        prefix = f"model.layers.{layer}.mlp"
        if f"{prefix}.gate.weight" in self.weights:
            return self._experts(x_BSH, prefix, static_shapes=static_shapes)
        names = [f"{prefix}.{part}_proj" for part in ("gate", "up", "down")]
        pieces = [self.weights[f"{name}.weight"] for name in names]
        if (all(len(p) == 1 for p in pieces) and not any(f"{name}.bias" in self.weights for name in names)
                and _feature_major(x_BSH, pieces[0][0])):
            # feature-major from the input to the down projection: one transposing copy instead of three
            (gate_IH,), (up_IH,), (down_HI,) = pieces
            x_HM = x_BSH.reshape(-1, x_BSH.shape[-1]).t()
            gated_IM = self.activation(gate_IH @ x_HM) * (up_IH @ x_HM)
            out_MH = (down_HI @ gated_IM).t().contiguous().view(x_BSH.shape)
            return self.tp.all_reduce(out_MH)
        gated_BSI = self.activation(self._column(x_BSH, names[0])) * self._column(x_BSH, names[1])
        return self._row(gated_BSI, names[2])

    def bytes_per_row(self, prompt_len: int, max_new_tokens: int) -> int:
        """Estimated device bytes one row costs this stage during generation: its KV cache at full length
        plus the prefill's transient activations (hidden states, attention and MLP projections of the
        prompt) and the fp32 logits of one position."""
        element = torch.finfo(self.dtype).bits // 8
        spec = self.spec
        kv_positions = sum(window or prompt_len + max_new_tokens
                           for window in self._windows(prompt_len + max_new_tokens))
        kv = 2 * self.local_kv_heads * kv_positions * spec.head_dim * element
        local_inter = spec.intermediate_size // self.tp.size
        prefill = prompt_len * (4 * spec.hidden_size + 3 * local_inter) * element
        logits = 2 * spec.vocab_size * 4 if self.has_head else 0
        return kv + prefill + logits

    def new_cache(self, *, batch: int, max_len: int) -> KVCache:
        """An empty KV cache of ``batch`` rows for ``max_len`` positions, with the rotary table of those
        positions (every position a row reaches is below ``max_len``: positions count its real tokens)."""
        positions = torch.arange(max_len, device=self.device)
        rotary = {kind: self.rotary_table(positions, kind) for kind in self.layer_types}
        return KVCache(windows=self._windows(max_len), batch=batch, kv_heads=self.local_kv_heads, max_len=max_len,
                       head_dim=self.spec.head_dim, dtype=self.dtype, device=self.device, rotary=rotary)

    def _windows(self, max_len: int) -> list[int | None]:
        """Per layer slot, the ring size of a sliding layer whose window is shorter than ``max_len`` (else None: a
        window that long never hides a key, so the layer attends like a full one)."""
        window = self.spec.sliding_window
        return [window if self.spec.layer_type(layer) == SLIDING_ATTENTION and window < max_len else None
                for layer in self.layers]

    def forward_layers(self, hidden_BSH: torch.Tensor, positions_BS: torch.Tensor, cache: KVCache,
                       key_valid_BL: torch.Tensor) -> torch.Tensor:
        """Run this stage's layers on S new positions, appending their keys/values to ``cache``.

        ``key_valid_BL`` marks the real tokens among the L = cache.length + S positions; a query
        attends to valid keys at or before its own position (and always to itself, so rows of
        left padding stay finite).
        """
        S = hidden_BSH.shape[1]
        L = cache.length + S
        if S == 1:  # a decode step: every cached position precedes the query, so the mask is the keys' validity
            mask_B1SL = key_valid_BL[:, None, None, :L].clone()
            mask_B1SL[..., -1] = True
        else:
            query_pos = torch.arange(cache.length, L, device=hidden_BSH.device)
            key_pos = torch.arange(L, device=hidden_BSH.device)
            causal_SL = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
            mask_B1SL = (key_valid_BL[:, None, None, :L] & causal_SL) | (key_pos == query_pos.unsqueeze(1))
        if grouped_matmul_attention(hidden_BSH, S):
            # matmuls on CPU copy a strided slice of the cache before multiplying it (bf16: 3 ms per layer at
            # batch 128 on the 256-wide model, more than the attention), so they take the whole contiguous
            # cache and the positions not yet written are masked (fp32 decode steps too)
            unwritten = cache.max_len - L
            mask_B1SL = torch.cat([mask_B1SL, mask_B1SL.new_zeros(*mask_B1SL.shape[:-1], unwritten)], dim=-1)
            if S == 1 and hidden_BSH.dtype == torch.float32 and CPU_DECODE_BIAS:
                mask_B1SL = decode_bias(mask_B1SL, self.local_kv_heads)
        masks = {None: mask_B1SL}
        masks.update({window: window_mask(key_valid_BL, cache.length, S, window)
                      for window in set(cache.windows) - {None}})
        rotary = self._rope(positions_BS, cache)
        for slot, layer in enumerate(self.layers):
            cos, sin = rotary[self.spec.layer_type(layer)]
            mask = masks[cache.windows[slot]]
            hidden_BSH = self._layer(hidden_BSH, layer, lambda normed: self._attention(
                normed, layer, slot, cache, cos, sin, mask))
        cache.length = L
        return hidden_BSH

