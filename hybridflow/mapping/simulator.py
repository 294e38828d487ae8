"""Simulator: predicted memory and seconds of one role under one parallel strategy (paper section 6).

Training and inference are modeled as compute-bound (the slowest pipeline stage's FLOPs / achievable
FLOP/s, at least the time to stream the weight shard once per micro-batch) plus the communication
they cannot hide: tensor-parallel all-reduces, pipeline sends and bubble, data-parallel gradient
all-reduce (3d), overlapped parameter gathers (fsdp). Generation is modeled as memory-bound: every
decode step streams the weights and the KV cache of its batch through memory (roofline with the
step's FLOPs), pays 2 tensor-parallel all-reduces per layer and the rollout engine's host time per
sequence of the replica's batch; the batch is bounded by the memory left for the KV cache, and the
actor pays the 3D-HybridEngine's resharding (paper Table 2) before generating. The rollout backend
(hybridflow.mapping.rollout: native or vllm) sets the KV cache a sequence in flight holds, whether the
engine keeps (and loads every step) a weight copy of its own, and the decode bandwidth. Links (NVLink or
the inter-node network) follow the rank order of hybridflow.parallel.layout.

Symbols in the formulas: N parameters (that multiply per token), L layers, h hidden size,
S = P + T sequence length, e bytes per element, p/t/d training pipeline/tensor/data sizes,
pg/tg generation sizes, n devices of the role's pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridflow.mapping.cluster import Cluster
from hybridflow.mapping.layouts import ADAM_STATE_BYTES, GRADIENT_BYTES, MASTER_WEIGHT_BYTES
from hybridflow.mapping.model_spec import ModelSpec
from hybridflow.mapping.rollout import NATIVE, RolloutBackend
from hybridflow.mapping.strategy import RoleStrategy
from hybridflow.mapping.workload import Workload

# Activations one decoder layer keeps for backward, in elements per token per hidden unit, with
# flash attention (no S x S scores) and sequence parallelism (all of it split over t): the 34 bytes
# of Korthikanti et al. 2022 ("Reducing Activation Recomputation", table 2) at 2 bytes per element.
ACTIVATION_ELEMENTS_PER_TOKEN_PER_HIDDEN = 17
LOGIT_BYTES = 4  # log-softmax of the vocabulary head is taken in fp32


def slowest_stage(spec: ModelSpec, head: str, pp_size: int) -> tuple[int, int]:
    """(matmul parameters, decoder layers) of the pipeline stage with the most work: the first stages
    hold ceil(L / p) layers, the last floor(L / p) layers and the output head (p = 1: the whole model)."""
    if pp_size == 1:
        return spec.matmul_params(head=head), spec.num_layers
    base, extra = divmod(spec.num_layers, pp_size)
    first_layers = base + (1 if extra else 0)
    first = (first_layers * spec.params_per_layer, first_layers)
    last = (base * spec.params_per_layer + spec.head_params(head), base)
    return max(first, last)


@dataclass(frozen=True)
class RoleCost:
    """A role's predicted seconds per stage and per-device memory under one strategy on n devices."""

    strategy: RoleStrategy
    stage_seconds: dict[str, float]
    """Stage name -> seconds this role spends in it (stages it takes no part in are absent)."""
    resident_bytes: float
    """Per device, held for the whole iteration (weights, gradients, optimizer state)."""
    transient_bytes: float
    """Per device, peak working memory of its training/inference (activations, logits, gathers)."""
    details: dict[str, float] = field(default_factory=dict, compare=False)
    """Parts of the prediction (e.g. generation waves, transition seconds), for reports."""

    @property
    def total_seconds(self) -> float:
        return sum(self.stage_seconds.values())

    @property
    def footprint_bytes(self) -> float:
        return self.resident_bytes + self.transient_bytes


class Simulator:
    """Cost model of one workload on one cluster; every method is per role and per strategy."""

    def __init__(self, *, workload: Workload, cluster: Cluster, generation_passes: int = 1,
                 compute_share: float = 1.0, backend: RolloutBackend = NATIVE,
                 kv_cache_bytes: float | None = None) -> None:
        """``compute_share``: the share of a device each process gets (Cluster.compute_share of the
        processes busy at the same time; below 1 only for CPU processes outnumbering cores).
        ``backend``: the actor's rollout engine (``actor.generation.backend``). ``kv_cache_bytes``: the KV
        cache the engine allocates per device (vLLM: ``actor.generation.vllm_kv_cache_gib``), which must fit
        in the memory left; None: the KV cache takes all memory left."""
        assert 0 < compute_share <= 1, compute_share
        assert kv_cache_bytes is None or kv_cache_bytes > 0, kv_cache_bytes
        self.backend = backend
        self.kv_cache_bytes = kv_cache_bytes
        self.workload = workload
        self.cluster = cluster
        self.generation_passes = generation_passes
        self.compute_share = compute_share
        hardware = cluster.hardware
        # in the profile's compute dtype; a model's own (a bf16 CPU's bf16 for wide models): _element_bytes, _flops
        self.element_bytes = hardware.element_bytes
        self.flops = hardware.peak_flops * hardware.flops_fraction * compute_share
        self.cpu_bf16_flops = (hardware.cpu_bf16_peak_flops or 0.0) * hardware.flops_fraction * compute_share
        self.memory_bandwidth = hardware.memory_bandwidth * hardware.memory_bandwidth_fraction * compute_share
        self.decode_memory_bandwidth = (hardware.memory_bandwidth * backend.decode_bandwidth_fraction(hardware)
                                        * compute_share)
        self.budget_bytes = hardware.usable_memory_bytes
        # dispatch is host work: an oversubscribed core slows it down like compute
        self.layer_overhead_s = hardware.layer_overhead_s / compute_share
        self.decode_dispatch_s = hardware.decode_dispatch_seconds_per_layer / compute_share
        # fixed host costs per call (0 unless calibrate measured them): host work, slowed like dispatch
        self.decode_step_overhead_s = hardware.decode_step_overhead_s / compute_share
        self.inference_call_overhead_s = hardware.inference_call_overhead_s / compute_share
        self.update_overhead_s = hardware.update_overhead_s / compute_share
        self.fsdp_collective_overhead_s = hardware.fsdp_collective_overhead_s / compute_share
        # the driver's side of a call: its own process, not one of the run's devices
        self.controller_call_s = hardware.controller_call_overhead_s

    def element_bytes_of(self, spec: ModelSpec) -> int:
        """Bytes of one of ``spec``'s compute elements: bf16 on a bf16 CPU for wide models (``cpu_bf16_for``)."""
        return 2 if self.cluster.hardware.cpu_bf16_for(spec.hidden_size) else self.element_bytes

    def _flops(self, spec: ModelSpec) -> float:
        """Achievable FLOP/s of one process computing ``spec`` (its dtype's rate, ``cpu_bf16_for``)."""
        return self.cpu_bf16_flops if self.cluster.hardware.cpu_bf16_for(spec.hidden_size) else self.flops

    # ---- links -------------------------------------------------------------------------------
    def crosses_nodes(self, group_span: int, num_devices: int | None = None) -> bool:
        """Whether some group whose ranks lie within ``group_span`` consecutive ranks of a pool of ``num_devices``
        (default: the span itself), blocks aligned to multiples of the span, leaves a node. A pool up to a node
        lies inside one; a larger one takes whole nodes, then part of one (Cluster.pool_nodes), so rank r sits
        on its node r // node size and a block stays inside a node exactly when its span divides the node size
        (tensor-parallel groups always do; a pipeline of p t = 6 on a 12-GPU pool [8, 4] has ranks 6-11 across)."""
        pool = group_span if num_devices is None else num_devices
        return pool > self.cluster.node_size and self.cluster.node_size % group_span != 0

    def link(self, crosses_nodes: bool) -> tuple[float, float]:
        """(bandwidth bytes/s per device, latency of one ring step s) of a group's links."""
        hardware = self.cluster.hardware
        # a collective waits for every rank to be scheduled: when processes outnumber cores its fixed
        # cost grows like host work (compute_share is 1 on devices that do not share cores)
        share = self.compute_share
        if crosses_nodes:
            bandwidth, latency = hardware.inter_node_bandwidth, hardware.inter_node_latency_s
        else:
            bandwidth, latency = hardware.intra_node_bandwidth, hardware.intra_node_latency_s
        return bandwidth * hardware.link_bandwidth_fraction, latency / share

    def all_reduce_seconds(self, num_bytes: float, group_size: int, group_span: int, *,
                           num_devices: int | None = None, crosses_nodes: bool | None = None) -> float:
        """Ring all-reduce of ``num_bytes`` on every rank: 2 (g-1) steps, 2 (g-1)/g of the bytes per link
        (links: ``crosses_nodes``, else those of groups spanning ``group_span`` ranks of a ``num_devices`` pool)."""
        if group_size <= 1:
            return 0.0
        crosses = self.crosses_nodes(group_span, num_devices) if crosses_nodes is None else crosses_nodes
        bandwidth, latency = self.link(crosses)
        return 2 * (group_size - 1) * latency + 2 * (group_size - 1) / group_size * num_bytes / bandwidth

    def all_gather_seconds(self, num_bytes: float, group_size: int, group_span: int, *,
                           num_collectives: int = 1, crosses_nodes: bool | None = None) -> float:
        """Ring all-gather (or reduce-scatter) of a ``num_bytes`` whole: g-1 steps, (g-1)/g of it per link;
        split over ``num_collectives`` calls (e.g. one per FSDP unit), each paying the steps' latency."""
        if group_size <= 1:
            return 0.0
        crosses = self.crosses_nodes(group_span) if crosses_nodes is None else crosses_nodes
        bandwidth, latency = self.link(crosses)
        return num_collectives * (group_size - 1) * latency + (group_size - 1) / group_size * num_bytes / bandwidth

    def send_seconds(self, num_bytes: float, group_span: int, num_devices: int | None = None) -> float:
        """A point-to-point send between neighbours of a group spanning ``group_span`` ranks of the pool."""
        bandwidth, latency = self.link(self.crosses_nodes(group_span, num_devices))
        return latency + num_bytes / bandwidth

    # ---- memory ------------------------------------------------------------------------------
    def resident_bytes(self, spec: ModelSpec, head: str, strategy: RoleStrategy, num_devices: int, *,
                       trained: bool) -> float:
        per_param = MASTER_WEIGHT_BYTES + ADAM_STATE_BYTES if trained else self.element_bytes_of(spec)
        return spec.num_params(head=head) * per_param / strategy.layout_model.state_shards(strategy, num_devices)

    def transient_bytes(self, spec: ModelSpec, head: str, strategy: RoleStrategy, *, trained: bool,
                        num_devices: int) -> float:
        """Activations of the micro-batches in flight (1F1B keeps L layers' worth on the first stage), the
        logits, fsdp's gathered layers and, for trained roles, the fp32 gradients of an update."""
        tokens = self.workload.sequences_per_micro_batch * self.workload.sequence_length
        tp_size = strategy.tp_size
        per_layer = (ACTIVATION_ELEMENTS_PER_TOKEN_PER_HIDDEN * self.element_bytes_of(spec) * tokens * spec.hidden_size
                     / tp_size)
        layers_held = spec.num_layers if trained else 1
        logits = tokens * spec.vocab_size * LOGIT_BYTES / tp_size if head == "lm" else 0.0
        layout = strategy.layout_model
        gathered = layout.gathered_layers * spec.params_per_layer * self.element_bytes_of(spec)
        gradients = spec.num_params(head=head) * GRADIENT_BYTES / layout.state_shards(strategy, num_devices) \
            if trained else 0.0
        return per_layer * layers_held + logits * (2 if trained else 1) + gathered + gradients

    # ---- training and inference --------------------------------------------------------------
    def _forward_pass_seconds(self, spec: ModelSpec, head: str, strategy: RoleStrategy, num_devices: int, *,
                              sequences: int, passes: int, backward: bool) -> float:
        """Seconds for ``passes`` rounds over ``sequences`` sequences split over the data-parallel ranks.

        A forward costs 2 FLOPs per parameter per token plus 2 h L S for causal attention; a backward
        twice that. Per micro-batch and layer, tensor parallelism all-reduces the activations twice
        forward and twice more backward; pipeline stages send activations (and their gradients back).
        """
        workload = self.workload
        seq_len = workload.sequence_length
        dp_size = strategy.dp_size(num_devices)
        sequences_per_rank = math.ceil(sequences / dp_size)
        work_factor = 3 if backward else 1
        # a pipeline runs at the pace of its slowest stage: the first stages take the extra layers when
        # p does not divide L (hybridflow.parallel.layout.stage_layer_range), the last one the output head
        stage_params, stage_layers = slowest_stage(spec, head, strategy.pp_size)
        flops_per_token = 2 * work_factor * (stage_params + stage_layers * spec.hidden_size * seq_len)
        micro_batches = math.ceil(sequences_per_rank / workload.sequences_per_micro_batch)
        compute = passes * sequences_per_rank * seq_len * flops_per_token / strategy.tp_size / self._flops(spec)
        # efficiency falls with the work per device: every micro-batch streams the device's weight shard
        # (forward; backward reads it again and writes its gradient), so a pass takes at least that
        # memory time: the roofline, whose knee is peak FLOP/s / bandwidth tokens per micro-batch
        layout = strategy.layout_model
        shard_bytes = spec.matmul_params(head=head) * self.element_bytes_of(spec) / layout.compute_shards(strategy)
        streaming = passes * micro_batches * work_factor * shard_bytes / self.memory_bandwidth
        compute = max(compute, streaming)
        compute += passes * micro_batches * work_factor * spec.num_layers / strategy.pp_size * self.layer_overhead_s
        # each pass is one engine call (an inference, or an update with its optimizer step)
        compute += passes * (self.update_overhead_s if backward else self.inference_call_overhead_s)
        return layout.pass_seconds(self, spec, strategy, num_devices, compute=compute, passes=passes,
                                   micro_batches=micro_batches, backward=backward, head=head)

    def training_seconds(self, spec: ModelSpec, head: str, strategy: RoleStrategy, num_devices: int) -> float:
        """Forward + backward over every update, then the gradient synchronization of each update."""
        workload = self.workload
        updates = workload.updates_per_step
        seconds = self._forward_pass_seconds(spec, head, strategy, num_devices,
                                             sequences=workload.samples_per_update, passes=updates, backward=True)
        sync = strategy.layout_model.gradient_sync_seconds(self, spec, head, strategy, num_devices)
        return seconds + updates * sync

    def inference_seconds(self, spec: ModelSpec, head: str, strategy: RoleStrategy, num_devices: int) -> float:
        """One forward over every sample of the iteration (log-probs, values or scores)."""
        return self._forward_pass_seconds(spec, head, strategy, num_devices,
                                          sequences=self.workload.num_samples, passes=1, backward=False)

    # ---- generation --------------------------------------------------------------------------
    def generation_weight_bytes(self, spec: ModelSpec, strategy: RoleStrategy) -> float:
        """Per device: the generation shard of the weights, 1/(tg*pg) of the model."""
        gen_size = strategy.generation_pp_size * strategy.generation_tp_size
        return spec.num_params(head="lm") * self.element_bytes_of(spec) / gen_size

    def generation_extra_bytes(self, spec: ModelSpec, strategy: RoleStrategy) -> float:
        """Per device: the generation weights the actor holds beside its training state while generating
        (with a backend that keeps its own copy, at the moment that copy is loaded, when the KV cache is
        already allocated)."""
        own_copy = self.generation_weight_bytes(spec, strategy) if self.backend.own_weight_copy else 0.0
        return strategy.layout_model.generation_extra_bytes(self, spec, strategy) + own_copy

    def weight_load_seconds(self, spec: ModelSpec, strategy: RoleStrategy) -> float:
        """A backend with its own weight copy: the in-place copy of the generation shard into it before the
        rollout, one read and one write of the shard per device at memory bandwidth; 0 for the native engine."""
        if not self.backend.own_weight_copy:
            return 0.0
        return 2 * self.generation_weight_bytes(spec, strategy) / self.memory_bandwidth

    def transition_seconds(self, spec: ModelSpec, strategy: RoleStrategy, num_devices: int) -> float:
        """3D-HybridEngine train -> generate: all-gather inside micro-DP groups of dg = t p / (tg pg) ranks.

        Each rank receives (t p - tg pg) / (tg pg t p) of the model (paper Table 2, HybridFlow row);
        fsdp gathers the whole model on every rank. Going back to training drops the extra copy (free).
        """
        return strategy.layout_model.transition_seconds(self, spec, strategy, num_devices)

    def kv_bytes_per_sequence(self, spec: ModelSpec, strategy: RoleStrategy) -> float:
        """Per device: keys and values of one full sequence on this rank's layers and heads (what must fit for
        generation to run at all, with either backend: vLLM refuses to start below one such sequence)."""
        kv_shards = min(strategy.generation_tp_size, spec.num_kv_heads)
        layers = spec.num_layers / strategy.generation_pp_size
        return 2 * layers * spec.kv_dim / kv_shards * self.workload.sequence_length * self.element_bytes_of(spec)

    def generation_seconds(self, spec: ModelSpec, strategy: RoleStrategy, num_devices: int,
                           kv_budget_bytes: float) -> tuple[float, dict[str, float]] | None:
        """Prefill + decode of every sample by num_devices / (tg pg) replicas; None if no sequence fits."""
        workload = self.workload
        tg, pg = strategy.generation_tp_size, strategy.generation_pp_size
        kv_per_sequence = self.kv_bytes_per_sequence(spec, strategy)
        if kv_budget_bytes < kv_per_sequence:
            return None
        # sequences in flight: the native engine preallocates P + T positions per row of a wave; a paged
        # cache with continuous batching holds each sequence's live context, P + T/2 on average
        occupied = self.backend.kv_tokens_per_sequence(workload.prompt_length, workload.response_length)
        kv_in_flight = kv_per_sequence if occupied == workload.sequence_length \
            else kv_per_sequence * occupied / workload.sequence_length
        max_batch = int(kv_budget_bytes // kv_in_flight)
        replicas = num_devices // (tg * pg)
        # prompts are split over the replicas (padded with repeated prompts when they do not divide), then
        # each replica samples every one of its prompts samples_per_prompt times
        sequences = math.ceil(workload.prompts_per_step / replicas) * workload.samples_per_prompt
        waves = math.ceil(sequences / max_batch)
        batch = math.ceil(sequences / waves)
        h, layers, e = spec.hidden_size, spec.num_layers, self.element_bytes_of(spec)
        matmul_params = spec.matmul_params(head="lm")
        prompt_len, response_len = workload.prompt_length, workload.response_length

        kv_bytes_per_token = 2 * layers / pg * spec.kv_dim / min(tg, spec.num_kv_heads) * e

        def pass_seconds(new_tokens: int, kv_tokens: float, attention_pairs: float) -> float:
            """One forward of ``new_tokens`` through all stages, reading ``kv_tokens`` cached keys/values.

            Roofline per stage: streaming the weight and KV shards vs the FLOPs (2 per parameter per
            token, 4 h L per query-key pair); without micro-batching across stages a token visits
            the pg stages one after another.
            """
            stage_bytes = matmul_params * e / (tg * pg) + kv_tokens * kv_bytes_per_token
            stage_flops = (2 * new_tokens * matmul_params + 4 * attention_pairs * h * layers) / (tg * pg)
            stage_tp = 2 * layers / pg * self.all_reduce_seconds(new_tokens * h * e, tg, tg, num_devices=num_devices)
            device = max(stage_bytes / self.decode_memory_bandwidth, stage_flops / self._flops(spec)) + stage_tp
            # eager decode: the host launches every layer's kernels; launches run ahead of the device, so
            # the stage takes at least their time (0 unless the profile measured it)
            stage = max(device, layers / pg * self.decode_dispatch_s) + layers / pg * self.layer_overhead_s
            sends = (pg - 1) * self.send_seconds(new_tokens * h * e, tg * pg, num_devices) if pg > 1 else 0.0
            return pg * stage + sends

        # every step (the prefill and each decode step) embeds, calls the head and samples once
        step_overhead = self.decode_step_overhead_s
        prefill = pass_seconds(batch * prompt_len, batch * prompt_len, batch * prompt_len * prompt_len / 2) \
            + step_overhead
        mean_context = prompt_len + response_len / 2
        # between decode steps the rollout engine's host work (scheduling, sampling inputs, bookkeeping)
        # grows with the replica's batch and does not overlap the device: few large replicas (large tg)
        # pay more of it than many small ones
        host = batch * self.cluster.hardware.decode_host_seconds_per_sequence / self.compute_share
        decode = response_len * (pass_seconds(batch, batch * mean_context, batch * mean_context) + host
                                 + step_overhead)
        # a backend with its own weight copy loads it once per step (remax's second pass reuses it)
        weight_load = self.weight_load_seconds(spec, strategy)
        seconds = self.generation_passes * waves * (prefill + decode) + weight_load
        return seconds, {"generation_waves": float(waves), "generation_batch": float(batch),
                         "weight_load_seconds": weight_load}

    # ---- one role ----------------------------------------------------------------------------
    def role_cost(self, *, kind: str, spec: ModelSpec, head: str, strategy: RoleStrategy, num_devices: int,
                  other_resident_bytes: float = 0.0, other_transient_bytes: float = 0.0) -> RoleCost | None:
        """Seconds per stage and memory of a role of ``kind`` (see dataflow.ROLE_KINDS), or None if it
        does not fit next to colocated roles holding ``other_resident_bytes`` per device."""
        trained = kind in ("actor", "critic")
        resident = self.resident_bytes(spec, head, strategy, num_devices, trained=trained)
        transient = self.transient_bytes(spec, head, strategy, trained=trained, num_devices=num_devices)
        if other_resident_bytes + resident + max(transient, other_transient_bytes) > self.budget_bytes:
            return None
        # every stage is one call of the driver on the role's worker group
        call = self.controller_call_s
        scores = kind != "actor" or self.workload.actor_log_prob_pass  # the actor's old log-probs, where they run
        stages = {"preparation": self.inference_seconds(spec, head, strategy, num_devices) + call if scores else 0.0}
        if trained:
            stages["training"] = self.training_seconds(spec, head, strategy, num_devices) + call
        details: dict[str, float] = {}
        if kind == "actor" and strategy.generates:  # an actor beside a rollout pool does not generate
            generation_extra = self.generation_extra_bytes(spec, strategy)
            kv_budget = self.budget_bytes - other_resident_bytes - resident - generation_extra
            if self.kv_cache_bytes is not None:  # a fixed allocation: it fits whole or not at all
                if self.kv_cache_bytes > kv_budget:
                    return None
                kv_budget = self.kv_cache_bytes
            generated = self.generation_seconds(spec, strategy, num_devices, kv_budget)
            if generated is None:
                return None
            generation, details = generated
            transition = self.transition_seconds(spec, strategy, num_devices)
            details["transition_seconds"] = transition
            stages["generation"] = generation + transition + call
        return RoleCost(strategy=strategy, stage_seconds=stages, resident_bytes=resident,
                        transient_bytes=transient, details=details)
