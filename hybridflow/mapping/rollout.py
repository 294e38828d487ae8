"""RolloutBackend: what the generation simulator needs to know about the actor's rollout engine.

One object per value of ``actor.generation.backend`` (hybridflow/engine/generation_config.py): the
differences between hybridflow's own decoder and vLLM that change where and how the actor should
generate. Symbols: P prompt tokens, T response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.mapping.hardware import HardwareProfile


@dataclass(frozen=True, kw_only=True)
class RolloutBackend:
    """A rollout engine's memory and speed traits, as the planner models them."""

    name: str
    """The ``actor.generation.backend`` value."""
    paged_kv_cache: bool
    """True: the KV cache is allocated in blocks as sequences grow and continuous batching refills freed
    slots at once, so with responses of T tokens the sequences in flight hold P + T/2 tokens each on
    average. False: every row of a wave holds a preallocated cache of P + T positions for the whole wave."""
    own_weight_copy: bool
    """True: the engine keeps its own copy of the generation shard; before every rollout the hybrid engine's
    generation shard is copied into it in place (one read and one write of the shard per device), and
    both copies are alive at that moment, beside the engine's KV cache (hybridflow/engine/vllm_rollout.py
    wakes the weights and the KV cache before loading, then drops the gathered pieces)."""
    model_parallel_generation: bool
    """Whether the actor may generate with tg > 1 or pg > 1 (hybridflow's vLLM backend runs tg = pg = 1)."""
    serving_kernels: bool
    """True: fused decode kernels reaching the profile's memory_bandwidth_fraction; False: the profile's
    native_decode_bandwidth_fraction (hybridflow's plain PyTorch decoder), where a profile sets one."""

    def decode_bandwidth_fraction(self, hardware: HardwareProfile) -> float:
        """Share of the device's memory bandwidth this engine's prefill and decode steps stream at."""
        if self.serving_kernels or hardware.native_decode_bandwidth_fraction is None:
            return hardware.memory_bandwidth_fraction
        return hardware.native_decode_bandwidth_fraction

    def kv_tokens_per_sequence(self, prompt_length: int, response_length: int) -> float:
        """KV-cache positions one sequence in flight occupies, on average over its generation."""
        if self.paged_kv_cache:
            return prompt_length + response_length / 2
        return prompt_length + response_length

    def supports(self, generation_pp_size: int, generation_tp_size: int) -> bool:
        return self.model_parallel_generation or (generation_pp_size, generation_tp_size) == (1, 1)


NATIVE = RolloutBackend(name="native", paged_kv_cache=False, own_weight_copy=False, model_parallel_generation=True,
                        serving_kernels=False)
"""hybridflow.engine.generation: any tg and pg, the KV cache preallocated at P + T per row of a wave, the
hybrid engine's generation shard used as is (no copy), its own PyTorch kernels."""
VLLM = RolloutBackend(name="vllm", paged_kv_cache=True, own_weight_copy=True, model_parallel_generation=False,
                      serving_kernels=True)
"""hybridflow.engine.vllm_rollout: paged KV cache with continuous batching, its own weight copy loaded in place
every rollout, tg = pg = 1, fused decode kernels."""

# one entry per actor.generation.backend value; the planner sits below the engine and does not import it, so
# tests/test_mapping_backend.py keeps these names equal to the engine's
ROLLOUT_BACKENDS = {backend.name: backend for backend in (NATIVE, VLLM)}


def rollout_backend(backend: str | RolloutBackend) -> RolloutBackend:
    """The model of ``actor.generation.backend`` ``backend``; ValueError naming the allowed values."""
    if isinstance(backend, RolloutBackend):
        return backend
    if backend not in ROLLOUT_BACKENDS:
        raise ValueError(f"actor.generation.backend must be one of {tuple(ROLLOUT_BACKENDS)}, got {backend!r}")
    return ROLLOUT_BACKENDS[backend]
