"""Role workers (one role per class): actor, reference, critic, reward and cost, each a thin adapter over an engine."""

from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.base import ModelWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.reward import CostWorker, RewardWorker
from hybridflow.workers.spec import (ActorSpec, EngineSpec, PolicyLossConfig, RewardSpec, TokenizerSource,
                                     ValueLossConfig)

__all__ = [
    "ActorSpec", "ActorWorker", "CostWorker", "CriticWorker", "EngineSpec", "ModelWorker", "PolicyLossConfig",
    "ReferenceWorker", "RewardSpec", "RewardWorker", "TokenizerSource", "ValueLossConfig",
]
