"""vLLM as the actor's rollout engine: one in-process engine per generation replica, loaded in place from the
3D-HybridEngine's generation shard before every rollout (``actor.generation.backend: vllm``).

Life of the engine on one actor rank:

1. First rollout: build one ``vllm.LLM`` inside this process (uniprocess executor, no engine-core process),
   from the model's ``config.json`` only (written to a temporary directory) with ``load_format="dummy"``:
   no weights are read from disk and no tokenizer is loaded (token ids in, token ids out). On CPU, vLLM
   prepacks every linear weight into a oneDNN/SGL handle and drops the tensor; we give each linear layer
   back a plain weight tensor of our own and route it through ``F.linear``, so later updates are copies
   into existing tensors instead of a repack (``WEIGHTS_NOTE``). With tg > 1 every rank builds its engine
   at once (``external_launcher`` executor over the caller's torch.distributed world), vLLM's TP groups
   being the hybrid engine's generation TP groups (``vllm_tp_groups``) and its vocabulary split into the
   same equal chunks (``vocab_padding``).
2. Every rollout: the hybrid engine gathers this rank's generation shard (its micro-DP all-gather, the
   bytes of the paper's Table 2); ``load_weights`` copies its pieces straight into vLLM's (TP-sharded) fused
   parameters (q/k/v rows into ``qkv_proj``, gate/up rows into ``gate_up_proj``, the vocabulary into the
   padded embedding and head, Qwen3-MoE's stacked experts into the fused-MoE ``w13_weight``/``w2_weight``, each
   TP rank its slice of every expert, prepacked in place for vLLM's CPU MoE kernel). The gathered pieces are then
   dropped and vLLM generates.
3. After the rollout the KV cache and the weight copy are released for training: vLLM's sleep mode where
   the platform has it (CUDA), else (the CPU build has no sleep mode) by shrinking their storages to zero
   bytes and growing them back before the next load.

A LoRA actor with ``actor.lora.vllm_sync: adapter`` builds the engine with LoRA slots instead: the base weights are
loaded once (step 2 with the unmerged shard) and kept between rollouts (only the KV cache is released), and every
later sync is ``load_adapter`` (A and B alone, ``hybridflow.engine.vllm_lora``), every request carrying the adapter.

Shape legend: B rows (prompts x samples per prompt), P prompt length, T max new tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass

import torch

from hybridflow.device import device_type
from hybridflow.engine.generation_config import GenerationConfig, SamplingConfig
from hybridflow.engine.hybrid_engine import parameter_shapes, storage_bytes
from hybridflow.engine.rollout import (GenerationShard, Rollout, RolloutStats, batch_output,
                                       cut_at_stop_sequence)
from hybridflow.engine.vllm_lora import VllmAdapter, check_lora_targets, vllm_lora_modules, vllm_lora_options
from hybridflow.engine.vllm_requests import VllmRequests, vllm_sampling_params
from hybridflow.engine.vllm_routing import VllmRoutingRecorder
from hybridflow.models.families import causal_lm_class_name
from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD
from hybridflow.parallel.sharding import tp_shard_dim

IN_FLIGHT_NOTE = """Weights loaded between two ``step`` calls reach the requests in flight (``async.mode: streaming``):
their tokens so far are kept, each stamped with the version that sampled it, and every later token is sampled by
the new weights from keys and values the new weights recomputed over the prompt and those tokens (vLLM's
``reset_prefix_cache(reset_running_requests=True)``: the running requests are preempted and re-prefilled on their
next step, their per-request random generators kept). The keys and values the old weights computed are never
reused: keeping them (as PipelineRL does) would make a token's distribution neither the old policy's nor the new
one's, so its recorded log-prob would not be the log-prob of any policy the trainer knows. The native backend
recomputes them too (it prefills afresh every round). The cost is one prefill of every request in flight per
sync."""

WEIGHTS_NOTE = ("vLLM's CPU build prepacks linear weights for its GEMM kernels and frees the tensors; the rollout "
                "engine keeps plain tensors of its own instead so every update is an in-place copy")

# (vLLM fused parameter suffix, the Hugging Face parameters stacked along dim 0 in that order)
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
EXPERTS = {"w13_weight": "gate_up_proj", "w2_weight": "down_proj"}
"""A fused-MoE layer's parameter (vLLM) -> the stacked expert parameter of transformers it holds, in the same layout:
``w13_weight`` [E, 2I, H] the gate rows then the up rows of each expert, ``w2_weight`` [E, H, I]."""


@dataclass(frozen=True)
class _Slot:
    """Where a Hugging Face parameter lands inside a vLLM parameter: rows [offset, offset + rows) of dim 0."""

    hf_name: str
    offset: int
    rows: int


def vllm_parameter_plan(hf_shapes: dict[str, torch.Size], vllm_names: list[str],
                        tie_word_embeddings: bool, tp_size: int = 1) -> dict[str, list[_Slot]]:
    """vLLM parameter name -> the Hugging Face parameters it is made of, on one of ``tp_size`` ranks.

    q/k/v stack into ``qkv_proj`` and gate/up into ``gate_up_proj`` (weights and biases alike); a fused-MoE layer's
    ``w13_weight``/``w2_weight`` hold the stacked experts (``EXPERTS``); every other parameter maps to the one of the
    same name (``lm_head`` to the embedding when tied). Under tensor parallelism a rank's fused parameter stacks the
    rank's shard of each part (its q heads, then its k and v heads), so a part split along dim 0 takes 1/tp_size of
    its rows.
    """
    plan = {}
    for name in vllm_names:
        # a LoRA-enabled engine wraps each adaptable layer, its own parameters under ``base_layer``
        sources = _hf_sources(name.replace(".base_layer.", "."), tie_word_embeddings)
        missing = [s for s in sources if s not in hf_shapes]
        if missing:
            raise ValueError(f"vLLM parameter {name!r} needs {missing}, which the model does not have; the vLLM "
                             f"backend loads the families whose weights it maps to vLLM's (tested: llama, mistral, "
                             f"qwen2, qwen3, qwen3_moe, gemma3_text); use generation.backend=native for this model")
        slots, offset = [], 0
        for source in sources:
            rows = hf_shapes[source][0] // (tp_size if tp_shard_dim(source) == 0 else 1)
            slots.append(_Slot(source, offset, rows))
            offset += rows
        plan[name] = slots
    return plan


def _hf_sources(vllm_name: str, tie_word_embeddings: bool) -> list[str]:
    """The Hugging Face parameters stacked (dim 0, in order) into vLLM parameter ``vllm_name``."""
    for fused, parts in FUSED.items():
        marker = f".{fused}."
        if marker in vllm_name:
            prefix, kind = vllm_name.split(marker)
            return [f"{prefix}.{part}.{kind}" for part in parts]
    prefix, _, kind = vllm_name.rpartition(".")
    if kind in EXPERTS and ".mlp.experts" in prefix:
        # vLLM may nest the expert weights in a submodule of the block's ``experts``
        return [f"{prefix.split('.mlp.experts')[0]}.mlp.experts.{EXPERTS[kind]}"]
    if vllm_name == "lm_head.weight" and tie_word_embeddings:
        return ["model.embed_tokens.weight"]
    return [vllm_name]


def copy_pieces(target: torch.Tensor, hf_name: str, pieces: list[torch.Tensor]) -> int:
    """Copy a generation shard's pieces (split along the name's tensor-parallel dim) into ``target``; bytes."""
    dim = tp_shard_dim(hf_name)
    if len(pieces) == 1 or dim is None:
        target.copy_(pieces[0])
        return pieces[0].numel() * target.element_size()
    start = 0
    for piece in pieces:
        target.narrow(dim, start, piece.shape[dim]).copy_(piece)
        start += piece.shape[dim]
    assert start == target.shape[dim], f"{hf_name}: pieces cover {start} of {target.shape[dim]}"
    return sum(p.numel() for p in pieces) * target.element_size()


@dataclass(frozen=True)
class ExpertWriter:
    """How a fused-MoE weight (``EXPERTS``) goes into vLLM's parameter on one of ``tp_size`` TP ranks: this rank's
    slice of every expert's intermediate dim (``expert_tp_slice``), zero-padded to the kernel's width
    (``pad_intermediate``) and, for vLLM's CPU grouped-GEMM kernel, prepacked for its ``isa`` straight into the
    existing tensor (the packed layout has the plain one's shape), so every update stays in place."""

    kind: str
    isa: str | None  # None: vLLM computes on the plain layout (CUDA, or its CPU kernel through zentorch)
    tp_rank: int = 0
    tp_size: int = 1

    def write(self, target: torch.Tensor, pieces: list[torch.Tensor]) -> int:
        """Write this rank's slice of the stacked experts (replicated over the generation TP group: every piece
        is whole); bytes written before padding."""
        experts = expert_tp_slice(pieces[0], self.kind, self.tp_rank, self.tp_size)
        padded = pad_intermediate(experts, target.shape, self.kind).to(target.dtype).contiguous()
        if self.isa is None:
            target.copy_(padded)
        else:
            torch.ops._C.prepack_moe_weight(padded, target, self.isa)
        return experts.numel() * target.element_size()


def expert_tp_slice(experts: torch.Tensor, kind: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of stacked experts, as vLLM's fused-MoE layer shards them: the contiguous
    1/tp_size of every expert's intermediate dim I, i.e. rows of the gate half and of the up half of
    ``w13_weight`` [E, 2I, H] (each sliced alone) -> [E, 2I/t, H], columns of ``w2_weight`` [E, H, I] -> [E, H, I/t]."""
    if tp_size == 1:
        return experts
    if kind == "w2_weight":
        return experts.chunk(tp_size, dim=2)[tp_rank]
    return torch.cat([half.chunk(tp_size, dim=1)[tp_rank] for half in experts.chunk(2, dim=1)], dim=1)


def pad_intermediate(experts: torch.Tensor, shape: torch.Size, kind: str) -> torch.Tensor:
    """A rank's stacked experts (``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I], I the rank's part) zero-padded
    to vLLM's ``shape`` ([E, 2P, H], [E, H, P], P >= I) as vLLM's CPU kernel pads them: gate rows [0, I), up rows
    [P, P + I)."""
    if experts.shape == shape:
        return experts
    if kind == "w2_weight":
        return torch.nn.functional.pad(experts, (0, shape[2] - experts.shape[2]))
    gate, up = experts.chunk(2, dim=1)
    rows = shape[1] // 2 - gate.shape[1]
    return torch.cat([torch.nn.functional.pad(part, (0, 0, 0, rows)) for part in (gate, up)], dim=1)


def expert_writers(model: torch.nn.Module, vllm_names) -> dict[str, ExpertWriter]:
    """vLLM's fused-MoE parameters among ``vllm_names`` -> how each is written (empty for a dense model)."""
    writers = {}
    for name in vllm_names:
        module_name, _, kind = name.rpartition(".")
        if kind in EXPERTS and ".mlp.experts" in module_name:
            layer = model.get_submodule(module_name)
            tp_rank, tp_size = _expert_tp_rank(layer)
            writers[name] = ExpertWriter(kind, _prepack_isa(module_name, layer), tp_rank, tp_size)
    return writers


def _expert_tp_rank(layer: torch.nn.Module) -> tuple[int, int]:
    """(rank, size) of the TP group over which vLLM's fused-MoE ``layer`` splits each expert ((0, 1) without TP);
    ValueError for vLLM's expert-parallel layout (whole experts on some ranks), which the rollout does not load."""
    parallel = layer.moe_config.moe_parallel_config
    if parallel.use_ep:
        raise ValueError("actor.generation.backend='vllm': vLLM shards this model's experts over an expert-parallel "
                         "group, a layout the rollout does not load; use backend='native' for this model")
    return parallel.tp_rank, parallel.tp_size


def _prepack_isa(name: str, layer: torch.nn.Module) -> str | None:
    """The ISA vLLM's CPU MoE kernel prepacked ``layer``'s expert weights for; None where they stay plain."""
    if device_type() != "cpu":
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts):
        raise ValueError(f"actor.generation.backend='vllm': vLLM runs the experts of {name} with "
                         f"{type(experts).__name__}, whose weight layout the rollout does not know (supported: "
                         f"CPUUnquantizedExperts); use backend='native' for this model")
    return None if experts._use_zentorch else experts.isa


class VllmRollout(VllmRequests, Rollout):
    """One vLLM engine inside this process for this rank's generation replica (tg >= 1, pg = 1).

    It copies the shard into its own parameters in ``load`` (``reads_shard_in_place`` False): the hybrid engine
    returns to training before ``generate``. Requests (``submit``/``step``/``abort``) run on the same engine with
    continuous batching (``hybridflow.engine.vllm_requests``); ``release`` aborts the ones still queued.
    """

    name = "vllm"
    reads_shard_in_place = False
    takes_adapters = True

    @classmethod
    def for_shard(cls, hf_config, shard: GenerationShard, *, dtype, config: GenerationConfig,
                  lora=None) -> "VllmRollout":
        """The engine of this rank's replica, tensor-parallel over the hybrid engine's generation TP groups; built
        by every rank at once. The sampling defaults of ``config`` (the actor's, not one call's: a greedy
        validation may come first) fix which log-probs vLLM records for the whole run. ``lora`` (a ``LoraConfig``):
        the engine generates with that adapter, synced alone by ``load_adapter``."""
        if shard.pp_size != 1:
            raise ValueError(f"actor.hybrid_engine.pp_size={shard.pp_size}: backend='vllm' runs pg = 1 "
                             "(tensor-parallel generation only); use backend='native' for pg > 1 "
                             "(see docs/generation.md)")
        return cls(hf_config, dtype=dtype, config=config, tp_groups=shard.tp_groups, lora=lora)

    def __init__(self, hf_config, *, dtype: torch.dtype, config: GenerationConfig, seed: int = 0,
                 tp_groups: list[list[int]] | None = None, lora=None) -> None:
        """Builds the engine once (tens of seconds): from ``hf_config`` only, with dummy weights.

        ``tp_groups``: the generation tensor-parallel groups of the whole torch.distributed world (the
        same list on every rank, each group ordered by generation TP rank), as the 3D-HybridEngine built
        them. Groups of one rank (or None): each rank runs its own engine (uniprocess executor). Larger
        groups: every rank of the world builds its engine in the same call (collective), vLLM's tensor
        parallelism running over exactly these groups (``external_launcher`` executor, ``vllm_tp_groups``).
        ``lora``: a ``LoraConfig`` whose adapter the engine applies itself (LoRA slots, ``load_adapter``).
        """
        super().__init__(hf_config, dtype=dtype, config=config)
        check_supported(hf_config)
        lora_options = vllm_lora_options(lora, hf_config) if lora is not None else {}
        tp_groups = tp_groups or [[0]]
        self.tp_size = check_tp_groups(tp_groups, hf_config)
        # an in-process engine core: no extra process, the caller's threads and torch.distributed world
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size
        self._model_dir = tempfile.TemporaryDirectory(prefix="hybridflow-vllm-")
        write_model_config(hf_config, self._model_dir.name)
        # the temperature-1 distribution, as the native engine and the training engine record; with another
        # temperature, the tempered one (vLLM's processed log-probs, also shaped by top-k/top-p)
        tempered = not config.greedy and config.resolved().temperature != 1.0
        parallel, shm_ident = {}, None
        if self.tp_size > 1:
            import torch.distributed as dist

            # the executor reads this rank from the environment; torch.distributed is already ours
            os.environ["RANK"] = str(dist.get_rank())
            os.environ.setdefault("LOCAL_RANK", "0")
            if device_type() == "cpu":  # a shared-memory name of this engine's own (see vllm_tp_groups)
                drawn = [f"hybridflow-{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(drawn, src=0)
                shm_ident = drawn[0]
            parallel = dict(tensor_parallel_size=self.tp_size, distributed_executor_backend="external_launcher")
        # vLLM's CPU worker replaces torch.set_num_threads process-wide with a no-op and drops torch to one
        # thread "for serving": both are restored below, so training keeps its threads (and so does vLLM)
        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        if self.tp_size == 1:
            ensure_expert_parallel_group(hf_config)
        try:
            with (vllm_tp_groups(tp_groups, shm_ident=shm_ident),
                  vocab_padding(self.tp_size if self.tp_size > 1 else None)):
                self.llm = LLM(model=self._model_dir.name, skip_tokenizer_init=True, load_format="dummy",
                               dtype=str(dtype).removeprefix("torch."), seed=seed,
                               enforce_eager=config.vllm_enforce_eager,
                               kv_cache_memory_bytes=int(config.vllm_kv_cache_gib * 2**30),
                               max_model_len=max_model_len(hf_config, dtype, config.vllm_kv_cache_gib,
                                                           tp_size=self.tp_size),
                               enable_prefix_caching=True,
                               logprobs_mode="processed_logprobs" if tempered else "raw_logprobs",
                               enable_sleep_mode=_sleep_mode_available(), **parallel,
                               **lora_options)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.model = _model_runner(self.llm).model
        self.params = dict(self.model.named_parameters())
        shapes = {name: torch.Size(shape) for name, shape in _hf_shapes(hf_config).items()}
        self.plan = vllm_parameter_plan(shapes, list(self.params), hf_config.tie_word_embeddings,
                                        tp_size=self.tp_size)
        self.expert_writers = expert_writers(self.model, self.params)
        self.sleeps = _sleep_mode_available()
        if not self.sleeps:
            self._own_linear_weights(shapes)
        self._released: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self._asleep = False
        self._routing: VllmRoutingRecorder | None = None  # routing replay: made by the first call that records
        self.adapter = VllmAdapter(lora) if lora is not None else None
        """The LoRA adapter vLLM applies (None: it generates with the weights ``load`` copied, merged or not)."""

    # ----- weights -----------------------------------------------------------------------------------
    def _own_linear_weights(self, shapes: dict[str, torch.Size]) -> None:
        """Give every prepacked linear layer a plain weight tensor and ``F.linear`` (see ``WEIGHTS_NOTE``)."""
        for module_name, module in self.model.named_modules():
            if not hasattr(module, "cpu_linear") or hasattr(module, "base_layer"):
                continue  # a LoRA wrapper forwards attributes to its base layer, which is listed on its own
            name = f"{module_name}.weight"
            weight = module.weight  # a tied head is the embedding's parameter (listed once, under its name)
            if weight.numel() == 0:
                slots = self.plan[name]
                rows = slots[-1].offset + slots[-1].rows
                cols = shapes[slots[0].hf_name][1] // (self.tp_size if tp_shard_dim(slots[0].hf_name) == 1 else 1)
                module.weight = torch.nn.Parameter(torch.zeros((rows, cols), dtype=weight.dtype), requires_grad=False)
                self.params[name] = module.weight
            module.cpu_linear = torch.nn.functional.linear
        for name, param in self.params.items():
            assert param.numel() > 0, f"vLLM parameter {name} has no storage"

    def load(self, shard: GenerationShard, *, version: int) -> RolloutStats:
        """Take back the released memory and copy the shard in (``load_weights``)."""
        stats = self.load_weights(shard.weights)
        self.version = version
        return stats

    def transition_metrics(self) -> dict[str, float]:
        """The last load's bytes and seconds and vLLM's KV cache (``rollout/vllm_*``, ``time/rollout_vllm_load_s``)."""
        return {"vllm_bytes_loaded": self.stats.bytes_loaded, "vllm_load_s": self.stats.load_seconds,
                "vllm_kv_cache_bytes": self.stats.kv_cache_bytes}

    @torch.no_grad()
    def load_weights(self, weights: dict[str, list[torch.Tensor]]) -> RolloutStats:
        """Copy this rank's generation shard (Hugging Face name -> pieces, as the hybrid engine built it)
        into vLLM's parameters in place (this rank's TP shard of every layer when tg > 1). Rows past the
        vocabulary (vLLM pads it to a multiple of 64 when tg = 1) are never read: no token id reaches them
        and vLLM cuts the logits to the vocabulary."""
        start = time.perf_counter()
        self.resume()
        stats = RolloutStats()
        for name, slots in self.plan.items():
            param = self.params[name]
            if name in self.expert_writers:
                stats.bytes_loaded += self.expert_writers[name].write(param.data, weights[slots[0].hf_name])
                continue
            for slot in slots:
                target = param.data.narrow(0, slot.offset, slot.rows)
                stats.bytes_loaded += copy_pieces(target, slot.hf_name, weights[slot.hf_name])
        self._forget_old_kv()
        stats.param_bytes = storage_bytes(self.params.values())
        stats.kv_cache_bytes = storage_bytes(self._kv_caches())
        stats.load_seconds = time.perf_counter() - start
        self.stats = stats
        return stats

    def _forget_old_kv(self) -> None:
        """After new weights (or a new adapter) no key or value the old ones computed is read again
        (``IN_FLIGHT_NOTE``): vLLM's prefix cache is emptied and the requests in flight are preempted, so that the
        next ``step`` recomputes the keys and values of their prompt and tokens so far with the new weights before
        it samples their next token, as the native backend's fresh prefill each round does."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM kept key/value blocks computed with the old weights after a weight load "
                               "(reset_prefix_cache failed with every running request preempted)")

    # ----- a LoRA adapter of its own (actor.lora.vllm_sync: adapter) --------------------------------------
    @property
    def holds_base_weights(self) -> bool:
        """Whether a LoRA engine has its base weights (loaded once by ``load``); later syncs need only the adapter."""
        return self.adapter is not None and self.version is not None

    @property
    def lora_request(self):
        """The ``LoRARequest`` every request carries (None: no adapter, or none synced yet)."""
        return self.adapter.request if self.adapter is not None else None

    def load_adapter(self, adapter: dict[str, torch.Tensor], *, version: int,
                     after: RolloutStats | None = None) -> RolloutStats:
        """Make ``adapter`` (parameter name -> full A [R, I] / B [O, R] in the generation dtype, ``lora_A`` /
        ``lora_B`` as ``models/lora.py`` names them) the one every request is generated with; only its bytes move
        (``vllm_bytes_loaded``). The base weights are the ones ``load`` copied; ``after``: that load's stats when it
        was part of this sync (its bytes and seconds are counted in)."""
        if self.adapter is None:
            raise ValueError("load_adapter needs an engine built with lora=...; this one loads merged weights")
        if self.adapter.request is None:
            check_lora_targets(adapter, vllm_lora_modules(self.llm))
        start = time.perf_counter()
        self.resume()
        stats = RolloutStats(bytes_loaded=self.adapter.load(self.llm, adapter))
        self._forget_old_kv()
        stats.param_bytes = storage_bytes(self.params.values())
        stats.kv_cache_bytes = storage_bytes(self._kv_caches())
        stats.load_seconds = time.perf_counter() - start
        if after is not None:
            stats.bytes_loaded += after.bytes_loaded
            stats.load_seconds += after.load_seconds
        self.stats = stats
        self.version = version
        return stats

    # ----- generation --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                 config: SamplingConfig) -> dict[str, torch.Tensor]:
        """Responses for left-padded prompts: the native engine's output keys, shapes and conventions."""
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        samples, T, P = config.samples_per_prompt, config.max_new_tokens, prompts_BP.shape[1]
        prompts_BP = prompts_BP.repeat_interleave(samples, dim=0)
        prompt_mask_BP = prompt_mask_BP.repeat_interleave(samples, dim=0).long()
        requests = [TokensPrompt(prompt_token_ids=row[mask.bool()].tolist())
                    for row, mask in zip(prompts_BP, prompt_mask_BP)]
        # a seed per row: the same config and weights give the same responses
        params = [vllm_sampling_params(config, vocab_size=self.vocab_size, seed=config.seed + row)
                  for row in range(len(requests))]
        with self._routing_recorded(config) as routing:
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora_request)
            routing_BSLK = None if routing is None else routing.experts([output.request_id for output in outputs],
                                                                        prompt_mask_BP.sum(-1).tolist(), P, P + T)
        B = len(requests)
        responses_BT = torch.full((B, T), config.pad_token_id, dtype=prompts_BP.dtype)
        logprobs_BT = torch.zeros((B, T), dtype=torch.float32)
        mask_BT = torch.zeros((B, T), dtype=prompt_mask_BP.dtype)
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            length = cut_at_stop_sequence(tokens, config.stop_sequences)
            responses_BT[row, :length] = torch.tensor(tokens[:length], dtype=prompts_BP.dtype)
            logprobs_BT[row, :length] = torch.tensor(
                [position[token].logprob for position, token in zip(completion.logprobs[:length], tokens)])
            mask_BT[row, :length] = 1
        self.stats.seconds = time.perf_counter() - start
        output = batch_output(prompts_BP, prompt_mask_BP, responses_BT, mask_BT, logprobs_BT)
        if routing_BSLK is not None:  # tokens a stop sequence cut off are padding now
            output[ROUTED_EXPERTS] = routing_BSLK.masked_fill_(~output["attention_mask"].bool()[:, :, None, None],
                                                               ROUTING_PAD)
        return output

    # ----- routing replay ----------------------------------------------------------------------------
    def _routing_recorded(self, config: SamplingConfig):
        """The block in which ``config.record_routing`` calls keep their requests' routing (``VllmRoutingRecorder``,
        set up on the first such call); None inside it when the call does not record."""
        if not config.record_routing:
            return contextlib.nullcontext()
        if self._routing is None:
            self._routing = VllmRoutingRecorder(self.llm, _model_runner(self.llm))
            self.llm.reset_prefix_cache()  # blocks cached before the recorder existed have no routing on file
        return self._routing.record()

    # ----- memory between rollouts -------------------------------------------------------------------
    def release(self) -> None:
        """Free the KV cache and the weight copy for training (refilled by the next ``load_weights``); requests still
        queued finish with reason "abort" (``continue_request`` resumes them after the next load). A LoRA engine
        (``adapter``) keeps its base weights, which no later sync sends again: the CPU build frees only the KV
        cache, sleep mode moves the weights to host memory (level 1)."""
        for request_id in list(self._request_state()[1]):
            self.abort(request_id)
        if self.sleeps:
            # level 2: weights and KV cache discarded, the next load refills the weights
            self.llm.sleep(level=1 if self.adapter is not None else 2)
            self._asleep = True
            return
        kept = self.adapter is not None
        for tensor in [*([] if kept else self.params.values()), *self._kv_caches()]:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._released and storage.nbytes() > 0:
                self._released[storage.data_ptr()] = (storage, storage.nbytes())
        for storage, _ in self._released.values():
            storage.resize_(0)

    def resume(self) -> None:
        """Take back the KV cache and the weight copy ``release`` gave to training (their contents are refilled
        by the next load)."""
        self._reacquire()

    def _reacquire(self) -> None:
        if self.sleeps:
            if self._asleep:
                self.llm.wake_up(tags=["weights"])
                self.llm.wake_up(tags=["kv_cache"])
                self._asleep = False
            return
        regrown = bool(self._released)
        for storage, nbytes in self._released.values():
            storage.resize_(nbytes)
        self._released = {}
        if not regrown:
            return
        # regrown storages hold whatever the allocator hands back (zeros only while it maps fresh pages):
        # the vocabulary padding rows are never read but must stay finite, and the KV cache must be zeros as
        # vLLM allocated it, because its attention multiplies every slot of a block by a probability, 0 * NaN
        for name, slots in self.plan.items():
            self.params[name].data[slots[-1].offset + slots[-1].rows:].zero_()
        for cache in self._kv_caches():
            cache.zero_()

    def _kv_caches(self) -> list[torch.Tensor]:
        caches = _model_runner(self.llm).kv_caches
        flat = []
        for cache in caches:
            flat.extend(cache if isinstance(cache, (list, tuple)) else [cache])
        return [c for c in flat if isinstance(c, torch.Tensor)]

    def resident_bytes(self) -> int:
        """Bytes of vLLM's weights and KV cache alive now (after ``release`` on CPU: 0, a LoRA engine's base
        weights)."""
        return storage_bytes([*self.params.values(), *self._kv_caches()])


def check_supported(hf_config) -> None:
    """ValueError when vLLM's CPU build cannot run this model: its attention supports a fixed set of head sizes,
    its mixture-of-experts kernel hidden sizes that are multiples of 32 (else vLLM fails with "No Unquantized MoE
    backend supports the deployment configuration")."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    if torch.cuda.is_available():
        return
    supported = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
    if head_dim not in supported:
        raise ValueError(f"actor.generation.backend='vllm': vLLM's CPU attention supports head sizes {supported}; "
                         f"this model's head_dim is {head_dim} (hidden_size {hf_config.hidden_size} / "
                         f"{hf_config.num_attention_heads} heads). Use backend='native' for it")
    if getattr(hf_config, "num_experts", 0) and hf_config.hidden_size % 32:
        raise ValueError(f"actor.generation.backend='vllm': vLLM's CPU mixture-of-experts kernel needs a hidden_size "
                         f"that is a multiple of 32; this {hf_config.model_type} model's is {hf_config.hidden_size}. "
                         f"Use backend='native' for it")


def check_tp_groups(tp_groups: list[list[int]], hf_config) -> int:
    """tg, the size of every group in ``tp_groups``; ValueError unless they partition the world into equal
    groups (of distinct ranks) whose size divides the model's heads, key/value heads, vocabulary and (a
    mixture-of-experts model) experts' intermediate size."""
    sizes = {len(group) for group in tp_groups}
    if len(sizes) != 1:
        raise ValueError(f"vLLM tp_groups must all have one size, got sizes {sorted(sizes)} in {tp_groups}")
    tp_size = sizes.pop()
    if tp_size == 1:
        return 1
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    counts = [("num_attention_heads", hf_config.num_attention_heads), ("num_key_value_heads", kv_heads),
              ("vocab_size", hf_config.vocab_size)]
    if getattr(hf_config, "num_experts", 0):  # vLLM splits every expert's intermediate rows over the TP ranks
        counts.append(("moe_intermediate_size", hf_config.moe_intermediate_size))
    for name, count in counts:
        if count % tp_size:
            raise ValueError(f"vLLM tensor_parallel_size {tp_size} does not divide the model's {name} {count}; "
                             f"allowed: a divisor of {count}")
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    ranks = sorted(r for group in tp_groups for r in group)
    if ranks != list(range(world)):
        raise ValueError(f"vLLM tp_groups must cover every rank of the torch.distributed world "
                         f"(0..{world - 1}) exactly once, got {tp_groups}")
    return tp_size


def ensure_expert_parallel_group(hf_config) -> bool:
    """Before a mixture-of-experts engine is built with tg = 1: end vLLM's parallel groups if an engine built
    earlier in this process made them without an expert-parallel group; True if it did.

    vLLM makes its parallel groups once per process (a later engine reuses them) and makes the expert-parallel
    one only for a mixture-of-experts model, so a Qwen3-MoE engine after a dense one failed with "expert parallel
    group is not initialized". Ended, they are made again, with it, by this engine; groups of one rank each, which
    the earlier engine then uses as well."""
    if not getattr(hf_config, "num_experts", 0):
        return False
    import vllm.distributed.parallel_state as parallel_state

    if not parallel_state.model_parallel_is_initialized() or parallel_state._EP is not None:
        return False
    parallel_state.destroy_model_parallel()
    return True


@contextlib.contextmanager
def vllm_tp_groups(tp_groups: list[list[int]], *, shm_ident: str | None = None):
    """While vLLM builds its engine, its parallel groups are made over ``tp_groups`` instead of consecutive ranks.

    vLLM lays the world out as (external DP, DP, PP, PCP, TP) over ranks 0..N-1, TP innermost, so its TP
    groups are consecutive ranks. We give vLLM the ranks in the order of ``tp_groups`` concatenated: every
    group list vLLM computes (TP, PP, DP, EP, ...) goes through that order, so its position i stands for
    world rank ``order[i]`` and its TP groups are exactly ``tp_groups`` (strided ones included). Nothing
    else of vLLM reads rank numbers while the groups are built (``GroupCoordinator`` finds this rank in
    each group it is given). No-op for groups of one rank.

    On CPU vLLM's TP group communicates through POSIX shared-memory segments (``/dev/shm``), one per rank,
    named after ``VLLM_DIST_IDENT``, which its CPU worker sets from the executor's init method: the same
    ``-tp:0-[0-1]-cpushm_0`` for every engine on the host, created with O_EXCL, and unlinked only by a
    destructor that never runs when the process is killed. A segment a killed run left behind therefore
    made every later engine on that host fail ("create shm in SHMManager failed. errno: 17"). Here each
    group is named after ``shm_ident`` (the same on every rank of this engine, unique to it), and its
    shared memory is unlinked as soon as the group is built (``unlink_shared_memory``): it then lives
    exactly as long as the processes that mapped it, and nothing is left in /dev/shm however they end.
    """
    if len({len(group) for group in tp_groups}) == 1 and len(tp_groups[0]) == 1:
        yield
        return
    import vllm.distributed.parallel_state as parallel_state

    order = [rank for group in tp_groups for rank in group]
    original = parallel_state.init_model_parallel_group

    def init_model_parallel_group(group_ranks, *args, **kwargs):
        if shm_ident is not None:
            os.environ["VLLM_DIST_IDENT"] = shm_ident  # read when the group's CPU communicator is built
        coordinator = original([[order[position] for position in group] for group in group_ranks], *args, **kwargs)
        unlink_shared_memory(coordinator)
        return coordinator

    parallel_state.init_model_parallel_group = init_model_parallel_group
    try:
        yield
    finally:
        parallel_state.init_model_parallel_group = original


def unlink_shared_memory(coordinator) -> list[str]:
    """Unlinks the ``/dev/shm`` names of a just-built vLLM group's shared memory, which every rank of the group
    has mapped by then (see ``vllm_tp_groups``); the memory itself lives on until the processes unmap it.

    Two kinds: the CPU communicator's segment of this rank (``{group name}_{rank in group}``; vLLM joins
    them behind a barrier) and the message-queue ring buffer the group's writer rank creates (its readers
    open it before ``create_from_process_group`` returns on the writer). Returns the names unlinked: none for
    a group without them (CUDA, one rank, or a vLLM that lays them out differently).
    """
    unlinked = []
    communicator = getattr(getattr(coordinator, "device_communicator", None), "dist_module", None)
    name = getattr(communicator, "group_name", None)
    if isinstance(name, str):
        # vLLM's shared-memory manager opens f"{name}_{rank in group}"; shm_open drops the leading slashes
        path = os.path.join("/dev/shm", f"{name}_{coordinator.rank_in_group}".lstrip("/"))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            unlinked.append(path)
    ring = getattr(getattr(coordinator, "mq_broadcaster", None), "buffer", None)
    if getattr(ring, "is_creator", False) and hasattr(ring, "shared_memory"):
        ring.shared_memory.unlink()
        ring.is_creator = False  # its destructor would unlink the name again
        unlinked.append(ring.shared_memory.name)
    return unlinked


@contextlib.contextmanager
def vocab_padding(multiple: int | None):
    """While vLLM builds its model, its vocabulary layers pad the vocabulary to ``multiple`` rows (None:
    vLLM's default, 64).

    vLLM pads the vocabulary to a multiple of 64 and splits the *padded* rows evenly over TP ranks, so
    with a vocabulary that is not a multiple of 64*tg rank g's rows are not the g-th equal chunk of the
    vocabulary that the hybrid engine's generation shard holds (vocab 24, tg 2: vLLM's rank 0 would hold
    rows 0-23 and rank 1 only padding). Padding to tg (which divides the vocabulary) makes every rank's
    rows exactly its chunk, so the embedding and head load from the shard with no exchange.
    """
    if multiple is None:
        yield
        return
    import inspect

    from vllm.model_executor.layers import vocab_parallel_embedding as vocab

    saved = []
    for cls in (vocab.VocabParallelEmbedding, vocab.ParallelLMHead):
        init = cls.__init__
        names = [p.name for p in inspect.signature(init).parameters.values()
                 if p.default is not inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD]
        defaults = list(init.__defaults__)
        defaults[names.index("padding_size")] = multiple
        saved.append((init, init.__defaults__))
        init.__defaults__ = tuple(defaults)
    try:
        yield
    finally:
        for init, defaults in saved:
            init.__defaults__ = defaults


def max_model_len(hf_config, dtype: torch.dtype, kv_cache_gib: float, *, tp_size: int = 1) -> int:
    """The longest sequence vLLM accepts: the model's context, or what one sequence's KV cache can take
    within ``kv_cache_gib`` on one of ``tp_size`` ranks (each holds 1/tp_size of the key/value heads;
    vLLM refuses to start when one sequence of its max length does not fit)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = (getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads) // tp_size
    bytes_per_token = 2 * hf_config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    fits = int(kv_cache_gib * 2**30 * 0.9 // bytes_per_token) // 128 * 128  # 10% margin, whole 128-token blocks
    return min(int(getattr(hf_config, "max_position_embeddings", 4096)), max(128, fits))


def write_model_config(hf_config, directory: str) -> None:
    """The model directory vLLM builds from: ``config.json`` only (dummy weights, no tokenizer)."""
    config = hf_config.to_dict()
    # Gemma 3: Gemma3ForCausalLM; a config never saved (a model built in memory) holds architectures None, on which
    # vLLM guesses a pooling model and fails for want of a tokenizer
    config["architectures"] = config.get("architectures") or [causal_lm_class_name(hf_config)]
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _hf_shapes(hf_config) -> dict[str, torch.Size]:
    return parameter_shapes(hf_config)


def _model_runner(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()
