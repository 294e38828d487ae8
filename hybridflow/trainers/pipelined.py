"""Pipelined asynchronous sampling (``async.max_staleness`` = k): generation on the rollout pool runs k batches
ahead of the trainer, on weights synced (and verified) from the actor.

Versions: version v is the policy after v RL steps. Step s (1-based) trains version s - 1 on batch s, which the
rollout pool generated with version max(0, s - 1 - k). So before step s trains, the driver syncs version s - 1
to the rollout pool and submits the generation of batch s + k (non-blocking); batches 1 .. k + 1 are generated
with version 0. The rollout replicas execute calls in submission order, so a batch is generated with the last
weights synced before it was submitted; each output is stamped with that version and checked against the
schedule. k = 0 is the synchronous step (generation of batch s with version s - 1, then training).

Scoring ahead: the frozen scoring roles placed on the rollout pool (``placement.roles`` reference / reward there)
are called with the generation's future as their input right after it is submitted, so the replicas' processes
score each batch as soon as it is generated (the rank fetches its rows from the object store, not through the
driver) while the trainer updates on the batch before; ``sample`` finds those scores done and the trainer scores
only what needs the current actor (old log-probs, a critic).

Exactly once: a checkpoint after step s holds the k batches in flight (generated samples, their versions, the
scores made ahead when there are), written next to the roles' checkpoints; a resume puts them back in the queue,
so no batch is dropped, regenerated with other weights or trained twice (tests/test_async.py). A batch saved
without scores made ahead is scored on the rollout pool when its step comes (the reference never changes).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.trainers.step import Experience, first_rank
from hybridflow.workers.actor import TRAINING_EXACT_LOGPROBS, WEIGHT_VERSION

IN_FLIGHT_FILE = "in_flight.pt"
"""The in-flight batches of a pipelined run's checkpoint (under the checkpoint's directory)."""


@dataclass
class InFlight:
    """One batch of the pipeline: its position in the run, the policy version generating it, its samples."""

    index: int
    """The step that trains it (1-based)."""
    version: int
    prompts: DataProto
    future: object = None
    """The rollout pool's pending generation; None once ``samples`` holds its result."""
    samples: DataProto | None = None
    scoring: list | None = None
    """The pending calls of the scoring roles on the rollout pool (scoring ahead), None once ``scores`` holds them."""
    scores: list[DataProto] | None = None
    """Their outputs; None while pending or when the batch was not scored ahead (a checkpoint without them)."""

    def result(self) -> DataProto:
        if self.samples is None:
            self.samples, self.future = self.future.get(), None
        return self.samples

    def ahead(self) -> list[DataProto] | None:
        """The scores made ahead on the rollout pool (waited for), or None when none were asked for."""
        if self.scoring is not None:
            self.scores, self.scoring = [future.get() for future in self.scoring], None
        return self.scores


class WeightSync:
    """The actor's weights to the rollout pool: issued without waiting, verified by every replica, reported."""

    def __init__(self, *, actor, rollout) -> None:
        self.actor, self.rollout = actor, rollout
        self.version: int | None = None
        """The version last sent to the replicas (None: they hold none yet)."""
        self.pending = None
        self.metrics: dict[str, float] = {}
        """The last finished sync's numbers (``async/weight_version``, ``async/sync_*``)."""

    def sync(self, version: int) -> None:
        """Send ``version`` unless the replicas already have it, without waiting: the actor's output goes to the
        replicas as a future (each fetches it from the object store; the driver never holds the weights), the
        replicas take it after the calls submitted before it, and the calls submitted after it use it. ``finish``
        collects their verification."""
        if self.version == version:
            return
        started = time.perf_counter()
        weights = self.actor.generation_weights.future(version)
        self.pending = (self.rollout.sync_weights.future(weights), version, started)
        self.version = version

    def finish(self) -> None:
        """Wait for the sync issued last (raises the replica's WeightMismatchError) and report it: bytes, the
        sync's seconds and GB/s, buckets, the checksum and verification seconds, the wall time to verification."""
        if self.pending is None:
            return
        future, version, started = self.pending
        received = first_rank(future.get())
        self.pending = None
        # the sync's own work: packing and checksums on the trainer, unpacking, verifying and loading on the
        # replica; the wall time from issue to verification also holds the calls queued before it
        seconds = sum(received[name] for name in ("pack_s", "checksum_s", "unpack_s", "verify_s", "load_s"))
        self.metrics = {"async/weight_version": float(version), "async/sync_bytes": float(received["bytes"]),
                        "async/sync_s": seconds, "async/sync_gb_per_s": received["bytes"] / seconds / 1e9,
                        "async/sync_wall_s": time.perf_counter() - started,
                        "async/sync_buckets": float(received["buckets"]),
                        "async/sync_checksum_s": received["checksum_s"],
                        "async/sync_verify_s": received["verify_s"]}


class SingleResponses:
    """What the rollout pool generates without ``env``: one response per sample, with no job and no metrics of its
    own (``EpisodeSampling`` is the multi-turn counterpart: the same three members)."""

    rollout_method = "generate_sequences"

    def prepare(self, prompts: DataProto) -> DataProto:
        return prompts

    def observe(self, batch: DataProto) -> dict[str, float]:
        return {}


class PipelinedSampling:
    """Generates on the rollout pool k batches ahead (a sampling strategy: ``sample(prompts, seed, ...)``)."""

    def __init__(self, *, actor, rollout, loader, score, max_staleness: int, samples_per_prompt: int,
                 run_seed: int, tis_cap: float | None, episodes=None, ahead: dict | None = None) -> None:
        """``score(batch)``: ``RLTrainer.score`` (reference, critic, reward, old log-probs as futures) less the
        scorers in ``ahead``: role -> scoring method of the roles on the rollout pool (e.g. ``{"reference":
        reference.compute_ref_log_prob}``), called on each batch as soon as its generation is submitted; ``episodes``:
        the run's ``EpisodeSampling`` (``env``), whose job the replicas run (``generate_episodes``) in place of
        single responses, on the same schedule."""
        self.actor, self.rollout, self.loader, self.score, self.ahead = actor, rollout, loader, score, dict(ahead or {})
        self.generated = episodes if episodes is not None else SingleResponses()
        """What the replicas generate: ``rollout_method``, ``prepare(prompts)``, ``observe(batch)`` metrics."""
        self.max_staleness, self.samples_per_prompt, self.run_seed = max_staleness, samples_per_prompt, run_seed
        self.queue: list[InFlight] = []
        self.step = 0
        """RL steps sampled so far (the trainer's step once ``sample`` returns)."""
        self.weights = WeightSync(actor=actor, rollout=rollout)
        warn_without_correction(max_staleness, tis_cap)

    # ----- one step ---------------------------------------------------------------------------------
    def sample(self, prompts: DataProto, seed: int, generate_and_score=None) -> Experience:
        """Batch ``step`` of the pipeline, scored; batches up to ``step + k`` submitted before it returns.

        ``prompts`` joins the pipeline as its newest batch (the loader's next, drawn by the trainer's loop); the
        step's own seed and ``generate_and_score`` (the actor's generation) are not used: each batch is
        generated on the rollout pool with the seed of the step that trains it."""
        self.step += 1
        self.queue.append(InFlight(index=self._next_index(), version=-1, prompts=prompts))
        while len(self.queue) < self.max_staleness + 1:  # the first step fills the pipeline
            self.queue.append(InFlight(index=self._next_index(), version=-1, prompts=self.loader.next_batch()))
        self._submit_pending(version=self.step - 1)
        head = self.queue.pop(0)
        assert head.index == self.step, (head.index, self.step)
        started = time.perf_counter()
        batch = head.result()
        waited = time.perf_counter() - started
        self.weights.finish()
        generated_by = int(batch.meta_info[WEIGHT_VERSION])
        if generated_by != head.version:
            raise RuntimeError(f"batch of step {head.index} was generated by policy version {generated_by}, the "
                               f"pipelined schedule says {head.version}")
        staleness = self.step - 1 - head.version
        # the rollout's log-probs are pi_old only when they are of the policy being trained
        batch.meta_info[TRAINING_EXACT_LOGPROBS] = bool(batch.meta_info.get(TRAINING_EXACT_LOGPROBS)) and staleness == 0
        batch["policy_version"] = np.full(len(batch), head.version)
        started = time.perf_counter()
        for scores in self._scores_ahead(head):
            batch = batch.union(scores)
        waited_scoring = time.perf_counter() - started
        batch = self.score(batch)
        return Experience(prompts=head.prompts, batch=batch,
                          sampling_metrics={**staleness_metrics(batch, trained_version=self.step - 1),
                                            **self.weights.metrics, **self.generated.observe(batch),
                                            "async/wait_generation_s": waited,
                                            **({"async/wait_scoring_s": waited_scoring} if self.ahead else {})})

    def _scores_ahead(self, head: InFlight) -> list[DataProto]:
        """``head``'s scores from the rollout pool's roles (waited for; scored there now when the batch came from a
        checkpoint saved without them)."""
        if self.ahead and head.scoring is None and head.scores is None:
            head.scoring = [scorer.future(head.samples) for scorer in self.ahead.values()]
        return head.ahead() or []

    def _next_index(self) -> int:
        return self.queue[-1].index + 1 if self.queue else self.step

    def _submit_pending(self, *, version: int) -> None:
        """Sync ``version`` to the rollout pool if it is not there, then submit every batch not yet submitted."""
        pending = [item for item in self.queue if item.future is None and item.samples is None]
        if not pending:
            return
        self.weights.sync(version)
        generate = getattr(self.rollout, self.generated.rollout_method)
        for item in pending:
            item.version = version
            item.prompts.meta_info.update(seed=self.run_seed * 1_000_003 + item.index,
                                          samples_per_prompt=self.samples_per_prompt)
            item.prompts["uid"] = np.arange(len(item.prompts))
            item.future = generate.future(self.generated.prepare(item.prompts))
            # the replicas' processes score the batch right after generating it (each rank fetches its rows)
            item.scoring = [scorer.future(item.future) for scorer in self.ahead.values()] if self.ahead else None

    # ----- checkpoints ------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """The batches in flight (waited for: their samples, versions and prompts) into ``directory``."""
        items = [{"index": item.index, "version": item.version, "prompts": item.prompts, "samples": item.result(),
                  "scores": item.ahead()} for item in self.queue]
        torch.save({"step": self.step, "synced_version": self.weights.version, "in_flight": items,
                    "scored_ahead_by": sorted(self.ahead)},
                   directory / IN_FLIGHT_FILE)

    def load(self, directory: Path) -> None:
        """Put back what ``save`` wrote: the next steps train exactly the batches the interrupted run had made."""
        state = torch.load(directory / IN_FLIGHT_FILE, weights_only=False)
        if "in_flight" not in state:
            raise ValueError(f"{directory / IN_FLIGHT_FILE} was written by a streaming run; async.mode=pipelined "
                             "cannot resume it (resume with the mode it was written with)")
        self.step = state["step"]
        # scores made ahead are kept while the same roles score ahead (else those that do score the batch again)
        same = self.ahead and state.get("scored_ahead_by") == sorted(self.ahead)
        self.queue = [InFlight(index=item["index"], version=item["version"], prompts=item["prompts"],
                               samples=item["samples"], scores=item.get("scores") if same else None)
                      for item in state["in_flight"]]
        self.weights.version = None  # the new rollout pool holds no weights yet


def warn_without_correction(max_staleness: int, tis_cap: float | None) -> None:
    """Stale samples without truncated importance weights train uncorrected: say so."""
    if max_staleness > 0 and tis_cap is None:
        warnings.warn(f"async.max_staleness={max_staleness} without actor.loss.tis_cap: stale samples are "
                      "trained without truncated importance weights against the rollout's log-probs", stacklevel=3)


def staleness_metrics(batch: DataProto, *, trained_version: int) -> dict[str, float]:
    """Mean and max staleness (updates between the generating and the trained policy) of a batch's samples, and
    the count of samples at each staleness (``async/staleness_count_<n>``)."""
    staleness_B = trained_version - np.asarray(batch["policy_version"], dtype=np.int64)
    counts = Counter(staleness_B.tolist())
    return {"async/staleness_mean": float(staleness_B.mean()), "async/staleness_max": float(staleness_B.max()),
            **{f"async/staleness_count_{value}": float(count) for value, count in sorted(counts.items())}}
