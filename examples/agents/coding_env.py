"""A small coding task with a sandboxed Python tool: the model may run code, then gives its solution, whose tests
run in the bubblewrap sandbox (the built-in code reward: the fraction of the row's tests that pass).

Use it as ``env.class: examples/agents/coding_env.py:CodingEnvironment`` on examples/agents/coding_tasks.jsonl
(fields ``prompt``, ``tests`` (assert statements), ``entry_point`` (the function asked for) and ``split``
(``train`` or ``heldout``); ``task_rows(split)`` reads one split). The graded code is the last ```python block
that defines ``entry_point`` (``code_reward``'s ``entry_point``), so a solution followed by an "example usage"
block is graded on the solution. ``PromptedCodingEnvironment`` writes the ``python`` tool into the system prompt,
for chat templates that render no ``tools=`` (SmolLM2's). Needs bubblewrap (scripts/install_sandbox.sh): without
it the environment is refused before any model is built.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hybridflow.agents import EpisodeStart, ToolEnvironment, python_tool, row_messages
from hybridflow.rewards import SandboxConfig, code_reward

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from calculator_smollm2 import tools_system_prompt  # noqa: E402  (an example file beside this one)

SYSTEM_PROMPT = ("You write Python functions. You may call the python tool to run code and see what it prints. "
                 "Finish with your solution in one ```python block and no tool call.")
TASKS = HERE / "coding_tasks.jsonl"
SPLITS = ("train", "heldout")


def task_rows(split: str | None = None, path: Path = TASKS) -> list[dict]:
    """The task rows of ``split`` ("train" or "heldout"; None: all of them), in file order."""
    if split is not None and split not in SPLITS:
        raise ValueError(f"split got {split!r}; allowed: {', '.join(SPLITS)} or None")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if split is None or row["split"] == split]


class CodingEnvironment(ToolEnvironment):
    """The task as the user turn, the sandboxed ``python`` tool on offer, the row's tests as the reward."""

    max_turns = 3
    system_prompt = SYSTEM_PROMPT

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.sandbox = SandboxConfig(timeout_s=timeout_s)
        self.python = python_tool(self.sandbox)  # refuses here when the sandbox cannot run

    def start(self, row: dict) -> EpisodeStart:
        return EpisodeStart(row_messages(row, system_prompt=self.system_prompt), [self.python])

    def reward(self, row: dict, messages: list[dict]) -> float:
        return code_reward(row["prompt"], messages[-1]["content"], tests=row["tests"], sandbox=self.sandbox,
                           entry_point=row.get("entry_point"))


class PromptedCodingEnvironment(CodingEnvironment):
    """``CodingEnvironment`` (same tool, reward and turns) with the ``python`` tool described in its system prompt
    (``tools_system_prompt``: one line per tool and the hermes ``<tool_call>`` instruction)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        super().__init__(timeout_s)
        self.system_prompt = tools_system_prompt(SYSTEM_PROMPT, [self.python.schema])
