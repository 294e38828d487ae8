"""`placement.mapping: auto`: turn the pools' devices into a cluster, ask hybridflow.mapping for the fastest plan.

The plan's config fragment (placement.pools/roles, <role>.engine layout and sizes, actor.generation
sizes) is merged over the user's config into a new RLConfig; the user's config object is untouched.
"""

from __future__ import annotations

from hybridflow.trainers.config import RLConfig
from hybridflow.trainers.config_loader import build_dataclass, to_plain

ROLE_KINDS = {"actor": "actor", "critic": "critic", "reference": "inference", "reward": "inference",
              "cost": "inference", "cost_critic": "critic"}


def _model_of(config: RLConfig, role: str) -> str:
    source = config.section_of(role).model or config.actor.model
    if source.builtin is not None:
        from hybridflow.data.builtin import ASSETS_DIR

        return str(ASSETS_DIR)
    return source.path


def _merge(base: dict, fragment: dict) -> dict:
    merged = dict(base)
    for key, value in fragment.items():
        merged[key] = _merge(base.get(key) or {}, value) if isinstance(value, dict) and key != "pools" \
            and key != "roles" else value
    return merged


def resolve_auto_mapping(config: RLConfig):
    """(the config with the auto-mapped placement, the Plan); the config itself when mapping is manual."""
    if config.placement.mapping != "auto":
        return config, None
    from hybridflow.mapping import Cluster, Dataflow, Workload, load_hardware, plan

    roles = config.active_roles
    flow = Dataflow(name=config.algorithm.advantage_estimator, roles={role: ROLE_KINDS[role] for role in roles},
                    generation_passes=2 if config.algorithm.advantage_estimator == "remax" else 1)
    workload = Workload(prompts_per_step=config.batch.prompts_per_step, prompt_length=config.data.max_prompt_tokens,
                        response_length=config.actor.generation.max_new_tokens,
                        samples_per_prompt=config.batch.samples_per_prompt,
                        mini_batch_size=config.batch.mini_batch_size, ppo_epochs=config.actor.ppo_epochs,
                        micro_batch_tokens=config.actor.engine.micro_batch_tokens)
    devices_per_node = [count for counts in config.placement.pools.values() for count in counts]
    cluster = Cluster(num_devices=sum(devices_per_node), devices_per_node=max(devices_per_node),
                      hardware=load_hardware(config.placement.hardware))
    best = plan(flow, {role: _model_of(config, role) for role in roles}, workload, cluster)
    fragment = best.to_config_fragment()
    if "cost_critic" in fragment:  # its section is cost.critic (RLConfig.section_key)
        fragment.setdefault("cost", {})["critic"] = fragment.pop("cost_critic")
    data = _merge(to_plain(config), fragment)
    data["placement"]["mapping"] = "manual"  # the resolved config is an explicit placement
    return build_dataclass(RLConfig, data), best
