"""Arithmetic with a calculator tool: questions of two to four operands, reward 1 for the right final answer.

Use it as ``env.class: examples/agents/calculator_env.py:CalculatorEnvironment`` on rows written by
``python examples/agents/calculator_env.py --rows 512 --out calculator.jsonl`` (fields ``prompt`` and
``answer``). The model may call ``calculator`` (hermes: ``<tool_call>{"name": "calculator", "arguments":
{"expression": "12*7"}}</tool_call>``) as often as ``max_turns`` allows, then answers ``Answer: <number>``.
"""

from __future__ import annotations

import argparse
import json
import random
import re

from hybridflow.agents import ToolEnvironment, calculator

SYSTEM_PROMPT = ("You solve arithmetic questions. You may call the calculator tool to compute. "
                 "When you know the result, reply with 'Answer: <number>' and nothing else.")
_ANSWER = re.compile(r"answer\s*[:=]?\s*(-?\d+)", re.IGNORECASE)


def make_rows(count: int, *, seed: int = 0, max_operand: int = 99) -> list[dict]:
    """``count`` questions like "What is 12 * 7 - 30?" with two to four operands and their integer answers."""
    generator = random.Random(seed)
    rows = []
    for _ in range(count):
        operands = [generator.randint(1, max_operand) for _ in range(generator.randint(2, 4))]
        expression = str(operands[0])
        for operand in operands[1:]:
            expression += f" {generator.choice('+-*')} {operand}"
        answer = calculator.call({"expression": expression})
        rows.append({"prompt": f"What is {expression}?", "answer": answer, "expression": expression})
    return rows


def final_answer(text: str) -> str | None:
    """The number after the last "Answer:" of the text, or None."""
    marked = _ANSWER.findall(text)
    return marked[-1] if marked else None


def demonstration(row: dict, *, tool_format: str = "hermes") -> list[dict]:
    """The ideal episode of a row as chat messages (for a short SFT before RL): one calculator call written in
    ``tool_format`` (hermes or llama3), its result, then ``Answer: <number>``."""
    arguments = {"expression": row["expression"]}
    if tool_format == "hermes":
        call = f'<tool_call>\n{json.dumps({"name": "calculator", "arguments": arguments})}\n</tool_call>'
    elif tool_format == "llama3":
        call = json.dumps({"name": "calculator", "parameters": arguments})
    else:
        raise ValueError(f"tool_format got {tool_format!r}; allowed: hermes, llama3")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["prompt"]},
            {"role": "assistant", "content": call},
            {"role": "tool", "name": "calculator", "content": calculator.call(arguments)},
            {"role": "assistant", "content": f"Answer: {row['answer']}"}]


class CalculatorEnvironment(ToolEnvironment):
    """The question as the user turn, the calculator as the tool; 1.0 when the final answer is right."""

    tools = (calculator,)
    system_prompt = SYSTEM_PROMPT
    max_turns = 4

    def reward(self, row: dict, messages: list[dict]) -> float:
        final = messages[-1]
        if final.get("tool_calls") or "<tool_call>" in final["content"]:
            return 0.0  # the turns ran out while the model was still calculating
        answer = final_answer(final["content"])
        return float(answer is not None and int(answer) == int(row["answer"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    arguments = parser.parse_args()
    with open(arguments.out, "w") as handle:
        for row in make_rows(arguments.rows, seed=arguments.seed):
            handle.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
