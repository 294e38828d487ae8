"""The native rollout backend: hybridflow's own decoder computing with the hybrid engine's generation shard in place.

``load`` builds a ``DecoderStage`` over the shard's pieces (the rank's training shard is one of them, never
copied) and a ``GenerationEngine`` over the generation pipeline; ``release`` drops both, so the pieces the hybrid
engine gathered are freed when it returns to training. Any tg and pg, any device.

Requests (``submit`` / ``step`` / ``abort``) run through the same decoder: each ``step`` groups the queued
requests by sampling options and progress and decodes each group as one batch for at most ``max_tokens``
tokens; a request that has not ended stays queued with its tokens so far and its next round starts from
prompt + tokens (a fresh prefill: the KV cache lives only inside a round). An aborted request finishes with its
tokens so far; ``continue_request`` makes a request that resumes from them, under whatever weights are loaded
then, every token stamped with the weight version that sampled it.

Shape legend: B rows, P context length (prompt + tokens so far), T tokens of one round.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from hybridflow.engine.decoder import DecoderSpec, DecoderStage, TensorParallelGroup
from hybridflow.engine.generation import GenerationEngine, PipelinePeers
from hybridflow.engine.generation_config import GenerationConfig, SamplingConfig
from hybridflow.engine.rollout import (GenerationShard, QueuedRequest, RequestHandle, Rollout, RolloutOutput,
                                       RolloutRequest, RolloutStats, SamplingOptions, cut_at_stop_sequence)

ROUND_SEED_STRIDE = 7919
"""A request's round seed is its options' seed + this x the tokens it already has: rounds draw fresh noise."""


class NativeRollout(Rollout):
    """hybridflow's decoder on this rank's generation shard (computes with its pieces in place)."""

    name = "native"
    reads_shard_in_place = True

    def __init__(self, hf_config, *, dtype, config: GenerationConfig) -> None:
        super().__init__(hf_config, dtype=dtype, config=config)
        self.spec = DecoderSpec.from_hf(hf_config)
        self.engine: GenerationEngine | None = None
        self._queue: dict[str, QueuedRequest] = {}

    @property
    def logprobs_match_training(self) -> bool:
        """The decoder computes with the training weights at the training compute dtype: in fp32 its log-probs of
        softmax(logits / temperature) are what the training forward computes, up to rounding."""
        return self.dtype == torch.float32

    # ----- lifecycle -------------------------------------------------------------------------------
    def load(self, shard: GenerationShard, *, version: int) -> RolloutStats:
        """A decoder stage over the shard's pieces (no copy) and the engine over its generation pipeline."""
        start = time.perf_counter()
        tp = TensorParallelGroup(shard.tp_group, size=len(shard.tp_ranks), rank=shard.tp_rank)
        stage = DecoderStage(self.spec, self.hf_config, shard.weights, layers=shard.layers,
                             has_embedding=shard.has_embedding, has_final_norm=shard.has_final_norm,
                             has_head=shard.has_head, tp=tp)
        pipeline = PipelinePeers(group=shard.pp_group, ranks=list(shard.pp_ranks), stage=shard.pp_stage)
        self.engine = GenerationEngine(stage, pipeline=pipeline)
        self.version = version
        self.stats = RolloutStats(load_seconds=time.perf_counter() - start)
        return self.stats

    def release(self) -> None:
        """Drop the decoder: its references to the shard's pieces go with it."""
        self.engine = None

    def _engine(self) -> GenerationEngine:
        if self.engine is None:
            raise RuntimeError("the native rollout has no weights: call load(shard, version=) first")
        return self.engine

    # ----- the batched call ------------------------------------------------------------------------
    def generate(self, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                 config: SamplingConfig) -> dict[str, torch.Tensor]:
        engine = self._engine()
        output = engine.generate(prompts_BP, prompt_mask_BP, config)
        self.stats = dataclasses.replace(engine.last_stats, load_seconds=self.stats.load_seconds)
        return output

    # ----- requests --------------------------------------------------------------------------------
    def submit(self, request: RolloutRequest) -> RequestHandle:
        if request.request_id in self._queue:
            raise ValueError(f"request {request.request_id!r} is already queued")
        queued = self._queue[request.request_id] = QueuedRequest.of(request)
        return queued.handle

    def pending(self) -> int:
        return len(self._queue)

    def abort(self, request_id: str) -> None:
        """Finish a queued request now with its tokens so far (reason "abort"); unknown or finished ids: no-op."""
        queued = self._queue.pop(request_id, None)
        if queued is not None:
            queued.finish("abort")

    def step(self, *, max_tokens: int | None = None) -> list[RolloutOutput]:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"step(max_tokens=) must be None or >= 1, got {max_tokens!r}")
        self._engine()
        groups: dict[tuple[SamplingOptions, int], list[QueuedRequest]] = {}
        for queued in self._queue.values():
            groups.setdefault((queued.request.options, len(queued.tokens)), []).append(queued)
        finished = []
        for (options, progress), members in groups.items():
            budget = options.max_new_tokens - progress
            if budget > 0:
                self._round(members, options, progress, budget if max_tokens is None else min(budget, max_tokens))
            for queued in members:
                reason = _finish_reason(queued, options)
                if reason is not None:
                    del self._queue[queued.request.request_id]
                    finished.append(queued.finish(reason))
        return finished

    def _round(self, members: list[QueuedRequest], options: SamplingOptions, progress: int, tokens: int) -> None:
        """Decode up to ``tokens`` more tokens for ``members`` (same options and progress) as one batch."""
        contexts = [list(queued.request.prompt_ids) + queued.tokens for queued in members]
        P = max(len(context) for context in contexts)
        context_BP = torch.full((len(contexts), P), options.pad_token_id, dtype=torch.long)
        mask_BP = torch.zeros((len(contexts), P), dtype=torch.long)
        for row, context in enumerate(contexts):  # left padding, as prompts come to the batched call
            context_BP[row, P - len(context):] = torch.tensor(context, dtype=torch.long)
            mask_BP[row, P - len(context):] = 1
        fields = {name: getattr(options, name) for name in SamplingOptions.__dataclass_fields__
                  if name not in ("max_new_tokens", "min_new_tokens", "seed")}
        config = dataclasses.replace(self.config.for_call(), **fields, max_new_tokens=tokens,
                                     min_new_tokens=min(max(options.min_new_tokens - progress, 0), tokens),
                                     seed=options.seed + ROUND_SEED_STRIDE * progress, samples_per_prompt=1)
        output = self.generate(context_BP, mask_BP, config)
        for row, queued in enumerate(members):
            mask_T = output["response_mask"][row].bool()
            new = output["responses"][row][mask_T].tolist()
            queued.tokens += new
            queued.logprobs += output["logprobs"][row][mask_T].tolist()
            queued.versions += [self.version] * len(new)


def _finish_reason(queued: QueuedRequest, options: SamplingOptions) -> str | None:
    """"stop" (an end token or stop sequence ends the tokens; cut after it), "length", or None (goes on)."""
    tokens = queued.tokens
    end = cut_at_stop_sequence(tokens, options.stop_sequences)
    if end < len(tokens):  # a stop sequence completed across two rounds: the decoder went on past it
        del queued.tokens[end:], queued.logprobs[end:], queued.versions[end:]
        return "stop"
    ends_with_sequence = any(len(s) <= len(tokens) and tuple(tokens[-len(s):]) == tuple(s)
                             for s in options.stop_sequences)
    if tokens and (tokens[-1] in (*options.eos_token_ids, *options.stop_token_ids) or ends_with_sequence):
        return "stop"
    return "length" if len(tokens) >= options.max_new_tokens else None
