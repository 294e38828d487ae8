"""The calculator task for a chat model whose template renders no tools (SmolLM2-135M-Instruct): the tools (one
line each, from their schemas) and the hermes ``<tool_call>`` instruction go into the system prompt, and the
questions are products of two 2-digit numbers, which the model cannot multiply (greedy, without the tool:
docs/agents.md) but can copy.

Use it as ``env.class: examples/agents/calculator_smollm2.py:PromptedCalculatorEnvironment`` on rows of
``product_rows``, or through the OpenAI-compatible endpoint as ``PromptedCalculatorAgent`` (the agent program of
``calculator_endpoint.py`` with the same system prompt). The rendering choice is explicit:
``template_renders_tools(tokenizer)`` says whether the chat template writes the ``tools=`` it is given; where it
does not, the episode runner still passes ``tools=`` (the template ignores it), and this environment's opening (and
the agent program's first call) carries the tools instead, so the runner's prompt ids, the endpoint's, the SFT
rows' prompts and the held-out evaluation render the same text.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from hybridflow.agents import calculator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_endpoint import CalculatorAgent  # noqa: E402  (example files beside this one)
from calculator_env import SYSTEM_PROMPT, CalculatorEnvironment  # noqa: E402


def tools_system_prompt(instruction: str, schemas: list[dict]) -> str:
    """``instruction``, one line per tool (``name(argument: type, ...): description`` from its JSON schema, shorter
    than the schema itself: every prompt token is paid for in each SFT, GRPO and evaluation forward), and how to
    call one (the hermes format that ``HermesParser`` reads)."""
    lines = []
    for schema in schemas:
        function = schema["function"]
        arguments = ", ".join(f"{name}: {spec.get('type', 'any')}"
                              for name, spec in function["parameters"].get("properties", {}).items())
        lines.append(f"- {function['name']}({arguments}): {function.get('description', '')}")
    listed = "\n".join(lines)
    return (f"{instruction}\n\nTools:\n{listed}\n"
            'To call a tool, reply with <tool_call>{"name": <tool name>, "arguments": <arguments as JSON>}'
            "</tool_call> and nothing else; its result comes back in the next message.")


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the tool schemas passed as ``tools=`` into the prompt."""
    messages = [{"role": "user", "content": "hi"}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with_tools = tokenizer.apply_chat_template(messages, tools=[calculator.schema], tokenize=False,
                                               add_generation_prompt=True)
    return plain != with_tools


def product_rows(count: int, *, seed: int = 0) -> list[dict]:
    """``count`` questions "What is a * b?" with 10 <= a, b <= 99 and their answers (fields as ``make_rows``)."""
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        expression = f"{generator.randint(10, 99)} * {generator.randint(10, 99)}"
        rows.append({"prompt": f"What is {expression}?", "answer": calculator.call({"expression": expression}),
                     "expression": expression})
    return rows


PROMPTED_SYSTEM_PROMPT = tools_system_prompt(SYSTEM_PROMPT, [calculator.schema])
"""The calculator task's instruction with the calculator described in it."""


class PromptedCalculatorEnvironment(CalculatorEnvironment):
    """``CalculatorEnvironment`` (same tool, reward and turns) with the calculator described in its system prompt."""

    system_prompt = PROMPTED_SYSTEM_PROMPT


class PromptedCalculatorAgent(CalculatorAgent):
    """The endpoint agent program (``calculator_endpoint.solve``) as an agent program for a model whose template
    renders no tools: it writes the calculator into its system prompt itself and still sends ``tools=`` (ignored by
    such a template), so its calls render exactly the text ``PromptedCalculatorEnvironment`` opens with."""

    system_prompt = PROMPTED_SYSTEM_PROMPT
