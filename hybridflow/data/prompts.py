"""Prompt datasets for RL: rows from jsonl/parquet or memory, tokenized once, over-long ones dropped, batched."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.data.collate import left_pad
from hybridflow.data.encoding import PromptEncoder
from hybridflow.data.files import load_rows

# Rows are tokenized in chunks: one tokenizer call per chunk is much faster than one per row.
_TOKENIZE_CHUNK = 1024


@dataclass(frozen=True)
class PromptExample:
    """One tokenized prompt and everything a reward function may need about its row."""

    input_ids: list[int]
    """Prompt token ids as the model sees them (chat template applied, special tokens included)."""
    raw_prompt: str
    """The prompt as the user wrote it (the `prompt` field, or the last user message)."""
    messages: list[dict]
    """The prompt as a chat: the row's `messages`, or its prompt text as one user turn (for
    re-rendering with another tokenizer's template, e.g. a reward model's)."""
    extra_fields: dict
    """Every other field of the row (ground truth `answer`, test cases, ...)."""
    row_index: int
    """Position of the row in the source file."""
    response_prefix: str = ""
    """The text pre-starting the response (``data.response_prefix``), already at the end of ``input_ids``."""


class PromptDataset:
    """Tokenized prompts of one file (or list of row dicts).

    Prompts longer than `max_prompt_tokens` tokens are dropped with one warning that counts them,
    never truncated; a dataset left with no prompt is a ValueError.
    """

    def __init__(
        self,
        source: str | Path | Sequence[dict],
        tokenizer,
        *,
        max_prompt_tokens: int,
        prompt_key: str = "prompt",
        messages_key: str = "messages",
        chat_template: str = "auto",
        system_prompt: str | None = None,
        response_prefix: str | None = None,
    ) -> None:
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
        rows, self.source_name = load_rows(source, description="prompt dataset")
        self.encoder = PromptEncoder(
            tokenizer,
            prompt_key=prompt_key,
            messages_key=messages_key,
            chat_template=chat_template,
            system_prompt=system_prompt,
            response_prefix=response_prefix,
        )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.max_prompt_tokens = max_prompt_tokens
        self.examples: list[PromptExample] = []
        self.num_filtered = 0
        longest_dropped = 0
        texts = [
            self.encoder.prompt_text(row, row_index=index, source_name=self.source_name)
            for index, row in enumerate(rows)
        ]
        conversations = [
            self.encoder.conversation(row, row_index=index, source_name=self.source_name)[0]
            for index, row in enumerate(rows)
        ]
        for start in range(0, len(rows), _TOKENIZE_CHUNK):
            chunk = texts[start : start + _TOKENIZE_CHUNK]
            encoded = self.encoder.encode_prompts([text for text, _ in chunk])
            for offset, ((_, raw_prompt), input_ids) in enumerate(zip(chunk, encoded)):
                index = start + offset
                if len(input_ids) > max_prompt_tokens:
                    self.num_filtered += 1
                    longest_dropped = max(longest_dropped, len(input_ids))
                    continue
                extra = {key: value for key, value in rows[index].items() if key not in (prompt_key, messages_key)}
                prefix = self.encoder.prefix_of(rows[index], row_index=index, source_name=self.source_name)
                self.examples.append(PromptExample(list(input_ids), raw_prompt, conversations[index], extra, index,
                                                   prefix))
        if self.num_filtered:
            warnings.warn(
                f"dropped {self.num_filtered} of {len(rows)} prompts of {self.source_name} longer than "
                f"max_prompt_tokens={max_prompt_tokens} (longest: {longest_dropped} tokens)",
                stacklevel=2,
            )
        if not self.examples:
            raise ValueError(
                f"no prompt of {self.source_name} fits max_prompt_tokens={max_prompt_tokens} "
                f"(all {len(rows)} were longer); raise max_prompt_tokens"
            )

    def __len__(self) -> int:
        return len(self.examples)

    def batch(self, indices: Sequence[int]):
        """A DataProto of these examples.

        Tensors: `input_ids` [B, P] and `attention_mask` [B, P], left-padded to the longest prompt
        of the batch. Non-tensors: `raw_prompt` (str), `messages` (the prompt as a chat, list of
        dicts), `extra_fields` (dict of the row's other fields, passed to reward functions as
        keyword arguments), `row_index` (int); with a response prefix, `response_prefix` (str: reward
        functions read it before the generated text).
        """
        from hybridflow.protocol import DataProto

        examples = [self.examples[index] for index in indices]
        input_ids_BP, attention_mask_BP = left_pad([e.input_ids for e in examples], pad_token_id=self.pad_token_id)
        non_tensors = {
            "raw_prompt": [e.raw_prompt for e in examples],
            "messages": [e.messages for e in examples],
            "extra_fields": [e.extra_fields for e in examples],
            "row_index": [e.row_index for e in examples],
        }
        if self.encoder.response_prefix is not None:
            non_tensors["response_prefix"] = [e.response_prefix for e in examples]
        return DataProto.from_dict(tensors={"input_ids": input_ids_BP, "attention_mask": attention_mask_BP},
                                   non_tensors=non_tensors)

    def batches_in_order(self, batch_size: int) -> Iterator:
        """Every example once, in file order, in DataProtos of up to `batch_size` rows (for validation)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, len(self), batch_size):
            yield self.batch(range(start, min(start + batch_size, len(self))))

