"""ReferenceWorker: the frozen initial policy, scoring responses for the KL penalty."""

from __future__ import annotations

from hybridflow.controller import register
from hybridflow.protocol import DataProto
from hybridflow.workers.base import ModelWorker


class ReferenceWorker(ModelWorker):
    """Log-probs of the responses under the reference weights (never trained)."""

    TRAINABLE = False

    @register("3D_PROTO")
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_logprobs`` [B, T] aligned to ``responses``."""
        return DataProto.from_dict(tensors={"ref_logprobs": self._forward(data, ("logprobs",))["logprobs"]})
