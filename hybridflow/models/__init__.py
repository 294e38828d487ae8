"""Models: Hugging Face decoders (Llama, Mistral, Qwen2) from local directories, scalar heads, tiny test models."""

from hybridflow.models.config import ModelConfig
from hybridflow.models.families import SUPPORTED_FAMILIES
from hybridflow.models.heads import init_scalar_head, last_token_index
from hybridflow.models.loader import build_model, hf_config_of, load_hf_config
from hybridflow.models.smollm2 import smollm2_path
from hybridflow.models.tiny import build_tiny_model, tiny_config
from hybridflow.models.tokenizer import load_tokenizer

__all__ = [
    "ModelConfig", "SUPPORTED_FAMILIES", "build_model", "build_tiny_model", "hf_config_of", "init_scalar_head",
    "last_token_index", "load_hf_config", "load_tokenizer", "smollm2_path", "tiny_config",
]
