"""The calculator example that learns (examples/agents/calculator_learns.py): its SFT rows are the runner's ids
(the tiny model's template renders the tools; SmolLM2's does not, so they go into the system prompt) and the ids the
OpenAI-compatible endpoint records for its agent program, and, in a short form, SFT -> GRPO with the calculator
environment (or through the endpoint) runs and measures the held-out episodes."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
from test_agents_episodes import EOS, IM_END, ScriptedRollout

from hybridflow.agents import checked_start, make_environment
from hybridflow.agents.endpoint import EndpointRunner
from hybridflow.agents.episode import ChatTokens
from hybridflow.agents.runner import EpisodeLimits
from hybridflow.agents.tool_calls import make_parser
from hybridflow.data.encoding import PromptEncoder
from hybridflow.engine.rollout import SamplingOptions
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


def assert_endpoint_ids_are_the_sft_rows(learns, tokenizer, agent, environment, rows):
    """The endpoint's episode of each row, with the model's turns scripted as the demonstration's call and answer:
    the agent program's first call renders to the first SFT row's prompt ids, its second call (after running the
    calculator itself) is sampled from the second SFT row's prompt ids, and it is rewarded 1."""
    demos = learns["sft_rows"](rows, tokenizer, tool_share=1.0, seed=0, environment=environment)
    encoder, end = PromptEncoder(tokenizer, chat_template="never"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end in (EOS, IM_END)  # ScriptedRollout ends a turn on these ids with finish_reason "stop"
    turns = {index: encoder.encode_responses([demos[2 * index]["response"], demos[2 * index + 1]["response"]])
             for index in range(len(rows))}
    rollout = ScriptedRollout(turns)
    runner = EndpointRunner(rollout, chat=ChatTokens(tokenizer), make_env=lambda: make_environment(agent, max_turns=3),
                            parser=make_parser("hermes"), limits=EpisodeLimits(max_turns=3, max_episode_tokens=4096),
                            options=SamplingOptions(max_new_tokens=256, eos_token_ids=(end,)))
    episodes = runner.run(rows, [[end]] * len(rows))
    for index, episode in enumerate(episodes):
        call, answer = encoder.encode_prompts([demos[2 * index]["prompt"], demos[2 * index + 1]["prompt"]])
        assert episode.failed is None and episode.done and episode.turns == 2 and episode.reward == 1.0
        assert episode.prompt_ids == call
        second = [request for request in rollout.requests if request.request_id == f"episode-{index}-turn-1"]
        assert list(second[0].prompt_ids) == answer
        observation = [segment.token_ids for segment in episode.segments if segment.kind == "observation"]
        assert call + turns[index][0] + observation[0] == answer
        assert episode.messages[3] == {"role": "tool", "tool_call_id": "call-0_0", "name": "calculator",
                                       "content": rows[index]["answer"]}


def test_sft_rows_are_the_token_ids_the_episode_runner_samples_after(learns, base_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    calculator_env, _ = learns["_examples"]()
    environment = learns["environment_for"](tokenizer)
    assert environment is calculator_env.CalculatorEnvironment  # the tiny template renders tools=
    assert_sft_rows_are_runner_ids(learns, tokenizer, environment, calculator_env.make_rows(6, seed=3))


def test_the_endpoint_agent_sends_exactly_the_sft_rows_prompt_ids(learns, base_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    calculator_env, _ = learns["_examples"]()
    agent = learns["endpoint_agent_for"](tokenizer)
    assert agent.__name__ == "CalculatorAgent"  # the tiny template renders tools=: they go there only
    assert learns["environment_spec"](agent).endswith("calculator_endpoint.py:CalculatorAgent")
    assert_endpoint_ids_are_the_sft_rows(learns, tokenizer, agent, learns["environment_for"](tokenizer),
                                         calculator_env.make_rows(3, seed=5))


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
    agent = learns["endpoint_agent_for"](tokenizer)
    assert agent is prompted.PromptedCalculatorAgent and agent.system_prompt == environment.system_prompt
    assert_endpoint_ids_are_the_sft_rows(learns, tokenizer, agent, environment, rows[:3])


def test_the_config_refuses_a_tool_share_outside_zero_to_one_an_unknown_task_model_and_agent(learns, tmp_path):
    with pytest.raises(ValueError, match="tool_share"):
        learns["LearnsConfig"](tool_share=1.5)
    with pytest.raises(ValueError, match="task got 'division'"):
        learns["LearnsConfig"](task="division")
    with pytest.raises(ValueError, match="agent got 'remote'; allowed: environment, endpoint"):
        learns["LearnsConfig"](agent="remote")
    with pytest.raises(ValueError, match="model got .*a Hugging Face directory"):
        learns["LearnsConfig"](model=str(tmp_path))


SHORT_FORM = {"num_train": 16, "num_val": 4, "sft_steps": 4, "sft_batch_size": 8, "grpo_steps": 2,
              "prompts_per_step": 2, "samples_per_prompt": 2, "val_every": 1, "max_new_tokens": 24}
"""The reduced command of docs/agents.md ("An example that learns")."""


def assert_held_out_measured(summary: dict) -> None:
    for stage in ("before", "after"):
        assert set(summary[stage]) == {"tool_call_rate", "accuracy", "turns_mean", "row_rewards"}
        rewards = summary[stage]["row_rewards"]  # greedy: one episode per held-out row
        assert rewards and summary[stage]["accuracy"] == pytest.approx(sum(rewards) / len(rewards))
        assert 0.0 <= summary[stage]["tool_call_rate"] <= 1.0 and 0.0 <= summary[stage]["accuracy"] <= 1.0
        assert 1.0 <= summary[stage]["turns_mean"] <= 3.0
    assert [record["step"] for record in summary["curve"]] == [0, 1, 2]


@pytest.mark.slow
def test_sft_then_grpo_with_the_calculator_environment_runs_and_measures_held_out_episodes(learns, tmp_path):
    config = learns["LearnsConfig"](output_dir=str(tmp_path), **SHORT_FORM)
    summary = learns["run"](config)
    assert_held_out_measured(summary)
    trained = summary["curve"][1:]
    assert all("agent/tool_calls_per_episode" in record and "val/score_mean" in record for record in trained)
    assert json.loads((tmp_path / "summary.json").read_text())["after"] == summary["after"]
    assert (tmp_path / "grpo" / "final" / "actor" / "config.json").exists()
    assert (tmp_path / "grpo" / "episodes.jsonl").exists()


def test_sft_then_grpo_through_the_endpoint_trains_the_agent_programs_episodes(learns, tmp_path, monkeypatch):
    served = []  # every chat-completion call the endpoint answered (training and validation episodes)
    reply = EndpointRunner._reply
    monkeypatch.setattr(EndpointRunner, "_reply", lambda self, *args: served.append(args[1].request_id) or
                        reply(self, *args))
    config = learns["LearnsConfig"](output_dir=str(tmp_path), agent="endpoint", **SHORT_FORM)
    summary = learns["run"](config)
    assert_held_out_measured(summary)
    assert summary["config"]["agent"] == "endpoint"
    records = [json.loads(line) for line in (tmp_path / "grpo" / "episodes.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1] * 4 + [2] * 4  # every episode of every step recorded
    assert all(record["turns"] >= 1 and record["messages"][0]["role"] == "system" for record in records)
    assert len(served) >= sum(record["turns"] for record in records) > 0
    for point in summary["curve"][1:]:
        step = [record for record in records if record["step"] == point["step"]]
        assert point["endpoint/calls_per_episode"] == sum(record["turns"] for record in step) / 4
        assert 0.0 <= point["endpoint/tool_calls_per_episode"] <= 3.0
        assert "agent/tool_calls_per_episode" not in point and "val/score_mean" in point
    assert (tmp_path / "grpo" / "final" / "actor" / "config.json").exists()
