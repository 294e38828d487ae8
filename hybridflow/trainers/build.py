"""From an RLConfig to running worker groups: model/engine specs per role, pools, colocation."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from hybridflow.controller import ResourcePool, WorkerGroup, runtime_mode
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.generation_config import GenerationConfig, GenerationTokens
from hybridflow.models.config import BUILTIN_MODELS, ModelConfig
from hybridflow.trainers.config.rl import CriticSection, RLConfig
from hybridflow.workers import (ActorSpec, ActorWorker, AdapterReferenceWorker, CostWorker, CriticSpec, CriticWorker,
                                EngineSpec, ReferenceWorker, RewardSpec, RewardWorker, TokenizerSource, UpdateSizes)
from hybridflow.workers.rollout import RolloutSpec, RolloutWorker

# Tensor-name prefix of the cost critic (Safe-RLHF): it returns ``cost_values`` and trains on ``cost_returns``.
COST_CRITIC_PREFIX = "cost_"

# Fields of the built-in task's config.json that make up its tiny model.
_BUILTIN_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                   "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")


def model_config_of(source: ModelConfig) -> ModelConfig:
    """The config a role builds: ``source`` with a ``builtin`` resolved into the equivalent ``tiny`` model."""
    if source.builtin is None:
        return source
    if source.builtin not in BUILTIN_MODELS:
        raise ValueError(f"config key model.builtin got {source.builtin!r}; allowed: {', '.join(BUILTIN_MODELS)}")
    from hybridflow.data.builtin import builtin_model_config

    hf_config = builtin_model_config()
    return replace(source, builtin=None, tiny={name: getattr(hf_config, name) for name in _BUILTIN_FIELDS},
                   family="llama")


def tokenizer_of(source: ModelConfig) -> TokenizerSource:
    """Where a model section's tokenizer lives."""
    if source.tokenizer_path is not None:
        return TokenizerSource(path=source.tokenizer_path)
    if source.builtin is not None:
        return TokenizerSource(builtin=source.builtin)
    if source.path is None:
        raise ValueError("config key model.tokenizer_path is required for a tiny model (it has no directory)")
    return TokenizerSource(path=source.path)


def engine_spec(model: ModelConfig, engine: EngineConfig, *, head: str, seed: int,
                total_steps: int | None = None, lora=None) -> EngineSpec:
    """A role's model and engine sections with the run's values: the role's head, the run's seed and, for a
    trained role, the optimizer steps of the whole run (its LR schedule is checked here, before any worker
    starts; inference-only roles pass None and never build an optimizer)."""
    if total_steps is not None:
        engine.optim.check_schedule(total_steps)
    return EngineSpec(model=model_config_of(model), engine=engine, head=head, seed=seed, total_steps=total_steps,
                      lora=lora)


def model_generation_defaults(source: ModelConfig) -> dict:
    """The model directory's ``generation_config.json`` as a dict ({} when there is none)."""
    if source.path is None:
        return {}
    path = Path(source.path) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def generation_config_of(config: RLConfig, tokenizer) -> tuple[GenerationConfig, GenerationTokens]:
    """The actor's sampling config resolved once with the model's generation defaults (``use_model_defaults``),
    and the token ids it samples with: the tokenizer's EOS (and the model's) and pad ids, ``stop`` encoded."""
    model_defaults = model_generation_defaults(config.actor.model)
    tokens = GenerationTokens.build(config.actor.generation, eos_token_id=tokenizer.eos_token_id,
                                    pad_token_id=tokenizer.pad_token_id, model_defaults=model_defaults,
                                    encode=lambda text: tokenizer.encode(text, add_special_tokens=False))
    return config.actor.generation.with_model_defaults(model_defaults), tokens


@dataclass(frozen=True)
class RoleSpecs:
    """The constructor arguments of every active role's worker."""

    actor: ActorSpec
    reference: EngineSpec | None
    """None without a reference role, and with actor.lora (the reference is then the actor's model, adapters off:
    ``AdapterReferenceWorker``)."""
    critic: CriticSpec | None
    reward: RewardSpec | None
    actor_tokenizer: TokenizerSource
    cost: RewardSpec | None = None
    cost_critic: CriticSpec | None = None
    rollout: RolloutSpec | None = None
    """The generation replicas of a rollout pool of their own (``placement.roles.rollout``), else None."""


def role_specs(config: RLConfig) -> RoleSpecs:
    """Specs for every active role (pure: nothing starts)."""
    seed, derived, roles = config.trainer.seed, config.derived(), config.active_roles
    actor_tokenizer = tokenizer_of(config.actor.model)
    steps = config.trainer.total_steps * derived.mini_batches_per_epoch
    generation, tokens = generation_config_of(config, actor_tokenizer.load())
    actor = ActorSpec(
        engine=engine_spec(config.actor.model, config.actor.engine, head="lm", seed=seed,
                           total_steps=steps * config.actor.loss.ppo_epochs, lora=config.actor.lora),
        hybrid_engine=config.actor.hybrid_engine,
        generation=generation, tokens=tokens, loss=config.actor.loss, sizes=update_sizes(config),
        kl_loss_coef=config.algorithm.kl_coef if config.algorithm.kl_in_loss else 0.0,
        routing_replay=config.actor.routing_replay)
    reference = critic = reward = None
    if "reference" in roles and config.actor.lora is None:  # with LoRA: the actor's model, adapters off
        source = config.reference.model or config.actor.model
        reference = engine_spec(source, config.reference.engine, head="lm", seed=seed)
    if "critic" in roles:
        critic = _critic_specs(config, config.critic, optimizer_steps=steps)
    if "reward" in roles:
        head = "lm" if config.reward.model_type == "likelihood" else "score"
        reward = _scorer_spec(config.reward.model, config.reward.engine, head=head, seed=seed,
                              actor_tokenizer=actor_tokenizer)
    cost = cost_critic = None
    if config.cost is not None:
        cost = _scorer_spec(config.cost.model, config.cost.engine, head="score", seed=seed,
                            actor_tokenizer=actor_tokenizer)
        cost_critic = _critic_specs(config, config.cost.critic, optimizer_steps=steps)
    rollout = None
    if config.placement.rollout_pool is not None:  # the actor's architecture, dtype and sampling, no optimizer
        rollout = RolloutSpec(engine=replace(actor.engine, total_steps=None), generation=generation, tokens=tokens,
                              verify_weights=config.asynchrony.verify_weights)
    return RoleSpecs(actor=actor, reference=reference, critic=critic, reward=reward, actor_tokenizer=actor_tokenizer,
                     cost=cost, cost_critic=cost_critic, rollout=rollout)


def update_sizes(config: RLConfig) -> UpdateSizes:
    """The sizes every PPO-style update of the run uses (the actor's and the critics'): the mini-batch of
    ``batch.mini_batch_size`` and ``actor.generation.max_new_tokens`` as the response-length normaliser."""
    return UpdateSizes(mini_batch_size=config.batch.mini_batch_size,
                       max_response_length=config.actor.generation.max_new_tokens)


def _critic_specs(config: RLConfig, section: CriticSection, *, optimizer_steps: int) -> CriticSpec:
    """A value model (the critic, or Safe-RLHF's cost critic): its backbone defaults to the actor's model."""
    source = section.model or config.actor.model
    engine = engine_spec(source, section.engine, head="value", seed=config.trainer.seed,
                         total_steps=optimizer_steps * section.loss.ppo_epochs, lora=section.lora)
    return CriticSpec(engine=engine, loss=section.loss, sizes=update_sizes(config))


def _scorer_spec(source: ModelConfig, engine: EngineConfig, *, head: str, seed: int,
                 actor_tokenizer: TokenizerSource) -> RewardSpec:
    """A reward or cost model; it re-tokenizes the actor's text only when its tokenizer encodes differently."""
    tokenizer = tokenizer_of(source)
    return RewardSpec(engine=engine_spec(source, engine, head=head, seed=seed),
                      actor_tokenizer=actor_tokenizer,
                      tokenizer=None if tokenizer.encodes_like(actor_tokenizer) else tokenizer)


def resolve_runtime(config: RLConfig, mode: str | None = None) -> str | None:
    """The pools' mode for this run: ``mode`` when the caller chose one (``--local``), else what
    ``placement.runtime`` gives for the pools the active roles use (``controller.runtime_mode``)."""
    pools_in_use = {config.placement.pool_of(role) for role in config.active_roles}
    if config.placement.rollout_pool is not None:
        pools_in_use.add(config.placement.rollout_pool)
    return runtime_mode(config.placement.runtime, [config.placement.pools[name] for name in pools_in_use], mode=mode)


def build_worker_groups(config: RLConfig, specs: RoleSpecs, *,
                        mode: str | None = None) -> tuple[dict[str, WorkerGroup], list[ResourcePool]]:
    """One pool per ``placement.pools`` entry in use; the roles of a pool colocated in one process per slot.

    Returns the groups by role and the pools (release them after shutting the groups down).
    """
    reference = (ReferenceWorker, (specs.reference,)) if specs.reference is not None else (AdapterReferenceWorker,)
    arguments = {"actor": (ActorWorker, (specs.actor,)),
                 "reference": reference,
                 "critic": (CriticWorker, (specs.critic,)),
                 "reward": (RewardWorker, (specs.reward,)),
                 "cost": (CostWorker, (specs.cost,)),
                 "cost_critic": (CriticWorker, (specs.cost_critic,), {"prefix": COST_CRITIC_PREFIX})}
    mode = resolve_runtime(config, mode)
    by_pool: dict[str, dict[str, tuple]] = {}
    for role in config.active_roles:
        by_pool.setdefault(config.placement.pool_of(role), {})[role] = arguments[role]
    if specs.rollout is not None:
        by_pool.setdefault(config.placement.rollout_pool, {})["rollout"] = (RolloutWorker, (specs.rollout,))
    groups: dict[str, WorkerGroup] = {}
    pools = []
    for pool_name, roles in by_pool.items():
        pools.append(ResourcePool(list(config.placement.pools[pool_name]), mode=mode))
        groups.update(WorkerGroup.colocate(pools[-1], roles, timeout_s=config.trainer.worker_timeout_s,
                                           watchdog_s=config.trainer.watchdog_s))
    return groups, pools
