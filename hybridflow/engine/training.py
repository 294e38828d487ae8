"""TrainingEngine: one model under a training layout (fsdp or 3d, engine/layouts.py); train steps, inference,
checkpoints, export.

Legend: B = batch rows on this rank, S = sequence columns, T = response columns, b = rows of one
micro-batch, N = packed tokens of one micro-batch, V = vocabulary.

Every rank of the group runs the same calls (SPMD). Ranks of one data-parallel replica (same dp
rank: its tp and pp ranks) must receive the same batch; different replicas receive different rows.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridflow.algorithms.finite import NonFiniteError, check_non_finite_action, first_non_finite
from hybridflow.device import configure_host_allocator, configure_matmul_precision, current_device, device_type
from hybridflow.engine import checkpoint as checkpoint_io
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.layouts import TrainingLayout, layout_class, local_tensor
from hybridflow.engine.logits import token_logprobs_and_entropy
from hybridflow.engine.micro_batch import (PackedMicroBatch, default_position_ids, last_token_values, pack_rows,
                                           plan_micro_batches, shift_to_next_token, unpack_columns)
from hybridflow.engine.optim import build_optimizer, clip_gradients, global_grad_norm, lr_at, set_lr
from hybridflow.parallel.mesh import build_training_mesh, group_rank_to_global, group_size, mesh_group, world_size
from hybridflow.parallel.pipeline import HEADS, build_pipeline_stage, build_schedule, build_stage

if TYPE_CHECKING:
    from hybridflow.models.lora_config import LoraConfig

LossFn = Callable[[dict[str, Tensor], dict[str, Tensor]], tuple[Tensor, dict[str, Tensor]]]
OUTPUTS_OF_HEAD = {"lm": ("logprobs", "entropy"), "value": ("values",), "score": ("scores",)}


class TrainingEngine:
    """A model laid out over this process group, trained and queried in token-budget micro-batches."""

    def __init__(self, config: EngineConfig, build_model: Callable[[], nn.Module], *, head: str = "lm",
                 weights_path: str | None = None, head_seed: int = 0, trainable: bool = True, seed: int = 0,
                 total_steps: int | None = None, lora: "LoraConfig | None" = None,
                 fp32_weights: bool | None = None):
        """``build_model()`` returns the full model; with ``weights_path`` it returns the architecture on the
        meta device, and each rank allocates only its shards and reads them from that Hugging Face
        directory (``engine/weights.py``). ``head_seed`` initialises a value/score head the checkpoint lacks.
        ``trainable=False`` (reference, reward and cost models): parameters are held in the compute dtype
        (bf16 on GPUs: half the memory of fp32 masters), without gradients and without an optimizer.
        ``fp32_weights`` (default: ``trainable``) holds them in fp32 instead, computing in the compute dtype by
        autocast exactly as a trained model does: a reference then gives its actor's log-probs bit for bit
        (held in bf16 it differs by ~1e-3 per token, since autocast keeps norms and residuals in the weights' dtype).
        ``seed`` (the run's) is set before ``build_model()`` (same initial weights on every rank);
        ``total_steps`` is the run's optimizer step count, the length of a linear or cosine LR schedule.
        ``lora``: LoRA adapters on the layers it targets (``models/lora.py``): only they (and a value/score head) are
        trained, optimized and checkpointed; generation gets W + scale B A (``local_shards``).
        """
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        if lora is not None and not trainable:
            raise ValueError("a LoRA config was given for an inference-only engine (trainable=False): a frozen role "
                             "has nothing to adapt; LoRA applies to the trained roles (actor.lora, critic.lora)")
        self.config, self.head, self.trainable = config, head, trainable
        self.lora = lora
        """The LoRA adapters of this model (None: every parameter is trained)."""
        self.fp32_weights = trainable if fp32_weights is None else fp32_weights
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            full_model = build_model()
        self.hf_config = full_model.config
        self._check_model_fits(full_model)
        self.training_layout: TrainingLayout = layout_class(config.layout).for_world(config, world_size())
        """The layout object: how this engine shards, scales, reduces and hands its weights to generation."""
        self.layout = self.training_layout.ranks
        """Its rank arithmetic (p, t, d)."""
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.coords = self.layout.coords(self.rank)
        self.device = current_device(int(os.environ.get("LOCAL_RANK", "0")))
        self.compute_dtype = config.resolve_dtype(self.hf_config.hidden_size)
        """What forward/backward compute in (autocast) and generation runs in: ``engine.dtype`` for this model."""
        configure_matmul_precision(self.compute_dtype)  # TF32 on CUDA under bf16 compute; true fp32 otherwise
        configure_host_allocator()  # CPU: freed memory kept for the next step instead of faulted in again
        self.mesh = build_training_mesh(self.layout)
        self.ties_embeddings = head == "lm" and bool(getattr(self.hf_config, "tie_word_embeddings", False))
        """Input and output embeddings are one matrix (checkpoints store it as model.embed_tokens.weight)."""
        on_meta = all(p.device.type == "meta" for p in full_model.parameters())
        if weights_path is not None and not on_meta:
            raise ValueError("TrainingEngine(weights_path=...) needs build_model() to return a model on the meta "
                             "device (build_model(config, device='meta'))")
        self.model = self._build_stage(full_model)
        del full_model
        if on_meta:
            if weights_path is None:
                raise ValueError("build_model() returned a model on the meta device but no weights_path was given")
            self._materialize(weights_path, head_seed)
        if not trainable:
            self.model.requires_grad_(False)
        if lora is not None:
            self._init_adapters(seed)
        self._routers = self._build_router_recorder()
        self._routing_replay = None  # enable_routing_replay
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._tied_group, self._tied_param = self._build_tied_embedding_sync()
        self.total_steps = total_steps
        self.optimizer = build_optimizer(self.model, config.optim, total_steps=total_steps) if trainable else None
        self._pipeline_stage = None  # built on first use (3d layout with pp_size > 1)
        self._token_budget = None if config.micro_batch_tokens == "auto" else config.micro_batch_tokens
        self._recorded_token_budget: int | None = None  # an auto budget restored by load_checkpoint
        self.last_batch_stats: dict[str, int] = {}
        """This rank's last batch: micro_batches, real_tokens, computed_tokens (packed, with filler),
        padded_tokens (B*S of the padded input): padding ratio = 1 - real/computed."""
        self.step = 0
        """Optimizer steps taken (the LR schedule position); restored by load_checkpoint."""

    # ----------------------------------------------------------------- setup
    def _check_model_fits(self, model: nn.Module) -> None:
        from hybridflow.models.families import family_of
        from hybridflow.parallel.tensor_parallel import validate_tp_size

        family_of(model.config, source=f"build_model() returned {type(model).__name__}")
        if not isinstance(getattr(model, "model", None), nn.Module) or not hasattr(model.model, "layers"):
            raise ValueError(f"build_model returned a {type(model).__name__}; the engine needs a Hugging Face "
                             f"decoder with `.model.layers` (Llama, Mistral or Qwen2 family)")
        validate_tp_size(model.config, self.config.tp_size)
        layout_class(self.config.layout).check_model(model, self.config, world_size())
        num_layers = len(model.model.layers)
        if self.config.pp_size > num_layers:
            raise ValueError(f"pp_size {self.config.pp_size} is larger than the model's {num_layers} layers; "
                             f"allowed: 1..{num_layers}")

    def _build_stage(self, model: nn.Module) -> nn.Module:
        # fp32 master weights whatever dtype the model was built in; compute runs in config.dtype (autocast).
        # A meta model stays on meta through sharding and is allocated shard by shard in _materialize.
        on_meta = all(p.device.type == "meta" for p in model.parameters())
        dtype = torch.float32 if self.fp32_weights else self.compute_dtype
        model.to(dtype=dtype) if on_meta else model.to(device=self.device, dtype=dtype)
        model.train()
        if self.lora is not None:
            self._add_adapters(model)
        stage = build_stage(model, head=self.head, pp_size=self.layout.pp_size, pp_rank=self.coords.pp_rank)
        if self.config.activation_checkpointing and self.trainable:
            from hybridflow.parallel.activation_checkpoint import apply_activation_checkpointing

            apply_activation_checkpointing(stage)
        return self.training_layout.shard_stage(stage, self.mesh, cpu_offload=self.config.fsdp_cpu_offload,
                                                compute_dtype=self.compute_dtype)

    def _build_router_recorder(self):
        """The recorder of router logits the load-balancing loss needs (``router_aux_loss_coef`` > 0), else None."""
        if not self.config.router_aux_loss_coef:
            return None
        from hybridflow.models.moe import RouterLogitsRecorder

        recorder = RouterLogitsRecorder(self.model)
        if not recorder.routers or self.layout.pp_size > 1:
            raise ValueError(f"engine.router_aux_loss_coef={self.config.router_aux_loss_coef} needs a mixture-of-"
                             f"experts model under pp_size 1; this model has {len(recorder.routers)} routers and "
                             f"pp_size is {self.layout.pp_size}; allowed: 0")
        return recorder

    def enable_routing_replay(self) -> None:
        """From now on a batch holding ``routed_experts`` (``hybridflow.models.moe.ROUTED_EXPERTS``: the rollout's
        routing) is computed with those experts instead of each router's own top-k (``RoutingReplay``), in
        ``forward`` and ``train_step``. ValueError for a model without MoE layers and under pipeline parallelism
        (its schedule interleaves micro-batches, so the hooks could not tell whose routing a forward needs)."""
        from hybridflow.models.moe import RoutingReplay, moe_routers

        if not moe_routers(self.model):
            raise ValueError(f"actor.routing_replay=True needs a mixture-of-experts model (Qwen3-MoE); model_type "
                             f"{self.hf_config.model_type!r} has no routers; allowed: false")
        if self.layout.pp_size > 1:
            raise ValueError(f"actor.routing_replay=True needs actor.engine.pp_size 1, got {self.layout.pp_size}; "
                             f"allowed: routing_replay false, or pp_size 1")
        self._routing_replay = RoutingReplay(self.model)

    def _replayed_routing(self, batch: dict[str, Tensor], micro: PackedMicroBatch):
        """The block in which one micro-batch's forward (and backward) routes as the batch's ``routed_experts`` say
        (a no-op block without them): the rows' real tokens packed like ``input_ids_1N``, filler unrecorded."""
        from hybridflow.models.moe import ROUTED_EXPERTS, ROUTING_PAD

        if ROUTED_EXPERTS not in batch or micro.is_filler:
            return contextlib.nullcontext()
        experts_NLK = batch[ROUTED_EXPERTS][micro.rows_b][micro.mask_bS]
        filler = micro.packed_length - experts_NLK.shape[0]
        if filler:
            experts_NLK = torch.cat([experts_NLK, experts_NLK.new_full((filler, *experts_NLK.shape[1:]), ROUTING_PAD)])
        return self._routing_replay.replaying(experts_NLK)

    def _check_routing(self, batch: dict[str, Tensor]) -> None:
        """ValueError for a batch with ``routed_experts`` this engine cannot replay (not enabled, wrong shape)."""
        from hybridflow.models.moe import ROUTED_EXPERTS

        if ROUTED_EXPERTS not in batch:
            return
        if self._routing_replay is None:
            raise ValueError(f"the batch holds {ROUTED_EXPERTS!r} but routing replay is off on this engine "
                             f"(actor.routing_replay; TrainingEngine.enable_routing_replay)")
        self._routing_replay.check(batch[ROUTED_EXPERTS], batch["input_ids"])

    def _materialize(self, weights_path: str, head_seed: int) -> None:
        from hybridflow.engine.weights import materialize_and_load

        stage = self.model
        materialize_and_load(stage, device=self.device, path=weights_path, head=self.head, seed=head_seed,
                             ties_embeddings=self.ties_embeddings)
        if self.ties_embeddings and self.layout.pp_size == 1:
            stage.lm_head.weight = stage.model.embed_tokens.weight  # to_empty allocated the two separately

    def _add_adapters(self, model: nn.Module) -> None:
        """Put the adapters in before the stage is cut and sharded (FSDP and the tensor-parallel plan must see
        them, and their frozen/trainable split): they and a value/score head (new, so it must learn) are the
        only trained parameters."""
        from hybridflow.models.heads import SCALAR_HEAD
        from hybridflow.models.lora import inject_lora, mark_trainable

        inject_lora(model, self.lora)
        mark_trainable(model, also=(SCALAR_HEAD,) if self.head != "lm" else ())

    def _init_adapters(self, seed: int) -> None:
        """Adapters start as LoRA's init, the same in every layout (``initial_adapter_weight``), set once the
        stage holds real memory."""
        from hybridflow.engine.lora import reset_adapters

        reset_adapters(self.model, seed=seed)

    @contextlib.contextmanager
    def adapters_disabled(self):
        """Inside the block the model computes as its base model (LoRA's adapters off); nothing changes without
        LoRA. The reference policy of a LoRA run (``workers/reference.py``)."""
        from hybridflow.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            yield

    @classmethod
    def from_model_config(cls, config: EngineConfig, model_config, *, head: str = "lm", seed: int = 0,
                          total_steps: int | None = None, trainable: bool = True,
                          lora: "LoraConfig | None" = None,
                          fp32_weights: bool | None = None) -> "TrainingEngine":
        """The engine of a ``ModelConfig`` under ``head``: a local checkpoint is read shard by shard onto
        meta-initialised stages (no rank ever holds the whole model); a tiny random model is built whole (it is
        tiny). ``seed`` initialises a tiny model or a new value/score head."""
        from hybridflow.models import build_model

        runtime = dict(head=head, seed=seed, total_steps=total_steps, trainable=trainable, lora=lora,
                       fp32_weights=fp32_weights)
        if model_config.path is None or not cls.meta_init_supported(config, model_config, head=head):
            return cls(config, lambda: build_model(model_config, head=head, seed=seed), **runtime)
        return cls(config, lambda: build_model(model_config, head=head, seed=seed, device="meta"),
                   weights_path=model_config.path, head_seed=seed, **runtime)

    @staticmethod
    def meta_init_supported(config: EngineConfig, model_config, *, head: str = "lm") -> bool:
        """Meta init everywhere except where the layout refuses it (a tied embedding under FSDP with several
        ranks: ``FsdpLayout.meta_init_supported``): those models are built whole, then sharded."""
        from hybridflow.models.loader import hf_config_of

        tied = head == "lm" and bool(getattr(hf_config_of(model_config, head=head), "tie_word_embeddings", False))
        return layout_class(config.layout).meta_init_supported(tied_embeddings=tied, world_size=world_size())

    def _build_tied_embedding_sync(self):
        """Under pp > 1 a tied embedding lives on the first stage (input) and the last (output head):
        each keeps a copy and their gradients are summed, like Megatron's embedding group."""
        if not self.ties_embeddings or self.layout.pp_size == 1:
            return None, None
        mine = None
        for dp_rank in range(self.layout.dp_size):
            for tp_rank in range(self.layout.tp_size):
                ranks = [self.layout.rank_of(dp_rank=dp_rank, pp_rank=p, tp_rank=tp_rank)
                         for p in (0, self.layout.pp_size - 1)]
                group = dist.new_group(ranks)  # every rank creates every group, in the same order
                if self.rank in ranks:
                    mine = group
        if self.coords.pp_rank == 0:
            return mine, self.model.model.embed_tokens.weight
        if self.is_last_stage:
            return mine, self.model.lm_head.weight
        return None, None

    def _norm_params(self) -> list[nn.Parameter]:
        """Parameters counted in the gradient norm: a tied embedding once (on the first stage)."""
        if self._tied_param is not None and self.coords.pp_rank != 0:
            return [p for p in self.params if p is not self._tied_param]
        return self.params

    def _sync_tied_embedding_gradients(self) -> None:
        if self._tied_group is None or not self._tied_param.requires_grad:
            return
        param = self._tied_param
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = local_tensor(param.grad)
        dist.all_reduce(grad, group=self._tied_group)

    @property
    def dp_group(self):
        return mesh_group(self.mesh, "dp") if self.layout.dp_size > 1 else None

    @property
    def pp_group(self):
        return mesh_group(self.mesh, "pp") if self.layout.pp_size > 1 else None

    @property
    def tp_group(self):
        return mesh_group(self.mesh, "tp") if self.layout.tp_size > 1 else None

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp_rank == self.layout.pp_size - 1

    # ----------------------------------------------------------------- batches
    @property
    def token_budget(self) -> int:
        """Real tokens one micro-batch may hold on this rank: ``micro_batch_tokens``, or what ``auto`` resolved
        to at the first batch (the same on every rank of the group: the smallest rank's; after a resume, the
        checkpoint's while it fits: ``resumed_token_budget``)."""
        if self._token_budget is None:
            self._token_budget = self._resolve_auto_budget()
        return self._token_budget

    def _resolve_auto_budget(self) -> int:
        from hybridflow.engine.token_budget import (activation_bytes_per_token, auto_token_budget, free_memory_bytes,
                                                    resumed_token_budget)

        per_token = activation_bytes_per_token(
            self.hf_config, compute_dtype=self.compute_dtype, trainable=self.trainable,
            activation_checkpointing=self.config.activation_checkpointing, tp_size=self.layout.tp_size,
            pp_size=self.layout.pp_size, lm_head=self.head == "lm")
        pending = 0
        if self.optimizer is not None and not self.optimizer.state:
            # AdamW allocates its two fp32 moments at the first step, and backward the fp32 gradients
            pending = 12 * sum(local_tensor(p).numel() for p in self.params)
        budget = auto_token_budget(per_token, free_memory_bytes(self.device), pending_bytes=pending,
                                   pipeline=self.layout.pp_size > 1)
        if dist.is_initialized() and world_size() > 1:
            # ranks that share micro-batches (tp, pp) must plan alike: every rank takes the smallest budget
            budget_t = torch.tensor(budget, device=self.device)
            dist.all_reduce(budget_t, op=dist.ReduceOp.MIN)
            budget = int(budget_t)
        return resumed_token_budget(self._recorded_token_budget, budget, pipeline=self.layout.pp_size > 1)

    def _prepare(self, batch: dict[str, Tensor],
                 group_size_rows: int) -> tuple[dict[str, Tensor], list[PackedMicroBatch], int]:
        """Move the batch to the device, plan and pack micro-batches; return (batch, packed, T)."""
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise ValueError(f"batch needs {key!r}; got keys {sorted(batch)}")
        batch = {k: (v.to(self.device) if isinstance(v, Tensor) else v) for k, v in batch.items()}
        input_ids_BS, mask_BS = batch["input_ids"], batch["attention_mask"]
        if input_ids_BS.dim() != 2 or mask_BS.shape != input_ids_BS.shape:
            raise ValueError(f"input_ids and attention_mask must both be [B, S]; got {tuple(input_ids_BS.shape)} "
                             f"and {tuple(mask_BS.shape)}")
        self._check_routing(batch)
        position_ids_BS = batch.get("position_ids")
        if position_ids_BS is None:
            position_ids_BS = default_position_ids(mask_BS)
        lengths_B = mask_BS.sum(-1)
        if bool((lengths_B == 0).any()):
            empty = (lengths_B == 0).nonzero()[:, 0].tolist()
            raise ValueError(f"batch rows {empty} have no real tokens (attention_mask all 0); every row needs "
                             f"at least one")
        num_columns = self._response_columns(batch)
        min_count = self.layout.pp_size
        token_budget = self.token_budget
        if self.config.micro_batch_tokens == "auto" and self.layout.pp_size == 1:
            # auto never refuses a batch: a group longer than the memory-sized budget runs alone
            token_budget = max(token_budget, int(lengths_B.view(-1, group_size_rows).sum(-1).max()))
        plans = plan_micro_batches(lengths_B, token_budget=token_budget,
                                   group_size=group_size_rows, min_count=min_count)
        count = max(len(plans), min_count)
        if self.training_layout.equal_micro_batch_counts and self.dp_group is not None:
            count_t = torch.tensor(count, device=self.device)
            dist.all_reduce(count_t, op=dist.ReduceOp.MAX, group=self.dp_group)
            count = int(count_t)
        plans = plans + [[] for _ in range(count - len(plans))]
        pad_to = token_budget if self.layout.pp_size > 1 else None
        packed = [pack_rows(rows, input_ids_BS, mask_BS, position_ids_BS, pad_to=pad_to) for rows in plans]
        self.last_batch_stats = {
            "token_budget": token_budget,
            "micro_batches": len(packed),
            "real_tokens": sum(m.num_real_tokens for m in packed),
            "computed_tokens": sum(m.packed_length for m in packed),
            "padded_tokens": mask_BS.numel(),
        }
        return batch, packed, num_columns

    @staticmethod
    def _response_columns(batch: dict[str, Tensor]) -> int:
        for key in ("responses", "response_mask"):
            if key in batch:
                return batch[key].shape[1]
        return batch["input_ids"].shape[1]

    def _normalisers(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Global counts over the whole mini-batch on all data-parallel ranks."""
        num_rows = batch["input_ids"].shape[0]
        token_mask = batch.get("response_mask", batch["attention_mask"])
        counts = torch.tensor([float(token_mask.sum()), float(num_rows)], dtype=torch.float64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(counts, group=self.dp_group)
        return {"num_tokens_global": counts[0].float(), "num_sequences_global": counts[1].float()}

    # ----------------------------------------------------------------- outputs
    def _outputs_of(self, head_out_1N, packed: PackedMicroBatch, outputs: tuple[str, ...],
                    num_columns: int, positions_K: Tensor | None = None, temperature: float = 1.0) -> dict[str, Tensor]:
        """Requested per-token [b, T] / per-sequence [b] outputs from the head output of one micro-batch
        (``positions_K``: the packed positions the head ran on, ``_head_positions``; None = all;
        ``temperature``: the 'lm' head's log-probs and entropy are of softmax(logits / temperature))."""
        n_real = packed.num_real_tokens
        result: dict[str, Tensor] = {}
        if self.head == "lm":
            # fp32 in chunks: the N x V logits are never upcast whole (see engine/logits.py)
            if positions_K is None:
                next_ids_N = torch.roll(packed.input_ids_1N[0, :n_real], -1)
                next_lp_N, entropy_N = token_logprobs_and_entropy(head_out_1N[0, :n_real], next_ids_N,
                                                                  want_entropy="entropy" in outputs,
                                                                  temperature=temperature)
            else:  # the head ran only where read: put its values back at their packed positions (0 elsewhere)
                next_lp_K, entropy_K = token_logprobs_and_entropy(
                    head_out_1N[0], packed.input_ids_1N[0, positions_K + 1], want_entropy="entropy" in outputs,
                    temperature=temperature)
                next_lp_N = next_lp_K.new_zeros(n_real).index_copy(0, positions_K, next_lp_K)
                entropy_N = (entropy_K.new_zeros(n_real).index_copy(0, positions_K, entropy_K)
                             if entropy_K is not None else None)
            if "logprobs" in outputs:
                result["logprobs"] = unpack_columns(shift_to_next_token(next_lp_N, packed), packed, num_columns)
            if "entropy" in outputs:
                result["entropy"] = unpack_columns(shift_to_next_token(entropy_N, packed), packed, num_columns)
        else:
            scalar_N = head_out_1N[0, :n_real].float()
            if "values" in outputs:
                result["values"] = unpack_columns(shift_to_next_token(scalar_N, packed), packed, num_columns)
            if "scores" in outputs:
                result["scores"] = last_token_values(scalar_N, packed)
        return result

    def _head_positions(self, packed: PackedMicroBatch, num_columns: int) -> Tensor | None:
        """Packed positions whose 'lm' head output is read (those that predict a token of the last
        ``num_columns`` columns: the response), or None for "every position" (other heads, filler
        micro-batches, and tensor- or pipeline-parallel layouts, whose head runs on the whole sequence)."""
        if self.head != "lm" or packed.is_filler or self.layout.tp_size > 1 or self.layout.pp_size > 1:
            return None
        columns_N = packed.mask_bS.nonzero()[:, 1]  # the column of every real packed token, in packing order
        read_N = torch.zeros(packed.num_real_tokens, dtype=torch.bool, device=columns_N.device)
        read_N[:-1] = columns_N[1:] >= packed.mask_bS.shape[1] - num_columns
        read_N[packed.sequence_starts[1:] - 1] = False  # a sequence's last token predicts nothing of its own
        return read_N.nonzero()[:, 0]

    def _check_outputs(self, outputs: tuple[str, ...]) -> tuple[str, ...]:
        allowed = OUTPUTS_OF_HEAD[self.head]
        outputs = tuple(outputs)
        bad = [name for name in outputs if name not in allowed]
        if bad or not outputs:
            raise ValueError(f"outputs {outputs} not available from head {self.head!r}; allowed: {allowed}")
        return outputs

    def _micro_batch_loss(self, head_out, packed: PackedMicroBatch, batch: dict, normalisers: dict,
                          loss_fn: LossFn, outputs: tuple[str, ...], num_columns: int, records: list,
                          positions_K: Tensor | None = None, temperature: float = 1.0):
        if packed.is_filler:
            return head_out.sum() * 0.0  # keeps collectives in step; contributes nothing
        num_rows = batch["input_ids"].shape[0]
        micro_batch = {k: v[packed.rows_b] for k, v in batch.items()
                       if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == num_rows}
        micro_batch.update(normalisers)
        loss, metrics = loss_fn(self._outputs_of(head_out, packed, outputs, num_columns, positions_K, temperature),
                                micro_batch)
        if self._routers is not None:  # this micro-batch's share of the mini-batch's tokens
            tokens = micro_batch.get("response_mask", micro_batch["attention_mask"]).sum()
            metrics = {**metrics, "router_aux_loss": self._routers.balancing_loss(packed.num_real_tokens)}
            loss = loss + self.config.router_aux_loss_coef * metrics["router_aux_loss"] * tokens / \
                micro_batch["num_tokens_global"]
        if self._routing_replay is not None and self._routing_replay.active:
            metrics = {**metrics, "routing_replay_overridden": self._routing_replay.overridden_fraction()}
        scalars = {k: float(v.detach() if isinstance(v, Tensor) else v) for k, v in metrics.items()}
        records.append((float(loss.detach()), scalars))
        return loss

    def _autocast(self):
        dtype = self.compute_dtype
        return torch.autocast(device_type(), dtype=dtype, enabled=dtype != torch.float32)

    # ----------------------------------------------------------------- training
    def train_step(self, batch: dict[str, Tensor], loss_fn: LossFn, *, outputs: tuple[str, ...] | None = None,
                   group_size: int = 1, on_non_finite: str = "raise", context: str = "",
                   temperature: float = 1.0) -> dict[str, float]:
        """Forward/backward over token-budget micro-batches, then clip, optimizer step and LR step.

        ``outputs``: what ``loss_fn`` reads (default: all outputs of the head); ``temperature``: the 'lm'
        head's log-probs and entropy are those of softmax(logits / temperature). Returns metrics
        averaged over micro-batches and data-parallel ranks, plus ``loss`` (summed over
        micro-batches and ranks: the mini-batch loss), ``grad_norm`` (before clipping) and ``lr``.
        A non-finite loss or gradient norm stops the step before the optimizer touches the
        weights: ``on_non_finite="raise"`` raises NonFiniteError naming ``context`` (e.g. the
        role), the step and the first non-finite quantity; ``"skip"`` drops the gradients and
        returns the metrics with ``skipped_non_finite = 1`` (the step counter does not advance).
        """
        check_non_finite_action(on_non_finite)
        if not self.trainable:
            raise ValueError(f"{context or 'this engine'} was built for inference only (trainable=False): it holds "
                             f"no gradients or optimizer, so train_step is not available")
        outputs = self._check_outputs(outputs or OUTPUTS_OF_HEAD[self.head])
        batch, packed, num_columns = self._prepare(batch, group_size)
        normalisers = self._normalisers(batch)
        lr = lr_at(self.step, self.config.optim, self.total_steps)
        set_lr(self.optimizer, lr)
        self.optimizer.zero_grad(set_to_none=True)
        records: list = []

        def micro_loss(head_out, index, positions_K=None) -> Tensor:
            return self._micro_batch_loss(head_out, packed[index], batch, normalisers, loss_fn, outputs,
                                          num_columns, records, positions_K, temperature)

        if self.layout.pp_size > 1:
            self._run_pipeline(packed, micro_loss, train=True)
        else:
            for index, micro in enumerate(packed):
                positions_K = self._head_positions(micro, num_columns)
                with self._replayed_routing(batch, micro):  # backward too: checkpointed layers rerun their routers
                    with self._autocast():
                        head_out = self.model(micro.input_ids_1N, micro.position_ids_1N, positions_K)
                    (micro_loss(head_out, index, positions_K) * self.training_layout.loss_scale).backward()
        self._sync_tied_embedding_gradients()
        self.training_layout.reduce_gradients(self.params, self.dp_group)
        shard_group = self.training_layout.shard_group(dp_group=self.dp_group, tp_group=self.tp_group)
        grad_norm = global_grad_norm(self._norm_params(), shard_group=shard_group, stage_group=self.pp_group)
        metrics = self._reduce_metrics(records)  # identical on every rank: all ranks take the same branch below
        metrics.update(grad_norm=float(grad_norm), lr=lr, token_budget=float(self.token_budget))
        if not all(map(math.isfinite, (metrics.get("loss", 0.0), metrics["grad_norm"]))):
            return self._stop_non_finite(metrics, on_non_finite, context)
        if self.config.optim.grad_clip is not None:
            clip_gradients(self.params, self.config.optim.grad_clip, grad_norm)
        self.optimizer.step()
        # gradients are dead until the next backward: free them now, not at the next step, so they do
        # not sit in memory through generation and scoring (a full fp32 copy of the model)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return metrics

    def _stop_non_finite(self, metrics: dict[str, float], on_non_finite: str, context: str) -> dict[str, float]:
        """A non-finite loss or gradient norm: drop the gradients, then raise or report a skipped step."""
        self.optimizer.zero_grad(set_to_none=True)
        # the loss's own terms (pg_loss, kl_loss, ...) first: they say which part went wrong
        named = {k: v for k, v in metrics.items() if k not in ("loss", "grad_norm", "lr")}
        named.update(loss=metrics.get("loss", 0.0), grad_norm=metrics["grad_norm"])
        quantity = first_non_finite(named) or "loss"
        if on_non_finite == "raise":
            where = f"{context} " if context else ""
            raise NonFiniteError(f"{where}training step {self.step}: {quantity} is {metrics.get(quantity)}; the "
                                 f"optimizer step was not taken (weights unchanged). Lower the learning rate or "
                                 f"check the loss inputs; on_non_finite='skip' drops such steps instead",
                                 quantity=quantity)
        return {**metrics, "skipped_non_finite": 1.0}

    def _reduce_metrics(self, records: list) -> dict[str, float]:
        """Loss summed, other metrics averaged over micro-batches; then over dp ranks; shared by pp stages."""
        metrics: dict[str, float] = {}
        if records:
            metrics["loss"] = sum(loss for loss, _ in records)
            for name in records[0][1]:
                metrics[name] = sum(m[name] for _, m in records) / len(records)
        if self.pp_group is not None:
            box = [metrics]
            dist.broadcast_object_list(box, group_rank_to_global(self.pp_group, self.layout.pp_size - 1),
                                       group=self.pp_group)
            metrics = box[0]
        if self.dp_group is not None:
            names = sorted(metrics)
            values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=self.device)
            dist.all_reduce(values, group=self.dp_group)
            dp_size = group_size(self.dp_group)
            metrics = {n: float(v) if n == "loss" else float(v) / dp_size for n, v in zip(names, values.tolist())}
        return metrics

    def _run_pipeline(self, packed: list[PackedMicroBatch], micro_loss, *, train: bool):
        """Run all micro-batches through the pipeline; ``micro_loss(head_out, index)`` on the last stage."""
        ids = torch.cat([m.input_ids_1N for m in packed])
        positions = torch.cat([m.position_ids_1N for m in packed])
        targets = torch.arange(len(packed), device=self.device)[:, None]

        def schedule_loss(head_out, target):
            return micro_loss(head_out, int(target[0, 0]))

        if self._pipeline_stage is None:
            self._pipeline_stage = build_pipeline_stage(
                self.model, pp_rank=self.coords.pp_rank, pp_size=self.layout.pp_size, group=self.pp_group,
                device=self.device, num_tokens=self.token_budget,
                hidden_size=self.hf_config.hidden_size, vocab_size=self.hf_config.vocab_size,
                compute_dtype=self.compute_dtype)
        schedule = build_schedule(self._pipeline_stage, num_micro_batches=len(packed), loss_fn=schedule_loss,
                                  schedule=self.config.pipeline_schedule)
        args = (ids, positions) if self.coords.pp_rank == 0 else ()
        kwargs = {"target": targets, "losses": []} if self.is_last_stage else {}
        with self._autocast():
            if train:
                schedule.step(*args, **kwargs)
            else:
                schedule.eval(*args, **kwargs)

    # ----------------------------------------------------------------- inference
    @torch.no_grad()
    def forward(self, batch: dict[str, Tensor], *, outputs: tuple[str, ...] | None = None,
                temperature: float = 1.0) -> dict[str, Tensor]:
        """Requested outputs for every row, without grad: per-token [B, T], per-sequence [B] (CPU tensors);
        the 'lm' head's log-probs and entropy are those of softmax(logits / temperature)."""
        outputs = self._check_outputs(outputs or OUTPUTS_OF_HEAD[self.head])
        batch, packed, num_columns = self._prepare(batch, 1)
        num_rows = batch["input_ids"].shape[0]
        results = {name: torch.zeros((num_rows,) if name == "scores" else (num_rows, num_columns),
                                     dtype=torch.float32, device=self.device) for name in outputs}

        def collect(head_out, index, positions_K=None) -> Tensor:
            micro = packed[index]
            if not micro.is_filler:
                for name, value in self._outputs_of(head_out, micro, outputs, num_columns, positions_K,
                                                    temperature).items():
                    results[name][micro.rows_b] = value
            return head_out.sum() * 0.0

        was_training = self.model.training
        self.model.eval()
        try:
            if self.layout.pp_size > 1:
                self._run_pipeline(packed, collect, train=False)
                last = group_rank_to_global(self.pp_group, self.layout.pp_size - 1)
                for name in outputs:
                    dist.broadcast(results[name], last, group=self.pp_group)
            else:
                for index, micro in enumerate(packed):
                    positions_K = self._head_positions(micro, num_columns)
                    with self._replayed_routing(batch, micro), self._autocast():
                        collect(self.model(micro.input_ids_1N, micro.position_ids_1N, positions_K), index, positions_K)
        finally:
            self.model.train(was_training)
        return {name: value.cpu() for name, value in results.items()}

    # ----------------------------------------------------------------- weights
    def local_shards(self) -> dict[str, Tensor]:
        """HF parameter name -> this rank's local tensor of its stage, what ``HybridEngine.to_generation`` takes:
        3d: the live tensor-parallel pieces (shared storage); fsdp: the dim-0 slices over dp, on the engine's
        device (a copy only under CPU offload). With LoRA an adapted weight is a new tensor W + scale B A (the
        trained W is never written) and the adapters themselves are left out."""
        shards = self.training_layout.local_shards(self.model, self.device)
        if self.lora is None:
            return shards
        from hybridflow.engine.lora import merge_into_shards

        return merge_into_shards(self.model, shards)

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's parameters as full CPU tensors (HF names) on global rank 0; {} elsewhere."""
        return checkpoint_io.gather_full_state_dict(self)

    def save_checkpoint(self, directory: str) -> None:
        """Save model, optimizer and step with torch.distributed.checkpoint (atomic: temp dir + rename)."""
        checkpoint_io.save_checkpoint(self, directory)

    def load_checkpoint(self, directory: str) -> None:
        """Load a checkpoint saved by save_checkpoint under any layout (DCP reshards it)."""
        checkpoint_io.load_checkpoint(self, directory)

    @property
    def resolved_auto_token_budget(self) -> int | None:
        """The budget ``micro_batch_tokens: auto`` resolved to (None before the first batch, or with a fixed
        ``micro_batch_tokens``): what a checkpoint records."""
        if self.config.micro_batch_tokens != "auto":
            return None
        return self._token_budget if self._token_budget is not None else self._recorded_token_budget

    def restore_auto_token_budget(self, recorded: int | None) -> None:
        """Keep a checkpoint's auto budget where it still fits (``resumed_token_budget``); with a fixed
        ``micro_batch_tokens`` nothing changes."""
        if self.config.micro_batch_tokens != "auto" or recorded is None:
            return
        self._recorded_token_budget = int(recorded)
        self._token_budget = None  # resolved again at the next batch, against this process's free memory

    def export_hf(self, directory: str) -> None:
        """Write a Hugging Face model directory (config.json + model.safetensors) from global rank 0; a LoRA
        model's is the merged model."""
        checkpoint_io.export_hf(self, directory)

    def export_adapter(self, directory: str, *, base_model: str | None = None) -> None:
        """Write the LoRA adapter in PEFT's format (adapter_config.json + adapter_model.safetensors)."""
        checkpoint_io.export_adapter(self, directory, base_model=base_model)
