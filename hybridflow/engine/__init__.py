"""Per-model engines: training and inference under the fsdp or 3d layout (generation lives beside them)."""

from typing import TYPE_CHECKING

from hybridflow._lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools (type checkers, IDEs, tests/test_layering.py)
    from hybridflow.engine.config import EngineConfig, OptimConfig
    from hybridflow.engine.training import TrainingEngine

# submodules are imported on first use: the light config modules of this package then load without
# torch, transformers or Ray (see hybridflow/_lazy.py)
_EXPORTS = {
    "EngineConfig": "hybridflow.engine.config",
    "OptimConfig": "hybridflow.engine.config",
    "TrainingEngine": "hybridflow.engine.training",
}
__all__ = ["EngineConfig", "OptimConfig", "TrainingEngine"]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
