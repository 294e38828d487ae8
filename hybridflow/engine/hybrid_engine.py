"""The 3D-HybridEngine: reshards the actor from its training layout (p, t, d) to generation (pg, tg, dg) and back.

Strategies (``HybridEngineConfig.strategy``):

- ``hybrid`` (the paper's, section 5.3): generation TP groups take ranks at stride t/tg inside each
  training TP group, generation stages cover p/pg consecutive training stages, and the micro-DP
  group (the ranks that will hold the same generation shard) are consecutive. A rank's training
  shard is one of the pieces of its generation shard, so the transition only all-gathers the other
  pieces inside the micro-DP group, keeps the local shard in place as one of the pieces the decoder
  computes with, and going back to training just drops the gathered pieces (no communication).
- ``vanilla`` (the paper's baseline grouping): generation TP groups of consecutive ranks; each rank
  all-gathers the whole model inside its training replica, cuts its generation shard out as a copy
  and frees the rest: (tp-1)/tp of the model moved, a redundant copy held during generation.
- ``full_gather`` (DeepSpeed-Chat style): every rank gathers the whole model from ZeRO-style equal
  slices of all t*p*d ranks and generates alone (tg = pg = 1): (tpd-1)/tpd of the model moved.

Those three take the 3d layout's shards (tensor-parallel pieces of a pipeline stage). The fsdp layout's
shards (FSDP2's dim-0 slice of every parameter) take ``FsdpGatherStrategy``: every rank all-gathers the
whole model from the d ranks' slices and generates alone, (d-1)/d of the model moved. The training
engine's layout object picks the strategy (``engine/layouts.py``, ``HybridEngine.for_training``), and a
strategy sees this rank through a ``TransitionContext``, not the engine.

Bytes are counted per rank as the payload its collectives deliver to it (received) and the payload
of its own tensors delivered to other ranks (sent). Parameter memory is the bytes of the distinct
storages of training shards and generation pieces alive on the rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.engine.decoder import DecoderSpec
from hybridflow.engine.hybrid_engine_config import STRATEGIES, HybridEngineConfig  # noqa: F401 (re-exported)
from hybridflow.engine.rollout import GenerationShard
from hybridflow.parallel.fsdp import dp_shard_rows
from hybridflow.parallel.layout import GenerationCoords, GenerationLayout, ParallelLayout, RankCoords, stage_layer_range
from hybridflow.parallel.sharding import tp_shard_dim


@dataclass
class TransitionStats:
    """Measurements of one transition on one rank."""

    direction: str
    """'to_generation' or 'to_training'."""
    strategy: str
    bytes_sent: int = 0
    bytes_received: int = 0
    param_bytes: int = 0
    """Parameter bytes alive on this rank after the transition (during generation for 'to_generation')."""
    peak_param_bytes: int = 0
    """Largest parameter bytes alive on this rank at any point of the transition."""
    allocated_bytes: int = 0
    """CUDA only (0 on CPU): the caching allocator's allocated bytes after the transition, everything
    the process holds (the analytic figures above count parameters only)."""
    peak_allocated_bytes: int = 0
    """CUDA only: the allocator's peak during the transition ('to_training': since 'to_generation' began,
    so it covers the rollout too)."""
    seconds: float = 0.0
    collectives: int = 0
    """Collective calls this rank made (one per bucket per group and source; ``bucket_mb``)."""


def parameter_shapes(hf_config) -> dict[str, torch.Size]:
    """Full shapes of the model's parameters by Hugging Face name (tied embeddings once), built on meta."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: param.shape for name, param in model.named_parameters()}


def training_stage_of(name: str, *, num_layers: int, pp_size: int) -> int:
    """The training pipeline stage that holds parameter ``name`` (embedding first, norm and head last)."""
    if name.startswith("model.layers."):
        layer = int(name.split(".")[2])
        return next(s for s in range(pp_size) if layer in stage_layer_range(num_layers, pp_size, s))
    return 0 if name.startswith("model.embed_tokens.") else pp_size - 1


def cut_training_shards(state_dict: dict[str, torch.Tensor], hf_config, layout: ParallelLayout,
                        rank: int) -> dict[str, torch.Tensor]:
    """The local shards a 3d training engine holds on ``rank``, cut from a full state_dict (own storages).

    Same contract as a 3d training engine's ``local_shards()``: parameters of the rank's training
    stage only, tensor-parallel ones as chunk tp_rank of tp_size along ``tp_shard_dim``.
    """
    coords = layout.coords(rank)
    shards = {}
    for name in parameter_shapes(hf_config):
        if training_stage_of(name, num_layers=hf_config.num_hidden_layers, pp_size=layout.pp_size) != coords.pp_rank:
            continue
        full, dim = state_dict[name], tp_shard_dim(name)
        shard = full if dim is None else full.chunk(layout.tp_size, dim=dim)[coords.tp_rank]
        shards[name] = shard.detach().clone()
    return shards


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a piece reused in place counts once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges over ``sizes`` (bytes) of at most ``bucket_bytes`` each; an item larger than
    that goes alone, and ``bucket_bytes`` = 0 gives one item per bucket (one collective per parameter)."""
    buckets, start, total = [], 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > bucket_bytes:
            buckets.append(range(start, index))
            start, total = index, 0
        total += size
    if sizes:
        buckets.append(range(start, len(sizes)))
    return buckets


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D buffer of ``tensors`` in order (a view of the tensor itself when there is one)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _views(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive views of ``shapes`` (they share its one storage)."""
    sizes = [math.prod(shape) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes)]


def _all_gather_bucket(tensors: list[torch.Tensor], peers: list[int], rank: int, group,
                       stats: "TransitionStats") -> dict[int, list[torch.Tensor]]:
    """Every peer's ``tensors`` (same shapes on every peer) in one all-gather: peer -> its tensors.

    This rank's entry is ``tensors`` themselves (kept in place); the others are views of one receive buffer
    per peer, so the bucket adds no copy of the local tensors to what stays alive.
    """
    send = _flatten(tensors)
    slots = [send if r == rank else torch.empty_like(send) for r in peers]
    dist.all_gather(slots, send, group=group)
    stats.collectives += 1
    shapes = [t.shape for t in tensors]
    return {r: list(tensors) if r == rank else _views(slot, shapes) for r, slot in zip(peers, slots)}


def _broadcast_bucket(tensors: list[torch.Tensor] | None, shapes: list[torch.Size], *, src: int, rank: int,
                      group, like: torch.Tensor, stats: "TransitionStats") -> list[torch.Tensor]:
    """``src``'s ``tensors`` (of ``shapes``) on every rank of ``group`` in one broadcast: the source keeps its
    own tensors, the others get views of one receive buffer."""
    if rank == src:
        dist.broadcast(_flatten(tensors), src=src, group=group)
        stats.collectives += 1
        return tensors
    flat = like.new_empty(sum(math.prod(shape) for shape in shapes))
    dist.broadcast(flat, src=src, group=group)
    stats.collectives += 1
    return _views(flat, shapes)


class _Groups:
    """Process groups built collectively: every rank creates every group, keeps the one it belongs to."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def mine(self, groups: list[list[int]]) -> tuple[object, list[int]]:
        chosen = None
        for ranks in groups:
            handle = dist.new_group(ranks) if len(ranks) > 1 else None
            if self.rank in ranks:
                chosen = (handle, ranks)
        assert chosen is not None, f"rank {self.rank} is in none of {groups}"
        return chosen


@dataclass(frozen=True, kw_only=True)
class TransitionContext:
    """What a transition strategy knows of this rank: both layouts, the model's shapes, its generation shard."""

    train_layout: ParallelLayout
    generation_layout: GenerationLayout
    rank: int
    num_layers: int
    """Decoder layers of the model."""
    shapes: dict[str, torch.Size]
    """Full shapes of the model's parameters by Hugging Face name (tied embeddings once)."""
    stage_names: list[str]
    """The parameters of this rank's generation shard (its generation stage), in the order of ``shapes``."""
    bucket_bytes: int
    """Largest payload one rank puts into one transition collective (0: one per parameter)."""

    @property
    def coords(self) -> RankCoords:
        return self.train_layout.coords(self.rank)

    @property
    def gen_coords(self) -> GenerationCoords:
        return self.generation_layout.coords(self.rank)

    def piece_shapes(self, name: str, *, tp_size: int, count: int) -> list[torch.Size]:
        """Shapes of the generation pieces of ``name``: ``count`` tp shards of 1/tp_size (or the whole tensor)."""
        shape, dim = list(self.shapes[name]), tp_shard_dim(name)
        if dim is None:
            return [torch.Size(shape)]
        shape[dim] //= tp_size
        return [torch.Size(shape)] * count


def generation_stage_names(shapes: dict[str, torch.Size], layout: GenerationLayout, rank: int, *,
                           num_layers: int) -> list[str]:
    """The parameters (in the order of ``shapes``) of ``rank``'s generation stage: its layers, the embedding on
    stage 0, the final norm and untied head on the last stage (all of them when pg = 1)."""
    gen_pp = layout.coords(rank).gen_pp_rank
    layers = layout.stage_layers(num_layers, gen_pp)
    names = []
    for name in shapes:
        if name.startswith("model.layers."):
            held = int(name.split(".")[2]) in layers
        elif name.startswith("model.embed_tokens."):
            held = gen_pp == 0
        else:
            held = gen_pp == layout.pp_size - 1
        if held:
            names.append(name)
    return names


class TransitionStrategy:
    """How the actor goes from its training shards to its generation weights and back (one subclass per
    ``HybridEngineConfig.strategy``, and one for the fsdp layout's shards); it owns the process groups its
    collectives use. With pg = tg = 1 every rank is a generation replica of its own holding the whole model."""

    name: str = ""
    generation_grouping: str = "hybrid"
    """How ``GenerationLayout`` groups the generation ranks."""
    def build_groups(self, context: "TransitionContext", groups: "_Groups") -> None:
        """Create this strategy's process groups (every rank creates every group, in the same order)."""
        raise NotImplementedError

    def gather(self, context: "TransitionContext", shards: dict[str, torch.Tensor],
               stats: "TransitionStats") -> dict[str, list]:
        """This rank's generation weights (name -> pieces) around its training ``shards``."""
        raise NotImplementedError


class HybridStrategy(TransitionStrategy):
    """The paper's zero-redundancy transition: all-gather inside the micro-DP group, local shard kept in place."""

    name = "hybrid"

    def build_groups(self, context: "TransitionContext", groups: "_Groups") -> None:
        # the micro-DP group split by axis; micro-TP peers share the training stage, micro-PP
        # peers share the training tp rank (member order = shard order inside the generation shard)
        train = context.train_layout
        micro = context.generation_layout.micro_dp_groups()
        self.micro_tp_group = groups.mine([sorted(g, key=lambda r: train.coords(r).tp_rank)
                                           for m in micro for g in _split_by(m, lambda r: train.coords(r).pp_rank)])
        self.micro_pp_group = groups.mine([sorted(g, key=lambda r: train.coords(r).pp_rank)
                                           for m in micro for g in _split_by(m, lambda r: train.coords(r).tp_rank)])

    def gather(self, context: "TransitionContext", shards: dict[str, torch.Tensor],
               stats: "TransitionStats") -> dict[str, list]:
        """All-gather the other pieces inside the micro-DP group; the local shard stays a piece, in place."""
        bucket_bytes = context.bucket_bytes
        group, peers = self.micro_tp_group
        weights: dict[str, list[torch.Tensor]] = {name: [shard] for name, shard in shards.items()}
        sharded = [name for name in shards if tp_shard_dim(name) is not None and len(peers) > 1]
        for bucket in plan_buckets([_nbytes(shards[n]) for n in sharded], bucket_bytes):
            names = [sharded[i] for i in bucket]
            by_peer = _all_gather_bucket([shards[n] for n in names], peers, context.rank, group, stats)
            for index, name in enumerate(names):
                weights[name] = [by_peer[r][index] for r in peers]
                stats.bytes_received += (len(peers) - 1) * _nbytes(shards[name])
                stats.bytes_sent += (len(peers) - 1) * _nbytes(shards[name])
        group, peers = self.micro_pp_group
        if len(peers) > 1:
            num_layers, pp_size = context.num_layers, context.train_layout.pp_size
            like, count = _any(shards), context.generation_layout.tp_ratio
            names_of: dict[int, list[str]] = {}
            for name in context.stage_names:
                owner_stage = training_stage_of(name, num_layers=num_layers, pp_size=pp_size)
                src = next(r for r in peers if context.train_layout.coords(r).pp_rank == owner_stage)
                names_of.setdefault(src, []).append(name)
            for src in sorted(names_of):
                # every peer knows the pieces' shapes; the source also has them
                shapes_of = {n: context.piece_shapes(n, tp_size=context.train_layout.tp_size, count=count)
                             for n in names_of[src]}
                sizes = [sum(math.prod(shape) for shape in shapes_of[n]) * like.element_size() for n in names_of[src]]
                for bucket in plan_buckets(sizes, bucket_bytes):
                    names = [names_of[src][i] for i in bucket]
                    shapes = [shape for n in names for shape in shapes_of[n]]
                    mine = [p for n in names for p in weights[n]] if src == context.rank else None
                    pieces = _broadcast_bucket(mine, shapes, src=src, rank=context.rank, group=group, like=like,
                                               stats=stats)
                    for name in names:
                        size = sum(math.prod(shape) for shape in shapes_of[name]) * like.element_size()
                        if src == context.rank:
                            stats.bytes_sent += (len(peers) - 1) * size
                        else:
                            stats.bytes_received += size
                        weights[name], pieces = pieces[:len(shapes_of[name])], pieces[len(shapes_of[name]):]
        return weights


class _WholeModelGather(TransitionStrategy):
    """Shared by the baselines: broadcast every training stage's parameters along the training pipeline."""

    def _gather_stage_then_pipeline(self, context: "TransitionContext", stage_params: dict[str, torch.Tensor],
                                    stats: "TransitionStats", running: int) -> dict[str, torch.Tensor]:
        """Broadcast every training stage's full parameters along the training pipeline: the whole model."""
        group, peers = self.train_pp_group
        full = dict(stage_params)
        if len(peers) == 1:
            stats.peak_param_bytes = max(stats.peak_param_bytes, running)
            return full
        like = _any(stage_params)
        names_of: dict[int, list[str]] = {}
        for name in context.shapes:
            owner = training_stage_of(name, num_layers=context.num_layers, pp_size=context.train_layout.pp_size)
            names_of.setdefault(owner, []).append(name)
        for owner in sorted(names_of):
            names = names_of[owner]
            shapes = [context.shapes[n] for n in names]
            sizes = [math.prod(shape) * like.element_size() for shape in shapes]
            mine = owner == context.coords.pp_rank
            for bucket in plan_buckets(sizes, context.bucket_bytes):
                tensors = _broadcast_bucket([full[names[i]] for i in bucket] if mine else None,
                                            [shapes[i] for i in bucket], src=peers[owner], rank=context.rank,
                                            group=group, like=like, stats=stats)
                for i, tensor in zip(bucket, tensors):
                    if mine:
                        stats.bytes_sent += (len(peers) - 1) * sizes[i]
                    else:
                        full[names[i]] = tensor
                        stats.bytes_received += sizes[i]
                        running += sizes[i]
        stats.peak_param_bytes = max(stats.peak_param_bytes, running)
        return full


class VanillaStrategy(_WholeModelGather):
    """The paper's baseline grouping: consecutive generation TP groups; gather the whole model, cut a copy."""

    name = "vanilla"
    generation_grouping = "vanilla"

    def build_groups(self, context: "TransitionContext", groups: "_Groups") -> None:
        self.train_tp_group = groups.mine(context.train_layout.tp_groups())
        self.train_pp_group = groups.mine(context.train_layout.pp_groups())

    def gather(self, context: "TransitionContext", shards: dict[str, torch.Tensor],
               stats: "TransitionStats") -> dict[str, list]:
        """Gather the whole model in the training replica, cut the generation shard out as a copy, free the rest."""
        group, peers = self.train_tp_group
        running = storage_bytes(shards.values())
        stage_params = dict(shards)
        sharded = [name for name in shards if tp_shard_dim(name) is not None and len(peers) > 1]
        for bucket in plan_buckets([_nbytes(shards[n]) for n in sharded], context.bucket_bytes):
            names = [sharded[i] for i in bucket]
            by_peer = _all_gather_bucket([shards[n] for n in names], peers, context.rank, group, stats)
            for index, name in enumerate(names):
                stage_params[name] = torch.cat([by_peer[r][index] for r in peers], dim=tp_shard_dim(name))
                stats.bytes_received += (len(peers) - 1) * _nbytes(shards[name])
                stats.bytes_sent += (len(peers) - 1) * _nbytes(shards[name])
                running += _nbytes(stage_params[name])
        full = self._gather_stage_then_pipeline(context, stage_params, stats, running)
        weights, copies = {}, 0
        tg, gen_tp = context.generation_layout.tp_size, context.gen_coords.gen_tp_rank
        for name in context.stage_names:
            dim = tp_shard_dim(name)
            if tg == 1:
                weights[name] = [full[name]]
            elif dim is None:
                # a received replicated tensor is a view of a bucket buffer that also holds pieces this rank
                # drops: keep its own copy so the buffer is freed (tg = 1 keeps every tensor: no copy)
                weights[name] = [_own_storage(full[name])]
            else:
                weights[name] = [full[name].chunk(tg, dim=dim)[gen_tp].clone()]
                copies += _nbytes(weights[name][0])
        # the copies are cut while the whole gathered model is still alive
        stats.peak_param_bytes = max(stats.peak_param_bytes, storage_bytes([*shards.values(), *full.values()])
                                     + copies)
        return weights


class FullGatherStrategy(_WholeModelGather):
    """DeepSpeed-Chat style: every rank gathers the whole model from ZeRO-style slices and generates alone."""

    name = "full_gather"

    def build_groups(self, context: "TransitionContext", groups: "_Groups") -> None:
        train = context.train_layout
        self.stage_group = groups.mine([[r for r in range(train.world_size) if train.coords(r).pp_rank == s]
                                        for s in range(train.pp_size)])
        self.train_pp_group = groups.mine(train.pp_groups())

    def gather(self, context: "TransitionContext", shards: dict[str, torch.Tensor],
               stats: "TransitionStats") -> dict[str, list]:
        """ZeRO-style: each of the t*d ranks of a training stage contributes 1/(t*d) of it; then the pipeline."""
        group, peers = self.stage_group
        t, d = context.train_layout.tp_size, context.train_layout.dp_size
        # slot of this rank among the stage's t*d contributors: (tp_rank, dp_rank)
        train = context.train_layout
        order = sorted(peers, key=lambda r: (train.coords(r).tp_rank, train.coords(r).dp_rank))
        running = storage_bytes(shards.values())
        coords = context.coords
        slices = {}  # name -> (this rank's zero-padded slice, the numel of its payload)
        for name, shard in shards.items():
            # the unit cut into equal slices: the tp shard over d slices, or a replicated tensor over t*d
            sharded = tp_shard_dim(name) is not None
            flat = shard.reshape(-1)
            size = math.ceil(flat.numel() / (d if sharded else t * d))
            index = coords.dp_rank if sharded else coords.tp_rank * d + coords.dp_rank
            mine = flat.new_zeros(size)
            payload = flat[index * size:(index + 1) * size]
            mine[:payload.numel()] = payload
            slices[name] = (mine, payload.numel())
        names = list(shards)
        stage_params = {}
        for bucket in plan_buckets([_nbytes(slices[n][0]) for n in names], context.bucket_bytes):
            bucket_names = [names[i] for i in bucket]
            by_rank = _all_gather_bucket([slices[n][0] for n in bucket_names], peers, context.rank, group, stats)
            for index, name in enumerate(bucket_names):
                shard, dim = shards[name], tp_shard_dim(name)
                numel = shard.numel()
                if dim is not None:
                    tp_shards = []
                    for tp_rank in range(t):
                        ranks = [r for r in order if train.coords(r).tp_rank == tp_rank]
                        tp_shards.append(torch.cat([by_rank[r][index] for r in ranks])[:numel].view(shard.shape))
                    stage_params[name] = torch.cat(tp_shards, dim=dim)
                else:
                    stage_params[name] = torch.cat([by_rank[r][index] for r in order])[:numel].view(shard.shape)
                own = slices[name][1] * shard.element_size()
                total = stage_params[name].numel() * shard.element_size()
                stats.bytes_received += total - own
                stats.bytes_sent += (len(order) - 1) * own
                running += total
            del by_rank
        full = self._gather_stage_then_pipeline(context, stage_params, stats, running)
        return {name: [full[name]] for name in context.stage_names}


class FsdpGatherStrategy(TransitionStrategy):
    """The fsdp training layout's transition: every rank holds FSDP2's dim-0 slice of every parameter and
    all-gathers the others' (bucketed) into the whole model, then generates alone (pg = tg = 1).

    Each rank receives (d-1)/d of the model (exactly: the model minus its own slices) and sends its slices
    to the d-1 others; generation holds the whole model beside the training slices.
    """

    name = "fsdp_gather"

    def build_groups(self, context: "TransitionContext", groups: "_Groups") -> None:
        train = context.train_layout
        if (train.pp_size, train.tp_size) != (1, 1):
            raise ValueError(f"the fsdp layout's transition needs a training layout of data parallelism only, got "
                             f"pp_size={train.pp_size}, tp_size={train.tp_size}")
        self.dp_group = groups.mine([list(range(train.world_size))])

    def gather(self, context: "TransitionContext", shards: dict[str, torch.Tensor],
               stats: "TransitionStats") -> dict[str, list]:
        """All-gather every parameter's dim-0 slices in buckets of equal-size (zero-padded) slots per rank."""
        group, peers = self.dp_group
        names = context.stage_names
        if len(peers) == 1:  # one rank holds everything: generate from the training tensors in place
            return {name: [shards[name]] for name in names}
        like, dp_size = _any(shards), len(peers)
        rows_of = {name: [dp_shard_rows(context.shapes[name][0], dp_size, r) for r in range(dp_size)]
                   for name in names}
        for name in names:
            assert shards[name].shape[0] == len(rows_of[name][context.rank]), f"{name}: not FSDP2's dim-0 slice"
        # a slot is the largest slice (the first rank's), so every rank puts the same sizes into the all-gather
        slot_numel = {name: len(rows_of[name][0]) * math.prod(context.shapes[name][1:]) for name in names}
        weights = {}
        for bucket in plan_buckets([slot_numel[n] * like.element_size() for n in names], context.bucket_bytes):
            bucket_names = [names[i] for i in bucket]
            send = like.new_zeros(sum(slot_numel[n] for n in bucket_names))
            for name, slot in zip(bucket_names, send.split([slot_numel[n] for n in bucket_names])):
                slot[:shards[name].numel()] = shards[name].reshape(-1)
            received = [send if r == context.rank else torch.empty_like(send) for r in peers]
            dist.all_gather(received, send, group=group)
            stats.collectives += 1
            slots_by_rank = [buffer.split([slot_numel[n] for n in bucket_names]) for buffer in received]
            for index, name in enumerate(bucket_names):
                shape, rows = context.shapes[name], rows_of[name]
                row_numel = math.prod(shape[1:])
                full = torch.cat([slots_by_rank[r][index][:len(rows[r]) * row_numel] for r in range(dp_size)])
                weights[name] = [full.view(shape)]
                own = _nbytes(shards[name])
                stats.bytes_received += _nbytes(full) - own
                stats.bytes_sent += (dp_size - 1) * own
            del received, slots_by_rank
        return weights


TRANSITION_STRATEGIES: dict[str, type[TransitionStrategy]] = {
    cls.name: cls for cls in (HybridStrategy, VanillaStrategy, FullGatherStrategy)}
"""``HybridEngineConfig.strategy`` -> its class (for tensor/pipeline-sharded training shards: the 3d layout's;
the fsdp layout's shards take ``FsdpGatherStrategy``, ``engine/layouts.py``)."""


class HybridEngine:
    """One actor rank's switch between its training shards and its generation shard over the same weights.

    Construct it on every rank of the actor's group at once (it creates process groups). Then, per
    RL step: ``to_generation(local_shards)``, a rollout backend ``load``s ``shard`` (``engine/rollout.py``),
    ``to_training()``.
    """

    def __init__(self, hf_config, train_layout: ParallelLayout, config: HybridEngineConfig, *,
                 dtype: torch.dtype = torch.float32, transition: TransitionStrategy | None = None) -> None:
        """``dtype``: what generation computes in (the actor engine's compute dtype). When it is not the
        training shards' dtype (bf16 generation from fp32 master weights), each rank casts its shard
        before the gather: the transition moves half the bytes and the generation weights are a bf16 copy
        (the in-place reuse of the training shard holds only when the dtypes agree).

        ``transition``: how the shards ``to_generation`` receives become generation weights; by default the
        strategy ``config.strategy`` names, for shards cut by tensor and pipeline rank as the 3d layout
        cuts them (``cut_training_shards``). ``for_training`` takes it from a training engine's layout.
        """
        if dist.get_world_size() != train_layout.world_size:
            raise ValueError(f"the training layout has {train_layout.world_size} ranks but the process group "
                             f"has {dist.get_world_size()}")
        self.hf_config, self.train_layout, self.config = hf_config, train_layout, config
        self.dtype = dtype
        self.spec = DecoderSpec.from_hf(hf_config)
        self.rank = dist.get_rank()
        self.strategy = transition or TRANSITION_STRATEGIES[config.strategy]()
        self.generation_layout = GenerationLayout(
            train=train_layout, pp_size=config.pp_size, tp_size=config.tp_size,
            grouping=self.strategy.generation_grouping)
        self.spec.check_tp_size(config.tp_size)
        self.gen_coords = self.generation_layout.coords(self.rank)
        self.gen_layers = self.generation_layout.stage_layers(self.spec.num_layers, self.gen_coords.gen_pp_rank)
        shapes = parameter_shapes(hf_config)
        self.context = TransitionContext(
            train_layout=train_layout, generation_layout=self.generation_layout, rank=self.rank,
            num_layers=self.spec.num_layers, shapes=shapes, bucket_bytes=int(config.bucket_mb * 2**20),
            stage_names=generation_stage_names(shapes, self.generation_layout, self.rank,
                                               num_layers=self.spec.num_layers))
        """What the strategy sees of this rank (layouts, shapes, its generation shard's names, bucket size)."""
        groups = _Groups(self.rank)
        self.gen_tp_group = groups.mine(self.generation_layout.tp_groups())
        self.gen_pp_group = groups.mine(self.generation_layout.pp_groups())
        self.strategy.build_groups(self.context, groups)
        self.local_shards: dict[str, torch.Tensor] | None = None
        self.shard: GenerationShard | None = None
        """This rank's generation shard between ``to_generation`` and ``to_training`` (None otherwise)."""

    @classmethod
    def for_training(cls, engine, config: HybridEngineConfig) -> "HybridEngine":
        """The hybrid engine of a ``TrainingEngine``'s ranks: generation in its compute dtype, from the shards its
        ``local_shards()`` gives, through the transition its training layout needs (``engine/layouts.py``)."""
        return cls(engine.hf_config, engine.layout, config, dtype=engine.compute_dtype,
                   transition=engine.training_layout.transition(config.strategy))

    # ----- replicas ----------------------------------------------------------------------------------
    @property
    def replica(self) -> int:
        """The generation replica of this rank: it generates the replica's share of the prompts (with
        pg = tg = 1 every rank is a replica of its own: ``replica`` is the rank)."""
        return self.gen_coords.replica

    @property
    def num_replicas(self) -> int:
        return self.generation_layout.num_replicas

    # ----- transitions -------------------------------------------------------------------------------
    def to_generation(self, local_shards: dict[str, torch.Tensor]) -> TransitionStats:
        """Gather this rank's generation weights around its training shards into ``self.shard``."""
        if self.shard is not None:
            raise RuntimeError("to_generation called twice without to_training in between")
        start = time.perf_counter()
        _reset_allocator_peak()
        self.local_shards = local_shards
        stats = TransitionStats(direction="to_generation", strategy=self.strategy.name)
        stats.peak_param_bytes = storage_bytes(local_shards.values())
        if any(shard.dtype != self.dtype for shard in local_shards.values()):
            local_shards = {name: shard.to(self.dtype) for name, shard in local_shards.items()}
        weights = self.strategy.gather(self.context, local_shards, stats)
        self.shard = self._generation_shard(weights)
        stats.param_bytes = self.param_bytes()
        stats.peak_param_bytes = max(stats.peak_param_bytes, stats.param_bytes)
        _read_allocator(stats)
        stats.seconds = time.perf_counter() - start
        return stats

    def to_training(self) -> TransitionStats:
        """Drop the generation weights; the training shards were never moved. No communication."""
        start = time.perf_counter()
        before = self.param_bytes()
        stats = TransitionStats(direction="to_training", strategy=self.strategy.name,
                                param_bytes=storage_bytes(self.local_shards.values()), peak_param_bytes=before)
        _read_allocator(stats)  # the peak since to_generation: the transition and the whole rollout
        self.shard = None
        self.local_shards = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats.allocated_bytes = torch.cuda.memory_allocated()  # what training gets back
        stats.seconds = time.perf_counter() - start
        return stats

    def param_bytes(self) -> int:
        tensors = list(self.local_shards.values()) if self.local_shards is not None else []
        if self.shard is not None:
            tensors += [p for pieces in self.shard.weights.values() for p in pieces]
        return storage_bytes(tensors)

    def _generation_shard(self, weights: dict[str, list[torch.Tensor]]) -> GenerationShard:
        """``weights`` with where they sit: this rank's generation stage, TP group and pipeline."""
        if self.generation_layout.ranks_per_replica == 1:
            world = self.train_layout.world_size
            return GenerationShard(weights, layers=range(self.spec.num_layers), has_embedding=True,
                                   has_final_norm=True, has_head=True, tp_ranks=[self.rank], pp_ranks=[self.rank],
                                   tp_groups=[[rank] for rank in range(world)])
        gen_pp, pg = self.gen_coords.gen_pp_rank, self.generation_layout.pp_size
        tp_group, tp_ranks = self.gen_tp_group
        pp_group, pp_ranks = self.gen_pp_group
        head_stage = 0 if self.spec.tie_word_embeddings else pg - 1
        layout = self.generation_layout
        return GenerationShard(weights, layers=self.gen_layers, has_embedding=gen_pp == 0,
                               has_final_norm=gen_pp == pg - 1, has_head=gen_pp == head_stage,
                               tp_group=tp_group, tp_ranks=list(tp_ranks), tp_rank=self.gen_coords.gen_tp_rank,
                               pp_group=pp_group, pp_ranks=list(pp_ranks), pp_stage=gen_pp,
                               tp_groups=[ranks[start:start + layout.tp_size] for ranks in
                                          map(layout.replica_ranks, range(layout.num_replicas))
                                          for start in range(0, len(ranks), layout.tp_size)])


def _reset_allocator_peak() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def _read_allocator(stats: TransitionStats) -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats.allocated_bytes = torch.cuda.memory_allocated()
        stats.peak_allocated_bytes = torch.cuda.max_memory_allocated()


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it spans its whole storage, else a copy (so the rest of the storage can be freed)."""
    return tensor if tensor.untyped_storage().nbytes() == _nbytes(tensor) else tensor.clone()


def _any(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """A tensor whose dtype and device new buffers take (all shards share them)."""
    return next(iter(tensors.values()))


def _split_by(ranks: list[int], key) -> list[list[int]]:
    buckets: dict[int, list[int]] = {}
    for r in ranks:
        buckets.setdefault(key(r), []).append(r)
    return [buckets[k] for k in sorted(buckets)]
