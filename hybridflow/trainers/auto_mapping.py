"""`placement.mapping: auto`: turn the pools' devices into a cluster, ask hybridflow.mapping for the fastest plan.

The plan is a typed object (``hybridflow.mapping.Plan``: pools, per-role strategies, the workload it
was planned for); ``apply_plan`` turns it into a new RLConfig by typed replacement of the placement,
each role's engine sizes and the actor's generation sizes. The user's config object is untouched.
"""

from __future__ import annotations

from dataclasses import replace

from hybridflow.trainers.config.rl import RLConfig
from hybridflow.trainers.redundant_passes import skips_old_log_prob_pass

LOCAL_HARDWARE = "local"
"""``placement.hardware`` value meaning: the profile `hybridflow calibrate` measured on this machine."""

ROLE_KINDS = {"actor": "actor", "critic": "critic", "reference": "inference", "reward": "inference",
              "cost": "inference", "cost_critic": "critic"}


def _model_of(config: RLConfig, role: str) -> str:
    source = config.section_of(role).model or config.actor.model
    if source.builtin is not None:
        from hybridflow.data.builtin import ASSETS_DIR

        return str(ASSETS_DIR)
    return source.path


def workload_of(config: RLConfig):
    """The mapping ``Workload`` of a run: its batch vocabulary, lengths, epochs and micro-batch budget."""
    from hybridflow.mapping import Workload

    loss = config.actor.loss
    return Workload(prompts_per_step=config.batch.prompts_per_step, prompt_length=config.data.max_prompt_tokens,
                    response_length=config.actor.generation.max_new_tokens,
                    samples_per_prompt=config.batch.samples_per_prompt,
                    mini_batch_size=config.batch.mini_batch_size, ppo_epochs=loss.ppo_epochs,
                    micro_batch_tokens=planning_token_budget(config.actor.engine.micro_batch_tokens),
                    actor_log_prob_pass=not skips_old_log_prob_pass(config) and loss.old_log_probs != "rollout")


def planning_token_budget(micro_batch_tokens: int | str) -> int:
    """The micro-batch budget the planner models: the configured one, or for 'auto' (resolved from free memory
    only when the engine runs) 4096 tokens, what auto gives a pipeline with memory to spare (other layouts get
    at least as many where memory allows)."""
    from hybridflow.engine.token_budget import AUTO_PIPELINE_MAX_TOKENS

    return AUTO_PIPELINE_MAX_TOKENS if micro_batch_tokens == "auto" else micro_batch_tokens


def apply_plan(config: RLConfig, plan) -> RLConfig:
    """``config`` placed and laid out as ``plan`` says (a manual placement): pools, roles, engine sizes, the
    actor's generation sizes, and the rollout pool (with the scorers that score ahead there) with its
    ``async.max_staleness`` (0 for a plan without one, whatever bound the config allowed the planner, and then
    ``async.mode`` pipelined: streaming needs k >= 1). Refuses a
    plan made for another workload (padded training splits included) or another rollout backend."""
    # a plan whose generation replicas divide the prompts (pad_generation=False) runs here as well
    if plan.workload is not None and replace(plan.workload, pad_generation=True) != workload_of(config):
        raise ValueError(f"the plan was made for {plan.workload}, not this run's {workload_of(config)}; "
                         f"plan again for this config")
    backend = config.actor.generation.backend
    if plan.backend is not None and plan.backend != backend:
        raise ValueError(f"the plan was made for actor.generation.backend={plan.backend!r}, not this run's "
                         f"{backend!r}; plan again for this config")
    sections = {}
    for role, strategy in plan.strategies.items():
        section = config.section_of(role)
        changes = {"engine": replace(section.engine, layout=strategy.layout, pp_size=strategy.pp_size,
                                     tp_size=strategy.tp_size)}
        if role == "actor" and strategy.generates:
            changes["hybrid_engine"] = replace(section.hybrid_engine, pp_size=strategy.generation_pp_size,
                                               tp_size=strategy.generation_tp_size)
        sections[role] = replace(section, **changes)
    if "cost_critic" in sections:  # its section is cost.critic (RLConfig.section_key)
        sections["cost"] = replace(sections.get("cost", config.cost), critic=sections.pop("cost_critic"))
    placement = replace(config.placement, mapping="manual",
                        pools={pool.name: list(pool.devices_per_node) for pool in plan.all_pools},
                        roles={role: pool.name for pool in plan.all_pools for role in pool.roles})
    # a synchronous plan (k = 0) has no streaming to do: the pipelined mode is the one that allows k = 0
    asynchrony = replace(config.asynchrony, max_staleness=plan.max_staleness,
                         mode=config.asynchrony.mode if plan.max_staleness else "pipelined")
    # one replace: validated once, as a whole
    return replace(config, placement=placement, asynchrony=asynchrony, **sections)


def hardware_of(config: RLConfig):
    """The ``HardwareProfile`` of ``placement.hardware``. ``local`` is the profile ``hybridflow calibrate``
    measured on this machine for the device hybridflow.device picks (cpu-local or cuda-local); without one
    it refuses instead of planning with another machine's numbers."""
    from hybridflow.mapping import load_hardware
    from hybridflow.mapping.hardware import LOCAL_PROFILE_NAMES, builtin_profile_names, local_profile_dir

    name = config.placement.hardware
    if name != LOCAL_HARDWARE:
        return load_hardware(name)
    from hybridflow.device import device_type

    local = LOCAL_PROFILE_NAMES[device_type()]
    path = local_profile_dir() / f"{local}.json"
    if not path.is_file():
        raise ValueError(f"placement.hardware={LOCAL_HARDWARE!r} plans with this machine's measured profile "
                         f"{local!r}, which does not exist yet (no {path}); run `hybridflow calibrate` once on "
                         f"this machine, or set placement.hardware to a built-in profile "
                         f"({', '.join(builtin_profile_names())}) or a profile JSON file")
    return load_hardware(local)


def planning_inputs(config: RLConfig) -> dict:
    """What the planner needs to know of a run, as keyword arguments of ``hybridflow.mapping.plan`` and
    ``simulate_plan``: its dataflow (active roles), models, workload, the cluster of all its pools' devices on the
    ``placement.hardware`` profile, the rollout backend and its KV cache."""
    from hybridflow.engine.rollout import rollout_backend
    from hybridflow.mapping import Cluster, Dataflow

    roles = config.active_roles
    flow = Dataflow(name=config.algorithm.advantage_estimator, roles={role: ROLE_KINDS[role] for role in roles},
                    generation_passes=2 if config.algorithm.estimator.baseline_generation else 1)
    devices_per_node = [count for counts in config.placement.pools.values() for count in counts]
    cluster = Cluster(num_devices=sum(devices_per_node), devices_per_node=max(devices_per_node),
                      hardware=hardware_of(config))
    generation = config.actor.generation
    # vLLM allocates exactly vllm_kv_cache_gib; the native engine's cache takes what is left
    kv_cache_gib = rollout_backend(generation.backend).kv_cache_gib(generation)
    return {"dataflow": flow, "models": {role: _model_of(config, role) for role in roles},
            "workload": workload_of(config), "cluster": cluster, "backend": generation.backend,
            "kv_cache_gib": kv_cache_gib}


def resolve_auto_mapping(config: RLConfig):
    """(the config with the auto-mapped placement, the Plan); the config itself when mapping is manual."""
    if config.placement.mapping != "auto":
        return config, None
    from hybridflow.mapping import plan

    inputs = planning_inputs(config)
    # async.max_staleness k >= 1 lets the planner weigh a rollout pool pipelined with staleness k (docs/async.md),
    # with the frozen scorers on it where the pipelined schedule scores ahead (streaming refuses them there)
    best = replace(plan(**inputs, max_staleness=config.asynchrony.max_staleness,
                        scoring_ahead=not config.asynchrony.streaming), workload=inputs["workload"])
    return apply_plan(config, best), best
