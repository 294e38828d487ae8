"""The calculator example that learns (examples/agents/calculator_learns.py): its SFT rows are the runner's ids
(the tiny model's template renders the tools; SmolLM2's does not, so they go into the system prompt), and, in a
short form, SFT -> GRPO with the calculator environment runs and measures the held-out episodes."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from hybridflow.agents import checked_start, make_environment
from hybridflow.agents.episode import ChatTokens
from hybridflow.data.encoding import PromptEncoder
from hybridflow.models import smollm2_path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "agents" / "calculator_learns.py"


@pytest.fixture(scope="module")
def learns():
    return runpy.run_path(str(EXAMPLE))


@pytest.fixture(scope="module")
def base_dir(learns, tmp_path_factory):
    return learns["build_base"](tmp_path_factory.mktemp("calclearn") / "base", 0)


def assert_sft_rows_are_runner_ids(learns, tokenizer, environment, rows):
    """Each tool-using demonstration's two SFT rows encode to the runner's prompt ids, then (after the call and
    its end of turn) the tool result's observation ids."""
    demos = learns["sft_rows"](rows, tokenizer, tool_share=1.0, seed=0, environment=environment)
    assert len(demos) == 2 * len(rows)
    encoder, chat = PromptEncoder(tokenizer, chat_template="never"), ChatTokens(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for index, row in enumerate(rows):
        opening = checked_start(make_environment(environment), row)
        tools = [tool.schema for tool in opening.tools]
        call, answer = demos[2 * index], demos[2 * index + 1]
        prompt_ids = chat.prompt_ids(opening.messages, tools)
        assert encoder.encode_prompts([call["prompt"]])[0] == prompt_ids
        # the SFT response ends with the end of turn the runner stops at, then the tool result's observation ids
        call_ids = encoder.encode_responses([call["response"]])[0]
        assert call_ids[-1] == end and '"calculator"' in call["response"]
        result = {"role": "tool", "name": "calculator", "content": row["answer"]}
        observation = chat.observation_ids([result], tools, closed_by="<|im_end|>")
        assert encoder.encode_prompts([answer["prompt"]])[0] == prompt_ids + call_ids + observation
        assert answer["response"] == f"Answer: {row['answer']}"
    direct = learns["sft_rows"](rows, tokenizer, tool_share=0.0, seed=0, environment=environment)
    assert [row["response"] for row in direct] == [f"Answer: {row['answer']}" for row in rows]


def test_sft_rows_are_the_token_ids_the_episode_runner_samples_after(learns, base_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    calculator_env, _ = learns["_examples"]()
    environment = learns["environment_for"](tokenizer)
    assert environment is calculator_env.CalculatorEnvironment  # the tiny template renders tools=
    assert_sft_rows_are_runner_ids(learns, tokenizer, environment, calculator_env.make_rows(6, seed=3))


@pytest.mark.needs_smollm2
@pytest.mark.skipif(smollm2_path() is None, reason="SmolLM2-135M not converted; run `python scripts/get_smollm2.py`")
def test_smollm2_gets_the_tools_in_its_system_prompt_and_its_sft_rows_are_the_runner_ids(learns):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    prompted = learns["_prompted"]()
    assert not prompted.template_renders_tools(tokenizer)
    environment = learns["environment_for"](tokenizer)
    assert environment is prompted.PromptedCalculatorEnvironment
    assert learns["environment_spec"](environment).endswith("calculator_smollm2.py:PromptedCalculatorEnvironment")
    rows = prompted.product_rows(6, seed=3)
    assert all(10 <= int(a) <= 99 and 10 <= int(b) <= 99 and int(row["answer"]) == int(a) * int(b)
               for row in rows for a, b in [row["expression"].split(" * ")])
    opening = checked_start(make_environment(environment), rows[0])
    prompt_ids = ChatTokens(tokenizer).prompt_ids(opening.messages, [tool.schema for tool in opening.tools])
    rendered = tokenizer.decode(prompt_ids)
    assert "- calculator(expression: string): Evaluate an arithmetic expression" in rendered
    assert '<tool_call>{"name": <tool name>, "arguments": <arguments as JSON>}</tool_call>' in rendered
    assert rendered.count("<|im_start|>system") == 1 and rendered.endswith("<|im_start|>assistant\n")
    assert_sft_rows_are_runner_ids(learns, tokenizer, environment, rows)


def test_the_config_refuses_a_tool_share_outside_zero_to_one_an_unknown_task_and_model(learns, tmp_path):
    with pytest.raises(ValueError, match="tool_share"):
        learns["LearnsConfig"](tool_share=1.5)
    with pytest.raises(ValueError, match="task got 'division'"):
        learns["LearnsConfig"](task="division")
    with pytest.raises(ValueError, match="model got .*a Hugging Face directory"):
        learns["LearnsConfig"](model=str(tmp_path))


@pytest.mark.slow
def test_sft_then_grpo_with_the_calculator_environment_runs_and_measures_held_out_episodes(learns, tmp_path):
    config = learns["LearnsConfig"](output_dir=str(tmp_path), num_train=16, num_val=4, sft_steps=4,
                                    sft_batch_size=8, grpo_steps=2, prompts_per_step=2, samples_per_prompt=2,
                                    val_every=1, max_new_tokens=24)
    summary = learns["run"](config)
    for stage in ("before", "after"):
        assert set(summary[stage]) == {"tool_call_rate", "accuracy", "turns_mean"}
        assert 0.0 <= summary[stage]["tool_call_rate"] <= 1.0 and 0.0 <= summary[stage]["accuracy"] <= 1.0
        assert 1.0 <= summary[stage]["turns_mean"] <= 3.0
    assert [record["step"] for record in summary["curve"]] == [0, 1, 2]
    trained = summary["curve"][1:]
    assert all("agent/tool_calls_per_episode" in record and "val/score_mean" in record for record in trained)
    assert json.loads((tmp_path / "summary.json").read_text())["after"] == summary["after"]
    assert (tmp_path / "grpo" / "final" / "actor" / "config.json").exists()
    assert (tmp_path / "grpo" / "episodes.jsonl").exists()
