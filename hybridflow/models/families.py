"""The decoder families hybridflow supports and how a Hugging Face config is mapped to one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type (as written in config.json); transformers is imported only by family_config_class, so that
# configs naming a family validate without it
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe",
                                        "gemma3_text")


def family_config_class(family: str) -> "type[PretrainedConfig]":
    """The transformers config class of a supported ``family``."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
               "qwen3_moe": Qwen3MoeConfig, "gemma3_text": Gemma3TextConfig}
    return classes[check_family(family)]


LM_ONLY_FAMILIES: tuple[str, ...] = ("gemma3_text",)
"""Families transformers has no ``*ForTokenClassification`` for: no value or score head (critic, reward, cost)."""

CAUSAL_LM_CLASS_NAMES: dict[str, str] = {"gemma3_text": "Gemma3ForCausalLM"}
"""The transformers causal-LM class of families whose name is not the config's name with ``ForCausalLM``."""


def causal_lm_class_name(hf_config: "PretrainedConfig") -> str:
    """The ``architectures`` entry of a causal LM of this config (e.g. Qwen3ForCausalLM, Gemma3ForCausalLM)."""
    return CAUSAL_LM_CLASS_NAMES.get(hf_config.model_type,
                                     type(hf_config).__name__.removesuffix("Config") + "ForCausalLM")


def check_family(family: str, *, source: str = "model") -> str:
    """Return ``family`` if it is supported; otherwise raise ValueError naming what is supported.

    ``source`` says where the family came from (a path, "ModelConfig.family"), for the message.
    """
    if family not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model family {family!r} ({source}) is not supported yet; "
            f"supported: {', '.join(SUPPORTED_FAMILIES)}"
        )
    return family


def family_of(hf_config: "PretrainedConfig", *, source: str = "model") -> str:
    """The supported family of a loaded Hugging Face config (its ``model_type``), else ValueError."""
    return check_family(getattr(hf_config, "model_type", "<unknown>"), source=source)
