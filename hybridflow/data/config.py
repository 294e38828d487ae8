"""The prompt-file section shared by every trainer's ``data`` config (RL, SFT, reward model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class PromptFiles:
    """Where the rows come from and how prompts are read (RL, SFT and RM data sections extend it)."""

    train_path: str
    """jsonl or parquet file of training rows (a ``prompt`` field or chat ``messages``)."""
    val_path: str | None = None
    """Held-out rows; null disables validation."""
    prompt_key: str = "prompt"
    """Field holding the prompt text (``messages`` rows use the chat template instead)."""
    max_prompt_tokens: int = 256
    """Rows with longer prompts are dropped with a counted warning (never truncated)."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """How prompts are rendered: ``auto`` through the tokenizer's chat template when it has one (a ``prompt``
    text becomes one user turn), ``always`` the same but an error without a template, ``never`` the raw
    ``prompt`` text (completion-style prompts; ``messages`` rows are then refused)."""
    system_prompt: str | None = None
    """A system message put before every chat that has none (under a chat template only)."""
    response_prefix: str | None = None
    """Text that pre-starts every response (e.g. ``"The answer is "``): appended to the prompt after the chat
    template's assistant header, so it is part of the prompt and never trained; training, validation and the
    export-time evaluation all use it, and rule rewards read it before the generated text. ``"{name}"`` (the
    whole value) takes each row's ``name`` field instead; any other value is used literally. null: none."""

    def prompt_format(self) -> dict:
        """The keyword arguments every dataset takes for reading and rendering prompts."""
        return dict(prompt_key=self.prompt_key, chat_template=self.chat_template, system_prompt=self.system_prompt,
                    response_prefix=self.response_prefix)

    def __post_init__(self) -> None:
        if not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1:
            raise ValueError(f"config key max_prompt_tokens got {self.max_prompt_tokens!r}; allowed: an integer >= 1")
