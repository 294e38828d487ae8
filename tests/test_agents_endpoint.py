"""The OpenAI-compatible endpoint: agent programs written against the real ``openai`` client drive episodes on the
tiny model's native rollout; the episodes trained are token-exact (prompt + sampled + observation ids, the loss mask
on sampled ids only), a call that edits the history is refused, and a GRPO step trains the recorded episodes."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import openai
import pytest
from test_agents_episodes import (  # noqa: F401 (run_inputs: a fixture, the tokenizer and rows of a training run)
    EOS,
    IM_END,
    REASONING_TEMPLATE,
    ScriptedRollout,
    _agent_config,
    _train,
    add,
    chat_tokenizer,
    encode,
    run_inputs,
    tiny_native_rollout,
)

from hybridflow.agents import OpenAIAgentEnvironment
from hybridflow.agents.endpoint import EndpointRunner
from hybridflow.agents.endpoint_messages import EndpointError, check_body, new_messages, sampling_changes
from hybridflow.agents.episode import ChatTokens
from hybridflow.agents.episode_batch import episode_tensors
from hybridflow.agents.loading import load_environment
from hybridflow.agents.runner import EpisodeLimits
from hybridflow.agents.tool_calls import make_parser
from hybridflow.engine.rollout import SamplingOptions

EXAMPLE_AGENT = Path(__file__).resolve().parents[1] / "examples" / "agents" / "calculator_endpoint.py"
GLUE = "<|im_start|>{role}\n{content}<|im_end|>\n<|im_start|>assistant\n"
"""ChatML between an assistant turn's <|im_end|> and the next turn: the new message, the next assistant header."""


class ThreeCallAgent(OpenAIAgentEnvironment):
    """Three calls: a tool result after the first reply, a user message after the second; reward 1 + row index.
    Even rows send the reply object back as it came, odd rows rebuild it as a plain dict."""

    async def agent(self, client, row):
        assert [model.id async for model in client.models.list()] == ["hybridflow-policy"]
        messages = [{"role": "user", "content": row["prompt"]}]
        for turn, reply in enumerate([{"role": "tool", "tool_call_id": "t0", "content": "r0"},
                                      {"role": "user", "content": "more"}, None]):
            response = await client.chat.completions.create(model="policy", messages=messages, tools=[add.schema],
                                                            max_tokens=5 + turn)
            message = response.choices[0].message
            assert response.usage.completion_tokens <= 5 + turn
            messages.append(message.model_dump(exclude_none=True) if row["index"] % 2 == 0
                            else {"role": "assistant", "content": message.content})
            if reply is not None:
                messages.append(reply)
        return 1.0 + row["index"]


def run_agents(env_class, rows, *, max_turns=None, max_new_tokens=6, agent_timeout_s=None):
    """Run ``env_class``'s agent per row on the tiny model, which samples only "a".."h" and <|im_end|> (so that some
    turns stop at <|im_end|> and others are cut by their length); the episodes, the requests, the tokenizer and the
    calls in flight at each rollout step."""
    tokenizer = chat_tokenizer(REASONING_TEMPLATE, merge_newlines=False)
    allowed = {IM_END, *encode(tokenizer, "abcdefgh")}
    suppressed = tuple(token for token in range(256) if token not in allowed)
    rollout = tiny_native_rollout()
    requests, submit, step = [], rollout.submit, rollout.step
    rollout.submit = lambda request: (requests.append(request), submit(request))[1]
    in_flight = []  # how many calls each rollout step advanced together

    def counted_step(**kwargs):
        in_flight.append(rollout.pending())
        return step(**kwargs)

    rollout.step = counted_step
    runner = EndpointRunner(rollout, chat=ChatTokens(tokenizer), make_env=env_class, parser=make_parser("hermes"),
                            options=SamplingOptions(max_new_tokens=max_new_tokens, eos_token_ids=(IM_END,), seed=3,
                                                    suppress_tokens=suppressed),
                            limits=EpisodeLimits(max_turns=max_turns, max_episode_tokens=1024, decode_chunk_tokens=2,
                                                 agent_timeout_s=agent_timeout_s))
    return runner.run(rows, [[1]] * len(rows)), requests, tokenizer, in_flight


def test_an_openai_client_agent_trains_exactly_the_ids_the_endpoint_sampled_and_appended():
    rows = [{"prompt": f"question {index}", "index": index} for index in range(4)]
    episodes, requests, tokenizer, in_flight = run_agents(ThreeCallAgent, rows)
    assert max(in_flight) >= 2  # the episodes' calls were generated together, not one at a time
    tensors = episode_tensors(episodes, pad_token_id=0, eos_token_id=IM_END)
    P = tensors["prompts"].shape[1]
    turn_ends = [segment.token_ids[-1] == IM_END for episode in episodes for segment in episode.segments
                 if segment.kind == "sampled"]
    assert set(turn_ends) == {True, False}  # turns closed by <|im_end|> and turns cut by their length both occur
    for index, episode in enumerate(episodes):
        assert episode.failed is None and episode.done and episode.turns == 3
        assert episode.turn_rewards == [0.0, 0.0, 1.0 + index]
        prompt = encode(tokenizer, tokenizer.apply_chat_template(
            [{"role": "user", "content": f"question {index}"}], tools=[add.schema], tokenize=False,
            add_generation_prompt=True))
        assert episode.prompt_ids == prompt
        contexts = [list(request.prompt_ids) for request in requests if request.request_id.startswith(
            f"episode-{index}-")]
        sampled = [segment.token_ids for segment in episode.segments if segment.kind == "sampled"]
        assert all(0 < len(ids) <= 5 + turn for turn, ids in enumerate(sampled))  # the call's max_tokens held
        pieces = []
        for turn, (role, content) in enumerate([("tool", "r0"), ("user", "more")]):
            glue = ("" if sampled[turn][-1] == IM_END else "<|im_end|>") + "\n" + GLUE.format(role=role,
                                                                                            content=content)
            pieces += [("sampled", sampled[turn]), ("observation", encode(tokenizer, glue))]
        pieces.append(("sampled", sampled[2]))
        # token in: each call was sampled from exactly the ids before it, not from a re-rendered history
        assert contexts == [prompt, prompt + pieces[0][1] + pieces[1][1],
                            prompt + [token for _, ids in pieces[:4] for token in ids]]
        real = tensors["attention_mask"][index].bool()
        assert tensors["input_ids"][index][real].tolist() == prompt + [token for _, ids in pieces for token in ids]
        assert tensors["response_mask"][index][real[P:]].tolist() == [
            int(kind == "sampled") for kind, ids in pieces for _ in ids]
        assert tensors["response_mask"][index][~real[P:]].sum() == 0
        assert all(value < 0 for value, bit in zip(episode.sampled_logprobs, episode.loss_mask) if bit)
        replies = [message["content"] for message in episode.messages if message["role"] == "assistant"]
        assert replies == [tokenizer.decode(ids[:-1] if ids[-1] == IM_END else ids) for ids in sampled]


class EditingAgent(OpenAIAgentEnvironment):
    """Row 0 rewrites its question before the second call; row 1 behaves; the endpoint must refuse row 0 only."""

    def agent(self, client, row):  # a plain def: runs with a synchronous openai.OpenAI
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
        if row["index"] == 0:
            messages[0] = {"role": "user", "content": row["prompt"] + " (edited)"}
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "again"}]
        try:
            client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError as error:
            assert error.code == "history_edited" and row["index"] == 0
            return 5.0
        return 1.0


def test_a_call_that_edits_the_history_is_refused_and_fails_only_its_episode():
    episodes, requests, _, _ = run_agents(EditingAgent, [{"prompt": "q0", "index": 0}, {"prompt": "q1", "index": 1}])
    assert episodes[0].failed.startswith("history_edited: message 0 (user) differs") and episodes[0].turns == 1
    assert not episodes[0].done
    assert episodes[1].failed is None and episodes[1].done and episodes[1].turns == 2 and episodes[1].reward == 1.0
    assert sorted(request.request_id for request in requests) == [
        "episode-0-turn-0", "episode-1-turn-0", "episode-1-turn-1"]
    tensors = episode_tensors(episodes, pad_token_id=0, eos_token_id=IM_END)
    assert tensors["episode_trainable"].tolist() == [False, True]


class ChattyAgent(OpenAIAgentEnvironment):
    """Calls until the endpoint refuses (max_turns), then lets the error out; row 1's agent returns a string."""

    async def agent(self, client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        while row["index"] == 0:
            reply = await client.chat.completions.create(model="policy", messages=messages, stop=["\n"], seed=11)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="policy", messages=messages)
        return "not a number"


def test_calls_past_max_turns_end_the_episode_truncated_and_a_bad_reward_fails_it():
    episodes, requests, tokenizer, _ = run_agents(ChattyAgent, [{"prompt": "q0", "index": 0},
                                                             {"prompt": "q1", "index": 1}], max_turns=2)
    assert episodes[0].truncated == "max_turns" and episodes[0].turns == 2 and episodes[0].failed is None
    assert episodes[0].turn_rewards == [0.0, 0.0] and not episodes[0].done
    assert "ChattyAgent.agent raised TypeError" in episodes[1].failed and "'not a number'" in episodes[1].failed
    stops = [request.options for request in requests if request.request_id.startswith("episode-0-")]
    assert all(options.seed == 11 and options.stop_sequences == (tuple(encode(tokenizer, "\n")),)
               for options in stops)


class StuckAgent(OpenAIAgentEnvironment):
    """One call, then row "stuck" never returns: an async agent waits forever, a plain-def one (``SyncStuckAgent``)
    sleeps in its thread."""

    async def agent(self, client, row):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        if row.get("stuck"):
            await asyncio.Event().wait()
        return 1.0


class SyncStuckAgent(OpenAIAgentEnvironment):
    def agent(self, client, row):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
        if row.get("stuck"):
            time.sleep(3600)  # a daemon thread: abandoned when the episode's time runs out
        return 1.0


@pytest.mark.parametrize("env_class", [StuckAgent, SyncStuckAgent], ids=["async", "plain_def"])
def test_an_agent_that_never_returns_fails_its_episode_after_agent_timeout_s_and_the_step_goes_on(env_class):
    started = time.perf_counter()
    episodes, _, _, _ = run_agents(env_class, [{"prompt": "q0", "index": 0, "stuck": True},
                                               {"prompt": "q1", "index": 1}], agent_timeout_s=2.0)
    assert time.perf_counter() - started < 600  # it ended at all (without the timeout it waits forever)
    assert f"{env_class.__name__}.agent raised TimeoutError" in episodes[0].failed
    assert "did not return within 2 s (env.agent_timeout_s)" in episodes[0].failed
    assert episodes[0].turns == 1 and not episodes[0].done and episodes[0].reward == 0.0
    assert episodes[1].failed is None and episodes[1].done and episodes[1].reward == 1.0


def test_agent_timeout_s_must_be_a_positive_number_of_seconds():
    from hybridflow.agents.config import EnvConfig

    with pytest.raises(ValueError, match=r"config key agent_timeout_s got 0; allowed: a number of seconds > 0"):
        EnvConfig(class_path="env.py:Env", agent_timeout_s=0)


class CountingAgent(OpenAIAgentEnvironment):
    """Two calls per episode with a user turn between; reward: distinct characters the model wrote (learnable by a
    random tiny model); row "poison" raises inside the agent."""

    max_turns = 3

    async def agent(self, client, row):
        messages = list(row["messages"])
        written = ""
        for turn in range(2):
            if turn and row.get("poison"):
                raise RuntimeError("poisoned row")
            reply = await client.chat.completions.create(model="policy", messages=messages)
            written += reply.choices[0].message.content
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        return float(len(set(written)))


def test_a_grpo_step_trains_the_episodes_the_endpoint_recorded(run_inputs, tmp_path):  # noqa: F811
    config = _agent_config(run_inputs, tmp_path, f"env.class={__file__}:CountingAgent",
                           "algorithm.advantage_estimator=grpo", "actor.loss.old_log_probs=recompute")
    history, batch = _train(config)
    metrics = history[-1]
    assert metrics["agent/turns_mean"] > 1.5 and metrics["agent/env_failures"] == 2.0
    # the training forward over the recorded ids gives back each sampled token's log-prob: token-exact
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-5
    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert [bool(record["failed"]) for record in records] == [False, False, True, True] + [False] * 4
    P = batch["prompts"].shape[1]
    for row, record in enumerate(records):
        real = batch["attention_mask"][row].bool()
        assert batch["input_ids"][row][real].tolist() == record["prompt_ids"] + record["response_ids"]
        expected_mask = [0] * len(record["response_ids"]) if record["failed"] else record["loss_mask"]
        assert batch["response_mask"][row][real[P:]].tolist() == expected_mask
        if not record["failed"]:
            assert record["turns"] == 2 and record["loss_mask"].count(0) > 0


def test_the_calculator_agent_example_runs_the_tool_calls_and_is_rewarded_for_the_right_answer():
    env_class = load_environment(f"{EXAMPLE_AGENT}:CalculatorAgent")
    rows = sys.modules[env_class.__module__].make_rows(2, seed=0)
    tokenizer = chat_tokenizer()  # ChatML offering tools, hermes tool calls
    call = json.dumps({"name": "calculator", "arguments": {"expression": rows[0]["expression"]}})
    turns = {0: [encode(tokenizer, f"<tool_call>{call}</tool_call>") + [IM_END],
                 encode(tokenizer, f"Answer: {rows[0]['answer']}") + [IM_END]],
             1: [encode(tokenizer, f"Answer: {int(rows[1]['answer']) + 1}") + [IM_END]]}
    rollout = ScriptedRollout(turns)
    runner = EndpointRunner(rollout, chat=ChatTokens(tokenizer), make_env=env_class, parser=make_parser("hermes"),
                            options=SamplingOptions(max_new_tokens=256, eos_token_ids=(EOS, IM_END)),
                            limits=EpisodeLimits(max_episode_tokens=4096))
    right, wrong = runner.run(rows, [[1]] * 2)
    assert right.done and right.turns == 2 and right.reward == 1.0 and right.failed is None
    assert [message["role"] for message in right.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert right.messages[3]["content"] == rows[0]["answer"]  # the agent ran the calculator on the parsed call
    assert right.messages[2]["tool_calls"][0]["function"]["name"] == "calculator"
    assert wrong.done and wrong.turns == 1 and wrong.reward == 0.0
    second = [request for request in rollout.requests if request.request_id == "episode-0-turn-1"][0]
    tool_turn = encode(tokenizer, f"\n<|im_start|>tool\n{rows[0]['answer']}<|im_end|>\n<|im_start|>assistant\n")
    assert list(second.prompt_ids) == right.prompt_ids + turns[0][0] + tool_turn


def test_a_call_must_extend_the_history_with_observations_and_keep_its_tools():
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
               {"role": "tool", "tool_call_id": "c0", "content": "1"}]
    sent, tools = check_body({"messages": [*history, {"role": "assistant", "content": [{"type": "text", "text": "b"}],
                                                      "tool_calls": None}, {"role": "user", "content": "go"}]})
    assert sent[3] == {"role": "assistant", "content": "b"} and tools == []
    assert new_messages(history + [sent[3]], [], sent, []) == [{"role": "user", "content": "go"}]
    for history_now, messages, tools_now, code in [
            (history, sent, [add.schema], "tools_changed"),
            (history, sent[:2], [], "history_edited"),  # fewer messages than the episode has
            (history, [sent[0], {"role": "assistant", "content": "A"}, *sent[2:]], [], "history_edited"),
            (history, [*history[:2], {"role": "tool", "tool_call_id": "c9", "content": "1"}], [], "history_edited"),
            (history[:2], [*history[:2], {"role": "assistant", "content": "x"}, sent[4]], [], "history_edited")]:
        with pytest.raises(EndpointError) as refused:
            new_messages(history_now, [], messages, tools_now)
        assert refused.value.code == code
    for body, code in [({"messages": []}, "bad_messages"), ({"messages": history, "n": 2}, "unsupported_n"),
                       ({"messages": history, "stream": True}, "unsupported_stream"),
                       ({"messages": history[:2]}, "assistant_prefill"),
                       ({"messages": [{"role": "robot", "content": "x"}]}, "bad_message"),
                       ({"messages": history, "tools": [{"name": "f"}]}, "bad_tools")]:
        with pytest.raises(EndpointError) as refused:
            check_body(body)
        assert refused.value.code == code


def test_a_call_sets_its_sampling_options_within_the_steps_limits():
    def encode_text(text):
        return [ord(character) for character in text]

    assert sampling_changes({}, encode_text, max_new_tokens=8) == {"max_new_tokens": 8}
    assert sampling_changes({"temperature": 0, "max_tokens": 3, "seed": 5, "stop": "ab"}, encode_text,
                            max_new_tokens=8) == {"greedy": True, "max_new_tokens": 3, "seed": 5,
                                                  "stop_sequences": ((97, 98),)}
    assert sampling_changes({"temperature": 0.7, "top_p": 0.9, "max_completion_tokens": 99, "stop": ["x", "yz"]},
                            encode_text, max_new_tokens=8) == {
        "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8, "stop_sequences": ((120,), (121, 122))}
    for body in [{"temperature": -1}, {"top_p": 2}, {"max_tokens": 0}, {"stop": [""]}, {"seed": "1"},
                 {"temperature": True}]:
        with pytest.raises(EndpointError):
            sampling_changes(body, encode_text, max_new_tokens=8)


def test_a_step_on_the_vllm_backend_trains_the_episodes_the_endpoint_recorded(run_inputs, tmp_path):  # noqa: F811
    pytest.importorskip("vllm")
    tiny = "actor.model.tiny={hidden_size: 128, intermediate_size: 256, num_attention_heads: 4}"  # vLLM: head dim 32
    history, batch = _train(_agent_config(run_inputs, tmp_path, tiny, f"env.class={__file__}:CountingAgent",
                                          "actor.generation.backend=vllm", "actor.generation.vllm_kv_cache_gib=0.0625",
                                          "actor.loss.old_log_probs=recompute"))
    metrics = history[-1]
    assert metrics["agent/turns_mean"] > 1.5 and metrics["agent/observation_tokens_mean"] > 0
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-3  # vLLM's kernels, not the training forward's
    records = [json.loads(line) for line in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    for row, record in enumerate(records):
        real = batch["attention_mask"][row].bool()
        assert batch["input_ids"][row][real].tolist() == record["prompt_ids"] + record["response_ids"]
