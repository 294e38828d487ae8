"""Streaming asynchronous sampling (``async.mode: streaming``): the rollout replicas keep prompts in flight as
requests, take new weights between decode steps, and a prompt's group of samples is trained once all of them
finished, if it is at most k policy versions stale.

Versions: version v is the policy after v RL steps; step s trains version s - 1. Before step s samples, the driver
sends version s - 1 to the replicas (queued behind the poll in progress, so it lands between two decode steps
of the requests in flight: a response may span versions, ``RolloutOutput.versions`` records each token's). The
driver polls the replicas (``RolloutWorker.stream``: abort, submit, decode ``async.stream_decode_tokens`` tokens,
return what finished), keeping k x ``prompts_per_step`` groups in flight (running or finished and waiting), as
the pipelined mode keeps k batches, until ``prompts_per_step`` groups are ready; it admits the ready groups drawn
first, and leaves one poll running while the step trains (rounds of ``stream_decode_tokens`` for about as long as
the previous step trained, so the next sync arrives between two rounds of the requests in flight).

Staleness of a sample: the trained version minus the version of its oldest token. A group is admitted only as a
whole (all ``samples_per_prompt`` samples finished, GRPO's group) and only while the staleness of each of its
samples is <= k. **The stale rule**: a group whose oldest token is older than that (finished and not admitted in
time, or still running) is never trained: its samples are discarded, its unfinished requests aborted, and its
prompt goes back to the front of the queue to be generated again from the start with the current weights. So
every prompt drawn is trained exactly once, by its last generation. Continuing the aborted requests instead
(``continue_request``) would keep their old tokens, and with them the staleness that got them dropped.

Exactly once across a resume: a checkpoint after step s holds every prompt drawn and not trained (waiting, running
or finished and not admitted) with what it has generated: the finished samples (tokens, log-probs, each token's
version), and the tokens so far of the samples still running, which the checkpoint reads from their replicas
(``StreamWork.snapshot``; the requests go on there) and a resume continues (``continue_request``) with the weights
of then, as a weight sync between two polls continues the requests in flight. A resume puts the groups back as
they were and the stale rule judges them as in a live run: the trained version after resuming from step s is the
one the checkpoint was written at. The loader's position counts every prompt drawn, so no prompt is lost or
trained twice, and no sample finished (and no token sampled) by the checkpoint is lost. ``in_flight.pt`` is
versioned (``IN_FLIGHT_FORMAT``); a file of format 1 (prompts only, before samples were kept) still loads, its
prompts generated afresh.
Streaming is not reproducible from the seed: which samples finish by which poll, and so the versions and groups
of a step, depend on timing.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hybridflow.engine.rollout import (RolloutOutput, RolloutRequest, SamplingOptions, batch_output,
                                       continue_request)
from hybridflow.protocol import DataProto
from hybridflow.trainers.pipelined import IN_FLIGHT_FILE, WeightSync, staleness_metrics, warn_without_correction
from hybridflow.trainers.step import Experience
from hybridflow.workers.actor import TRAINING_EXACT_LOGPROBS, WEIGHT_VERSION
from hybridflow.workers.base import ROLLOUT_TEMPERATURE
from hybridflow.workers.rollout import StreamReport, StreamWork

DRAW_INDEX = "draw_index"
"""Non-tensor column of a streamed batch: the prompt's position in the run's draw order (its identity for
exactly-once accounting; all samples of a prompt share it)."""
IN_FLIGHT_FORMAT = 2
"""The format of the ``in_flight.pt`` a streaming run writes: 1, the prompts drawn and not trained; 2, with their
groups' state, finished samples and partial samples."""


@dataclass
class PromptGroup:
    """One prompt drawn from the loader and its samples being generated (a GRPO group)."""

    draw_index: int
    prompt: DataProto
    """The loader's row (one row: ``input_ids``, ``attention_mask``, the reward function's fields)."""
    attempt: int = 0
    """Generations started so far minus one: request ids carry it, so a dropped attempt's late outputs are known."""
    replica: int = -1
    """The replica holding its unfinished requests; -1: none (not submitted yet, or restored from a checkpoint)."""
    submitted_version: int = -1
    """The weights the first poll of this attempt decoded with: the version of its oldest token."""
    outputs: dict[int, RolloutOutput] = field(default_factory=dict)
    """Sample index -> its finished output."""
    partial: dict[int, RolloutOutput] = field(default_factory=dict)
    """Sample index -> its tokens so far, as a checkpoint held them: the next submission (after the resume) continues
    them."""

    def request_id(self, sample: int) -> str:
        return f"{self.draw_index}:{self.attempt}:{sample}"

    def oldest_version(self) -> int:
        """The version of the group's oldest token known (the submission's while none is)."""
        return min((min(output.versions) for output in (*self.outputs.values(), *self.partial.values())
                    if output.versions), default=self.submitted_version)

    def restart(self) -> None:
        """Discard this attempt: the next submission generates every sample afresh."""
        self.attempt, self.replica, self.submitted_version = self.attempt + 1, -1, -1
        self.outputs, self.partial = {}, {}

    def requests(self, samples_per_prompt: int, options: SamplingOptions) -> list[RolloutRequest]:
        """The requests of the samples not finished: one restored with tokens so far continues from them, the others
        start with ``options``."""
        prompt_ids = tuple(self.prompt["input_ids"][0][self.prompt["attention_mask"][0].bool()].tolist())
        requests = [continue_request(self.partial[sample], request_id=self.request_id(sample))
                    if sample in self.partial else RolloutRequest(self.request_id(sample), prompt_ids, options)
                    for sample in range(samples_per_prompt) if sample not in self.outputs]
        self.partial = {}
        return requests


class StreamingSampling:
    """Streams prompts through the rollout replicas with in-flight weight updates (a sampling strategy:
    ``sample(prompts, seed, ...)``; ``save`` / ``load`` for checkpoints, as ``PipelinedSampling``)."""

    def __init__(self, *, actor, rollout, loader, score, options: SamplingOptions, max_staleness: int,
                 prompts_per_step: int, samples_per_prompt: int, decode_tokens: int, run_seed: int,
                 tis_cap: float | None) -> None:
        """``score(batch)``: ``RLTrainer.score``; ``options``: the actor's sampling options (its seed is replaced
        per poll)."""
        self.actor, self.rollout, self.loader, self.score, self.options = actor, rollout, loader, score, options
        self.max_staleness, self.prompts_per_step, self.samples_per_prompt = (max_staleness, prompts_per_step,
                                                                              samples_per_prompt)
        self.decode_tokens, self.run_seed = decode_tokens, run_seed
        self.capacity = max_staleness * prompts_per_step
        """Groups in flight at most (running, or finished and not admitted): k steps' worth. A group submitted while
        step j trains (with version j - 1) is k versions stale at step j + k; more groups in flight would wait longer
        than that and be generated again."""
        self.num_replicas = rollout.world_size
        self.weights = WeightSync(actor=actor, rollout=rollout)
        self.step = 0
        """RL steps sampled so far (the trainer's step once ``sample`` returns)."""
        self.next_draw = 0
        self.polls = 0
        self.waiting: list[PromptGroup] = []
        self.running: dict[int, PromptGroup] = {}
        self.ready: dict[int, PromptGroup] = {}
        self.aborts: list[list[str]] = [[] for _ in range(self.num_replicas)]
        self.outstanding = None
        """The poll issued and not collected yet (a controller future), or None."""
        self.exact_logprobs = False
        self.regenerated = 0
        self.overlaps = not rollout.is_local
        """Replicas in processes of their own decode while the step trains (in one process the poll would run
        before the training instead)."""
        self.returned_at: float | None = None
        self.training_seconds = 0.0
        """How long the driver was away between two ``sample`` calls (the step's training), last time."""
        warn_without_correction(max_staleness, tis_cap)

    # ----- one step ---------------------------------------------------------------------------------
    def sample(self, prompts: DataProto, seed: int, generate_and_score=None) -> Experience:
        """``prompts_per_step`` finished groups at most k versions stale, scored; ``prompts`` (the loader's next
        batch, drawn by the trainer's loop) join the queue. The step's seed and ``generate_and_score`` are not
        used: the replicas sample with per-poll seeds."""
        if self.returned_at is not None:
            self.training_seconds = time.perf_counter() - self.returned_at
        self.step += 1
        trained = self.step - 1
        self.waiting += self._groups(prompts)
        self.weights.sync(trained)  # behind the poll in progress: the requests in flight continue on it
        started, regenerated = time.perf_counter(), self.regenerated
        while True:
            self._restart_stale(trained)
            if len(self.ready) >= self.prompts_per_step:
                break
            self._poll()
        waited = time.perf_counter() - started
        self.weights.finish()
        admitted = [self.ready.pop(index) for index in sorted(self.ready)[:self.prompts_per_step]]
        # the replicas go on decoding while the step trains, for about as long as the last step trained: new
        # weights can only come after it, and then land between two rounds of the requests in flight
        self._issue(decode_seconds=self.training_seconds if self.overlaps else 0.0)
        self.returned_at = time.perf_counter()
        batch = self._batch(admitted, trained=trained)
        prompts = self._prompts(batch)
        batch = self.score(batch)
        return Experience(prompts=prompts, batch=batch, sampling_metrics={
            **staleness_metrics(batch, trained_version=trained), **self.weights.metrics,
            **version_span_metrics(admitted), "async/wait_generation_s": waited,
            "async/stale_regenerated_groups": float(self.regenerated - regenerated),
            "async/in_flight_groups": float(len(self.running) + len(self.ready) + len(self.waiting))})

    def _groups(self, prompts: DataProto) -> list[PromptGroup]:
        groups = [PromptGroup(draw_index=self.next_draw + row, prompt=prompts[np.array([row])])
                  for row in range(len(prompts))]
        self.next_draw += len(prompts)
        return groups

    def _restart_stale(self, trained: int) -> None:
        """The stale rule: a group with a token older than ``trained - k`` (running or ready) is aborted and its
        prompt queued first, to be generated again."""
        oldest_allowed = trained - self.max_staleness
        stale = [group for group in (*self.running.values(), *self.ready.values())
                 if group.oldest_version() < oldest_allowed]
        for group in stale:
            if self.running.pop(group.draw_index, None) is not None and group.replica >= 0:
                self.aborts[group.replica] += [group.request_id(sample) for sample in range(self.samples_per_prompt)]
            self.ready.pop(group.draw_index, None)
            group.restart()
        self.waiting = sorted(stale, key=lambda group: group.draw_index) + self.waiting
        self.regenerated += len(stale)

    # ----- polls ------------------------------------------------------------------------------------
    def _poll(self) -> None:
        """Collect the poll in progress (issuing one first if none is): finished samples join their groups."""
        if self.outstanding is None:
            self._issue()
        assert self.outstanding is not None, "nothing in flight and nothing to submit"
        reports: list[StreamReport] = self.outstanding.get()
        self.outstanding = None
        for report in reports:
            self.exact_logprobs = report.logprobs_match_training
            for output in report.finished:
                draw_index, attempt, sample = map(int, output.request_id.split(":"))
                group = self.running.get(draw_index)
                if group is None or group.attempt != attempt:
                    continue  # an attempt dropped as stale after this poll was issued
                group.outputs[sample] = output
                if len(group.outputs) == self.samples_per_prompt:
                    self.ready[draw_index] = self.running.pop(draw_index)

    def _issue(self, *, decode_seconds: float = 0.0) -> None:
        """Start a poll of every replica without waiting: the pending aborts, the running groups no replica holds
        (restored from a checkpoint), new groups up to the capacity (drawing another batch from the loader when none
        waits), each to the replica with the fewest running groups; nothing while a poll is in progress."""
        if self.outstanding is not None:
            return
        free = self.capacity - len(self.running) - len(self.ready)
        if free > 0 and not self.waiting:
            self.waiting = self._groups(self.loader.next_batch())
        submit: list[list[RolloutRequest]] = [[] for _ in range(self.num_replicas)]
        # the samples of a poll differ by their row in the replica's batch, not by their seed
        options = dataclasses.replace(self.options, seed=self.run_seed * 1_000_003 + self.polls)
        restored = [group for group in self.running.values() if group.replica < 0]
        for group in restored + self.waiting[:max(free, 0)]:
            load = [sum(g.replica == r for g in self.running.values()) for r in range(self.num_replicas)]
            group.replica = load.index(min(load))
            if group.submitted_version < 0:  # a new attempt; a restored one keeps its first poll's version
                group.submitted_version = self.weights.version
            submit[group.replica] += group.requests(self.samples_per_prompt, options)
            self.running[group.draw_index] = group
        self.waiting = self.waiting[max(free, 0):]
        if not self.running and not any(self.aborts):
            return
        work = [StreamWork(submit=tuple(requests), abort=tuple(aborts), decode_tokens=self.decode_tokens,
                           decode_seconds=decode_seconds) for requests, aborts in zip(submit, self.aborts)]
        self.aborts = [[] for _ in range(self.num_replicas)]
        self.outstanding = self.rollout.stream.future(work)
        self.polls += 1

    # ----- the step's batch -------------------------------------------------------------------------
    def _batch(self, groups: list[PromptGroup], *, trained: int) -> DataProto:
        """The admitted groups' samples in the batched call's conventions (``batch_output``; rows prompt-major,
        responses padded to ``max_new_tokens``), with ``uid``, ``policy_version`` (each sample's oldest token's
        version) and ``draw_index``."""
        outputs = [group.outputs[sample] for group in groups for sample in range(self.samples_per_prompt)]
        versions_B = np.array([min(output.versions) for output in outputs], dtype=np.int64)
        assert trained - versions_B.min() <= self.max_staleness, "a stale sample was admitted"
        pad, T = self.options.pad_token_id, self.options.max_new_tokens
        P = max(len(output.prompt_ids) for output in outputs)
        prompts_BP = torch.full((len(outputs), P), pad, dtype=torch.long)
        prompt_mask_BP = torch.zeros((len(outputs), P), dtype=torch.long)
        responses_BT = torch.full((len(outputs), T), pad, dtype=torch.long)
        response_mask_BT = torch.zeros((len(outputs), T), dtype=torch.long)
        logprobs_BT = torch.zeros((len(outputs), T), dtype=torch.float32)
        for row, output in enumerate(outputs):
            prompt, length = output.prompt_ids, len(output.token_ids)
            prompts_BP[row, P - len(prompt):] = torch.tensor(prompt)
            prompt_mask_BP[row, P - len(prompt):] = 1
            responses_BT[row, :length] = torch.tensor(output.token_ids, dtype=torch.long)
            response_mask_BT[row, :length] = 1
            logprobs_BT[row, :length] = torch.tensor(output.logprobs, dtype=torch.float32)
        rows = [group.prompt for group in groups]
        non_tensors = {key: [row.non_tensor_batch[key][0] for row in rows for _ in range(self.samples_per_prompt)]
                       for key in rows[0].non_tensor_batch}
        non_tensors.update(uid=np.repeat(np.arange(len(groups)), self.samples_per_prompt), policy_version=versions_B,
                           **{DRAW_INDEX: np.repeat([group.draw_index for group in groups], self.samples_per_prompt)})
        on_policy = bool((versions_B == trained).all()) and all(max(o.versions) == trained for o in outputs)
        temperature = 1.0 if self.options.greedy else float(self.options.temperature)
        return DataProto.from_dict(
            tensors=batch_output(prompts_BP, prompt_mask_BP, responses_BT, response_mask_BT, logprobs_BT),
            non_tensors=non_tensors,
            meta_info={"samples_per_prompt": self.samples_per_prompt, ROLLOUT_TEMPERATURE: temperature,
                       # the rollout's log-probs are pi_old only when every token is of the policy being trained
                       TRAINING_EXACT_LOGPROBS: self.exact_logprobs and on_policy,
                       WEIGHT_VERSION: int(versions_B.min())})

    def _prompts(self, batch: DataProto) -> DataProto:
        """The step's prompts (one row per admitted group, with its ``uid``), as the synchronous step's."""
        heads = np.arange(0, len(batch), self.samples_per_prompt)
        return DataProto.from_dict(
            tensors={"input_ids": batch["prompts"][heads], "attention_mask": batch["attention_mask"][heads][
                :, :batch["prompts"].shape[1]]},
            non_tensors={key: values[heads] for key, values in batch.non_tensor_batch.items()},
            meta_info={"samples_per_prompt": self.samples_per_prompt})

    # ----- checkpoints ------------------------------------------------------------------------------
    def save(self, directory: Path) -> None:
        """Every group drawn and not trained (waiting, running, finished and not admitted) into ``directory``, with
        its finished samples and the tokens so far of its running ones (read from the replicas, where they go on)."""
        if self.outstanding is not None:
            self._poll()
        partial = self._snapshot()
        groups = [("waiting", group) for group in self.waiting] + sorted(
            [*(("running", group) for group in self.running.values()),
             *(("ready", group) for group in self.ready.values())], key=lambda item: item[1].draw_index)
        torch.save({"format": IN_FLIGHT_FORMAT, "mode": "streaming", "step": self.step, "next_draw": self.next_draw,
                    "polls": self.polls, "groups": [group_state(group, where, partial.get(group.draw_index, {}))
                                                    for where, group in groups]},
                   directory / IN_FLIGHT_FILE)

    def _snapshot(self) -> dict[int, dict[int, RolloutOutput]]:
        """The tokens so far of the running groups' unfinished samples (draw index -> sample index -> output), read
        from their replicas in a poll without a decode round (the requests go on there), or, for a group restored
        and not submitted yet, as restored."""
        partial = {group.draw_index: dict(group.partial) for group in self.running.values() if group.replica < 0}
        snapshot: list[list[str]] = [[] for _ in range(self.num_replicas)]
        for group in self.running.values():
            if group.replica >= 0:
                snapshot[group.replica] += [group.request_id(sample) for sample in range(self.samples_per_prompt)
                                            if sample not in group.outputs]
        if not any(snapshot):
            return partial
        work = [StreamWork(snapshot=tuple(ids), decode_tokens=0) for ids in snapshot]
        for report in self.rollout.stream.future(work).get():
            assert not report.finished, "a poll without a decode round finished requests"
            for output in report.snapshots:
                draw_index, attempt, sample = map(int, output.request_id.split(":"))
                assert self.running[draw_index].attempt == attempt, "a snapshot of a dropped attempt"
                if output.token_ids:
                    partial.setdefault(draw_index, {})[sample] = output
        return partial

    def load(self, directory: Path) -> None:
        """Put back what ``save`` wrote: the groups where they were, with their samples (the first step's stale rule
        judges them; the running ones continue at its first poll). A format-1 file's prompts are queued first and
        generated afresh."""
        path = directory / IN_FLIGHT_FILE
        state = torch.load(path, weights_only=False)
        if state.get("mode") != "streaming":
            raise ValueError(f"{path} was written by a pipelined run; async.mode=streaming "
                             "cannot resume it (resume with the mode it was written with)")
        version = state.get("format", 1)
        if version not in (1, IN_FLIGHT_FORMAT):
            raise ValueError(f"{path} has format {version!r}; this hybridflow reads in_flight.pt formats 1 and "
                             f"{IN_FLIGHT_FORMAT} (resume with the hybridflow that wrote it)")
        self.step, self.next_draw, self.polls = state["step"], state["next_draw"], state["polls"]
        self.waiting, self.running, self.ready, self.outstanding = [], {}, {}, None
        if version == 1:
            print(f"resume: {path} holds the prompts in flight without their samples (format 1): they are "
                  "generated afresh", flush=True)
            self.waiting = [PromptGroup(draw_index=item["draw_index"], prompt=item["prompt"])
                            for item in state["untrained"]]
        for item in state.get("groups", []):
            group = group_of_state(item)
            if item["where"] == "waiting":
                self.waiting.append(group)
            else:
                (self.running if item["where"] == "running" else self.ready)[group.draw_index] = group
        self.weights.version = None  # the new rollout pool holds no weights yet


def group_state(group: PromptGroup, where: str, partial: dict[int, RolloutOutput]) -> dict:
    """A group as ``in_flight.pt`` (format 2) holds it, with the tokens so far of its running samples: plain values,
    its outputs as dicts."""
    return {"where": where, "draw_index": group.draw_index, "prompt": group.prompt, "attempt": group.attempt,
            "submitted_version": group.submitted_version,
            "outputs": {sample: dataclasses.asdict(output) for sample, output in group.outputs.items()},
            "partial": {sample: dataclasses.asdict(output) for sample, output in partial.items()}}


def group_of_state(item: dict) -> PromptGroup:
    """The group ``group_state`` wrote (held by no replica)."""
    def output_of(fields: dict) -> RolloutOutput:
        return RolloutOutput(**{**fields, "options": SamplingOptions(**fields["options"])})

    return PromptGroup(draw_index=item["draw_index"], prompt=item["prompt"], attempt=item["attempt"],
                       submitted_version=item["submitted_version"],
                       outputs={sample: output_of(fields) for sample, fields in item["outputs"].items()},
                       partial={sample: output_of(fields) for sample, fields in item["partial"].items()})


def version_span_metrics(groups: list[PromptGroup]) -> dict[str, float]:
    """How many policy versions the admitted samples' tokens span: ``async/version_span_max`` (newest minus oldest
    token version) and ``async/multi_version_fraction`` (samples sampled by more than one version)."""
    spans = [max(output.versions) - min(output.versions) for group in groups for output in group.outputs.values()
             if output.versions]
    return {"async/version_span_max": float(max(spans, default=0)),
            "async/multi_version_fraction": sum(span > 0 for span in spans) / max(len(spans), 1)}
