"""The RL training config: one keyword-only dataclass per component, validated where it is defined.

Batch vocabulary (docs/config.md is the user-facing copy):
- ``batch.prompts_per_step``: prompts drawn from the dataset for one RL iteration;
- ``batch.samples_per_prompt``: responses generated per prompt; a step holds their product;
- ``batch.mini_batch_size``: samples per optimizer update (a step is split into several per epoch);
- ``<role>.engine.micro_batch_tokens`` (per rank): tokens one forward/backward may hold ('auto', the default:
  what half the rank's free memory holds, ``hybridflow.engine.token_budget``).
Everything else (samples per step, mini-batches per epoch, data-parallel sizes, generation replicas)
is derived into :class:`DerivedSizes`; the config itself is never written to after it is built.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from hybridflow.agents.config import EnvConfig
from hybridflow.data.config import PromptFiles
from hybridflow.engine.config import EngineConfig, OptimConfig
from hybridflow.engine.generation_config import GenerationConfig
from hybridflow.engine.hybrid_engine_config import HybridEngineConfig
from hybridflow.engine.rollout import ROLLOUT_BACKENDS, rollout_backend
from hybridflow.models.config import ModelConfig
from hybridflow.models.lora_config import LoraConfig
from hybridflow.trainers.config.algorithm import AlgorithmSection
from hybridflow.trainers.config.loader import apply_overrides, build_dataclass, load_yaml
from hybridflow.trainers.estimators import estimators_with
from hybridflow.workers.spec import PolicyLossConfig, ValueLossConfig

ACTOR_LR = 1e-6
CRITIC_LR = 1e-5
ROLES = ("actor", "reference", "critic", "reward", "cost", "cost_critic")
ROLLOUT_ROLE = "rollout"
"""The placement-only role of a generation pool of its own (asynchronous RL: ``async``, docs/async.md)."""
SCORING_AHEAD_ROLES = ("reference", "reward")
"""Frozen scoring roles that may share the rollout pool (``placement.roles``): they score each batch there right
after its generation, ahead of the trainer (pipelined mode)."""
# "package.module:function", "path/to/file.py:function" or a built-in short name (no colon)
_FUNCTION_SPEC = re.compile(r"^([^:\s]+:[A-Za-z_][\w.]*|[A-Za-z_]\w*)$")


def _finite_positive(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    """ValueError naming the key (relative to its section; the loader prefixes the path), the value and what is allowed."""
    if not condition:
        raise ValueError(f"config key {key} got {value!r}; allowed: {allowed}")


def default_engine(lr: float) -> EngineConfig:
    """A role's default engine: ``EngineConfig()`` with its own default learning rate."""
    return EngineConfig(optim=OptimConfig(lr=lr))


@dataclass(frozen=True, kw_only=True)
class ActorSection:
    """The policy: its model, training engine (with optimizer), PPO loss, sampling and generation layout."""

    model: ModelConfig
    """Initial policy weights (usually the SFT model)."""
    engine: EngineConfig = field(default_factory=lambda: default_engine(ACTOR_LR))
    """Training layout, micro-batch budget, precision and optimizer (default lr 1e-6)."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """PPO update knobs."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """Generation layout (the 3D-HybridEngine's pg, tg) and the transition strategy."""
    lora: LoraConfig | None = None
    """Train LoRA adapters instead of every weight (docs/lora.md); null: full fine-tuning. The reference is then
    the actor's own model with the adapters off (no second copy), generation gets the merged weights, checkpoints
    hold the adapters and the export is PEFT's adapter format."""
    routing_replay: bool = False
    """Mixture-of-experts models (Qwen3-MoE): routing replay (R3). The rollout records the experts every MoE layer
    chose for every token (``routed_experts``) and the actor's old log-probs and update route each token to those
    experts instead of recomputing the top-k, the router's weights recomputed for them (so the router still learns);
    the reference routes by itself. Backends native and vllm (any whose ``BackendEntry.records_routing``), pp_size 1
    (training and generation), no env or rollout pool (docs/models.md, "Routing replay")."""

    def __post_init__(self) -> None:
        for name in ("pp_size", "tp_size"):
            size, train_size = getattr(self.hybrid_engine, name), getattr(self.engine, name)
            require(train_size % size == 0, f"hybrid_engine.{name}", size,
                    f"a divisor of actor.engine.{name}={train_size}")
        # some backends run tensor-parallel generation only (vLLM: docs/generation.md, why pg > 1 is not wired up)
        backend = self.generation.backend
        require(rollout_backend(backend).pipeline_parallel or self.hybrid_engine.pp_size == 1, "hybrid_engine.pp_size",
                self.hybrid_engine.pp_size,
                f"1 with actor.generation.backend={backend} (use backend=native for pg > 1)")
        if self.routing_replay:
            self._check_routing_replay()

    def _check_routing_replay(self) -> None:
        """Routing replay needs a backend that reports its routing, and one pipeline stage on both sides."""
        backend = self.generation.backend
        recording = [name for name, entry in ROLLOUT_BACKENDS.items() if entry.records_routing]
        require(rollout_backend(backend).records_routing, "routing_replay", True,
                f"false with actor.generation.backend={backend}, which does not report the experts its routers chose; "
                f"backends that do: {', '.join(recording)}")
        require(self.hybrid_engine.pp_size == 1 and self.engine.pp_size == 1, "routing_replay", True,
                f"false unless actor.engine.pp_size and actor.hybrid_engine.pp_size are 1 (got "
                f"{self.engine.pp_size} and {self.hybrid_engine.pp_size})")


FROZEN_ROLE_LORA = ("the {role} is frozen (never trained), so it has no adapter to train; LoRA applies to the "
                    "trained roles: actor.lora, critic.lora, cost.critic.lora")
"""Why a ``lora`` key under a frozen role's section is refused (``REFUSED_KEYS``, read by the config loader)."""


@dataclass(frozen=True, kw_only=True)
class ReferenceSection:
    """The frozen reference policy for the KL penalty (defaults to the actor's initial model)."""

    REFUSED_KEYS: ClassVar[dict[str, str]] = {"lora": FROZEN_ROLE_LORA.format(role="reference") + (
        "; with actor.lora the reference is the actor's model with its adapters off")}
    """Keys a user may try here that are refused with a reason (the loader names it)."""

    model: ModelConfig | None = None
    """Reference weights; null means the actor's ``model``."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Inference layout, micro-batch budget and precision (its ``optim`` is unused)."""


@dataclass(frozen=True, kw_only=True)
class CriticSection:
    """A value model (the critic for ``gae``, or Safe-RLHF's cost critic)."""

    model: ModelConfig | None = None
    """Backbone for the value head; null means the actor's ``model``."""
    engine: EngineConfig = field(default_factory=lambda: default_engine(CRITIC_LR))
    """Training layout, micro-batch budget, precision and optimizer (default lr 1e-5: a fresh value head
    learns faster than the policy may move)."""
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    """Value-loss knobs."""
    lora: LoraConfig | None = None
    """Train LoRA adapters on the backbone (and the value head in full) instead of every weight; null: full
    fine-tuning (docs/lora.md)."""


@dataclass(frozen=True, kw_only=True)
class RewardSection:
    """The reward: a reward model, a rule-based function, or a weighted sum of both."""

    REFUSED_KEYS: ClassVar[dict[str, str]] = {"lora": FROZEN_ROLE_LORA.format(role="reward model")}
    """Keys a user may try here that are refused with a reason (the loader names it)."""

    model: ModelConfig | None = None
    """Reward model (a backbone with a score head, or a causal LM for ``model_type: likelihood``); null for
    rule-based only."""
    model_type: Literal["score_head", "likelihood"] = "score_head"
    """``score_head``: a scalar head at the last token (``hybridflow rm`` default); ``likelihood``: the reward is
    the response's summed token log-probs under the model (``hybridflow rm reward_type=likelihood``), credited
    token by token."""
    model_weight: float = 1.0
    """Weight of the reward model's score in the total reward."""
    function: str | None = None
    """Rule-based reward ``module:function`` (prompt, response, row fields -> float); ``module`` may live in
    the working directory; ``file.py:function`` and built-in names (math, code, arithmetic) work too."""
    function_weight: float = 1.0
    """Weight of the function's reward in the total reward."""
    function_timeout_s: float = 300.0
    """Seconds one batch of the reward function may take; past it the step fails with an error naming the
    function and the samples still running (a function that never returns cannot hang training)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Inference layout, micro-batch budget and precision of the reward model (its ``optim`` is unused)."""

    def __post_init__(self) -> None:
        require(self.model_type in ("score_head", "likelihood"), "model_type", self.model_type,
                "'score_head' or 'likelihood'")
        if self.function is not None:
            require(bool(_FUNCTION_SPEC.match(self.function)), "function", self.function,
                     "'package.module:function', 'file.py:function' or a built-in name (math, code, arithmetic)")
        require(_finite_positive(self.function_timeout_s), "function_timeout_s", self.function_timeout_s,
                "a number of seconds > 0")


@dataclass(frozen=True, kw_only=True)
class EnvSection(EnvConfig):
    """Multi-turn episodes (docs/agents.md): the environment's keys plus how the RL step runs and records them."""

    record_every: int = 0
    """Every N steps, append ``record_episodes`` of the step's episodes (the whole conversation, the token ids
    and the loss mask) to ``output_dir/episodes.jsonl``; 0: never."""
    record_episodes: int = 4
    """Episodes recorded per recording step (the first ones of the batch)."""
    decode_chunk_tokens: int = 32
    """Tokens the rollout decodes between two looks at the environments: smaller lets an episode whose tool
    returned start its next turn sooner, larger decodes longer batches (the native backend prefills again each
    chunk)."""
    env_threads: int = 16
    """Threads that run the environments' ``start`` and ``step`` (and so their tools) concurrently."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, least in (("record_every", 0), ("record_episodes", 1), ("decode_chunk_tokens", 1),
                            ("env_threads", 1)):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= least, name, value,
                    f"an integer >= {least}")


@dataclass(frozen=True, kw_only=True)
class CostSection:
    """Safe-RLHF (Dai et al. 2024): a cost model, its critic, and the Lagrange multiplier of E[cost] <= limit."""

    REFUSED_KEYS: ClassVar[dict[str, str]] = {"lora": FROZEN_ROLE_LORA.format(role="cost model")}
    """Keys a user may try here that are refused with a reason (the loader names it)."""

    model: ModelConfig
    """The cost model: a backbone with a score head (what ``hybridflow rm`` exports), read at the last token."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Inference layout, micro-batch budget and precision of the cost model (its ``optim`` is unused)."""
    critic: CriticSection = field(default_factory=CriticSection)
    """The cost critic (a second value model, regressing the cost returns); its ``model`` null means the actor's."""
    limit: float = 0.0
    """Cost limit d of the constraint E[cost] <= d (the mean cost per response)."""
    lambda_init: float = 1.0
    """Initial Lagrange multiplier lambda (> 0; it is kept positive through its log)."""
    lambda_lr: float = 0.1
    """Step size of the dual ascent on log(lambda)."""
    lambda_max: float | None = None
    """Upper bound on lambda (the paper's lambda_max); null for none."""

    def __post_init__(self) -> None:
        require(math.isfinite(self.limit), "limit", self.limit, "a finite float")
        require(math.isfinite(self.lambda_init) and self.lambda_init > 0, "lambda_init", self.lambda_init,
                "a finite float > 0")
        require(math.isfinite(self.lambda_lr) and self.lambda_lr > 0, "lambda_lr", self.lambda_lr,
                "a finite float > 0")
        if self.lambda_max is not None:
            require(self.lambda_max > 0, "lambda_max", self.lambda_max, "a float > 0 or null")
            require(self.lambda_init <= self.lambda_max, "lambda_init", self.lambda_init,
                    f"a float <= lambda_max = {self.lambda_max}")


@dataclass(frozen=True, kw_only=True)
class DataSection(PromptFiles):
    """Prompt datasets (the shared prompt-file keys plus the RL-only ones)."""

    ptx_path: str | None = None
    """jsonl/parquet of prompt/response rows for the ptx next-token loss (``actor.loss.ptx_coef`` > 0)."""
    max_ptx_response_tokens: int = 256
    """ptx rows with longer responses are dropped (counted in a warning)."""
    shuffle: bool = True
    """Shuffle the prompts every epoch (seeded by ``trainer.seed``)."""


@dataclass(frozen=True, kw_only=True)
class BatchSection:
    """The batch vocabulary of one RL step (see the module docstring)."""

    prompts_per_step: int = 8
    """Prompts drawn from the dataset for one RL iteration."""
    samples_per_prompt: int = 1
    """Responses generated per prompt (at least 2 for the group estimators grpo, dr_grpo and rloo)."""
    mini_batch_size: int = 8
    """Samples per optimizer update."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt", "mini_batch_size"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "an integer >= 1")
        samples = self.prompts_per_step * self.samples_per_prompt
        require(samples % self.mini_batch_size == 0, "mini_batch_size", self.mini_batch_size,
                 f"a divisor of prompts_per_step * samples_per_prompt = {samples}")


RUNTIMES = ("auto", "ray", "local")
"""``placement.runtime`` values (``controller.runtime_mode`` applies them)."""


@dataclass(frozen=True, kw_only=True)
class PlacementSection:
    """Which devices each role runs on. Roles on the same pool are colocated."""

    pools: dict[str, list[int]] = field(default_factory=lambda: {"global": [1]})
    """Pool name -> devices (GPUs, or CPU slots) per node."""
    roles: dict[str, str] = field(default_factory=dict)
    """Role (actor, reference, critic, reward, cost, cost_critic) -> pool name; roles left out go to the first pool.
    ``rollout`` -> a pool of its own gives generation its own processes (docs/async.md); left out, the actor
    generates itself through the 3D-HybridEngine. Only ``reference`` and ``reward`` may share the rollout pool
    (pipelined mode): they then score each batch there ahead of the trainer."""
    mapping: Literal["manual", "auto"] = "manual"
    """``auto``: the pools' devices form the cluster and hybridflow.mapping picks pools, roles and parallel sizes;
    with ``async.max_staleness`` k >= 1 also whether a rollout pool of its own (pipelined with staleness k, with
    or without the reference and reward model scoring ahead on it) beats the synchronous placements
    (docs/async.md, "Placement")."""
    hardware: str = "local"
    """Hardware profile for ``mapping: auto``: ``local`` (this machine as ``hybridflow calibrate`` measured it:
    cpu-local or cuda-local; an error until it has run), a built-in name (a100-80g, ...) or a JSON file."""
    runtime: Literal["auto", "ray", "local"] = "auto"
    """Where the workers run. ``ray``: Ray actors, one process per device slot. ``local``: every role inside the
    driver's process (one rank per pool; what ``--local`` does). ``auto``: ``local`` when the run is one process
    anyway (one pool of one device on one node) and the driver is not connected to a Ray cluster (no
    ``ray.init()`` before, no RAY_ADDRESS, no ``ray start`` on this machine); ``ray`` otherwise. A one-process
    run on Ray would pay Ray's start-up and memory for nothing (docs/controller.md, "Single-process mode")."""

    def __post_init__(self) -> None:
        require(len(self.pools) > 0, "pools", self.pools, "at least one pool")
        for name, counts in self.pools.items():
            require(len(counts) > 0 and all(count >= 1 for count in counts), f"pools.{name}", counts,
                     "a non-empty list of positive device counts per node")
        require(self.runtime in RUNTIMES, "runtime", self.runtime, ", ".join(RUNTIMES))
        for role, pool in self.roles.items():
            require(role in ROLES + (ROLLOUT_ROLE,), "roles", role, ", ".join(ROLES + (ROLLOUT_ROLE,)))
            require(pool in self.pools, f"roles.{role}", pool, ", ".join(self.pools))
        if ROLLOUT_ROLE in self.roles:
            require(self.mapping == "manual", "mapping", self.mapping,
                    "'manual' with roles.rollout (with mapping 'auto' the planner sizes the rollout pool itself when "
                    "async.max_staleness >= 1: leave roles.rollout out; docs/async.md, \"Placement\")")
            shared = sorted(role for role in ROLES if self.pool_of(role) == self.roles[ROLLOUT_ROLE]
                            and role not in SCORING_AHEAD_ROLES)
            require(not shared, "roles.rollout", self.roles[ROLLOUT_ROLE],
                    f"a pool no trained role uses (it holds {', '.join(shared)}; only "
                    f"{' and '.join(SCORING_AHEAD_ROLES)} may share it); without a pool of its own the actor "
                    "generates itself: leave rollout out")

    @property
    def scoring_ahead(self) -> tuple[str, ...]:
        """The frozen scoring roles placed on the rollout pool: they score a batch there as soon as it is generated
        (docs/async.md, "Scoring ahead on the rollout pool")."""
        pool = self.rollout_pool
        return tuple(role for role in SCORING_AHEAD_ROLES if pool is not None and self.roles.get(role) == pool)

    @property
    def rollout_pool(self) -> str | None:
        """The pool of the generation replicas when they have their own (the ``rollout`` role), else None."""
        return self.roles.get(ROLLOUT_ROLE)

    def pool_of(self, role: str) -> str:
        """The pool a role runs on."""
        return self.roles.get(role, next(iter(self.pools)))

    def pool_size(self, pool: str) -> int:
        """Devices in a pool over all nodes."""
        return sum(self.pools[pool])


ASYNC_MODES = ("pipelined", "streaming")
"""``async.mode`` values (docs/async.md "Modes")."""


@dataclass(frozen=True, kw_only=True)
class AsyncSection:
    """Asynchronous RL (docs/async.md): generation on the rollout pool overlapping the trainer's updates.

    The YAML key is ``async``; the Python attribute is ``RLConfig.asynchrony`` (``async`` is a keyword)."""

    max_staleness: int = 0
    """k: a batch may be generated by a policy up to k updates older than the one it trains. 0: today's
    synchronous step. With k >= 1, ``placement.roles.rollout`` must name a pool of its own, or
    ``placement.mapping: auto`` chooses one (or a synchronous placement, which sets k to 0)."""
    mode: Literal["pipelined", "streaming"] = "pipelined"
    """``pipelined`` (deterministic): batch i is generated by policy version max(0, i - 1 - k) (version v = the
    policy after v RL steps), so a run is reproducible from its seed and a resume equals an uninterrupted run.
    ``streaming``: the replicas keep k x ``batch.prompts_per_step`` prompts in flight as requests, take
    new weights between decode rounds (a response may span versions), and a prompt's group is trained once all
    its samples finished, if its oldest token is at most k versions old (else it is generated again); not
    reproducible from the seed. Needs k >= 1 and a backend that takes weights in flight (native, vllm)."""
    stream_decode_tokens: int = 8
    """``streaming``: tokens each request in flight decodes per round on its replica; new requests join and new
    weights arrive between rounds (smaller: fresher weights and finer admission, more calls and prefills)."""
    verify_weights: bool = True
    """After each weight sync every rollout replica checks the version and an exact checksum of every tensor it
    holds against the trainer's; a mismatch stops the run naming the tensor and the replica."""

    def __post_init__(self) -> None:
        require(isinstance(self.max_staleness, int) and not isinstance(self.max_staleness, bool)
                and self.max_staleness >= 0, "max_staleness", self.max_staleness, "an integer >= 0 (0: synchronous)")
        require(self.mode in ASYNC_MODES, "mode", self.mode, ", ".join(ASYNC_MODES))
        require(isinstance(self.stream_decode_tokens, int) and not isinstance(self.stream_decode_tokens, bool)
                and self.stream_decode_tokens >= 1, "stream_decode_tokens", self.stream_decode_tokens,
                "an integer >= 1")
        if self.mode == "streaming":
            require(self.max_staleness >= 1, "max_staleness", self.max_staleness,
                    "an integer >= 1 with async.mode=streaming (0 is the synchronous step: use mode pipelined)")

    @property
    def streaming(self) -> bool:
        """Whether the rollout pool streams requests with weights updated in flight (``mode: streaming``)."""
        return self.mode == "streaming"


@dataclass(frozen=True, kw_only=True)
class TrainerSection:
    """Loop length, seeding, logging, validation and checkpoints."""

    total_steps: int = 10
    """RL iterations to run."""
    seed: int = 0
    """Seeds data order, model init (built-in models) and sampling."""
    val_every: int = 0
    """Validate every N steps (and after the last); 0 disables; > 0 needs ``data.val_path``."""
    val_function: str | None = None
    """A rule function also scoring the validation responses (e.g. an exact checker), logged as ``val/function_mean``."""
    val_before_train: bool = True
    """With validation configured (``val_every`` > 0 and ``data.val_path``), validate once before the first
    step and log it as step 0: the starting score."""
    save_every: int = 0
    """Checkpoint every N steps (and after the last); 0 disables."""
    keep_last: int = 0
    """Keep only the newest N checkpoints (older ones are deleted after each save); 0 keeps every one."""
    keep_best: str | None = None
    """A validation metric (e.g. ``val/function_mean``): each time it reaches a new best, the trained models are
    exported as Hugging Face directories under ``output_dir/best`` (``best/best.json`` names the step); null: off."""
    keep_best_mode: Literal["max", "min"] = "max"
    """Whether a larger (``max``) or smaller (``min``) ``keep_best`` metric is better."""
    output_dir: str = "runs/hybridflow"
    """Metrics (JSONL, TensorBoard), checkpoints and the exported models (``output_dir/final/<role>``) go here."""
    resume: bool = True
    """Continue from the newest complete checkpoint in ``output_dir`` (announced on stdout). A directory holding a
    run without a checkpoint, or ``resume: false`` on a directory holding a run, is refused unless ``overwrite``."""
    overwrite: bool = False
    """Delete the previous run in ``output_dir`` (checkpoints, metrics, models; each named on stdout) and start
    over; without it a new run never writes into a directory holding another run."""
    save_on_signal: bool = False
    """On SIGINT or SIGTERM, finish the current step and save a checkpoint before stopping (a second signal
    stops at once); without it the run stops at once, naming the last checkpoint."""
    allow_config_change: bool = False
    """Resume even when the config differs from the checkpoint's in more than the loop keys (``total_steps``,
    ``val_every``, ``save_every``, logging, ...); without it such a resume is refused with the differences listed."""
    progress_bar: bool = True
    """Show a tqdm progress bar when stderr is a terminal; otherwise (CI, nohup, files) one line every
    ``log_every`` steps."""
    progress_every_s: float = 30.0
    """Off a terminal: while a long phase runs (loading the models, validation, a step's generation, scoring and
    update, the export), print what it is and how long it has run every this many seconds (a bar on a terminal)."""
    log_every: int = 1
    """When stderr is not a terminal (or ``progress_bar`` is false): print one metrics line every N steps."""
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    """Where the metrics go: any of jsonl (``output_dir/metrics.jsonl``, always written: resume and plots read
    it), tensorboard (``output_dir/tensorboard``), wandb, mlflow, trackio (through their own libraries, the
    ``loggers`` extra: ``pip install 'hybridflow[loggers]'``). Each gets the config, every step's metrics and,
    where the library has tables (wandb, mlflow, trackio), a table of sampled episodes (docs/diagnostics.md)."""
    project: str | None = None
    """The W&B / trackio project and MLflow experiment name; null: ``wandb_project``, else ``hybridflow``."""
    mlflow_tracking_uri: str | None = None
    """MLflow's tracking store (``file:///path``, ``http://host:5000``); null: $MLFLOW_TRACKING_URI, else a file
    store in ``output_dir/mlruns``."""
    episodes_per_log: int = 8
    """Rows of each step's sampled-episodes table (prompt, response, reward) for the loggers that have tables."""
    tensorboard: bool = True
    """False turns the tensorboard logger off (the older switch; ``loggers`` is the newer one)."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (adds wandb to ``loggers``); null: off."""
    worker_timeout_s: float = 3600.0
    """Seconds one worker call (a generation, an update, ...) may take before the run fails with an error
    naming the role, method and the ranks still running (a frozen worker cannot hang the run)."""
    warn_no_signal_steps: int = 3
    """Warn (naming the likely causes, docs/diagnostics.md) when every group's samples got the same reward for
    this many steps in a row: a group estimator then learns nothing; 0: never warn."""
    watchdog_s: float = 120.0
    """While a worker call runs longer than this, log every this many seconds which role, method and
    ranks it is waiting for."""

    def __post_init__(self) -> None:
        require(self.total_steps >= 1, "total_steps", self.total_steps, "an integer >= 1")
        require(self.val_every >= 0, "val_every", self.val_every, "an integer >= 0")
        require(self.save_every >= 0, "save_every", self.save_every, "an integer >= 0")
        require(self.keep_last >= 0, "keep_last", self.keep_last, "an integer >= 0 (0 keeps every checkpoint)")
        require(self.log_every >= 1, "log_every", self.log_every, "an integer >= 1")
        require(_finite_positive(self.progress_every_s), "progress_every_s", self.progress_every_s,
                "a number of seconds > 0")
        from hybridflow.trainers.loggers import LOGGER_NAMES

        for name in self.loggers:
            require(name in LOGGER_NAMES, "loggers", self.loggers, f"a list of {', '.join(LOGGER_NAMES)}")
        require(self.episodes_per_log >= 0, "episodes_per_log", self.episodes_per_log, "an integer >= 0")
        require(self.warn_no_signal_steps >= 0, "warn_no_signal_steps", self.warn_no_signal_steps,
                "an integer >= 0 (0: never warn)")
        require(_finite_positive(self.worker_timeout_s), "worker_timeout_s", self.worker_timeout_s,
                "a number of seconds > 0")
        require(_finite_positive(self.watchdog_s), "watchdog_s", self.watchdog_s, "a number of seconds > 0")
        require(self.keep_best_mode in ("max", "min"), "keep_best_mode", self.keep_best_mode, "'max' or 'min'")
        if self.keep_best is not None:
            require(self.keep_best.startswith("val/") and self.val_every > 0, "keep_best", self.keep_best,
                    "a validation metric name (val/score_mean, val/function_mean, ...) with val_every > 0, or null")
        if self.val_function is not None:
            require(bool(_FUNCTION_SPEC.match(self.val_function)), "val_function", self.val_function,
                     "'package.module:function', 'file.py:function' or a built-in name (math, code, arithmetic)")


@dataclass(frozen=True, kw_only=True)
class DerivedSizes:
    """Values computed from the config; stored here, never written back into it."""

    samples_per_step: int
    """prompts_per_step * samples_per_prompt."""
    mini_batches_per_epoch: int
    """samples_per_step / mini_batch_size."""
    dp_sizes: dict[str, int]
    """Data-parallel size per role: pool devices / (pp_size * tp_size)."""
    generation_replicas: int
    """Actor generation replicas: actor pool devices / (generation pp * tp). They need not divide the prompts
    per step: the generation dispatch pads the prompts with repeated rows and drops their samples."""


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """A whole RL training run (PPO, GRPO, ReMax, ...)."""

    data: DataSection
    """Prompt datasets."""
    actor: ActorSection
    """The policy."""
    reward: RewardSection
    """Reward model and/or rule-based reward."""
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    """The KL reference."""
    critic: CriticSection = field(default_factory=CriticSection)
    """The value model (ignored by critic-free estimators)."""
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    """Advantages and KL."""
    batch: BatchSection = field(default_factory=BatchSection)
    """Batch vocabulary."""
    placement: PlacementSection = field(default_factory=PlacementSection)
    """Pools and role placement."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    """Loop, logging, checkpoints."""
    cost: CostSection | None = None
    """Safe-RLHF's cost model, cost critic and Lagrange multiplier; null for plain (unconstrained) RL."""
    env: EnvSection | None = None
    """Multi-turn episodes with tools (docs/agents.md); null: one response per prompt, scored by ``reward``."""
    asynchrony: AsyncSection = field(default_factory=AsyncSection, metadata={"key": "async"})
    """Asynchronous RL: bounded staleness on a rollout pool of its own (docs/async.md)."""

    def __post_init__(self) -> None:
        self._check_reward_source()
        if self.actor.loss.ptx_coef > 0:
            require(self.data.ptx_path is not None, "actor.loss.ptx_coef", self.actor.loss.ptx_coef,
                     "0 unless data.ptx_path is set")
        estimator = self.algorithm.estimator
        if self.cost is not None:
            # Safe-RLHF's cost advantages come from the cost critic through the same estimator as the reward's.
            require(estimator.needs_critic, "algorithm.advantage_estimator", self.algorithm.advantage_estimator,
                    f"{' or '.join(map(repr, estimators_with('needs_critic')))} when a cost section is set (Safe-RLHF "
                    "trains a cost critic; remove cost or use an estimator with a critic)")
        groups = ", ".join(estimators_with("group_based"))
        if self.algorithm.dynamic_sampling:
            require(estimator.group_based, "algorithm.dynamic_sampling", True,
                    f"false unless advantage_estimator is a group estimator ({groups})")
            require(self.batch.samples_per_prompt >= 2, "algorithm.dynamic_sampling", True,
                    "false unless batch.samples_per_prompt >= 2 (a group of one always ties)")
        if estimator.group_based:
            require(self.batch.samples_per_prompt >= 2, "batch.samples_per_prompt", self.batch.samples_per_prompt,
                    f"an integer >= 2 with algorithm.advantage_estimator={self.algorithm.advantage_estimator!r} "
                    f"(its baseline is the mean over each prompt's group of samples; a group of one has none)")
        if self.trainer.val_every > 0:
            require(self.data.val_path is not None, "trainer.val_every", self.trainer.val_every,
                    "0 unless data.val_path is set (validation needs held-out prompts)")
        max_new_tokens = self.actor.generation.max_new_tokens
        require(self.algorithm.overlong_buffer_length <= max_new_tokens, "algorithm.overlong_buffer_length",
                self.algorithm.overlong_buffer_length,
                f"an integer <= actor.generation.max_new_tokens = {max_new_tokens}")
        self._check_lora_reference()
        # with mapping auto, k >= 1 lets the planner choose a rollout pool: the run must allow one
        may_split = self.placement.mapping == "auto" and self.asynchrony.max_staleness > 0
        if self.asynchrony.max_staleness > 0:
            require(self.placement.rollout_pool is not None or may_split, "async.max_staleness",
                    self.asynchrony.max_staleness,
                    "0 unless placement.roles.rollout names a pool of its own (stale batches are generated there "
                    "while the actor trains) or placement.mapping is 'auto' (the planner chooses)")
        if self.actor.routing_replay:
            require(self.env is None and self.placement.rollout_pool is None, "actor.routing_replay", True,
                    "false with env.class or placement.roles.rollout (episodes run on rollout requests, which do not "
                    "record routing, and a rollout pool's replicas do not record it either)")
        if self.placement.rollout_pool is not None or may_split:
            require(not self.algorithm.dynamic_sampling, "algorithm.dynamic_sampling", True,
                    "false with placement.roles.rollout (the pipelined schedule draws one batch per step)")
            require(not estimator.baseline_generation, "algorithm.advantage_estimator",
                    self.algorithm.advantage_estimator,
                    "an estimator without a greedy baseline generation with placement.roles.rollout")
            require(self.actor.lora is None, "actor.lora", "a section",
                    "null with placement.roles.rollout (the rollout pool receives whole weights, not adapters)")
            require(not (self.asynchrony.streaming and self.placement.scoring_ahead), "async.mode",
                    self.asynchrony.mode, f"'pipelined' with {' and '.join(self.placement.scoring_ahead)} on the "
                    "rollout pool (they score there ahead of the trainer on the pipelined schedule)")
            require(not self.asynchrony.streaming or self.env is None, "env", "a section",
                    "null with async.mode=streaming (the streaming driver generates single responses)")
            backend = self.actor.generation.backend
            require(not self.asynchrony.streaming or rollout_backend(backend).in_flight_weights,
                    "actor.generation.backend", backend, "a backend that takes new weights between decode steps "
                    "with async.mode=streaming: " + ", ".join(
                        name for name, entry in ROLLOUT_BACKENDS.items() if entry.in_flight_weights))
        self.derived()  # raises on inconsistent sizes before any worker starts

    def _check_reward_source(self) -> None:
        """The reward comes from a reward model and/or function, or from the environment (``env``)."""
        reward = self.reward
        if self.env is None:
            require(reward.model is not None or reward.function is not None, "reward.model", None,
                    "a reward model, a reward function, or both (reward.model / reward.function), or an env.class")
            return
        require(reward.function is None, "reward.function", reward.function,
                "null with env.class: the environment gives the episode's rewards (a reward function "
                "becomes a one-turn environment with hybridflow.agents.RewardFunctionEnvironment)")
        backend = self.actor.generation.backend
        require(rollout_backend(backend).requests, "actor.generation.backend", backend,
                "a backend that implements requests with env.class (episodes run on them): "
                + ", ".join(name for name, entry in ROLLOUT_BACKENDS.items() if entry.requests))
        hybrid = self.actor.hybrid_engine
        require(hybrid.tp_size == 1 and hybrid.pp_size == 1, "actor.hybrid_engine.tp_size", hybrid.tp_size,
                "1 (and pp_size 1) with env.class: every rank of a generation replica would run the "
                "environments, whose tools need not agree across ranks")
        require(not self.algorithm.dynamic_sampling, "algorithm.dynamic_sampling", True,
                "false with env.class (dynamic sampling draws single-turn rounds)")

    def _check_lora_reference(self) -> None:
        """With actor.lora the reference is the actor's own model with the adapters off, computed in the actor's
        processes: a separate reference model or pool would be a second copy the adapter was meant to avoid."""
        if self.actor.lora is None or "reference" not in self.active_roles:
            return
        require(self.reference.model is None, "reference.model", "<set>",
                "null with actor.lora (the reference is the actor's base model with the adapters switched off; "
                "train without actor.lora to score against another model)")
        actor_pool = self.placement.pool_of("actor")
        require(self.placement.pool_of("reference") == actor_pool, "placement.roles.reference",
                self.placement.pool_of("reference"),
                f"the actor's pool {actor_pool!r} with actor.lora (the reference runs in the actor's processes)")

    @property
    def active_roles(self) -> tuple[str, ...]:
        """Roles with a worker group in this run."""
        roles = ["actor"]
        if self.algorithm.kl_mode != "none":
            roles.append("reference")
        if self.algorithm.uses_critic:
            roles.append("critic")
        if self.reward.model is not None:
            roles.append("reward")
        if self.cost is not None:
            roles.extend(("cost", "cost_critic"))
        return tuple(roles)

    @staticmethod
    def section_key(role: str) -> str:
        """The config key of a role's section (``cost_critic``'s is ``cost.critic``; the others are their names)."""
        return "cost.critic" if role == "cost_critic" else role

    def section_of(self, role: str):
        """A role's config section (model, engine, ...)."""
        section = self
        for name in self.section_key(role).split("."):
            section = getattr(section, name)
        return section

    def engine_of(self, role: str) -> EngineConfig:
        """The engine section of a role (with actor.lora the reference runs on the actor's engine)."""
        if role == "reference" and self.actor.lora is not None:
            return self.actor.engine
        return self.section_of(role).engine

    def derived(self) -> DerivedSizes:
        """Check the sizes against each other and return the derived ones."""
        samples = self.batch.prompts_per_step * self.batch.samples_per_prompt
        dp_sizes = {}
        for role in self.active_roles:
            engine, pool = self.engine_of(role), self.placement.pool_of(role)
            devices, model_parallel = self.placement.pool_size(pool), engine.pp_size * engine.tp_size
            require(devices % model_parallel == 0, f"{self.section_key(role)}.engine.tp_size", engine.tp_size,
                     f"pp_size * tp_size = {model_parallel} must divide the {devices} devices of pool {pool!r}")
            require(devices % engine.ep_size == 0, f"{self.section_key(role)}.engine.ep_size", engine.ep_size,
                     f"a divisor of the {devices} devices of pool {pool!r}")
            dp_sizes[role] = devices // model_parallel
            require(samples % dp_sizes[role] == 0, "batch.prompts_per_step", self.batch.prompts_per_step,
                     f"a value making samples per step ({samples}) divisible by {role}'s data-parallel "
                     f"size {dp_sizes[role]}")
        for role in ("actor", "critic", "cost_critic"):
            if role in dp_sizes:
                require(self.batch.mini_batch_size % dp_sizes[role] == 0, "batch.mini_batch_size",
                         self.batch.mini_batch_size, f"a multiple of {role}'s data-parallel size {dp_sizes[role]}")
        hybrid = self.actor.hybrid_engine
        # No rule ties the prompts to the generation replicas: the generation dispatch (3D_ALL_MICRO_DP) pads
        # the prompts to a multiple of the replicas with repeated rows and drops those rows' samples on
        # collect, so every replica count works (the padded rows cost generation time, nothing else).
        replicas = self.placement.pool_size(self.placement.pool_of("actor")) // (hybrid.pp_size * hybrid.tp_size)
        return DerivedSizes(samples_per_step=samples, mini_batches_per_epoch=samples // self.batch.mini_batch_size,
                            dp_sizes=dp_sizes, generation_replicas=replicas)


def load_rl_config(path: str | Path | None, overrides: list[str] = ()) -> RLConfig:
    """Build an :class:`RLConfig` from a YAML file (or nothing) and ``key=value`` overrides."""
    data = load_yaml(path) if path is not None else {}
    return build_dataclass(RLConfig, apply_overrides(data, overrides, RLConfig))
