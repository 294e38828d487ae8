"""What the driver sends a worker to build: its model, engine and role knobs (plain, picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.engine.config import EngineConfig
from hybridflow.engine.generation import GenerationConfig
from hybridflow.engine.hybrid_engine import HybridEngineConfig
from hybridflow.models.config import ModelConfig


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
    """One model under one engine: what every role worker builds first."""

    model: ModelConfig
    """Which weights and which head (lm, value, score)."""
    engine: EngineConfig
    """Layout, micro-batch budget, optimizer."""


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The actor's PPO update (the RL config's ``actor.loss``)."""

    ppo_epochs: int = 1
    """Passes over each step's samples."""
    clip_ratio: float = 0.2
    """PPO ratio clip epsilon."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the policy loss."""
    ptx_coef: float = 0.0
    """Weight of the pretraining (ptx) next-token loss step (``update_actor_ptx``); needs ``data.ptx_path``."""
    mini_batch_size: int = field(default=8, metadata={"derived": "batch.mini_batch_size"})
    """Samples per optimizer update (global; each data-parallel rank takes its share)."""
    kl_loss_coef: float = field(default=0.0, metadata={"derived": "algorithm.kl_coef when algorithm.kl_mode is loss"})
    """Weight of the low-variance KL to the reference added to the loss (``kl_mode: loss``)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.ppo_epochs, int) and self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs,
                 "an integer >= 1")
        _require(self.clip_ratio > 0, "clip_ratio", self.clip_ratio, "a float > 0")
        _require(self.entropy_coef >= 0, "entropy_coef", self.entropy_coef, "a float >= 0")
        _require(self.ptx_coef >= 0, "ptx_coef", self.ptx_coef, "a float >= 0")
        _require(self.mini_batch_size >= 1, "mini_batch_size", self.mini_batch_size, "an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class ValueLossConfig:
    """A critic's update (the RL config's ``critic.loss`` and ``cost.critic.loss``)."""

    ppo_epochs: int = 1
    """Passes over each step's samples."""
    value_clip: float = 0.2
    """Clip of new values around the old ones in the value loss; 0 disables clipping."""
    mini_batch_size: int = field(default=8, metadata={"derived": "batch.mini_batch_size"})
    """Samples per optimizer update (global)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.ppo_epochs, int) and self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs,
                 "an integer >= 1")
        _require(self.value_clip >= 0, "value_clip", self.value_clip, "a float >= 0")
        _require(self.mini_batch_size >= 1, "mini_batch_size", self.mini_batch_size, "an integer >= 1")


def _require(condition: bool, key: str, value, allowed: str) -> None:
    if not condition:
        raise ValueError(f"config key {key} got {value!r}; allowed: {allowed}")


@dataclass(frozen=True, kw_only=True)
class ActorSpec:
    """Everything an ActorWorker builds: training engine, 3D-HybridEngine, sampling defaults, loss."""

    engine: EngineSpec
    """The policy model and its training engine."""
    hybrid_engine: HybridEngineConfig = field(default_factory=HybridEngineConfig)
    """Generation layout (pg, tg) and resharding strategy."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Sampling defaults; a call may override ``greedy``, ``samples_per_prompt``, ``seed`` and ``max_new_tokens``."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """PPO update knobs."""


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
