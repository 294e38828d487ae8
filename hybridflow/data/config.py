"""The prompt-file section shared by every trainer's ``data`` config (RL, SFT, reward model)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        if not isinstance(self.max_prompt_tokens, int) or self.max_prompt_tokens < 1:
            raise ValueError(f"config key max_prompt_tokens got {self.max_prompt_tokens!r}; allowed: an integer >= 1")
