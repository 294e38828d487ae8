"""What the driver sends a worker to build: its model, engine and role knobs (plain, picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hybridflow.algorithms.names import (KL_ESTIMATOR_NAMES, LOSS_AGGREGATION_NAMES, NON_FINITE_ACTIONS,
                                         POLICY_LOSS_NAMES)
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.generation_config import GenerationConfig, GenerationTokens
from hybridflow.engine.hybrid_engine_config import HybridEngineConfig
from hybridflow.models.config import HEADS, ModelConfig
from hybridflow.models.lora_config import LoraConfig

OLD_LOG_PROB_SOURCES = ("auto", "recompute", "rollout")
"""Values of ``actor.loss.old_log_probs``."""


@dataclass(frozen=True, kw_only=True)
class TokenizerSource:
    """Where a role's tokenizer comes from: a local directory or the built-in task's tokenizer."""

    path: str | None = None
    """Local tokenizer directory (a Hugging Face model directory works)."""
    builtin: str | None = None
    """Name of a built-in tokenizer (``arithmetic``)."""

    def __post_init__(self) -> None:
        if (self.path is None) == (self.builtin is None):
            raise ValueError(f"TokenizerSource needs exactly one of path and builtin; got path={self.path!r}, "
                             f"builtin={self.builtin!r}")

    def encodes_like(self, other: "TokenizerSource") -> bool:
        """Whether both sources give the same token ids for any text (same vocabulary, special tokens and
        chat template): then a model of one can read the other's tokens without re-tokenization."""
        if self == other:
            return True
        mine, theirs = self.load(), other.load()
        return (mine.get_vocab() == theirs.get_vocab()
                and mine.all_special_tokens == theirs.all_special_tokens
                and getattr(mine, "chat_template", None) == getattr(theirs, "chat_template", None)
                and type(mine).__name__ == type(theirs).__name__)

    def load(self):
        """The tokenizer (left padding, so prompts batch for generation)."""
        if self.builtin is not None:
            if self.builtin != "arithmetic":
                raise ValueError(f"unknown built-in tokenizer {self.builtin!r}; allowed: 'arithmetic'")
            from hybridflow.data.builtin import builtin_tokenizer

            return builtin_tokenizer()
        from hybridflow.models import load_tokenizer

        return load_tokenizer(self.path)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """One model under one engine: what every role worker builds first. ``model`` and ``engine`` are the user's
    config sections; the other fields are the run's values the trainer derives for this role."""

    model: ModelConfig
    """Which weights (local directory, tiny or built-in model) in which dtype."""
    engine: EngineConfig
    """Layout, micro-batch budget, optimizer."""
    head: str = "lm"
    """What the model ends in, from the role (``hybridflow.models.config.HEADS``): lm (actor, reference,
    likelihood reward), value (critic), score (reward and cost models)."""
    seed: int = 0
    """The run's seed (``trainer.seed``): a tiny model's weights and a new value/score head, the same on every
    rank."""
    total_steps: int | None = None
    """Optimizer steps of the whole run (the learning-rate schedule's length); None for inference-only roles."""
    lora: LoraConfig | None = None
    """The role's LoRA adapters (its section's ``lora``); None trains every weight. A frozen role refuses one."""

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"EngineSpec.head must be one of {HEADS}, got {self.head!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineSpec.seed must be an integer, got {self.seed!r}")


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The actor's update (the RL config's ``actor.loss``): objective, clip range, aggregation, KL loss, TIS."""

    ppo_epochs: int = 1
    """Passes over each step's samples."""
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    """Policy objective (``hybridflow.algorithms.POLICY_LOSSES``): ``ppo`` clipped surrogate, ``gspo``
    sequence-level ratio and clip (set its clip range to ~3e-4/4e-4), ``cispo`` clipped-IS-weight REINFORCE."""
    clip_ratio: float = 0.2
    """Symmetric ratio clip epsilon: the default of ``clip_ratio_low`` and ``clip_ratio_high``."""
    clip_ratio_low: float | None = None
    """Lower clip: ratios below 1 - low are clipped; null means ``clip_ratio``."""
    clip_ratio_high: float | None = None
    """Upper clip: ratios above 1 + high are clipped; null means ``clip_ratio``. DAPO's clip-higher: 0.28 with
    low 0.2."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become one number (``LOSS_AGGREGATIONS``): ``token-mean`` (PPO, DAPO),
    ``seq-mean-token-mean`` (DeepSeekMath's GRPO, GSPO), ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``
    (Dr. GRPO: divided by sequences x the maximum response length)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    kl_loss_estimator: Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"] = "k3"
    """Per-token estimator of KL(pi || pi_ref) in the loss when ``algorithm.kl_mode`` is ``loss`` (GRPO: k3)."""
    tis_cap: float | None = None
    """Truncated importance sampling against the rollout's (behaviour) log-probs: each token's policy loss is
    weighted by min(pi_old / pi_behaviour, tis_cap); null: off. Logs ``actor/tis_cap_fraction``."""
    old_log_probs: Literal["auto", "recompute", "rollout"] = "auto"
    """Where PPO's old log-probs (pi_old of the ratio and of the KL to the reference) come from: ``recompute``
    runs the actor's forward over the samples after the rollout; ``rollout`` takes the log-probs the rollout
    engine sampled with; ``auto`` takes them when the rollout was the native engine at fp32 (the training
    weights at the training precision and the same tempered distribution: the same numbers up to rounding, as
    TRL's PPO uses its sampler's logits) and recomputes otherwise (vLLM, bf16); with ``auto`` the forward is not
    run at all where it is provably redundant (one epoch of one mini-batch and no KL penalty in the reward, stale
    batches included: ``perf/old_log_prob_skipped``; ``kl/sequence_kl`` is then measured from the sampled
    log-probs). Logged as ``perf/old_log_prob_from_rollout``; the rollout-vs-training mismatch
    (``rollout/logprob_*``) is measured only when the forward runs."""
    on_non_finite: Literal["raise", "skip"] = "raise"
    """A NaN/inf loss or gradient norm: ``raise`` stops the run naming the role, RL step and quantity; ``skip``
    drops that optimizer step (logged as ``actor/skipped_non_finite``). The weights are never written."""
    ptx_coef: float = 0.0
    """Weight of the pretraining (ptx) next-token loss step (``update_actor_ptx``); needs ``data.ptx_path``."""

    def __post_init__(self) -> None:
        _require(isinstance(self.ppo_epochs, int) and self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs,
                 "an integer >= 1")
        _require(self.policy_loss in POLICY_LOSS_NAMES, "policy_loss", self.policy_loss, ", ".join(POLICY_LOSS_NAMES))
        _require(self.clip_ratio > 0, "clip_ratio", self.clip_ratio, "a float > 0")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            _require(value is None or value > 0, name, value, "a float > 0, or null for clip_ratio")
        _require(self.clip_low <= 1, "clip_ratio_low", self.clip_low,
                 "a float in (0, 1] (1 - low is the smallest unclipped ratio; 1: no lower bound)")
        _require(self.loss_aggregation in LOSS_AGGREGATION_NAMES, "loss_aggregation", self.loss_aggregation,
                 ", ".join(LOSS_AGGREGATION_NAMES))
        _require(self.entropy_coef >= 0, "entropy_coef", self.entropy_coef, "a float >= 0")
        _require(self.kl_loss_estimator in KL_ESTIMATOR_NAMES, "kl_loss_estimator", self.kl_loss_estimator,
                 ", ".join(KL_ESTIMATOR_NAMES))
        _require(self.tis_cap is None or self.tis_cap >= 1, "tis_cap", self.tis_cap, "a float >= 1, or null (off)")
        _require(self.old_log_probs in OLD_LOG_PROB_SOURCES, "old_log_probs", self.old_log_probs,
                 ", ".join(OLD_LOG_PROB_SOURCES))
        _require(not (self.old_log_probs == "rollout" and self.tis_cap is not None), "old_log_probs",
                 self.old_log_probs, "'auto' or 'recompute' with tis_cap set (TIS weighs the recomputed log-probs "
                 "against the rollout's; taken from the rollout, every weight would be 1)")
        _require(self.on_non_finite in NON_FINITE_ACTIONS, "on_non_finite", self.on_non_finite,
                 ", ".join(NON_FINITE_ACTIONS))
        _require(self.ptx_coef >= 0, "ptx_coef", self.ptx_coef, "a float >= 0")

    @property
    def clip_low(self) -> float:
        """The lower clip in use (``clip_ratio_low``, else ``clip_ratio``)."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        """The upper clip in use (``clip_ratio_high``, else ``clip_ratio``)."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass(frozen=True, kw_only=True)
class ValueLossConfig:
    """A critic's update (the RL config's ``critic.loss`` and ``cost.critic.loss``)."""

    ppo_epochs: int = 1
    """Passes over each step's samples."""
    value_clip: float = 0.2
    """Clip of new values around the old ones in the value loss; 0 disables clipping."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token value losses become one number (as ``actor.loss.loss_aggregation``)."""
    on_non_finite: Literal["raise", "skip"] = "raise"
    """A NaN/inf loss or gradient norm: ``raise`` (naming the role and RL step) or ``skip`` the optimizer step."""

    def __post_init__(self) -> None:
        _require(isinstance(self.ppo_epochs, int) and self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs,
                 "an integer >= 1")
        _require(self.value_clip >= 0, "value_clip", self.value_clip, "a float >= 0")
        _require(self.loss_aggregation in LOSS_AGGREGATION_NAMES, "loss_aggregation", self.loss_aggregation,
                 ", ".join(LOSS_AGGREGATION_NAMES))
        _require(self.on_non_finite in NON_FINITE_ACTIONS, "on_non_finite", self.on_non_finite,
                 ", ".join(NON_FINITE_ACTIONS))


def _require(condition: bool, key: str, value, allowed: str) -> None:
    if not condition:
        raise ValueError(f"config key {key} got {value!r}; allowed: {allowed}")


@dataclass(frozen=True, kw_only=True)
class UpdateSizes:
    """The sizes of a PPO-style update (the actor's and the critics') that come from the run, not from the
    role's loss section: the trainer takes them from ``batch`` and ``actor.generation``."""

    mini_batch_size: int = 8
    """Samples per optimizer update, global (``batch.mini_batch_size``): each data-parallel rank takes its
    share."""
    max_response_length: int | None = None
    """The constant normaliser of ``seq-mean-token-sum-norm`` (``actor.generation.max_new_tokens``); None: the
    batch's response width."""

    def __post_init__(self) -> None:
        if not isinstance(self.mini_batch_size, int) or self.mini_batch_size < 1:
            raise ValueError(f"UpdateSizes.mini_batch_size must be an integer >= 1, got {self.mini_batch_size!r}")
        if self.max_response_length is not None and (not isinstance(self.max_response_length, int)
                                                     or self.max_response_length < 1):
            raise ValueError(f"UpdateSizes.max_response_length must be an integer >= 1 or None, got "
                             f"{self.max_response_length!r}")


@dataclass(frozen=True, kw_only=True)
class ActorSpec:
    """Everything an ActorWorker builds: training engine, 3D-HybridEngine, sampling defaults, loss."""

    engine: EngineSpec
    """The policy model and its training engine."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """Generation layout (pg, tg) and resharding strategy."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling defaults; a call may override ``greedy`` and ``max_new_tokens`` and sets ``samples_per_prompt`` and
    ``seed`` (default 1 and 0)."""
    tokens: GenerationTokens = field(default_factory=GenerationTokens)
    """The actor tokenizer's EOS and pad ids and the encoded stop strings (built from the tokenizer)."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """PPO update knobs (the user's ``actor.loss``)."""
    sizes: UpdateSizes = field(default_factory=UpdateSizes)
    """The update's mini-batch size and response-length normaliser."""
    kl_loss_coef: float = 0.0
    """Weight of the KL to the reference added to the policy loss: ``algorithm.kl_coef`` when the KL goes in the
    loss (``algorithm.kl_mode`` loss, or auto for GRPO), else 0."""
    routing_replay: bool = False
    """Record the experts the rollout's routers chose and compute the old log-probs and the update with them (the
    user's ``actor.routing_replay``)."""

    def __post_init__(self) -> None:
        if not self.kl_loss_coef >= 0:
            raise ValueError(f"ActorSpec.kl_loss_coef must be a float >= 0, got {self.kl_loss_coef!r}")


@dataclass(frozen=True, kw_only=True)
class CriticSpec:
    """Everything a CriticWorker builds: a value model (the critic, or Safe-RLHF's cost critic) and its update."""

    engine: EngineSpec
    """The value-head model and its training engine."""
    loss: ValueLossConfig = field(default_factory=ValueLossConfig)
    """Value-loss knobs (the user's ``critic.loss`` or ``cost.critic.loss``)."""
    sizes: UpdateSizes = field(default_factory=UpdateSizes)
    """The update's mini-batch size and response-length normaliser (the actor's)."""


@dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """A reward (or cost) model and how to feed it the actor's text."""

    engine: EngineSpec
    """The score-head model."""
    actor_tokenizer: TokenizerSource
    """The tokenizer the actor generated with."""
    tokenizer: TokenizerSource | None = None
    """The reward model's tokenizer; None means the actor's (no re-tokenization)."""
    max_prompt_tokens: int = 1024
    """Re-tokenized prompts longer than this keep their last tokens (the reward model's context limit)."""
