"""The calculator task as an agent program written against the ``openai`` client, trained through the endpoint.

The agent loop below knows nothing of hybridflow's token ids: it calls ``client.chat.completions.create`` with the
calculator's schema, runs the tool calls it gets back, appends the results as tool messages, and returns 1.0 for a
right ``Answer: <number>``. In a run (``env.class: examples/agents/calculator_endpoint.py:CalculatorAgent``,
rows from ``python examples/agents/calculator_env.py --out calculator.jsonl``) hybridflow points the client at the
step's endpoint and trains the ids the endpoint recorded (docs/agents.md, "The OpenAI-compatible endpoint").
The same function runs against any OpenAI-compatible server, e.g. a vLLM one, without hybridflow:

    python examples/agents/calculator_endpoint.py --base-url http://127.0.0.1:8000/v1 --model NAME --rows 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from hybridflow.agents import OpenAIAgentEnvironment, calculator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_env import SYSTEM_PROMPT, final_answer, make_rows  # noqa: E402 (the task's rows and answers)


def run_tool(name: str, arguments: str) -> str:
    """The calculator's result for one tool call, or the error the model reads instead."""
    if name != calculator.name:
        return f"error: unknown tool {name!r}; the only tool is {calculator.name!r}"
    try:
        return calculator.call(json.loads(arguments))
    except Exception as error:  # noqa: BLE001 - a bad call is the model's mistake: it reads why
        return f"error: {error}"


async def solve(client, row: dict, *, model: str = "policy", max_calls: int = 4,
                system_prompt: str = SYSTEM_PROMPT) -> float:
    """One episode: up to ``max_calls`` completions; 1.0 if the final answer is right, else 0.0. The calculator's
    schema goes in ``tools=``; ``system_prompt`` opens the chat (a model whose template renders no tools gets them
    described there: ``calculator_smollm2.PromptedCalculatorAgent``)."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": row["prompt"]}]
    for _ in range(max_calls):
        response = await client.chat.completions.create(model=model, messages=messages, tools=[calculator.schema])
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            answer = final_answer(reply.content or "")
            return float(answer is not None and int(answer) == int(row["answer"]))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return 0.0  # the calls ran out while the model was still calculating


class CalculatorAgent(OpenAIAgentEnvironment):
    """``solve`` as a hybridflow environment: one call per allowed turn (``env.max_turns`` overrides the class's)."""

    max_turns = 4
    system_prompt = SYSTEM_PROMPT

    async def agent(self, client, row: dict) -> float:
        return await solve(client, row, max_calls=self.max_turns, system_prompt=self.system_prompt)


async def _main(base_url: str, model: str, rows: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused")
    rewards = await asyncio.gather(*(solve(client, row, model=model) for row in make_rows(rows, seed=1)))
    print(f"accuracy {sum(rewards) / len(rewards):.3f} over {len(rewards)} questions")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, default=4)
    arguments = parser.parse_args()
    asyncio.run(_main(arguments.base_url, arguments.model, arguments.rows))
