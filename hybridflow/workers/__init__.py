"""Role workers (one role per class): actor, reference, critic, reward and cost, and the SFT and reward-model
trainers' workers, each a thin adapter over an engine."""

from typing import TYPE_CHECKING

from hybridflow._lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools (type checkers, IDEs, tests/test_layering.py)
    from hybridflow.workers.actor import ActorWorker
    from hybridflow.workers.base import ModelWorker
    from hybridflow.workers.critic import CriticWorker
    from hybridflow.workers.reference import AdapterReferenceWorker, ReferenceWorker
    from hybridflow.workers.reward import CostWorker, RewardWorker
    from hybridflow.workers.spec import (
        ActorSpec, CriticSpec, EngineSpec, PolicyLossConfig, RewardSpec, TokenizerSource, UpdateSizes,
        ValueLossConfig,
    )
    from hybridflow.workers.supervised import SFTWorker, PreferenceWorker

# submodules are imported on first use: the light config modules of this package then load without
# torch, transformers or Ray (see hybridflow/_lazy.py)
_EXPORTS = {
    "ActorWorker": "hybridflow.workers.actor",
    "ModelWorker": "hybridflow.workers.base",
    "CriticWorker": "hybridflow.workers.critic",
    "ReferenceWorker": "hybridflow.workers.reference",
    "AdapterReferenceWorker": "hybridflow.workers.reference",
    "CostWorker": "hybridflow.workers.reward",
    "RewardWorker": "hybridflow.workers.reward",
    "SFTWorker": "hybridflow.workers.supervised",
    "PreferenceWorker": "hybridflow.workers.supervised",
    "ActorSpec": "hybridflow.workers.spec",
    "CriticSpec": "hybridflow.workers.spec",
    "EngineSpec": "hybridflow.workers.spec",
    "PolicyLossConfig": "hybridflow.workers.spec",
    "RewardSpec": "hybridflow.workers.spec",
    "TokenizerSource": "hybridflow.workers.spec",
    "UpdateSizes": "hybridflow.workers.spec",
    "ValueLossConfig": "hybridflow.workers.spec",
}
__all__ = [
    "ActorSpec", "ActorWorker", "AdapterReferenceWorker", "CostWorker", "CriticSpec", "CriticWorker", "EngineSpec", "ModelWorker",
    "PolicyLossConfig", "PreferenceWorker", "ReferenceWorker", "RewardSpec", "RewardWorker", "SFTWorker",
    "TokenizerSource", "UpdateSizes", "ValueLossConfig",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
