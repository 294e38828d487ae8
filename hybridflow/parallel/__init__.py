"""Parallel layouts: configs, device meshes, FSDP2, tensor-parallel (DTensor) and pipeline helpers."""
