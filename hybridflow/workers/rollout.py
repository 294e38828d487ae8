"""RolloutWorker: a generation-only copy of the policy on its own pool, fed by verified weight syncs from the actor.

With a ``rollout`` role in ``placement.roles`` the rollout replicas run in processes of their own (asynchronous
RL, docs/async.md): each rank is one generation replica (pg = tg = 1) that holds the whole policy in the
generation dtype, no optimizer and no gradients. Its weights arrive from the actor through ``sync_weights``
(bucketed, with a version and per-tensor checksums: ``engine/weight_sync.py``); ``generate_sequences`` and
``generate_episodes`` (multi-turn episodes, ``env``) answer like the actor's, every output stamped with the version
of the weights that generated it. ``stream`` is streaming mode's poll (docs/async.md "Modes"): the replica keeps a
set of requests in flight across calls and across weight syncs (continuous batching through the ``Rollout`` request
API), each token stamped with the version that sampled it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridflow.controller import Worker, register
from hybridflow.controller.host import pin_num_threads
from hybridflow.engine.generation_config import GenerationConfig, GenerationTokens
from hybridflow.engine.rollout import (GenerationShard, RequestHandle, Rollout, RolloutOutput, RolloutRequest,
                                       continue_request, rollout_class)
from hybridflow.engine.weight_sync import WeightPayload, unpack_weights, verify_weights
from hybridflow.parallel.layout import GenerationLayout, ParallelLayout
from hybridflow.protocol import DataProto
from hybridflow.workers.actor import GENERATION_OVERRIDES, TRAINING_EXACT_LOGPROBS, WEIGHT_VERSION, episodes_batch
from hybridflow.workers.base import ROLLOUT_TEMPERATURE
from hybridflow.workers.spec import EngineSpec


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """Everything a RolloutWorker builds: the policy's architecture and dtype, sampling defaults, verification."""

    engine: EngineSpec
    """The actor's model and engine sections: the architecture, and the compute dtype generation runs in."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling defaults (the actor's)."""
    tokens: GenerationTokens = field(default_factory=GenerationTokens)
    """EOS, pad and stop ids (the actor's)."""
    verify_weights: bool = True
    """Check every received tensor against the trainer's checksum (``async.verify_weights``)."""


@dataclass(frozen=True)
class StreamWork:
    """One poll of a streaming replica (``RolloutWorker.stream``): requests to stop, requests to start, how far to
    decode."""

    submit: tuple[RolloutRequest, ...] = ()
    abort: tuple[str, ...] = ()
    """Request ids to drop (finished or unknown ids are ignored): their tokens so far are discarded."""
    snapshot: tuple[str, ...] = ()
    """Request ids whose tokens so far the poll reports (``StreamReport.snapshots``, finish reason "abort") before
    decoding; the requests go on: ``continue_request`` of such an output resumes it elsewhere (after a resume from a
    checkpoint). Ids the replica does not hold are ignored."""
    decode_tokens: int = 8
    """Tokens each held request decodes per round of the poll (0: no round)."""
    decode_seconds: float = 0.0
    """Rounds go on while the poll has run for less than this and requests are held (0: one round)."""


@dataclass(frozen=True)
class StreamReport:
    """What a poll returns: the requests that finished in it, and the replica's state after it."""

    finished: list[RolloutOutput]
    version: int | None
    """The weight version the poll decoded with."""
    pending: int
    """Requests still held (in flight) after the poll."""
    logprobs_match_training: bool
    """The backend's ``Rollout.logprobs_match_training``."""
    snapshots: list[RolloutOutput] = field(default_factory=list)
    """The requests of ``StreamWork.snapshot`` the replica holds, each with its tokens so far."""


class RolloutWorker(Worker):
    """One generation replica per rank; weights only through ``sync_weights``."""

    def __init__(self, spec: RolloutSpec) -> None:
        from hybridflow.models.loader import hf_config_of

        self.spec = spec
        if spec.engine.engine.num_threads:
            pin_num_threads(spec.engine.engine.num_threads)
        self.hf_config = hf_config_of(spec.engine.model, head="lm")
        self.dtype = spec.engine.engine.resolve_dtype(self.hf_config.hidden_size)
        layout = ParallelLayout.for_world(self.world_size)
        self.set_parallel_layout(layout, generation=GenerationLayout(train=layout))  # every rank a replica
        self.rollout: Rollout | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.held: dict[str, RequestHandle] = {}
        """The requests ``stream`` submitted and not finished or aborted yet."""

    @register("ONE_TO_ALL")
    def sync_weights(self, weights: WeightPayload | list[WeightPayload | None]) -> dict[str, float]:
        """Take the trainer's weights, verify them tensor by tensor, load them into the backend; return the
        sync's numbers (bytes, buckets, the trainer's pack and checksum seconds, this replica's unpack, verify and
        load seconds).

        ``weights``: a payload, or the per-rank outputs of ``ActorWorker.generation_weights`` (what a future of
        that call resolves to here: each replica fetches rank 0's payload from the object store itself, and the
        driver never holds the weights)."""
        start = time.perf_counter()
        payload = weights if isinstance(weights, WeightPayload) else next(p for p in weights if p is not None)
        self.weights = unpack_weights(payload, device=self.device)
        received = time.perf_counter()
        if self.spec.verify_weights:
            verify_weights(self.weights, payload.checksums, version=payload.version,
                           replica=f"rollout replica rank {self.rank}")
        verified = time.perf_counter()
        shard = GenerationShard({name: [tensor] for name, tensor in self.weights.items()},
                                layers=range(self.hf_config.num_hidden_layers), has_embedding=True,
                                has_final_norm=True, has_head=True, tp_ranks=[self.rank], pp_ranks=[self.rank],
                                tp_groups=[[rank] for rank in range(self.world_size)])
        if self.rollout is None:
            self.rollout = rollout_class(self.spec.generation.backend).for_shard(
                self.hf_config, shard, dtype=self.dtype, config=self.spec.generation)
        self.rollout.resume()
        self.rollout.load(shard, version=payload.version)
        self.version = payload.version
        return {"bytes": payload.num_bytes, "buckets": len(payload.buckets), "pack_s": payload.pack_seconds,
                "checksum_s": payload.checksum_seconds, "unpack_s": received - start, "verify_s": verified - received,
                "load_s": time.perf_counter() - verified}

    @register("ONE_TO_ALL")
    def weight_version(self) -> int | None:
        """The version of the weights this replica generates with (None before the first sync)."""
        return self.version

    @register("ALL_TO_ALL")
    def stream(self, work: StreamWork) -> StreamReport:
        """Streaming mode's poll, one ``StreamWork`` per replica: drop ``work.abort``, queue ``work.submit`` beside
        the requests held since earlier polls, decode every held request by up to ``work.decode_tokens`` tokens with
        the weights of the last sync (again while the poll is younger than ``work.decode_seconds``), and return those
        that finished, and the tokens so far of ``work.snapshot``'s. Requests outlive syncs: a sync between
        two polls changes the weights mid-sequence, and ``RolloutOutput.versions`` records each token's version."""
        if self.rollout is None:
            raise RuntimeError("the rollout worker has no weights yet: the driver syncs them before streaming")
        rollout = self.rollout
        for request_id in work.abort:
            rollout.abort(request_id)
            self.held.pop(request_id, None)
        snapshots = []
        for request_id in work.snapshot:
            if request_id not in self.held:
                continue
            # the interface reads a request's tokens so far by aborting it; continued at once, it goes on as before
            rollout.abort(request_id)
            snapshots.append(self.held[request_id].result())
            self.held[request_id] = rollout.submit(continue_request(snapshots[-1]))
        for request in work.submit:
            self.held[request.request_id] = rollout.submit(request)
        started, finished = time.perf_counter(), []
        while work.decode_tokens and rollout.pending():
            finished += rollout.step(max_tokens=work.decode_tokens)
            if time.perf_counter() - started >= work.decode_seconds:
                break
        for output in finished:
            self.held.pop(output.request_id, None)
        return StreamReport(finished=finished, version=self.version, pending=rollout.pending(),
                            logprobs_match_training=rollout.logprobs_match_training, snapshots=snapshots)

    @register("3D_ALL_MICRO_DP")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """As ``ActorWorker.generate_sequences``, with the weights of the last sync."""
        if self.rollout is None:
            raise RuntimeError("the rollout worker has no weights yet: the driver syncs them before generating")
        meta = prompts.meta_info
        config = self._call_config(meta)
        output = self.rollout.generate(prompts["input_ids"].to(self.device),
                                       prompts["attention_mask"].to(self.device), config)
        samples = config.samples_per_prompt
        non_tensors = {key: np.repeat(values, samples) for key, values in prompts.non_tensor_batch.items()}
        temperature = 1.0 if config.greedy else float(config.temperature)
        return DataProto.from_dict(tensors={k: v.cpu() for k, v in output.items()}, non_tensors=non_tensors,
                                   meta_info={**meta, ROLLOUT_TEMPERATURE: temperature,
                                              TRAINING_EXACT_LOGPROBS: self.rollout.logprobs_match_training,
                                              WEIGHT_VERSION: self.version})

    @register("3D_ALL_MICRO_DP")
    def generate_episodes(self, prompts: DataProto) -> DataProto:
        """As ``ActorWorker.generate_episodes``, with the weights of the last sync: the same ``EpisodeJob``
        (``prompts.meta_info["episode_job"]``) runs this replica's episodes on its rollout's requests, the
        environments and tools in this process; the batch is the actor's (token-exact ids, the loss mask 1 only on
        sampled tokens, each episode's record), stamped with the version that generated it."""
        if self.rollout is None:
            raise RuntimeError("the rollout worker has no weights yet: the driver syncs them before generating")
        config = self._call_config(prompts.meta_info)
        result = prompts.meta_info["episode_job"].run(self.rollout, prompts, config)
        return episodes_batch(prompts, config, self.rollout, result)

    def _call_config(self, meta: dict):
        """The sampling config of one generation call: the actor's defaults with ``meta``'s overrides; each replica
        draws its own noise (the seed and the rank)."""
        config = self.spec.generation.for_call(self.spec.tokens, seed=int(meta.get("seed", 0)) * 1_000_003 + self.rank,
                                               samples_per_prompt=int(meta.get("samples_per_prompt", 1)))
        return dataclasses.replace(config, **{key: meta[key] for key in GENERATION_OVERRIDES if key in meta})
