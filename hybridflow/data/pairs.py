"""Supervised datasets: SFT pairs (prompt -> response) and preference pairs (prompt -> chosen, rejected).

Shape legend: B = pairs in a batch, P = prompt tokens, T = response tokens, S = P + T.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridflow.data.collate import prompt_response_tensors
from hybridflow.data.encoding import PromptEncoder
from hybridflow.data.files import load_rows, require_field


@dataclass(frozen=True)
class _TokenizedPair:
    prompt_ids: list[int]
    response_ids: tuple[list[int], ...]
    raw_prompt: str
    row_index: int


class _PairDataset:
    """Rows with a prompt and one or more response texts, tokenized once, over-long rows dropped (counted)."""

    def __init__(
        self,
        source: str | Path | Sequence[dict],
        tokenizer,
        *,
        response_keys: tuple[str, ...],
        description: str,
        max_prompt_tokens: int,
        max_response_tokens: int,
        prompt_key: str,
        messages_key: str,
        chat_template: str,
        system_prompt: str | None,
        response_prefix: str | None = None,
    ) -> None:
        for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_response_tokens", max_response_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        rows, self.source_name = load_rows(source, description=description)
        self.encoder = PromptEncoder(
            tokenizer, prompt_key=prompt_key, messages_key=messages_key,
            chat_template=chat_template, system_prompt=system_prompt, response_prefix=response_prefix,
        )
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        rendered = [
            self.encoder.prompt_text(row, row_index=i, source_name=self.source_name) for i, row in enumerate(rows)
        ]
        prompt_ids = self.encoder.encode_prompts([text for text, _ in rendered])
        responses_per_key = []
        for key in response_keys:
            texts = [require_field(row, key, row_index=i, source_name=self.source_name) for i, row in enumerate(rows)]
            for index, text in enumerate(texts):
                if not isinstance(text, str):
                    raise ValueError(
                        f"row {index} of {self.source_name}: field {key!r} must be text, got {type(text).__name__}"
                    )
            responses_per_key.append(self.encoder.encode_responses(texts))
        self.pairs: list[_TokenizedPair] = []
        self.num_filtered = 0
        for index, (_, raw_prompt) in enumerate(rendered):
            responses = tuple(list(per_key[index]) for per_key in responses_per_key)
            if len(prompt_ids[index]) > max_prompt_tokens or max(map(len, responses)) > max_response_tokens:
                self.num_filtered += 1
                continue
            self.pairs.append(_TokenizedPair(list(prompt_ids[index]), responses, raw_prompt, index))
        if self.num_filtered:
            warnings.warn(
                f"dropped {self.num_filtered} of {len(rows)} rows of {self.source_name} with a prompt over "
                f"max_prompt_tokens={max_prompt_tokens} or a response (with EOS) over "
                f"max_response_tokens={max_response_tokens}",
                stacklevel=3,
            )
        if not self.pairs:
            raise ValueError(
                f"no row of {self.source_name} fits max_prompt_tokens={max_prompt_tokens} and "
                f"max_response_tokens={max_response_tokens}"
            )

    def __len__(self) -> int:
        return len(self.pairs)


class SFTDataset(_PairDataset):
    """Prompt/response rows for supervised fine-tuning (loss on the response tokens only)."""

    def __init__(
        self,
        source: str | Path | Sequence[dict],
        tokenizer,
        *,
        max_prompt_tokens: int,
        max_response_tokens: int,
        prompt_key: str = "prompt",
        response_key: str = "response",
        messages_key: str = "messages",
        chat_template: str = "auto",
        system_prompt: str | None = None,
        response_prefix: str | None = None,
    ) -> None:
        super().__init__(
            source, tokenizer, response_keys=(response_key,), description="SFT dataset",
            max_prompt_tokens=max_prompt_tokens, max_response_tokens=max_response_tokens, prompt_key=prompt_key,
            messages_key=messages_key, chat_template=chat_template, system_prompt=system_prompt,
            response_prefix=response_prefix,
        )

    def batch(self, indices: Sequence[int]):
        """A DataProto with the sequence tensors (`input_ids`, `attention_mask`, `position_ids`
        [B, S]; `prompts` [B, P]; `responses`, `response_mask` [B, T], the response ending in EOS)
        and non-tensors `raw_prompt`, `row_index`."""
        from hybridflow.protocol import DataProto

        pairs = [self.pairs[index] for index in indices]
        tensors = prompt_response_tensors(
            [p.prompt_ids for p in pairs], [p.response_ids[0] for p in pairs], pad_token_id=self.pad_token_id
        )
        return DataProto.from_dict(
            tensors=tensors,
            non_tensors={"raw_prompt": [p.raw_prompt for p in pairs], "row_index": [p.row_index for p in pairs]},
        )


class PreferenceDataset(_PairDataset):
    """Prompt/chosen/rejected rows for reward-model training (Bradley-Terry)."""

    def __init__(
        self,
        source: str | Path | Sequence[dict],
        tokenizer,
        *,
        max_prompt_tokens: int,
        max_response_tokens: int,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        messages_key: str = "messages",
        chat_template: str = "auto",
        system_prompt: str | None = None,
        response_prefix: str | None = None,
    ) -> None:
        super().__init__(
            source, tokenizer, response_keys=(chosen_key, rejected_key), description="preference dataset",
            max_prompt_tokens=max_prompt_tokens, max_response_tokens=max_response_tokens, prompt_key=prompt_key,
            messages_key=messages_key, chat_template=chat_template, system_prompt=system_prompt,
            response_prefix=response_prefix,
        )
        tied = [pair.row_index for pair in self.pairs if pair.response_ids[0] == pair.response_ids[1]]
        if tied:
            warnings.warn(
                f"{len(tied)} of {len(self.pairs)} pairs of {self.source_name} have the same chosen and rejected "
                f"response (first: row {tied[0]}); such a pair teaches nothing (its loss is log 2 whatever the "
                f"model): fix or drop those rows", stacklevel=2)

    def batch(self, indices: Sequence[int]):
        """A DataProto whose rows are pairs: for side in (chosen, rejected) the tensors
        `{side}_input_ids`, `{side}_attention_mask`, `{side}_position_ids` [B, S],
        `{side}_response_mask` [B, T] share one shape (same P and T), so both sides can go through
        the model in one forward; non-tensors `raw_prompt`, `row_index`."""
        from hybridflow.protocol import DataProto

        pairs = [self.pairs[index] for index in indices]
        response_length = max(len(response) for p in pairs for response in p.response_ids)
        tensors = {}
        for side, position in (("chosen", 0), ("rejected", 1)):
            side_tensors = prompt_response_tensors(
                [p.prompt_ids for p in pairs], [p.response_ids[position] for p in pairs],
                pad_token_id=self.pad_token_id, response_length=response_length,
            )
            for key in ("input_ids", "attention_mask", "position_ids", "response_mask"):
                tensors[f"{side}_{key}"] = side_tensors[key]
        return DataProto.from_dict(
            tensors=tensors,
            non_tensors={"raw_prompt": [p.raw_prompt for p in pairs], "row_index": [p.row_index for p in pairs]},
        )
