"""Requests (``submit`` / ``step`` / ``abort``) on the vLLM rollout's engine: continuous batching, so a request
submitted while others decode joins their batch at the next engine step.

Each request becomes one vLLM request (``LLMEngine.add_request``) with its own ``SamplingParams`` (its options,
its own seed) and delta outputs; ``step(max_tokens=k)`` runs k engine steps (each decodes one token of every
running request) and collects what came back. A stop sequence (token ids) is checked on the tokens as they arrive:
the request is cut after it and aborted in the engine. ``abort`` finishes a request with its tokens so far;
``continue_request`` resumes one from them (the prefix is part of the new vLLM request's prompt). Weights loaded
between two ``step`` calls reach the requests queued: vLLM recomputes their keys and values with the new weights,
and the tokens of every later step are stamped with the new ``version`` (``vllm_rollout.IN_FLIGHT_NOTE``).
"""

from __future__ import annotations

import dataclasses
import itertools

from hybridflow.engine.generation_config import SamplingConfig
from hybridflow.engine.rollout import (QueuedRequest, RequestHandle, RolloutOutput, RolloutRequest,
                                       cut_at_stop_sequence)

REQUEST_SEED_STRIDE = 1_000_003
"""A request's vLLM seed is its options' seed x this + its submission number: requests of one options object (the
samples of one prompt) draw different noise."""


def vllm_sampling_params(config: SamplingConfig, *, vocab_size: int, seed: int):
    """``vllm.SamplingParams`` with the same meaning as ``config`` has for the native engine.

    End tokens (EOS and stop ids) are stop ids, kept in the response; suppressed tokens are left out of
    ``allowed_token_ids`` (exact, where ``logit_bias`` would clamp at -100); stop strings are applied by the
    caller on tokens (``stop_sequences``) because vLLM runs without a tokenizer here. One request per
    response row (vLLM refuses n > 1 when greedy; the prefix cache shares a prompt's samples' prefill).
    """
    from vllm import SamplingParams

    config = config.resolved()
    allowed = None
    if config.suppress_tokens:
        banned = set(config.suppress_tokens)
        allowed = [token for token in range(vocab_size) if token not in banned]
    return SamplingParams(
        max_tokens=config.max_new_tokens, min_tokens=config.min_new_tokens,
        temperature=0.0 if config.greedy else config.temperature,
        top_p=1.0 if config.greedy else config.top_p, top_k=0 if config.greedy else config.top_k,
        repetition_penalty=config.repetition_penalty, seed=seed,
        # vLLM's own EOS (from config.json) is ignored: the config's end ids are the only ones, as natively
        stop_token_ids=sorted(set(config.eos_token_ids) | set(config.stop_token_ids)) or None, ignore_eos=True,
        logprobs=0, detokenize=False, allowed_token_ids=allowed)


class VllmRequests:
    """The request half of ``VllmRollout`` (uses its ``llm``, ``config``, ``vocab_size``, ``version`` and
    ``lora_request``)."""

    def _request_state(self) -> tuple[dict[str, QueuedRequest], dict[str, str]]:
        """(our request id -> queued request, our request id -> the engine's id for it), created on first use.
        vLLM's outputs carry our id; aborting takes the engine's (it may add a suffix to keep ids unique)."""
        if not hasattr(self, "_queued"):
            self._queued, self._engine_ids, self._submissions = {}, {}, itertools.count()
        return self._queued, self._engine_ids

    def submit(self, request: RolloutRequest) -> RequestHandle:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        queued, engine_ids = self._request_state()
        if request.request_id in engine_ids:
            raise ValueError(f"request {request.request_id!r} is already queued")
        options, progress = request.options, len(request.prefix_ids)
        if progress >= options.max_new_tokens:
            raise ValueError(f"request {request.request_id!r}: its prefix already holds max_new_tokens tokens")
        fields = {name: getattr(options, name) for name in type(options).__dataclass_fields__
                  if name not in ("max_new_tokens", "min_new_tokens", "seed")}
        config = dataclasses.replace(self.config.for_call(), **fields, max_new_tokens=options.max_new_tokens - progress,
                                     min_new_tokens=max(options.min_new_tokens - progress, 0), samples_per_prompt=1)
        params = vllm_sampling_params(config, vocab_size=self.vocab_size,
                                      seed=options.seed * REQUEST_SEED_STRIDE + next(self._submissions))
        params.output_kind = RequestOutputKind.DELTA  # each step hands back only the new tokens
        prompt = TokensPrompt(prompt_token_ids=[*request.prompt_ids, *request.prefix_ids])
        engine_id = self.llm.llm_engine.add_request(request.request_id, prompt, params,
                                                    lora_request=self.lora_request)
        item = queued[request.request_id] = QueuedRequest.of(request)
        engine_ids[request.request_id] = engine_id
        return item.handle

    def pending(self) -> int:
        return len(self._request_state()[0])

    def abort(self, request_id: str) -> None:
        """Finish a queued request now with its tokens so far (reason "abort"); unknown or finished ids: no-op."""
        queued, engine_ids = self._request_state()
        engine_id = engine_ids.pop(request_id, None)
        if engine_id is not None:
            self.llm.llm_engine.abort_request([engine_id], internal=True)
            queued.pop(request_id).finish("abort")

    def step(self, *, max_tokens: int | None = None) -> list[RolloutOutput]:
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"step(max_tokens=) must be None or >= 1, got {max_tokens!r}")
        queued, _ = self._request_state()
        finished = []
        for _ in (range(max_tokens) if max_tokens is not None else itertools.count()):
            if not queued:
                break
            if not self.llm.llm_engine.has_unfinished_requests():
                raise RuntimeError(f"vLLM holds none of the {len(queued)} queued requests {sorted(queued)[:4]}")
            for output in self.llm.llm_engine.step():
                item = queued.get(output.request_id)
                if item is not None:
                    reason = self._take(item, output)
                    if reason is not None:
                        finished.append(self._finished(output.request_id, reason))
        return finished

    def _take(self, item: QueuedRequest, output) -> str | None:
        """Append a delta output's tokens to ``item``; its finish reason, or None while it goes on."""
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        item.tokens += tokens
        item.logprobs += [position[token].logprob for position, token in zip(completion.logprobs, tokens)]
        item.versions += [self.version] * len(tokens)
        stop_sequences = item.request.options.stop_sequences
        end = cut_at_stop_sequence(item.tokens, stop_sequences) if stop_sequences else len(item.tokens)
        if end < len(item.tokens) or (stop_sequences and end == len(item.tokens) and _ends_with_any(
                item.tokens, stop_sequences)):
            del item.tokens[end:], item.logprobs[end:], item.versions[end:]
            if not output.finished:
                self.llm.llm_engine.abort_request([self._request_state()[1][item.request.request_id]], internal=True)
            return "stop"
        return (completion.finish_reason or "stop") if output.finished else None

    def _finished(self, request_id: str, reason: str) -> RolloutOutput:
        queued, engine_ids = self._request_state()
        item = queued.pop(request_id)
        del engine_ids[request_id]
        return item.finish(reason if reason in ("stop", "length", "abort") else "stop")


def _ends_with_any(tokens: list[int], sequences) -> bool:
    return any(len(sequence) <= len(tokens) and tuple(tokens[-len(sequence):]) == tuple(sequence)
               for sequence in sequences)
