"""ReferenceWorker: the frozen initial policy, scoring responses for the KL penalty."""

from __future__ import annotations

from hybridflow.controller import register
from hybridflow.protocol import DataProto
from hybridflow.workers.base import ModelWorker


class ReferenceWorker(ModelWorker):
    """Log-probs of the responses under the reference weights (never trained)."""

    TRAINABLE = False
    # fp32 weights computing by autocast, as the actor's masters do: with the actor's initial model the KL to it is
    # then exactly 0 before the first update (bf16-held weights gave ~1e-3 per token: autocast leaves norms and
    # residual adds in the weights' dtype). Costs twice a bf16 copy's memory; docs/engines.md, "Precision".
    FP32_WEIGHTS = True

    @register("3D_PROTO")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_logprobs`` [B, T] aligned to ``responses``."""
        return DataProto.from_dict(tensors={"ref_logprobs": self._forward(data, ("logprobs",))["logprobs"]})
