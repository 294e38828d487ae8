"""The generation engine: batched KV-cache sampling on a (possibly tensor- and pipeline-parallel) decoder.

One call of ``GenerationEngine.generate`` decodes a batch of left-padded prompts. Rows that hit an
EOS/stop token leave the active batch and their rows are cut out of the KV cache, so finished
sequences cost nothing; the cache lives only inside the call. Under pipeline parallelism (pg > 1)
each stage receives hidden states from the previous one, the stage holding the output head samples,
and the sampled tokens are broadcast to every stage of the pipeline so all stages drop the same rows.

Shape legend: B rows (prompts x samples per prompt), P prompt length, T max new tokens,
S = P + T, V vocabulary, H hidden size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridflow.engine.decoder import DecoderStage
from hybridflow.engine.generation_config import GenerationConfig, SamplingConfig  # noqa: F401 (re-exported)
from hybridflow.engine.rollout import RolloutStats, batch_output
from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD, routing_dtype


def process_logits(logits_BV: torch.Tensor, config: GenerationConfig, *, history_BL: torch.Tensor | None,
                   step: int, end_ids: torch.Tensor | None) -> torch.Tensor:
    """Logits with repetition penalty, suppressed tokens and ``min_new_tokens`` applied (a new tensor).

    ``history_BL``: the tokens seen so far per row (prompt and response; padding may be included, it is
    never sampled anyway); ``step``: response tokens generated so far; ``end_ids``: EOS and stop ids.
    """
    logits_BV = logits_BV.clone()
    if config.repetition_penalty != 1.0 and history_BL is not None:
        seen_BL = logits_BV.gather(-1, history_BL)
        penalised_BL = torch.where(seen_BL > 0, seen_BL / config.repetition_penalty, seen_BL * config.repetition_penalty)
        logits_BV.scatter_(-1, history_BL, penalised_BL)
    if config.suppress_tokens:
        suppressed = torch.tensor(config.suppress_tokens, dtype=torch.long, device=logits_BV.device)
        logits_BV.index_fill_(-1, suppressed, float("-inf"))
    if step < config.min_new_tokens and end_ids is not None and len(end_ids):
        logits_BV.index_fill_(-1, end_ids, float("-inf"))
    return logits_BV


@dataclass(frozen=True)
class PipelinePeers:
    """Where this rank sits in its generation pipeline (one per generation tensor-parallel rank)."""

    group: object
    """The torch.distributed group of the pipeline's ranks (stage 0 first)."""
    ranks: list[int] = field(default_factory=list)
    """Global ranks of the stages, stage 0 first."""
    stage: int = 0
    """This rank's stage."""

    @property
    def num_stages(self) -> int:
        return len(self.ranks)


def sample_tokens(logits_BV: torch.Tensor, config: GenerationConfig, generator: torch.Generator | None, *,
                  history_BL: torch.Tensor | None = None, step: int = 0,
                  end_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], logprobs [B]) of one step.

    Greedy: argmax and its log-probability under the model (temperature 1). Sampling: the
    log-probability under the tempered distribution softmax(logits / temperature) before top-k/top-p
    truncation: the distribution a training engine recomputes with the same temperature. The token is
    chosen from the logits after ``process_logits`` (repetition penalty, suppressed tokens, min length).
    """
    processed_BV = process_logits(logits_BV, config, history_BL=history_BL, step=step, end_ids=end_ids)
    if config.greedy:
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        tokens_B = processed_BV.argmax(dim=-1)
        return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
    # dividing by 1 would only copy (x / 1 == x exactly)
    scaled_BV = logits_BV / config.temperature if config.temperature != 1.0 else logits_BV
    logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
    filtered_BV = processed_BV / config.temperature if config.temperature != 1.0 else processed_BV
    if config.top_k and config.top_k < filtered_BV.shape[-1]:
        kth_B1 = filtered_BV.topk(config.top_k, dim=-1).values[:, -1:]
        filtered_BV[filtered_BV < kth_B1] = float("-inf")
    if config.top_p < 1.0:
        sorted_BV, order_BV = filtered_BV.sort(dim=-1, descending=True)
        probs_BV = sorted_BV.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the first always stays)
        drop_BV = (probs_BV.cumsum(dim=-1) - probs_BV) >= config.top_p
        sorted_BV[drop_BV] = float("-inf")
        filtered_BV = torch.full_like(filtered_BV, float("-inf")).scatter(-1, order_BV, sorted_BV)
    tokens_B = draw_tokens(filtered_BV.softmax(dim=-1), generator)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def draw_tokens(probs_BV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, token v of row b with probability ``probs_BV[b, v]`` (long, [B]); zero-probability
    tokens are never drawn.

    On CPU by inverting each row's cumulative distribution at one uniform draw: ``torch.multinomial`` draws
    one exponential variate per vocabulary entry (the exponential race), which at a 49k vocabulary and
    128 rows costs 0.17 s per decode step here against 0.012 s for a cumsum and a binary search. The CPU
    cumsum adds each row's entries in order, so the cumulative sums never decrease and stay flat across a
    zero-probability token: the search, aimed strictly below the row's total, cannot land on one. CUDA
    keeps ``torch.multinomial``: its kernel is fast there and its parallel scan does not promise that order.
    """
    if probs_BV.device.type != "cpu":
        return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)
    cdf_BV = probs_BV.cumsum(dim=-1)
    total_B1 = cdf_BV[:, -1:]
    target_B1 = torch.rand(total_B1.shape, generator=generator, dtype=cdf_BV.dtype) * total_B1
    # u < 1, but u * total can round up to total: stay strictly below it
    target_B1 = torch.minimum(target_B1, torch.nextafter(total_B1, torch.zeros_like(total_B1)))
    return torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)


class GenerationEngine:
    """Samples responses with one decoder stage per rank; all ranks of a generation replica call it together."""

    def __init__(self, stage: DecoderStage, *, pipeline: PipelinePeers | None = None,
                 static_decode: bool | None = None, cuda_graphs: bool | None = None) -> None:
        """``static_decode``: decode every row of a wave at every step with fixed shapes instead of cutting
        finished rows out of the batch and the KV cache. None = on CUDA with one pipeline stage, where the
        GPU is launch-bound and compaction costs host syncs and cache copies; on CPU compaction saves the
        compute of finished rows. ``cuda_graphs``: replay each static decode step as one CUDA graph
        (None = whenever static decode runs on CUDA without tensor parallelism)."""
        self.stage = stage
        self.pipeline = pipeline or PipelinePeers(group=None, ranks=[0], stage=0)
        single = self.pipeline.num_stages == 1
        on_cuda = stage.device.type == "cuda"
        self.static_decode = (on_cuda and single) if static_decode is None else static_decode
        if self.static_decode and not single:
            raise ValueError("static_decode needs a single generation pipeline stage (pg = 1)")
        self.cuda_graphs = (self.static_decode and on_cuda and stage.tp.size == 1) if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not (self.static_decode and on_cuda):
            raise ValueError("cuda_graphs needs static_decode on a CUDA device")
        self.last_stats = RolloutStats()
        p = self.pipeline
        assert stage.has_embedding == (p.stage == 0) and stage.has_final_norm == (p.stage == p.num_stages - 1)
        # the head lives with the embedding when tied (stage 0), else on the last stage
        self.head_stage = 0 if stage.spec.tie_word_embeddings else p.num_stages - 1
        assert stage.has_head == (p.stage == self.head_stage)

    def generate(self, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                 config: SamplingConfig) -> dict[str, torch.Tensor]:
        """Responses for left-padded prompts, per the shared batch conventions.

        Returns ``prompts``, ``responses`` [B, T], ``response_mask``, ``input_ids`` [B, P+T],
        ``attention_mask``, ``position_ids``, ``logprobs`` [B, T] (0 after the end), with
        B = prompts x samples_per_prompt and T = max_new_tokens; with ``config.record_routing`` also
        ``routed_experts`` [B, P+T, L, K] (``RoutingRecorder``).

        Decodes under ``torch.inference_mode`` (no view or version tracking: a decode step is hundreds of
        small operations, each cheaper that way) and returns ordinary tensors (copies of the few outputs), which
        training may use like any other.
        """
        config = config.resolved()
        if config.record_routing and self.pipeline.num_stages > 1:
            raise ValueError("record_routing (routing replay) needs a single generation pipeline stage (pg = 1): each "
                             "stage would hold only its own layers' routing")
        try:
            with torch.inference_mode():
                outputs = self._generate(prompts_BP, prompt_mask_BP, config)
        finally:
            self.stage.routing = None  # a failed call leaves no recording behind
        return {key: value.clone() for key, value in outputs.items()}

    def _generate(self, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                  config: GenerationConfig) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        device = self.stage.device
        prompts_BP = prompts_BP.to(device).repeat_interleave(config.samples_per_prompt, dim=0)
        prompt_mask_BP = prompt_mask_BP.to(device).repeat_interleave(config.samples_per_prompt, dim=0).long()
        generator = torch.Generator(device=device)
        generator.manual_seed(config.seed)
        stats = RolloutStats()
        B, P = prompts_BP.shape
        rows = self.rows_per_wave(B, P, config)
        waves = [self._generate_wave(prompts_BP[first:first + rows], prompt_mask_BP[first:first + rows], config,
                                     generator, stats) for first in range(0, B, rows)]
        stats.waves = len(waves)
        stats.seconds = time.perf_counter() - start
        self.last_stats = stats
        return waves[0] if len(waves) == 1 else {key: torch.cat([w[key] for w in waves]) for key in waves[0]}

    def rows_per_wave(self, num_rows: int, prompt_len: int, config: GenerationConfig) -> int:
        """How many rows one wave admits under ``config.memory_budget_gib`` (the same on every rank of the
        replica: the smallest of their answers)."""
        budget = config.memory_budget_gib * 2**30 if config.memory_budget_gib is not None else None
        if budget is None and self.stage.device.type == "cuda":
            budget = 0.8 * torch.cuda.mem_get_info(self.stage.device)[0]
        if budget is None:
            return num_rows
        rows = max(1, min(num_rows, int(budget // self.stage.bytes_per_row(prompt_len, config.max_new_tokens))))
        groups = [g for g in (self.stage.tp.group if self.stage.tp.size > 1 else None,
                              self.pipeline.group if self.pipeline.num_stages > 1 else None) if g is not None]
        if groups:
            rows_t = torch.tensor(rows, device=self.stage.device)
            for group in groups:
                dist.all_reduce(rows_t, op=dist.ReduceOp.MIN, group=group)
            rows = int(rows_t)
        return rows

    def _generate_wave(self, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, config: GenerationConfig,
                       generator: torch.Generator, stats: RolloutStats) -> dict[str, torch.Tensor]:
        if self.static_decode:
            return self._generate_wave_static(prompts_BP, prompt_mask_BP, config, generator, stats)
        device = self.stage.device
        B, P = prompts_BP.shape
        T = config.max_new_tokens
        responses_BT, logprobs_BT, response_mask_BT, stops = _wave_buffers(prompts_BP, prompt_mask_BP, config)
        routing = RoutingRecorder(self.stage, B, P + T) if config.record_routing else NO_ROUTING

        rows_B = torch.arange(B, device=device)  # output row of each row in the batch
        alive_B = torch.ones(B, dtype=torch.bool, device=device)  # rows of the batch still generating
        cache = self.stage.new_cache(batch=B, max_len=P + T)
        key_valid_BS = torch.zeros((B, P + T), dtype=torch.bool, device=device)
        key_valid_BS[:, :P] = prompt_mask_BP.bool()
        positions_BP = (prompt_mask_BP.cumsum(dim=1) - 1).clamp(min=0)
        next_position_B = prompt_mask_BP.sum(dim=1)
        logits_BV = self._forward(prompts_BP, positions_BP, cache, key_valid_BS)
        routing.take(slice(None), slice(0, P))
        stats.kv_cache_bytes = max(stats.kv_cache_bytes, cache.nbytes())
        needs_history = config.repetition_penalty != 1.0
        alive = B  # rows of the batch still generating, counted on the host
        for step in range(T):
            history_BL = (torch.cat([prompts_BP[rows_B], responses_BT[rows_B, :step]], dim=1)
                          if needs_history else None)
            tokens_B, logprobs_B = self._sample_and_share(logits_BV, config, generator, len(rows_B),
                                                          history_BL=history_BL, step=step, end_ids=stops)
            if alive == len(rows_B):  # no finished row waits in the batch: every row writes
                written_B, new_tokens_B, new_logprobs_B = rows_B, tokens_B, logprobs_B
            else:
                written_B, new_tokens_B, new_logprobs_B = rows_B[alive_B], tokens_B[alive_B], logprobs_B[alive_B]
            responses_BT[written_B, step] = new_tokens_B
            logprobs_BT[written_B, step] = new_logprobs_B
            response_mask_BT[written_B, step] = 1
            finished_B = torch.isin(tokens_B, stops)
            if config.stop_sequences:
                finished_B |= _ends_with_stop_sequence(responses_BT[rows_B], step, config)
            alive_B = alive_B & ~finished_B
            alive = int(alive_B.sum())
            if step == T - 1 or alive == 0:
                break
            key_valid_BS[:, P + step] = True
            # Finished rows leave the batch and the KV cache once they are a COMPACT_FRACTION of it: cutting
            # them out copies every layer's cache, so it is done in batches, not at every step a row ends
            # (until then a finished row is decoded and ignored)
            finished = len(alive_B) - alive
            if finished and finished >= COMPACT_FRACTION * len(alive_B):
                rows_B, tokens_B, next_position_B = rows_B[alive_B], tokens_B[alive_B], next_position_B[alive_B]
                key_valid_BS = key_valid_BS[alive_B]
                cache.keep_rows(alive_B)
                alive_B = alive_B[alive_B]
            logits_BV = self._forward(tokens_B[:, None], next_position_B[:, None], cache, key_valid_BS)
            routing.take(rows_B, slice(P + step, P + step + 1))  # the forward read this step's token, column P + step
            next_position_B = next_position_B + 1
            stats.decode_steps += 1
            stats.rows_decoded += len(rows_B)
        del cache  # the KV cache lives only inside this call
        return routing.finish(batch_output(prompts_BP, prompt_mask_BP, responses_BT, response_mask_BT, logprobs_BT))

    def _generate_wave_static(self, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                              config: GenerationConfig, generator: torch.Generator,
                              stats: RolloutStats) -> dict[str, torch.Tensor]:
        """The wave with fixed shapes: finished rows stay in the batch (padded, masked out), the cache is
        written at a device-side index, and the host checks for the end only every few steps."""
        device = self.stage.device
        B, P = prompts_BP.shape
        T = config.max_new_tokens
        responses_BT, logprobs_BT, response_mask_BT, stops = _wave_buffers(prompts_BP, prompt_mask_BP, config)
        routing = RoutingRecorder(self.stage, B, P + T) if config.record_routing else NO_ROUTING
        cache = self.stage.new_cache(batch=B, max_len=P + T)
        key_valid_BL = torch.zeros((B, P + T), dtype=torch.bool, device=device)
        key_valid_BL[:, :P] = prompt_mask_BP.bool()
        positions_BP = (prompt_mask_BP.cumsum(dim=1) - 1).clamp(min=0)
        position_B = prompt_mask_BP.sum(dim=1)
        logits_BV = self._forward(prompts_BP, positions_BP, cache, key_valid_BL)
        routing.take(slice(None), slice(0, P))
        stats.kv_cache_bytes = max(stats.kv_cache_bytes, cache.nbytes())
        finished_B = torch.zeros(B, dtype=torch.bool, device=device)
        pad_B = torch.full((B,), config.pad_token_id, dtype=prompts_BP.dtype, device=device)
        step_fn = _DecodeGraph(self, cache, key_valid_BL, B) if self.cuda_graphs and routing.graphable else None
        needs_history = config.repetition_penalty != 1.0
        for step in range(T):
            history_BL = torch.cat([prompts_BP, responses_BT[:, :step]], dim=1) if needs_history else None
            tokens_B, logprobs_B = self._sample_and_share(logits_BV, config, generator, B,
                                                          history_BL=history_BL, step=step, end_ids=stops)
            active_B = ~finished_B
            tokens_B = torch.where(active_B, tokens_B, pad_B)
            responses_BT[:, step] = tokens_B
            logprobs_BT[:, step] = torch.where(active_B, logprobs_B, 0.0)
            response_mask_BT[:, step] = active_B.to(response_mask_BT.dtype)
            ends_B = torch.isin(tokens_B, stops)
            ends_B |= _ends_with_stop_sequence(responses_BT, step, config)
            finished_B = finished_B | (active_B & ends_B)
            # one host sync every few steps instead of several per step
            if step == T - 1 or ((step + 1) % STATIC_END_CHECK_EVERY == 0 and bool(finished_B.all())):
                break
            key_valid_BL[:, P + step] = True
            index_1 = torch.full((1,), P + step, dtype=torch.long, device=device)
            if step_fn is not None:
                logits_BV = step_fn(tokens_B, position_B, index_1)
            else:
                logits_BV = self._decode_at(tokens_B[:, None], position_B[:, None], cache, key_valid_BL, index_1)
            routing.take(slice(None), slice(P + step, P + step + 1))
            position_B = position_B + 1
            stats.decode_steps += 1
            stats.rows_decoded += B
        del cache, step_fn
        return routing.finish(batch_output(prompts_BP, prompt_mask_BP, responses_BT, response_mask_BT, logprobs_BT))

    def _decode_at(self, ids_B1: torch.Tensor, positions_B1: torch.Tensor, cache, key_valid_BL: torch.Tensor,
                   index_1: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of one static decode step (single pipeline stage)."""
        stage = self.stage
        hidden_B1H = stage.decode_layers_at(stage.embed(ids_B1), positions_B1, cache, key_valid_BL, index_1)
        return stage.head(stage.final_norm(hidden_B1H[:, -1]))

    # ----- one step through the pipeline ------------------------------------------------------------
    def _forward(self, ids_BS: torch.Tensor, positions_BS: torch.Tensor, cache, key_valid_BS: torch.Tensor):
        """Logits [B, V] of the last position on the head stage, None on the other stages."""
        stage, p = self.stage, self.pipeline
        B, S = ids_BS.shape
        if p.stage == 0:
            hidden_BSH = stage.embed(ids_BS)
        else:
            hidden_BSH = torch.empty((B, S, stage.spec.hidden_size), dtype=stage.dtype, device=stage.device)
            dist.recv(hidden_BSH, src=p.ranks[p.stage - 1], group=p.group)
        hidden_BSH = stage.forward_layers(hidden_BSH, positions_BS, cache, key_valid_BS)
        if p.stage < p.num_stages - 1:
            dist.send(hidden_BSH.contiguous(), dst=p.ranks[p.stage + 1], group=p.group)
        last_hidden_BH = None
        if p.stage == p.num_stages - 1:
            last_hidden_BH = stage.final_norm(hidden_BSH[:, -1])
            if self.head_stage != p.stage:
                dist.send(last_hidden_BH.contiguous(), dst=p.ranks[self.head_stage], group=p.group)
        elif p.stage == self.head_stage:
            last_hidden_BH = torch.empty((B, stage.spec.hidden_size), dtype=stage.dtype, device=stage.device)
            dist.recv(last_hidden_BH, src=p.ranks[-1], group=p.group)
        return stage.head(last_hidden_BH) if p.stage == self.head_stage else None

    def _sample_and_share(self, logits_BV, config, generator, rows: int, **processing):
        """Sample on the head stage (every tp rank draws the same tokens from the same logits and seed),
        then broadcast tokens and log-probs to the other stages of the pipeline."""
        p = self.pipeline
        if p.stage == self.head_stage:
            tokens_B, logprobs_B = sample_tokens(logits_BV, config, generator, **processing)
        else:
            tokens_B = torch.empty(rows, dtype=torch.long, device=self.stage.device)
            logprobs_B = torch.empty(rows, dtype=torch.float32, device=self.stage.device)
        if p.num_stages > 1:
            packed = torch.stack([tokens_B.double(), logprobs_B.double()])
            dist.broadcast(packed, src=p.ranks[self.head_stage], group=p.group)
            tokens_B, logprobs_B = packed[0].long(), packed[1].float()
        return tokens_B, logprobs_B


class RoutingRecorder:
    """The experts a wave's MoE layers chose for its tokens, as ``routed_experts`` [B, S, L, K] (S = P + T columns of
    ``input_ids``, L the stage's MoE layers in layer order, K experts per token; ``ROUTING_PAD`` where no forward
    read a token: padding, and each response's last token, sampled after the last forward).

    The decoder appends each MoE layer's choice to ``stage.routing`` during a forward (``DecoderStage._experts``);
    ``take`` moves one forward's routing to the rows and columns that forward read. ``NO_ROUTING`` stands in when
    nothing is recorded, so the decode loop never asks which."""

    graphable = False
    """A CUDA graph replay runs no Python, so recording decodes eagerly."""

    def __init__(self, stage: DecoderStage, rows: int, columns: int) -> None:
        if not stage.moe_layers:
            raise ValueError("record_routing (routing replay) needs a mixture-of-experts model (Qwen3-MoE); this "
                             "decoder has no MoE layers")
        self.stage = stage
        self.experts_BSLK = torch.full((rows, columns, len(stage.moe_layers), stage.spec.experts_per_token),
                                       ROUTING_PAD, dtype=routing_dtype(stage.num_experts), device=stage.device)
        stage.routing = []

    def take(self, rows, columns: slice) -> None:
        """Store the routing of the forward just run: it read rows ``rows`` (indices or a slice) at ``columns``."""
        layers = self.stage.routing
        assert len(layers) == len(self.stage.moe_layers), (len(layers), self.stage.moe_layers)
        self.experts_BSLK[rows, columns] = torch.stack(layers, dim=2).to(self.experts_BSLK.dtype)
        layers.clear()

    def finish(self, output: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A wave's output with the recording as ``routed_experts``, padding marked (``attention_mask`` 0: left
        padding, tokens after a response's end)."""
        self.stage.routing = None
        mask_BS11 = ~output["attention_mask"].bool()[:, :, None, None]
        output[ROUTED_EXPERTS] = self.experts_BSLK.masked_fill_(mask_BS11, ROUTING_PAD)
        return output


class _NoRouting:
    """``RoutingRecorder``'s stand-in when a call records nothing: every method does nothing."""

    graphable = True

    def take(self, rows, columns: slice) -> None:
        pass

    def finish(self, output: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return output


NO_ROUTING = _NoRouting()


def _wave_buffers(prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, config: GenerationConfig):
    """(responses_BT filled with padding, logprobs_BT zeros, response_mask_BT zeros, the end-token ids)."""
    (B, _), T, device = prompts_BP.shape, config.max_new_tokens, prompts_BP.device
    responses_BT = torch.full((B, T), config.pad_token_id, dtype=prompts_BP.dtype, device=device)
    logprobs_BT = torch.zeros((B, T), dtype=torch.float32, device=device)
    response_mask_BT = torch.zeros((B, T), dtype=prompt_mask_BP.dtype, device=device)
    stops = torch.tensor(sorted(set(config.eos_token_ids) | set(config.stop_token_ids)), dtype=torch.long,
                         device=device)
    return responses_BT, logprobs_BT, response_mask_BT, stops


def _ends_with_stop_sequence(responses_BT: torch.Tensor, step: int, config: GenerationConfig) -> torch.Tensor:
    """[B] bool: the response (tokens 0..step) now ends with one of ``config.stop_sequences``."""
    ends_B = torch.zeros(responses_BT.shape[0], dtype=torch.bool, device=responses_BT.device)
    for sequence in config.stop_sequences:
        if len(sequence) <= step + 1:
            tail_BL = responses_BT[:, step + 1 - len(sequence):step + 1]
            ends_B |= (tail_BL == torch.tensor(sequence, device=responses_BT.device)).all(dim=1)
    return ends_B


COMPACT_FRACTION = 0.25
"""Compacting decode cuts finished rows out of the batch and the KV cache once they are at least this
fraction of the rows decoded (0: at every step a row finishes)."""

STATIC_END_CHECK_EVERY = 8
"""Static decode asks the device whether every row has finished once per this many steps."""


class _DecodeGraph:
    """One static decode step of a wave captured as a CUDA graph and replayed every step.

    Eager decode of a ~1B model at batch 128 is bound by the host launching ~800 kernels per step;
    a replay launches them all at once. Inputs are copied into static buffers; the logits come back
    in the graph's static output (valid until the next replay).
    """

    def __init__(self, engine: GenerationEngine, cache, key_valid_BL: torch.Tensor, batch: int) -> None:
        device = engine.stage.device
        self.tokens_B1 = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions_B1 = torch.zeros((batch, 1), dtype=torch.long, device=device)
        # warm-up and capture write the cache at this index; the first real step rewrites the same slot
        self.index_1 = torch.full((1,), cache.length, dtype=torch.long, device=device)
        args = (self.tokens_B1, self.positions_B1, cache, key_valid_BL, self.index_1)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and library warm-up off the capture
                engine._decode_at(*args)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits_BV = engine._decode_at(*args)

    def __call__(self, tokens_B: torch.Tensor, positions_B: torch.Tensor, index_1: torch.Tensor) -> torch.Tensor:
        self.tokens_B1.copy_(tokens_B[:, None])
        self.positions_B1.copy_(positions_B[:, None])
        self.index_1.copy_(index_1)
        self.graph.replay()
        return self.logits_BV
