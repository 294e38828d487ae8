"""ActorWorker: the policy — generation through the 3D-HybridEngine, log-probs, the PPO update, the ptx loss.

Shape legend: B = samples on this rank, P = prompt tokens, T = response tokens.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch
from torch import Tensor

from hybridflow.algorithms import (POLICY_LOSSES, aggregate_loss, kl_estimate, masked_mean,
                                   truncated_importance_weights)
from hybridflow.controller import register
from hybridflow.engine.hybrid_engine import HybridEngine, TransitionStats, storage_bytes
from hybridflow.engine.lora import base_shards, generation_adapter
from hybridflow.engine.optim import OptimizerOffload
from hybridflow.engine.rollout import Rollout, rollout_class
from hybridflow.engine.weight_sync import WeightPayload, pack_weights
from hybridflow.models.moe import ROUTED_EXPERTS
from hybridflow.protocol import DataProto
from hybridflow.workers.base import (ROLLOUT_TEMPERATURE, SEQUENCE_KEYS, ModelWorker, step_context,
                                     tensors_of)
from hybridflow.workers.spec import ActorSpec

UPDATE_KEYS = SEQUENCE_KEYS + ("old_logprobs", "advantages", "ref_logprobs")
BEHAVIOUR_KEY = "logprobs"  # the rollout's sampled log-probs (TIS)
TRAINING_EXACT_LOGPROBS = "logprobs_are_training_logprobs"
"""meta_info flag of a rollout: its log-probs are the training engine's up to rounding (the backend's
``Rollout.logprobs_match_training``)."""
WEIGHT_VERSION = "weight_version"
"""meta_info of a rollout: the version of the weights that generated it (the actor's optimizer steps so far)."""
GENERATION_OVERRIDES = ("greedy", "max_new_tokens")


def generated_batch(prompts: DataProto, config, rollout: Rollout, tensors: dict, non_tensors: dict) -> DataProto:
    """A rollout's output with what it was generated under (temperature, whether its log-probs are the training
    engine's, weight version) in its meta_info: the batch of the actor's and of a rollout replica's generations."""
    temperature = 1.0 if config.greedy else float(config.temperature)
    return DataProto.from_dict(tensors={k: v.cpu() for k, v in tensors.items()}, non_tensors=non_tensors,
                               meta_info={**prompts.meta_info, ROLLOUT_TEMPERATURE: temperature,
                                          TRAINING_EXACT_LOGPROBS: rollout.logprobs_match_training,
                                          WEIGHT_VERSION: rollout.version})


def episodes_batch(prompts: DataProto, config, rollout: Rollout, result) -> DataProto:
    """One replica's episodes (the ``EpisodeResult`` of ``EpisodeJob.run`` on ``rollout``) as its batch: rows
    prompts x samples per prompt (prompt-major) with the prompts' fields, each episode's record (``episode``) and
    the seconds the rollout generated (``meta_info["episode_generation_s"]``)."""
    samples = config.samples_per_prompt
    non_tensors = {key: np.repeat(values, samples) for key, values in prompts.non_tensor_batch.items()}
    output = generated_batch(prompts, config, rollout, result.tensors, {**non_tensors, "episode": result.records})
    output.meta_info["episode_generation_s"] = result.generation_seconds
    return output


def policy_loss_fn(spec: ActorSpec):
    """The per-micro-batch policy loss the training engine calls: the configured objective (x TIS weights),
    aggregated as configured, - entropy bonus + KL-to-reference loss (``spec.kl_loss_coef``).

    TIS reads the rollout's own sampled log-probs (``logprobs``, the behaviour policy) next to the
    recomputed ``old_logprobs``.
    """
    loss_config, kl_coef = spec.loss, spec.kl_loss_coef
    objective = POLICY_LOSSES[loss_config.policy_loss]

    def loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT = batch["response_mask"]

        def aggregate(loss_BT: Tensor) -> Tensor:
            # clamp: a mini-batch whose every response was filtered (overlong filter) has 0 tokens, loss 0
            return aggregate_loss(loss_BT, mask_BT, aggregation=loss_config.loss_aggregation,
                                  num_tokens_global=batch["num_tokens_global"].clamp(min=1),
                                  num_sequences_global=batch["num_sequences_global"],
                                  constant_normalizer=spec.sizes.max_response_length)

        # no old log-probs: the trainer skipped their pass as redundant (they equal the current ones)
        old_logprobs_BT = batch["old_logprobs"] if "old_logprobs" in batch else outputs["logprobs"].detach()
        policy = objective(outputs["logprobs"], old_logprobs_BT, batch["advantages"],
                           clip_ratio_low=loss_config.clip_low, clip_ratio_high=loss_config.clip_high,
                           mask_BT=mask_BT)
        loss_BT = policy.loss_BT
        metrics = {}
        if loss_config.tis_cap is not None:
            tis = truncated_importance_weights(old_logprobs_BT, batch["logprobs"], mask_BT, cap=loss_config.tis_cap)
            loss_BT = loss_BT * tis.weights_BT
            metrics["tis_cap_fraction"] = tis.cap_fraction
        loss = aggregate(loss_BT)
        metrics.update({"pg_loss": loss.detach(),
                        "clip_fraction": masked_mean(policy.clipped_BT.float(), mask_BT),
                        "approx_kl": masked_mean(policy.approx_kl_BT, mask_BT)})
        if loss_config.entropy_coef > 0:
            loss = loss - loss_config.entropy_coef * aggregate(outputs["entropy"])
            metrics["entropy"] = masked_mean(outputs["entropy"].detach(), mask_BT)
        if kl_coef > 0:
            kl_BT = kl_estimate(outputs["logprobs"], batch["ref_logprobs"], estimator=loss_config.kl_loss_estimator,
                                mask_BT=mask_BT)
            kl = aggregate(kl_BT)
            metrics["kl_loss"] = kl.detach()
            if outputs["logprobs"].requires_grad:
                metrics["pg_grad_share"] = pg_grad_share(outputs["logprobs"], loss, kl_coef * kl)
            loss = loss + kl_coef * kl
        return loss, metrics

    return loss_fn


def pg_grad_share(logprobs_BT: Tensor, pg_loss: Tensor, kl_loss: Tensor) -> Tensor:
    """|d pg / d logprobs| / (|d pg / d logprobs| + |d kl / d logprobs|): the policy-gradient term's share of the
    push on the token log-probs, where both terms enter the model's backward. autograd walks only the loss's own
    [B, T] graph back to the log-probs (never the model), so it costs O(B * T), not a second backward."""
    grads = [torch.autograd.grad(term, logprobs_BT, retain_graph=True, allow_unused=True)[0]
             for term in (pg_loss, kl_loss)]
    pg_norm, kl_norm = (grad.norm() if grad is not None else torch.zeros(()) for grad in grads)
    return (pg_norm / (pg_norm + kl_norm).clamp(min=1e-30)).detach()


def next_token_loss_fn(scale: float):
    """Mean negative log-likelihood of the response tokens, times ``scale`` (SFT and the ptx loss)."""

    def loss_fn(outputs: dict[str, Tensor], batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        nll = aggregate_loss(-outputs["logprobs"], batch["response_mask"], num_tokens_global=batch["num_tokens_global"])
        return scale * nll, {"nll": nll.detach()}

    return loss_fn


class ActorWorker(ModelWorker):
    """The policy: trains under its (p, t, d) layout and generates under (pg, tg, dg) on the same devices."""

    def __init__(self, spec: ActorSpec) -> None:
        super().__init__(spec.engine)
        self.actor_spec = spec
        # generation computes in the actor's compute dtype (bf16 by default on GPUs and bf16-capable CPUs), not in
        # the fp32 masters
        self.hybrid = HybridEngine.for_training(self.engine, spec.hybrid_engine)
        self.set_parallel_layout(self.engine.layout, generation=self.hybrid.generation_layout)
        self.last_transition: dict[str, float] = {}
        self._shard_numel = 0  # elements of the last rollout's generation shard on this rank (LoRA's sync bytes)
        self.sync_seconds = 0.0
        """Seconds of the last weight sync on this rank: from the training weights to the backend's loaded copy (the
        merge, the transition and the load; an adapter-only sync: gathering the adapter and loading it)."""
        # the AdamW moments leave the accelerator for the rollout (actor.hybrid_engine.offload_optimizer)
        offload = spec.hybrid_engine.offload_optimizer
        self.optimizer_offload = OptimizerOffload(self.engine.optimizer) if offload else None
        self.rollout: Rollout | None = None
        """The generation backend (``actor.generation.backend``), built on the first rollout and kept."""
        if spec.routing_replay:  # refused here for a dense model
            self.engine.enable_routing_replay()
        lora = self.engine.lora
        self.syncs_adapter = (lora is not None and lora.vllm_sync == "adapter"
                              and rollout_class(spec.generation.backend).takes_adapters)
        """LoRA on a backend that applies the adapter itself: base weights once, then only the adapter per sync."""

    def _rollout_for(self, shard) -> Rollout:
        """This rank's rollout backend, built once (every rank at once) for shards laid out like ``shard``."""
        if self.rollout is None:
            generation = self.actor_spec.generation
            adapter = {"lora": self.engine.lora} if self.syncs_adapter else {}
            self.rollout = rollout_class(generation.backend).for_shard(self.engine.hf_config, shard,
                                                                       dtype=self.hybrid.dtype, config=generation,
                                                                       **adapter)
        return self.rollout

    @register("3D_ALL_MICRO_DP")
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Responses for this replica's prompts: rows become prompts x samples per prompt (prompt-major).

        ``prompts.meta_info`` may override ``greedy`` and ``max_new_tokens`` of the spec's sampling defaults and
        sets ``samples_per_prompt`` (default 1) and ``seed`` (default 0).
        """
        config = self._call_config(prompts.meta_info)
        output, self.last_transition = self._offloaded_rollout(prompts, config, lambda rollout: rollout.generate(
            prompts["input_ids"], prompts["attention_mask"], config))
        samples = config.samples_per_prompt
        non_tensors = {key: np.repeat(values, samples) for key, values in prompts.non_tensor_batch.items()}
        return generated_batch(prompts, config, self.rollout, output, non_tensors)

    @register("3D_ALL_MICRO_DP")
    def generate_episodes(self, prompts: DataProto) -> DataProto:
        """Multi-turn episodes for this replica's prompts, ``samples_per_prompt`` per prompt (prompt-major), run by
        ``prompts.meta_info["episode_job"]`` (an ``hybridflow.agents.EpisodeJob``) on this rank's rollout requests:
        the batch conventions of ``generate_sequences`` with ``response_mask`` 1 only on sampled tokens, plus each
        episode's record (``episode``) and its turn rewards (``episode_turn_rewards``)."""
        config = self._call_config(prompts.meta_info)
        job = prompts.meta_info["episode_job"]
        result, self.last_transition = self._offloaded_rollout(prompts, config,
                                                               lambda rollout: job.run(rollout, prompts, config))
        return episodes_batch(prompts, config, self.rollout, result)

    def _call_config(self, meta: dict):
        """The sampling config of one generation call: the spec's defaults with ``meta``'s overrides."""
        overrides = {key: meta[key] for key in GENERATION_OVERRIDES if key in meta}
        # replicas draw different noise for their different prompts; ranks of one replica the same
        config = self.actor_spec.generation.for_call(
            self.actor_spec.tokens, seed=int(meta.get("seed", 0)) * 1_000_003 + self.hybrid.replica,
            samples_per_prompt=int(meta.get("samples_per_prompt", 1)))
        return dataclasses.replace(config, **overrides, record_routing=self.actor_spec.routing_replay)

    def _offloaded_rollout(self, prompts: DataProto, config, produce):
        """``_rollout`` with the optimizer state offloaded around it (``actor.hybrid_engine.offload_optimizer``);
        returns (what ``produce(rollout)`` returned, the transition's metrics)."""
        offloaded_bytes = self.optimizer_offload.offload() if self.optimizer_offload is not None else 0
        try:
            output, to_generation, to_training, load = self._rollout(prompts, config, produce)
        finally:  # the optimizer state comes back once generation is over
            if self.optimizer_offload is not None:
                self.optimizer_offload.reload()
        return output, {
            "to_generation_s": to_generation.seconds, "to_training_s": to_training.seconds,
            "bytes_received": to_generation.bytes_received,
            # during generation: the training shards and the shard's pieces (kept by a backend that reads them in
            # place, else dropped) plus the backend's own copy; while loading, all of them
            "generation_param_bytes": ((to_generation if self.rollout.reads_shard_in_place else to_training).param_bytes
                                       + load.param_bytes),
            "peak_param_bytes": max(to_generation.peak_param_bytes, to_generation.param_bytes + load.param_bytes),
            "generation_allocated_bytes": to_generation.allocated_bytes,
            "generation_peak_allocated_bytes": to_training.peak_allocated_bytes,
            "training_allocated_bytes": to_training.allocated_bytes, "collectives": to_generation.collectives,
            # 0 when the option is off or the state already lives on the CPU (a CPU run, FSDP CPU offload)
            "optimizer_offloaded": float(offloaded_bytes > 0), "optimizer_offloaded_bytes": offloaded_bytes,
            "weight_sync_s": self.sync_seconds, **self._lora_sync_bytes(), **self.rollout.transition_metrics()}

    def _lora_sync_bytes(self) -> dict[str, float]:
        """With LoRA, what one weight sync hands the rollout backend on this rank both ways it can be done:
        ``lora_sync_bytes_merged``, the generation shard with the adapters merged in (what the native backend
        reads and vLLM copies with ``vllm_sync: merged``); ``lora_sync_bytes_adapter``, the adapters alone in the
        generation dtype (what vLLM's adapter-only sync moves once the base weights are loaded). Nothing without
        LoRA."""
        if self.engine.lora is None:
            return {}
        from hybridflow.models.lora import is_adapter_parameter

        element = torch.empty((), dtype=self.hybrid.dtype).element_size()
        adapter = sum(param.numel() for name, param in self.engine.model.named_parameters()
                      if is_adapter_parameter(name))
        return {"lora_sync_bytes_merged": float(self._shard_numel * element),
                "lora_sync_bytes_adapter": float(adapter * element)}

    def _rollout(self, prompts: DataProto, config, produce):
        """One rollout's lifecycle, whatever the backend: to generation, load the shard (a backend that copied it
        lets training have the gathered pieces back at once), ``produce(rollout)`` (the batched call, or episodes on
        its requests), release, back to training.
        Returns (what ``produce`` returned, to_generation stats, to_training stats, the load's stats)."""
        if self.syncs_adapter and self.rollout is not None and self.rollout.holds_base_weights:
            return self._adapter_rollout(produce)
        start = time.perf_counter()
        to_generation = self.hybrid.to_generation(base_shards(self.engine) if self.syncs_adapter
                                                  else self.engine.local_shards())
        self.sync_seconds = time.perf_counter() - start
        self._shard_numel = sum(piece.numel() for pieces in self.hybrid.shard.weights.values() for piece in pieces)
        to_training = None
        try:
            rollout = self._rollout_for(self.hybrid.shard)
            try:
                rollout.resume()
                start = time.perf_counter()
                load = rollout.load(self.hybrid.shard, version=self.engine.step)
                if self.syncs_adapter:  # the base weights are in: from now on the adapter alone goes over
                    load = rollout.load_adapter(generation_adapter(self.engine, dtype=self.hybrid.dtype),
                                                version=self.engine.step, after=load)
                if not rollout.reads_shard_in_place:
                    to_training = self.hybrid.to_training()
                self.sync_seconds += time.perf_counter() - start
                output = produce(rollout)
            finally:
                rollout.release()  # KV cache, weight copies and references to the pieces back to training
        finally:
            if to_training is None:
                to_training = self.hybrid.to_training()
        return output, to_generation, to_training, load

    def _adapter_rollout(self, produce):
        """``_rollout`` once the backend holds the base weights (``syncs_adapter``): no transition, the adapter
        alone is synced; the training shards stay as they are (the returned transition stats say so)."""
        held = storage_bytes(self.engine.training_layout.local_shards(self.engine.model, self.engine.device).values())
        try:
            self.rollout.resume()
            start = time.perf_counter()
            load = self.rollout.load_adapter(generation_adapter(self.engine, dtype=self.hybrid.dtype),
                                             version=self.engine.step)
            self.sync_seconds = time.perf_counter() - start
            output = produce(self.rollout)
        finally:
            self.rollout.release()
        stays = [TransitionStats(direction, "adapter_only", param_bytes=held, peak_param_bytes=held)
                 for direction in ("to_generation", "to_training")]
        return output, *stays, load

    @register("ONE_TO_ALL")
    def transition_stats(self) -> dict[str, float]:
        """The last rollout's transition on this rank: seconds, bytes received, parameter bytes during
        generation (analytic), the transition's collectives, the optimizer-state bytes moved to the CPU for
        the rollout (``optimizer_offloaded``: 1 if any) and, on CUDA, the allocator's bytes during generation
        and after it."""
        return dict(self.last_transition)

    @register("ONE_TO_ALL")
    def generation_weights(self, version: int, checksums: bool = True) -> WeightPayload | None:
        """The whole policy for a rollout pool (``RolloutWorker.sync_weights``): gathered on rank 0, cast to the
        generation dtype, bucketed as the hybrid engine buckets (``hybrid_engine.bucket_mb``), with per-tensor
        checksums; None on the other ranks (every rank takes part in the gather)."""
        state = self.engine.full_state_dict()
        if not state:
            return None
        return pack_weights(state, version=version, dtype=self.hybrid.dtype, checksums=checksums,
                            bucket_bytes=int(self.actor_spec.hybrid_engine.bucket_mb * 2**20))

    @register("3D_PROTO")
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_logprobs`` [B, T] of the responses under the current weights (no grad; with routing replay, under
        the rollout's routing)."""
        logprobs_BT = self._forward(data, ("logprobs",), keys=self._replay_keys(data, SEQUENCE_KEYS))["logprobs"]
        return DataProto.from_dict(tensors={"old_logprobs": logprobs_BT})

    def _replay_keys(self, data: DataProto, keys: tuple[str, ...]) -> tuple[str, ...]:
        """``keys``, and the rollout's ``routed_experts`` under ``actor.routing_replay`` (which must be in ``data``)."""
        if not self.actor_spec.routing_replay:
            return keys
        if ROUTED_EXPERTS not in data:
            raise ValueError(f"actor.routing_replay=True needs the rollout's {ROUTED_EXPERTS!r} in the batch (the "
                             f"batched generate_sequences of the native backend records them); got keys {data.keys()}")
        return keys + (ROUTED_EXPERTS,)

    @register("DP_METRICS")
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs over the step's samples in mini-batches; ``meta_info['seed']`` seeds the shuffling."""
        loss = self.actor_spec.loss
        outputs = ("logprobs", "entropy") if loss.entropy_coef > 0 else ("logprobs",)
        keys = UPDATE_KEYS + (BEHAVIOUR_KEY,) if loss.tis_cap is not None else UPDATE_KEYS
        if loss.tis_cap is not None and BEHAVIOUR_KEY not in data:
            raise ValueError("actor.loss.tis_cap needs the rollout's sampled log-probs ('logprobs') in the batch; "
                             f"got keys {data.keys()}")
        metrics = self._train_epochs(data, keys=self._replay_keys(data, keys), loss_fn=policy_loss_fn(self.actor_spec),
                                     outputs=outputs,
                                     ppo_epochs=loss.ppo_epochs, mini_batch_size=self.actor_spec.sizes.mini_batch_size,
                                     seed=int(data.meta_info.get("seed", 0)), on_non_finite=loss.on_non_finite,
                                     context=step_context("actor", data))
        return {f"actor/{name}": value for name, value in metrics.items()}

    @register("DP_METRICS")
    def update_actor_ptx(self, data: DataProto) -> dict[str, float]:
        """One optimizer step on ptx_coef x the next-token loss of pretraining rows (prompt/response tensors)."""
        metrics = self.engine.train_step(tensors_of(data, SEQUENCE_KEYS), next_token_loss_fn(self.actor_spec.loss.ptx_coef),
                                         outputs=("logprobs",))
        return {f"actor/ptx_{name}": value for name, value in metrics.items()}

    @register("3D_PROTO")
    def compute_loss(self, data: DataProto) -> DataProto:
        """Per-sample mean next-token loss of the responses (``nll`` [B]) under the model's own distribution
        (temperature 1, whatever the rows were sampled at); no update (validation, ptx monitoring)."""
        logprobs_BT = self.engine.forward(tensors_of(data, SEQUENCE_KEYS), outputs=("logprobs",))["logprobs"]
        mask_BT = data["response_mask"].to(logprobs_BT.dtype)
        nll_B = -(logprobs_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return DataProto.from_dict(tensors={"nll": nll_B})
