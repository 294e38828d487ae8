"""Models: Hugging Face decoders (Llama, Mistral, Qwen2) from local directories, scalar heads, tiny test models."""

from typing import TYPE_CHECKING

from hybridflow._lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools (type checkers, IDEs, tests/test_layering.py)
    from hybridflow.models.config import ModelConfig
    from hybridflow.models.families import SUPPORTED_FAMILIES
    from hybridflow.models.heads import init_scalar_head, last_token_index
    from hybridflow.models.loader import build_model, hf_config_of, load_hf_config
    from hybridflow.models.smollm2 import smollm2_path
    from hybridflow.models.tiny import build_tiny_model, tiny_config
    from hybridflow.models.tokenizer import load_tokenizer

# submodules are imported on first use: the light config modules of this package then load without
# torch, transformers or Ray (see hybridflow/_lazy.py)
_EXPORTS = {
    "ModelConfig": "hybridflow.models.config",
    "SUPPORTED_FAMILIES": "hybridflow.models.families",
    "init_scalar_head": "hybridflow.models.heads",
    "last_token_index": "hybridflow.models.heads",
    "build_model": "hybridflow.models.loader",
    "hf_config_of": "hybridflow.models.loader",
    "load_hf_config": "hybridflow.models.loader",
    "smollm2_path": "hybridflow.models.smollm2",
    "build_tiny_model": "hybridflow.models.tiny",
    "tiny_config": "hybridflow.models.tiny",
    "load_tokenizer": "hybridflow.models.tokenizer",
}
__all__ = [
    "ModelConfig", "SUPPORTED_FAMILIES", "build_model", "build_tiny_model", "hf_config_of", "init_scalar_head",
    "last_token_index", "load_hf_config", "load_tokenizer", "smollm2_path", "tiny_config",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
