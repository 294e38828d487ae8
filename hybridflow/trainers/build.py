"""From an RLConfig to running worker groups: model/engine specs per role, pools, colocation."""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.controller import ResourcePool, WorkerGroup
from hybridflow.engine.config import EngineConfig, OptimConfig
from hybridflow.engine.generation import GenerationConfig
from hybridflow.engine.hybrid_engine import HybridEngineConfig
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.config import CriticSection, EngineSection, ModelSource, OptimSection, RLConfig
from hybridflow.workers import (ActorSpec, ActorWorker, CostWorker, CriticWorker, EngineSpec, PolicyLossSpec,
                                ReferenceWorker, RewardSpec, RewardWorker, TokenizerSource, ValueLossSpec)

# Tensor-name prefix of the cost critic (Safe-RLHF): it returns ``cost_values`` and trains on ``cost_returns``.
COST_CRITIC_PREFIX = "cost_"

BUILTIN_MODELS = ("arithmetic",)
# Fields of the built-in task's config.json that make up its tiny model.
_BUILTIN_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                   "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings")


def model_config_of(source: ModelSource, *, head: str, seed: int) -> ModelConfig:
    """The ModelConfig a role builds from a config ``model`` section."""
    if source.builtin is None:
        return ModelConfig(path=source.path, head=head, seed=seed)
    if source.builtin not in BUILTIN_MODELS:
        raise ValueError(f"config key model.builtin got {source.builtin!r}; allowed: {', '.join(BUILTIN_MODELS)}")
    from hybridflow.data.builtin import builtin_model_config

    hf_config = builtin_model_config()
    return ModelConfig(tiny={name: getattr(hf_config, name) for name in _BUILTIN_FIELDS}, family="llama",
                       head=head, seed=seed)


def tokenizer_of(source: ModelSource) -> TokenizerSource:
    """Where a model section's tokenizer lives."""
    if source.tokenizer_path is not None:
        return TokenizerSource(path=source.tokenizer_path)
    if source.builtin is not None:
        return TokenizerSource(builtin=source.builtin)
    return TokenizerSource(path=source.path)


def engine_config_of(engine: EngineSection, optim: OptimSection | None, *, seed: int,
                     optimizer_steps: int) -> EngineConfig:
    """The engine's own config from a role's ``engine`` (and ``optim``) sections."""
    optim_config = OptimConfig()
    if optim is not None:
        optim_config = OptimConfig(lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                   grad_clip=optim.grad_clip or None, lr_schedule=optim.schedule,
                                   warmup_steps=min(optim.warmup_steps, optimizer_steps), total_steps=optimizer_steps)
    return EngineConfig(layout=engine.layout, pp_size=engine.pp_size, tp_size=engine.tp_size,
                        micro_batch_tokens=engine.micro_batch_tokens, seed=seed, optim=optim_config)


@dataclass(frozen=True)
class RoleSpecs:
    """The constructor arguments of every active role's worker."""

    actor: ActorSpec
    reference: EngineSpec | None
    critic: tuple[EngineSpec, ValueLossSpec] | None
    reward: RewardSpec | None
    actor_tokenizer: TokenizerSource
    cost: RewardSpec | None = None
    cost_critic: tuple[EngineSpec, ValueLossSpec] | None = None


def role_specs(config: RLConfig) -> RoleSpecs:
    """Specs for every active role (pure: nothing starts)."""
    seed, derived, roles = config.trainer.seed, config.derived(), config.active_roles
    actor_tokenizer = tokenizer_of(config.actor.model)
    tokenizer = actor_tokenizer.load()
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    steps = config.trainer.total_steps * derived.mini_batches_per_epoch
    generation = config.actor.generation
    actor = ActorSpec(
        engine=EngineSpec(model=model_config_of(config.actor.model, head="lm", seed=seed),
                          engine=engine_config_of(config.actor.engine, config.actor.optim, seed=seed,
                                                  optimizer_steps=steps * config.actor.ppo_epochs)),
        hybrid=HybridEngineConfig(pp_size=generation.pp_size, tp_size=generation.tp_size,
                                  strategy=generation.grouping),
        generation=GenerationConfig(max_new_tokens=generation.max_new_tokens,
                                    temperature=generation.temperature if generation.temperature > 0 else 1.0,
                                    greedy=generation.temperature == 0, top_k=generation.top_k,
                                    top_p=generation.top_p, eos_token_ids=(tokenizer.eos_token_id,),
                                    pad_token_id=pad_token_id, seed=seed),
        loss=PolicyLossSpec(ppo_epochs=config.actor.ppo_epochs, mini_batch_size=config.batch.mini_batch_size,
                            clip_ratio=config.actor.clip_ratio, entropy_coef=config.actor.entropy_coef,
                            kl_loss_coef=config.algorithm.kl_coef if config.algorithm.kl_mode == "loss" else 0.0,
                            ptx_coef=config.actor.ptx_coef))
    reference = critic = reward = None
    if "reference" in roles:
        source = config.reference.model or config.actor.model
        reference = EngineSpec(model=model_config_of(source, head="lm", seed=seed),
                               engine=engine_config_of(config.reference.engine, None, seed=seed, optimizer_steps=1))
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
    return RoleSpecs(actor=actor, reference=reference, critic=critic, reward=reward, actor_tokenizer=actor_tokenizer,
                     cost=cost, cost_critic=cost_critic)


def _critic_specs(config: RLConfig, section: CriticSection, *,
                  optimizer_steps: int) -> tuple[EngineSpec, ValueLossSpec]:
    """A value model (the critic, or Safe-RLHF's cost critic): its backbone defaults to the actor's model."""
    source = section.model or config.actor.model
    seed = config.trainer.seed
    return (EngineSpec(model=model_config_of(source, head="value", seed=seed),
                       engine=engine_config_of(section.engine, section.optim, seed=seed,
                                               optimizer_steps=optimizer_steps * section.ppo_epochs)),
            ValueLossSpec(ppo_epochs=section.ppo_epochs, mini_batch_size=config.batch.mini_batch_size,
                          value_clip=section.value_clip))


def _scorer_spec(source: ModelSource, engine: EngineSection, *, head: str, seed: int,
                 actor_tokenizer: TokenizerSource) -> RewardSpec:
    """A reward or cost model; it re-tokenizes the actor's text only when its tokenizer encodes differently."""
    tokenizer = tokenizer_of(source)
    return RewardSpec(engine=EngineSpec(model=model_config_of(source, head=head, seed=seed),
                                        engine=engine_config_of(engine, None, seed=seed, optimizer_steps=1)),
                      actor_tokenizer=actor_tokenizer,
                      tokenizer=None if tokenizer.encodes_like(actor_tokenizer) else tokenizer)


def build_worker_groups(config: RLConfig, specs: RoleSpecs, *,
                        mode: str | None = None) -> tuple[dict[str, WorkerGroup], list[ResourcePool]]:
    """One pool per ``placement.pools`` entry in use; the roles of a pool colocated in one process per slot.

    Returns the groups by role and the pools (release them after shutting the groups down).
    """
    arguments = {"actor": (ActorWorker, (specs.actor,)),
                 "reference": (ReferenceWorker, (specs.reference,)),
                 "critic": (CriticWorker, specs.critic),
                 "reward": (RewardWorker, (specs.reward,)),
                 "cost": (CostWorker, (specs.cost,)),
                 "cost_critic": (CriticWorker, specs.cost_critic, {"prefix": COST_CRITIC_PREFIX})}
    by_pool: dict[str, dict[str, tuple]] = {}
    for role in config.active_roles:
        by_pool.setdefault(config.placement.pool_of(role), {})[role] = arguments[role]
    groups: dict[str, WorkerGroup] = {}
    pools = []
    for pool_name, roles in by_pool.items():
        pools.append(ResourcePool(list(config.placement.pools[pool_name]), mode=mode))
        groups.update(WorkerGroup.colocate(pools[-1], roles))
    return groups, pools
