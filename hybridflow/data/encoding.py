"""Turning dataset rows into token ids: `prompt` text or chat `messages`, the chat template, responses ending in EOS."""

from __future__ import annotations

import re

CHAT_TEMPLATE_MODES = ("auto", "always", "never")


class PromptEncoder:
    """Renders and tokenizes prompts and responses the same way for every dataset kind.

    A row's prompt is its `messages_key` field (a list of {"role", "content"} dicts) when present,
    else its `prompt_key` text. With a chat template (chat_template="auto" and the tokenizer has
    one, or "always") the prompt is rendered with add_generation_prompt=True and tokenized without
    adding special tokens again (the template writes them); without one the text is tokenized
    as-is with the tokenizer's own special tokens (e.g. a leading BOS).

    `response_prefix` pre-starts the model's reply: it is appended to the rendered prompt (after the chat
    template's assistant header), so it is part of the prompt, never trained. A value `{name}` (the whole
    string) takes each row's `name` field; any other value is used literally, braces included.
    """

    def __init__(
        self,
        tokenizer,
        *,
        prompt_key: str = "prompt",
        messages_key: str = "messages",
        chat_template: str = "auto",
        system_prompt: str | None = None,
        response_prefix: str | None = None,
    ) -> None:
        if chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {chat_template!r}")
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if chat_template == "always" and not has_template:
            raise ValueError(
                "chat_template is 'always' but the tokenizer has no chat template; use 'auto' or 'never'"
            )
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; responses must end in one")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.messages_key = messages_key
        self.system_prompt = system_prompt
        self.uses_chat_template = has_template and chat_template != "never"
        self.response_prefix = response_prefix
        field = re.fullmatch(r"\{(\w+)\}", response_prefix or "")
        self.prefix_field = field.group(1) if field else None
        """The row field holding each row's prefix (``response_prefix: "{name}"``), or None for a fixed one."""

    def prefix_of(self, row: dict, *, row_index: int, source_name: str) -> str:
        """The text that pre-starts this row's response ('' without ``response_prefix``)."""
        if self.prefix_field is None:
            return self.response_prefix or ""
        prefix = row.get(self.prefix_field)
        if not isinstance(prefix, str):
            raise ValueError(
                f"row {row_index} of {source_name}: response_prefix {self.response_prefix!r} takes the row's "
                f"{self.prefix_field!r} field, which must be text; got {prefix!r} (fields present: {sorted(row)})"
            )
        return prefix

    def conversation(self, row: dict, *, row_index: int, source_name: str) -> tuple[list[dict], str]:
        """(the row's chat: its messages, or its prompt text as one user turn; the user's prompt as written)."""
        messages = row.get(self.messages_key)
        if messages is not None:
            messages = self._checked_messages(messages, row_index=row_index, source_name=source_name)
            user_turns = [message["content"] for message in messages if message["role"] == "user"]
            return messages, user_turns[-1] if user_turns else messages[-1]["content"]
        raw_prompt = row.get(self.prompt_key)
        if raw_prompt is None:
            raise ValueError(
                f"row {row_index} of {source_name} has neither a {self.prompt_key!r} field nor a "
                f"{self.messages_key!r} field; fields present: {sorted(row)}"
            )
        if not isinstance(raw_prompt, str):
            raise ValueError(
                f"row {row_index} of {source_name}: field {self.prompt_key!r} must be text, "
                f"got {type(raw_prompt).__name__}"
            )
        return [{"role": "user", "content": raw_prompt}], raw_prompt

    def prompt_text(self, row: dict, *, row_index: int, source_name: str) -> tuple[str, str]:
        """(text fed to the model, the user's prompt as written) for one row; the text ends in the row's
        response prefix."""
        text, raw_prompt = self._rendered(row, row_index=row_index, source_name=source_name)
        return text + self.prefix_of(row, row_index=row_index, source_name=source_name), raw_prompt

    def _rendered(self, row: dict, *, row_index: int, source_name: str) -> tuple[str, str]:
        messages, raw_prompt = self.conversation(row, row_index=row_index, source_name=source_name)
        if not self.uses_chat_template:
            if row.get(self.messages_key) is not None:
                raise ValueError(
                    f"row {row_index} of {source_name} holds chat {self.messages_key!r} but no chat template "
                    "is in use (the tokenizer has none, or chat_template='never'); give a 'prompt' text instead"
                )
            return raw_prompt, raw_prompt
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, raw_prompt

    def _checked_messages(self, messages, *, row_index: int, source_name: str) -> list[dict]:
        if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise ValueError(
                f"row {row_index} of {source_name}: field {self.messages_key!r} must be a non-empty list of "
                "{'role': str, 'content': str} dicts"
            )
        return messages

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of rendered prompts (special tokens added only when no chat template wrote them)."""
        if not texts:
            return []
        return self.tokenizer(texts, add_special_tokens=not self.uses_chat_template)["input_ids"]

    def encode_responses(self, texts: list[str]) -> list[list[int]]:
        """Token ids of responses, each followed by EOS (the model must learn to stop)."""
        if not texts:
            return []
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(ids) + [self.tokenizer.eos_token_id] for ids in encoded]


def decode_responses(tokenizer, data) -> list[str]:
    """The text of each response of a DataProto (its real tokens, special tokens such as EOS removed)."""
    # to Python lists once: indexing the tensors row by row costs more than the decoding
    responses, masks = data["responses"].tolist(), data["response_mask"].bool().tolist()
    return [tokenizer.decode([token for token, real in zip(row, mask) if real], skip_special_tokens=True)
            for row, mask in zip(responses, masks)]


def answer_texts(tokenizer, data) -> list[str]:
    """What each sample answered, as a reward function reads it: the row's response prefix (the non-tensor
    ``response_prefix``, when the prompts had one) followed by the generated text."""
    texts = decode_responses(tokenizer, data)
    if "response_prefix" not in data:
        return texts
    return [str(prefix) + text for prefix, text in zip(data["response_prefix"], texts)]
