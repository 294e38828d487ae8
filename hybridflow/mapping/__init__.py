"""Auto-mapping: choose placement, device allocation and parallel sizes by simulating an RLHF iteration.

Pure Python (no Ray, no torch.distributed; torch only inside the calibration command)::

    from hybridflow.mapping import Cluster, Workload, load_hardware, plan
    best = plan("ppo", {"actor": "llama-7b", "critic": "llama-7b", "reference": "llama-7b",
                        "reward": "llama-7b"},
                Workload(prompts_per_step=1024, prompt_length=1024, response_length=1024),
                Cluster(num_devices=64, devices_per_node=8, hardware=load_hardware("a100-80g")))
    config_fragment = best.to_config_fragment()

``plan(..., max_staleness=1)`` also weighs splits with a rollout pool generating one step ahead
(hybridflow.mapping.overlap; docs/async.md, "Placement").
"""

from hybridflow.mapping.cluster import Cluster
from hybridflow.mapping.dataflow import DATAFLOWS, STAGES, Dataflow, dataflow
from hybridflow.mapping.hardware import HardwareProfile, load_hardware
from hybridflow.mapping.model_spec import KNOWN_MODELS, ModelSpec, model_spec
from hybridflow.mapping.plan import OverlapSeconds, Plan, PoolPlan, format_table
from hybridflow.mapping.ranking import spearman_correlation
from hybridflow.mapping.rollout import ROLLOUT_BACKENDS, RolloutBackend, rollout_backend
from hybridflow.mapping.search import Planner, plan, set_partitions, simulate_plan
from hybridflow.mapping.strategy import RoleStrategy
from hybridflow.mapping.workload import Workload

__all__ = [
    "Cluster", "DATAFLOWS", "STAGES", "Dataflow", "dataflow", "HardwareProfile", "load_hardware",
    "KNOWN_MODELS", "ModelSpec", "model_spec", "OverlapSeconds", "Plan", "PoolPlan", "format_table",
    "spearman_correlation",
    "ROLLOUT_BACKENDS", "RolloutBackend", "rollout_backend",
    "Planner", "plan", "set_partitions", "simulate_plan", "RoleStrategy", "Workload",
]
