"""Datasets (prompts, SFT and preference pairs) from jsonl/parquet, tokenization, chat templates, the built-in task."""

from hybridflow.data.collate import left_pad, prompt_response_tensors, right_pad
from hybridflow.data.encoding import CHAT_TEMPLATE_MODES, PromptEncoder, decode_responses
from hybridflow.data.files import read_rows, write_jsonl
from hybridflow.data.loader import BatchLoader
from hybridflow.data.pairs import PreferenceDataset, SFTDataset
from hybridflow.data.prompts import PromptDataset, PromptExample
from hybridflow.data.sampler import ResumableSampler

__all__ = [
    "CHAT_TEMPLATE_MODES",
    "BatchLoader",
    "PreferenceDataset",
    "PromptDataset",
    "PromptEncoder",
    "PromptExample",
    "ResumableSampler",
    "SFTDataset",
    "decode_responses",
    "left_pad",
    "prompt_response_tensors",
    "read_rows",
    "right_pad",
    "write_jsonl",
]
