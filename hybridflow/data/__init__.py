"""Datasets (prompts, SFT and preference pairs) from jsonl/parquet, tokenization, chat templates, the built-in task."""

from typing import TYPE_CHECKING

from hybridflow._lazy import lazy_exports

if TYPE_CHECKING:  # the same names for static tools (type checkers, IDEs, tests/test_layering.py)
    from hybridflow.data.collate import left_pad, prompt_response_tensors, right_pad
    from hybridflow.data.encoding import CHAT_TEMPLATE_MODES, PromptEncoder, answer_texts, decode_responses
    from hybridflow.data.files import read_rows, write_jsonl
    from hybridflow.data.loader import BatchLoader
    from hybridflow.data.pairs import PreferenceDataset, SFTDataset
    from hybridflow.data.prompts import PromptDataset, PromptExample
    from hybridflow.data.sampler import ResumableSampler

# submodules are imported on first use: the light config modules of this package then load without
# torch, transformers or Ray (see hybridflow/_lazy.py)
_EXPORTS = {
    "left_pad": "hybridflow.data.collate",
    "prompt_response_tensors": "hybridflow.data.collate",
    "right_pad": "hybridflow.data.collate",
    "CHAT_TEMPLATE_MODES": "hybridflow.data.encoding",
    "PromptEncoder": "hybridflow.data.encoding",
    "decode_responses": "hybridflow.data.encoding",
    "answer_texts": "hybridflow.data.encoding",
    "read_rows": "hybridflow.data.files",
    "write_jsonl": "hybridflow.data.files",
    "BatchLoader": "hybridflow.data.loader",
    "PreferenceDataset": "hybridflow.data.pairs",
    "SFTDataset": "hybridflow.data.pairs",
    "PromptDataset": "hybridflow.data.prompts",
    "PromptExample": "hybridflow.data.prompts",
    "ResumableSampler": "hybridflow.data.sampler",
}
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
    "answer_texts",
    "left_pad",
    "prompt_response_tensors",
    "read_rows",
    "right_pad",
    "write_jsonl",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
