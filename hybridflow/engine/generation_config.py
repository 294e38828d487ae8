"""GenerationConfig: how the actor samples responses (kept free of torch so configs load in a blink)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields, replace

from hybridflow.engine.rollout import ROLLOUT_BACKENDS, rollout_backend

BACKENDS = tuple(ROLLOUT_BACKENDS)
"""The built-in rollout backends (``engine/rollout.py``'s registry takes more)."""

SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
"""What the sampling fields a model's ``generation_config.json`` may fill mean when neither the user nor the model
sets them (None in ``GenerationConfig`` = unset). Also the values configs saved before they became optional hold
where the user set nothing (``unset_before_it_was_optional``)."""


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """How to sample responses.

    The recorded ``logprobs`` are those of the tempered distribution softmax(logits / temperature), the
    one a training engine recomputes; top-k/top-p, ``repetition_penalty``, ``suppress_tokens`` and
    ``min_new_tokens`` only shape which token is drawn (as vLLM does).
    """

    backend: str = "native"
    """Rollout backend (a name in ``hybridflow.engine.rollout.ROLLOUT_BACKENDS``): "native" (hybridflow's decoder:
    any tg/pg, any device) or "vllm" (one in-process vLLM engine per generation replica, weights copied in place
    from the hybrid engine before every rollout; needs ``pip install hybridflow[vllm]``, any tg, pg = 1; see
    docs/generation.md)."""
    vllm_kv_cache_gib: float = 1.0
    """backend=vllm: memory of vLLM's paged KV cache (GiB, allocated once, released between rollouts on
    CPU). Rows that do not fit wait for a free slot, as in vLLM's scheduler. It also caps the longest
    sequence (prompt + response) vLLM accepts: the one sequence whose KV cache fits in 90% of it."""
    vllm_enforce_eager: bool = True
    """backend=vllm: run the model eagerly (no torch.compile / CUDA graphs): the engine starts in seconds
    instead of minutes; set false on GPUs for the faster compiled decode."""
    max_new_tokens: int = 64
    """T: the most tokens generated per response; responses are right-padded to exactly T."""
    min_new_tokens: int = 0
    """End tokens (EOS, stop tokens) cannot be sampled before this many response tokens."""
    temperature: float | None = None
    """Logits are divided by it before top-k/top-p and sampling (ignored when greedy). null: the model's
    ``generation_config.json`` value (``use_model_defaults``), else 1.0."""
    top_k: int | None = None
    """Sample among the k most likely tokens only; 0 turns it off. null: the model's value, else 0."""
    top_p: float | None = None
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1.0 turns it off. null: the
    model's value, else 1.0."""
    repetition_penalty: float | None = None
    """CTRL-style penalty on tokens already in the prompt or response: positive logits are divided by it,
    negative ones multiplied; 1.0 turns it off. null: the model's value, else 1.0."""
    greedy: bool = False
    """Take the most likely token at every step (temperature, top_k, top_p and seed are ignored)."""
    suppress_tokens: tuple[int, ...] = ()
    """Token ids never sampled (added to the model's ``suppress_tokens`` when ``use_model_defaults``)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response (kept in it); the trainer encodes them into ``stop_sequences``."""
    stop_token_ids: tuple[int, ...] = ()
    """Further tokens that end a response, e.g. an end-of-turn token; kept like EOS."""
    use_model_defaults: bool = True
    """Read the model directory's ``generation_config.json``: its EOS ids and ``suppress_tokens`` are added,
    and its temperature, top_k, top_p and repetition_penalty fill the ones left unset (null) here."""
    memory_budget_gib: float | None = None
    """Memory one wave of rows may take (KV cache plus prefill activations, estimated per row); rows
    beyond it wait for the next wave. None: 80% of the device's free memory on CUDA, unbounded on CPU.
    Greedy outputs do not depend on the waves; sampled ones are reproducible for a given budget."""

    def __post_init__(self) -> None:
        entry = rollout_backend(self.backend)
        if entry.requires is not None and importlib.util.find_spec(entry.requires) is None:
            raise ValueError(f"actor.generation.backend={self.backend!r} needs {entry.requires}, which is not "
                             f"installed here: {entry.install or 'install it'}, or use backend='native'")
        if (isinstance(self.vllm_kv_cache_gib, bool) or not isinstance(self.vllm_kv_cache_gib, (int, float))
                or not self.vllm_kv_cache_gib > 0):
            raise ValueError(f"actor.generation.vllm_kv_cache_gib must be a number > 0, got "
                             f"{self.vllm_kv_cache_gib!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not isinstance(self.min_new_tokens, int) or not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens!r}")
        if self.temperature is not None and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}; use greedy=True for argmax "
                             "(null: unset)")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r} (null: unset)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r} (null: unset)")
        if self.repetition_penalty is not None and not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 = off), got {self.repetition_penalty!r} "
                             "(null: unset)")
        if self.memory_budget_gib is not None and (isinstance(self.memory_budget_gib, bool)
                                                   or not isinstance(self.memory_budget_gib, (int, float))
                                                   or not self.memory_budget_gib > 0):
            raise ValueError(f"memory_budget_gib must be a number > 0 or null (automatic), got "
                             f"{self.memory_budget_gib!r}")
        for name in ("stop_token_ids", "suppress_tokens"):
            ids = getattr(self, name)
            if not isinstance(ids, tuple) or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"{name} must be a tuple of non-negative token ids, got {ids!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(text, str) and text for text in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")

    def with_model_defaults(self, model_defaults: dict) -> "GenerationConfig":
        """This config resolved once: a model's ``generation_config.json`` (a dict) applied per
        ``use_model_defaults`` (its suppressed tokens added, its sampling values filling the fields left unset),
        then the fields still unset at ``SAMPLING_DEFAULTS``. (Its EOS ids go to ``GenerationTokens.build``.)"""
        changes: dict = {}
        if self.use_model_defaults and model_defaults:
            suppress = list(model_defaults.get("suppress_tokens") or [])
            changes["suppress_tokens"] = tuple(dict.fromkeys([*self.suppress_tokens, *suppress]))
            for name, default in SAMPLING_DEFAULTS.items():
                if getattr(self, name) is None and model_defaults.get(name) is not None:
                    changes[name] = type(default)(model_defaults[name])
        return replace(self, **changes).resolved()

    def resolved(self) -> "GenerationConfig":
        """This config with every unset sampling field at its ``SAMPLING_DEFAULTS`` value (itself if none is)."""
        unset = {name: default for name, default in SAMPLING_DEFAULTS.items() if getattr(self, name) is None}
        return replace(self, **unset) if unset else self

    def for_call(self, tokens: "GenerationTokens | None" = None, *, seed: int = 0,
                 samples_per_prompt: int = 1) -> "SamplingConfig":
        """The ``SamplingConfig`` one generate call runs with: this config, the tokenizer's ids, a seed, n."""
        tokens = tokens or GenerationTokens()
        return SamplingConfig(**{f.name: getattr(self, f.name) for f in fields(GenerationConfig)},
                              eos_token_ids=tokens.eos_token_ids, pad_token_id=tokens.pad_token_id,
                              stop_sequences=tokens.stop_sequences, seed=seed, samples_per_prompt=samples_per_prompt)


@dataclass(frozen=True, kw_only=True)
class GenerationTokens:
    """The token ids a rollout samples with, from the actor's tokenizer (runtime values: never in a user's YAML)."""

    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a response (kept in it, response_mask 1)."""
    pad_token_id: int = 0
    """Fills responses after their end."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """``GenerationConfig.stop`` encoded: a response ends when it ends with one of them."""

    def __post_init__(self) -> None:
        if not isinstance(self.eos_token_ids, tuple) or not all(isinstance(i, int) and i >= 0
                                                                for i in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be a tuple of non-negative token ids, got {self.eos_token_ids!r}")
        if not all(isinstance(seq, tuple) and seq and all(isinstance(i, int) and i >= 0 for i in seq)
                   for seq in self.stop_sequences):
            raise ValueError(f"stop_sequences must hold non-empty token-id sequences, got {self.stop_sequences!r}")

    @classmethod
    def build(cls, config: GenerationConfig, *, eos_token_id: int | None, pad_token_id: int | None,
              model_defaults: dict | None = None, encode=None) -> "GenerationTokens":
        """The tokenizer's EOS (plus the model's ``generation_config.json`` EOS ids when ``use_model_defaults``),
        its pad id (EOS when it has none) and ``config.stop`` encoded by ``encode`` (text -> token ids)."""
        eos = [] if eos_token_id is None else [eos_token_id]
        model_eos = (model_defaults or {}).get("eos_token_id") if config.use_model_defaults else None
        eos += [] if model_eos is None else ([model_eos] if isinstance(model_eos, int) else list(model_eos))
        stops = tuple(tuple(encode(text)) for text in config.stop) if encode is not None else ()
        pad = pad_token_id if pad_token_id is not None else (eos_token_id or 0)
        return cls(eos_token_ids=tuple(dict.fromkeys(eos)), pad_token_id=pad, stop_sequences=stops)


@dataclass(frozen=True, kw_only=True)
class SamplingConfig(GenerationConfig):
    """What one generate call samples with: a ``GenerationConfig`` (unset sampling fields resolved to
    ``SAMPLING_DEFAULTS``) plus the runtime values of the call. Built by ``GenerationConfig.for_call``; never
    read from a user's config."""

    eos_token_ids: tuple[int, ...] = ()
    """Tokens that end a response (kept in it, response_mask 1)."""
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token sequences that end a response when the response ends with one of them."""
    pad_token_id: int = 0
    """Fills responses after their end."""
    seed: int = 0
    """Seed of the sampling generator: same prompts, weights and config give the same responses."""
    samples_per_prompt: int = 1
    """Responses generated per prompt; output rows are prompt-major (prompt 0's samples first)."""
    record_routing: bool = False
    """Also return ``routed_experts`` [B, P+T, MoE layers, K]: the experts every MoE layer's router chose for every
    token the call processed (routing replay, ``actor.routing_replay``; backends whose ``BackendEntry`` says
    ``records_routing``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, default in SAMPLING_DEFAULTS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)  # resolved at construction: engines read plain values
        GenerationTokens(eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                         stop_sequences=self.stop_sequences)  # validates them
        if not isinstance(self.samples_per_prompt, int) or self.samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt must be a positive integer, got {self.samples_per_prompt!r}")


def unset_before_it_was_optional(key: str, saved, current) -> bool:
    """Whether a resumed run's ``key`` (dotted) is unset now (None) where a config saved before the sampling fields
    became optional held their old default: that default meant "unset" (the model's value applied), so it is
    the same setting, not a change."""
    name = key.rsplit(".", 1)[-1]
    return (key.startswith("actor.generation.") and name in SAMPLING_DEFAULTS and current is None
            and saved == SAMPLING_DEFAULTS[name])
