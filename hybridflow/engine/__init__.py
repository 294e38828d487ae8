"""Per-model engines: training and inference under the fsdp or 3d layout (generation lives beside them)."""

from hybridflow.engine.config import EngineConfig, OptimConfig
from hybridflow.engine.training import TrainingEngine

__all__ = ["EngineConfig", "OptimConfig", "TrainingEngine"]
