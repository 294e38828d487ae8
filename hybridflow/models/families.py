"""The decoder families hybridflow supports and how a Hugging Face config is mapped to one."""

from __future__ import annotations

from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

# model_type (as written in config.json) -> the transformers config class of that family.
FAMILY_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(sorted(FAMILY_CONFIGS))


def check_family(family: str, *, source: str = "model") -> str:
    """Return ``family`` if it is supported; otherwise raise ValueError naming what is supported.

    ``source`` says where the family came from (a path, "ModelConfig.family"), for the message.
    """
    if family not in FAMILY_CONFIGS:
        raise ValueError(
            f"model family {family!r} ({source}) is not supported yet; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def family_of(hf_config: PretrainedConfig, *, source: str = "model") -> str:
    """The supported family of a loaded Hugging Face config (its ``model_type``), else ValueError."""
    return check_family(getattr(hf_config, "model_type", "<unknown>"), source=source)
