"""hybridflow: RLHF of language models with a single controller driving SPMD PyTorch workers."""

__version__ = "0.1.0"
