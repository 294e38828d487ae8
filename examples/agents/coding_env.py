"""A small coding task with a sandboxed Python tool: the model may run code, then gives its solution, whose tests
run in the bubblewrap sandbox (the built-in code reward: the fraction of the row's tests that pass).

Use it as ``env.class: examples/agents/coding_env.py:CodingEnvironment`` on examples/agents/coding_tasks.jsonl
(fields ``prompt`` and ``tests``, assert statements). Needs bubblewrap (scripts/install_sandbox.sh): without it
the environment is refused before any model is built.
"""

from __future__ import annotations

from hybridflow.agents import EpisodeStart, ToolEnvironment, python_tool, row_messages
from hybridflow.rewards import SandboxConfig, code_reward

SYSTEM_PROMPT = ("You write Python functions. You may call the python tool to run code and see what it prints. "
                 "Finish with your solution in one ```python block and no tool call.")


class CodingEnvironment(ToolEnvironment):
    """The task as the user turn, the sandboxed ``python`` tool on offer, the row's tests as the reward."""

    max_turns = 3

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.sandbox = SandboxConfig(timeout_s=timeout_s)
        self.python = python_tool(self.sandbox)  # refuses here when the sandbox cannot run

    def start(self, row: dict) -> EpisodeStart:
        return EpisodeStart(row_messages(row, system_prompt=SYSTEM_PROMPT), [self.python])

    def reward(self, row: dict, messages: list[dict]) -> float:
        return code_reward(row["prompt"], messages[-1]["content"], tests=row["tests"], sandbox=self.sandbox)
