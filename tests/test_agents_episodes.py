"""Multi-turn episodes: the tokens trained are the tokens sampled (a reasoning template that drops <think> from
history, a tokenizer whose merges join a turn's end with the next text), all episodes in flight at once (a slow tool
holds back only its episode), failed environments, and GRPO and PPO steps on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import runpy
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hybridflow.agents import AssistantTurn, Environment, EpisodeStart, ToolEnvironment, TurnResult, tool
from hybridflow.agents.episode import ChatTokens
from hybridflow.agents.episode_batch import episode_metrics, episode_tensors
from hybridflow.agents.runner import EpisodeLimits, EpisodeRunner
from hybridflow.agents.tool_calls import make_parser
from hybridflow.controller import local_mode
from hybridflow.data import write_jsonl
from hybridflow.engine.generation import SamplingConfig
from hybridflow.engine.native_rollout import NativeRollout
from hybridflow.engine.rollout import GenerationShard, Rollout, RolloutOutput, SamplingOptions
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer
from hybridflow.trainers.step import StepComponent

EXAMPLE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "episodes" / "make_chat_model.py"))
chat_tokenizer = EXAMPLE["chat_tokenizer"]
"""A character BPE (vocab < 256: the tiny model's) with a chat template; ``merge_newlines``: every character merges
with a following newline into one token, so re-tokenizing a turn with the glue after it changes ids."""
EOS, IM_END = 2, 4  # <eos>, <|im_end|>
TOOLS_HEADER = ("{% if tools %}<|im_start|>system\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
                "</tool_call>. Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>\n{% endif %}")
REASONING_TEMPLATE = (  # ChatML that keeps only what follows </think> of an assistant turn in the history
    TOOLS_HEADER + "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_TEMPLATE = (  # no special end of turn: a turn's last character meets the "\n" that follows it
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% endif %}")


@tool
def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return str(a + b)


class ScriptedEnv(Environment):
    """Answers every turn with a tool message until the third turn, which ends the episode with reward 1."""

    max_turns = 3

    def start(self, row: dict) -> EpisodeStart:
        return EpisodeStart([{"role": "user", "content": row["prompt"]}], [add])

    def step(self, turn: AssistantTurn) -> TurnResult:
        if turn.turn_index == 2:
            return TurnResult([], reward=1.0, done=True)
        return TurnResult([{"role": "tool", "content": f"r{turn.turn_index}"}], reward=0.25)


class ScriptedRollout(Rollout):
    """Returns pre-written turns: episode e's turn t is ``turns[e][t]``; log-probs -0.01 x (position + 1)."""

    name = "scripted"

    def __init__(self, turns: dict[int, list[list[int]]]) -> None:
        super().__init__(None, dtype=torch.float32, config=None)
        self.turns, self.queue, self.requests = turns, {}, []

    def load(self, shard, *, version):
        pass

    def release(self):
        pass

    def generate(self, prompts_BP, prompt_mask_BP, config):
        raise NotImplementedError

    def submit(self, request):
        from hybridflow.engine.rollout import RequestHandle

        self.requests.append(request)
        handle = RequestHandle(request)
        self.queue[request.request_id] = handle
        return handle

    def pending(self):
        return len(self.queue)

    def step(self, *, max_tokens=None):
        outputs = []
        for request_id, handle in list(self.queue.items()):
            _, episode, _, turn = request_id.split("-")
            ids = tuple(self.turns[int(episode)][int(turn)])
            reason = "stop" if ids[-1] in (EOS, IM_END) else "length"
            output = RolloutOutput(request_id, handle.request.prompt_ids, ids,
                                   tuple(-0.01 * (k + 1) for k in range(len(ids))), (0,) * len(ids), reason)
            handle.future.set_result(output)
            outputs.append(output)
            del self.queue[request_id]
        return outputs


def run_scripted(tokenizer, turns, *, limits=EpisodeLimits(max_episode_tokens=4096), env=ScriptedEnv):
    rollout = ScriptedRollout(turns)
    runner = EpisodeRunner(rollout, chat=ChatTokens(tokenizer), make_env=env, parser=make_parser("hermes"),
                           options=SamplingOptions(max_new_tokens=16, eos_token_ids=(EOS, IM_END)), limits=limits)
    rows = [{"prompt": f"question {index}"} for index in turns]
    return runner.run(rows, [[1]] * len(rows)), rollout


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def assert_token_exact(tensors, row: int, expected_prompt: list[int], pieces: list[tuple[str, list[int]]]):
    """The trained row equals prompt + pieces in order, and the loss mask is 1 exactly on the sampled pieces."""
    real = tensors["attention_mask"][row].bool()
    trained = tensors["input_ids"][row][real].tolist()
    expected = expected_prompt + [token for _, ids in pieces for token in ids]
    assert trained == expected
    P = tensors["prompts"].shape[1]
    response_real = real[P:]
    mask = tensors["response_mask"][row][response_real].tolist()
    assert mask == [int(kind == "sampled") for kind, ids in pieces for _ in ids]
    assert tensors["response_mask"][row][~response_real].sum() == 0


@pytest.mark.parametrize("template, merges", [(REASONING_TEMPLATE, False), (PLAIN_TEMPLATE, True)],
                         ids=["reasoning-template-drops-think", "merges-across-turn-boundary"])
def test_trained_ids_are_prompt_plus_sampled_plus_observation_ids_and_the_mask_marks_sampled_ones(template, merges):
    tokenizer = chat_tokenizer(template, merge_newlines=merges)
    think = encode(tokenizer, "<think>a\nb</think>") if not merges else []
    turns = {  # turn 0 stops at the end-of-turn token, turn 1 is cut by its length, turn 2 answers
        0: [think + encode(tokenizer, "call x") + [IM_END if not merges else EOS], think + encode(tokenizer, "go on"),
            encode(tokenizer, "done") + [EOS]],
        1: [encode(tokenizer, "y") + [EOS], encode(tokenizer, "zz"), encode(tokenizer, "ok") + [EOS]],
    }
    episodes, rollout = run_scripted(tokenizer, turns)
    tensors = episode_tensors(episodes, pad_token_id=0, eos_token_id=EOS)
    for index, episode in enumerate(episodes):
        assert episode.done and episode.turns == 3 and episode.reward == 1.5
        prompt = encode(tokenizer, tokenizer.apply_chat_template(
            [{"role": "user", "content": f"question {index}"}], tools=[add.schema], tokenize=False,
            add_generation_prompt=True))
        assert episode.prompt_ids == prompt
        sampled = turns[index]
        if template is REASONING_TEMPLATE:  # glue after a stopped turn starts after its <|im_end|>, else with it
            glue = ["\n<|im_start|>tool\nr0<|im_end|>\n<|im_start|>assistant\n",
                    "<|im_end|>\n<|im_start|>tool\nr1<|im_end|>\n<|im_start|>assistant\n"]
            if sampled[0][-1] != IM_END:
                glue[0] = "<|im_end|>" + glue[0]
        else:
            glue = ["\ntool: r0\nassistant:", "\ntool: r1\nassistant:"]
        pieces = [("sampled", sampled[0]), ("observation", encode(tokenizer, glue[0])), ("sampled", sampled[1]),
                  ("observation", encode(tokenizer, glue[1])), ("sampled", sampled[2])]
        assert_token_exact(tensors, index, prompt, pieces)
        # each turn was sampled from exactly the ids before it (token in), and its log-probs are kept
        contexts = [request.prompt_ids for request in rollout.requests
                    if request.request_id.startswith(f"episode-{index}-")]
        assert [list(context) for context in contexts] == [
            prompt, prompt + pieces[0][1] + pieces[1][1], prompt + [t for _, ids in pieces[:4] for t in ids]]
        response = episode.response_ids
        sampled_positions = [k for k, bit in enumerate(episode.loss_mask) if bit]
        assert len(sampled_positions) == sum(len(ids) for ids in sampled)
        assert all(episode.sampled_logprobs[k] < 0 for k in sampled_positions)
        assert all(value == 0 for k, value in enumerate(episode.sampled_logprobs) if k not in sampled_positions)
        # re-rendering the decoded conversation, what other frameworks train on, gives other ids: this test bites
        text = tokenizer.apply_chat_template(episode.messages, tools=[add.schema], tokenize=False)
        assert encode(tokenizer, text)[:len(prompt) + len(response)] != prompt + response
    assert tensors["episode_turn_rewards"].sum(-1).tolist() == [1.5, 1.5]


def test_an_observation_that_overflows_the_token_budget_ends_the_episode_truncated_and_is_not_appended():
    tokenizer = chat_tokenizer(REASONING_TEMPLATE, merge_newlines=False)
    turns = {0: [encode(tokenizer, "abc") + [IM_END]] * 3}
    prompt_length = len(ChatTokens(tokenizer).prompt_ids([{"role": "user", "content": "question 0"}], [add.schema]))
    limits = EpisodeLimits(max_episode_tokens=prompt_length + 6)
    (episode,), _ = run_scripted(tokenizer, turns, limits=limits)
    assert episode.truncated == "token_budget" and episode.turns == 1 and not episode.done
    assert episode.loss_mask == [1] * 4 and episode.length == prompt_length + 4
    (episode,), _ = run_scripted(tokenizer, turns, limits=EpisodeLimits(max_turns=2, max_episode_tokens=4096))
    assert episode.truncated == "max_turns" and episode.turns == 2


class RaisingEnv(ScriptedEnv):
    def start(self, row):
        self.row = row
        if row["prompt"] == "question 2":
            raise ValueError("no such task")
        return super().start(row)

    def step(self, turn):
        if "boom" in turn.text:
            raise RuntimeError("the environment broke")
        return super().step(turn)

    def close(self):
        if self.row["prompt"] == "question 3":
            raise OSError("cannot clean up")


def test_an_environment_that_raises_fails_only_its_episode_which_then_trains_nothing_under_drop():
    tokenizer = chat_tokenizer(REASONING_TEMPLATE, merge_newlines=False)
    fine = [encode(tokenizer, "fine") + [IM_END]] * 3
    turns = {0: [encode(tokenizer, "boom") + [IM_END]], 1: fine, 2: fine, 3: fine}
    episodes, _ = run_scripted(tokenizer, turns, env=RaisingEnv)
    assert "RaisingEnv.step raised RuntimeError: the environment broke" in episodes[0].failed
    assert episodes[1].done and episodes[1].failed is None
    assert "RaisingEnv.start raised ValueError: no such task" in episodes[2].failed and episodes[2].turns == 0
    assert "RaisingEnv.close raised OSError: cannot clean up" in episodes[3].failed and episodes[3].turns == 3
    # an episode that sampled nothing holds one placeholder token (its reward needs a place) and never trains
    every = episode_tensors(episodes, pad_token_id=0, eos_token_id=EOS, on_env_error="zero_reward")
    assert every["episode_trainable"].tolist() == [True, True, False, True] and episodes[2].placeholder
    assert every["response_mask"][2].sum() == 1 and every["responses"][2, 0] == EOS
    episodes = episodes[:2]
    dropped = episode_tensors(episodes, pad_token_id=0, eos_token_id=EOS, on_env_error="drop")
    assert dropped["episode_trainable"].tolist() == [False, True]
    assert dropped["episode_failed"].tolist() == [True, False]
    zero = episode_tensors(episodes, pad_token_id=0, eos_token_id=EOS, on_env_error="zero_reward")
    assert zero["episode_trainable"].tolist() == [True, True]
    assert zero["response_mask"][0].sum() == 5 and zero["episode_turn_rewards"][0].sum() == 0
    metrics = episode_metrics([{**episode.record(), "finished_s": 0.0} for episode in episodes],
                              generation_seconds=0.0)
    assert metrics["agent/env_failures"] == 1.0 and metrics["agent/turns_mean"] == 2.0


# ----- concurrency on the native rollout ----------------------------------------------------------------------
SLOW_S = 1.5


@tool
def wait(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "waited"


class SlowToolEnv(ToolEnvironment):
    """Episode 0 calls a tool that sleeps SLOW_S seconds on its first turn; the others call nothing slow."""

    tools = (wait,)
    max_turns = 3

    def start(self, row):
        self.slow = row["slow"]
        return EpisodeStart([{"role": "user", "content": row["prompt"]}], [wait])

    def step(self, turn):
        if turn.turn_index == 2:
            return TurnResult([], reward=1.0, done=True)
        seconds = SLOW_S if self.slow and turn.turn_index == 0 else 0.0
        return TurnResult([{"role": "tool", "content": wait.call({"seconds": seconds})}])

    def reward(self, row, messages):
        return 0.0


def tiny_native_rollout() -> NativeRollout:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()
    weights = {name: [tensor.detach()] for name, tensor in model.state_dict().items()}
    rollout = NativeRollout(model.config, dtype=torch.float32, config=SamplingConfig())
    rollout.load(GenerationShard(weights, layers=range(2), has_embedding=True, has_final_norm=True, has_head=True),
                 version=0)
    return rollout


def test_a_slow_tool_holds_back_only_its_own_episode():
    tokenizer = chat_tokenizer(REASONING_TEMPLATE, merge_newlines=False)
    runner = EpisodeRunner(tiny_native_rollout(), chat=ChatTokens(tokenizer), make_env=SlowToolEnv,
                           parser=make_parser("hermes"),
                           options=SamplingOptions(max_new_tokens=6, eos_token_ids=(EOS, IM_END), seed=3),
                           limits=EpisodeLimits(max_episode_tokens=1024, decode_chunk_tokens=2))
    rows = [{"prompt": f"q{index}", "slow": index == 0} for index in range(4)]
    started = time.perf_counter()
    episodes = runner.run(rows, [[1]] * 4)
    finished = [episode.finished_at - started for episode in episodes]
    assert all(episode.turns == 3 and episode.done for episode in episodes)
    # the fast episodes ran all three turns while the slow tool slept; the slow one ended after it returned
    assert max(finished[1:]) < SLOW_S <= finished[0], finished
    assert episodes[0].tool_seconds >= SLOW_S and max(episode.tool_seconds for episode in episodes[1:]) < SLOW_S


# ----- training steps -----------------------------------------------------------------------------------------
class CountingEnv(ToolEnvironment):
    """Two to three turns: the add tool is offered; the reward is the number of distinct characters the model
    wrote over the episode (a dense, learnable signal for a random tiny model); row "poison" raises."""

    tools = (add,)
    max_turns = 3

    def step(self, turn):
        if self.row.get("poison"):
            raise RuntimeError("poisoned row")
        if turn.turn_index < 1:
            self.messages.append({"role": "assistant", "content": turn.text})
            return TurnResult([{"role": "user", "content": "more"}], reward=0.1)
        return super().step(turn)

    def reward(self, row, messages):
        return len({char for message in messages if message["role"] == "assistant" for char in message["content"]})


@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("agent_run")
    chat_tokenizer(REASONING_TEMPLATE, merge_newlines=False).save_pretrained(directory / "tokenizer")
    rows = [{"prompt": f"add {index} and {index + 1}", "poison": index == 1} for index in range(8)]
    write_jsonl(directory / "train.jsonl", rows)
    return directory


def _agent_config(directory, output_dir, *overrides):
    return load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", "actor.model.tiny={}",
        f"actor.model.tokenizer_path={directory / 'tokenizer'}", f"env.class={__file__}:CountingEnv",
        "env.max_episode_tokens=160", "env.record_every=1", "env.record_episodes=8", "env.decode_chunk_tokens=4",
        "actor.generation.max_new_tokens=6", "data.shuffle=false", "actor.engine.optim.lr=1e-3",
        "critic.engine.optim.lr=1e-3",
        "actor.engine.dtype=float32", "reference.engine.dtype=float32", "critic.engine.dtype=float32",
        "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
        "trainer.total_steps=1", "trainer.progress_bar=false", f"trainer.output_dir={output_dir}", *overrides])


class BatchCapture(StepComponent):
    """A step component keeping the training batch the updates read."""

    def loss_mask(self, batch, mask_BT):
        self.batch = batch
        return mask_BT


def _train(config):
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        capture = BatchCapture()
        trainer.components.append(capture)
        try:
            history = trainer.fit()
        finally:
            trainer.shutdown()
    return history, capture.batch


@pytest.mark.parametrize("estimator", ["grpo", "gae", "remax"])
def test_a_multi_turn_step_trains_exactly_the_recorded_episodes(run_inputs, tmp_path, estimator):
    history, batch = _train(_agent_config(run_inputs, tmp_path / estimator,
                                             f"algorithm.advantage_estimator={estimator}",
                                             "actor.loss.old_log_probs=recompute", "algorithm.whiten_advantages=false"))
    metrics = history[-1]
    if estimator == "remax":  # the baseline is the greedy episode's reward (distinct characters: > 0), not 0
        assert metrics["advantage/mean"] < metrics["return/mean"] - 0.5
    assert metrics["agent/turns_mean"] > 1.5 and metrics["agent/env_failures"] == 2.0
    assert metrics["agent/observation_tokens_mean"] > 0 and metrics["agent/sampled_tokens_mean"] > 0
    assert metrics["actor/pg_loss"] == metrics["actor/pg_loss"]  # finite: the step trained
    if estimator == "gae":  # PPO: the critic's values over the episodes, trained on the sampled tokens
        assert "critic/values_before_mean" in metrics and metrics["critic/loss"] == metrics["critic/loss"]
    # the training forward over the trained ids gives back the log-prob each sampled token was sampled with:
    # every sampled token is trained in the very context it was sampled in
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-5
    records = [json.loads(line) for line in (tmp_path / estimator / "episodes.jsonl").read_text().splitlines()]
    assert len(records) == 8 and len(batch) == 8
    P = batch["prompts"].shape[1]
    for row, record in enumerate(records):
        real = batch["attention_mask"][row].bool()
        assert batch["input_ids"][row][real].tolist() == record["prompt_ids"] + record["response_ids"]
        response_real = real[P:]
        expected_mask = [0] * len(record["response_ids"]) if record["failed"] else record["loss_mask"]
        assert batch["response_mask"][row][response_real].tolist() == expected_mask
        assert batch["response_mask"][row][~response_real].sum() == 0
        if not record["failed"]:  # observation tokens get no advantage
            assert batch["advantages"][row][~batch["response_mask"][row].bool()].abs().sum() == 0
    failed = [bool(record["failed"]) for record in records]
    assert failed == [False, False, True, True, False, False, False, False]  # row 1 (samples 2, 3) is poisoned


def test_the_env_section_is_refused_where_episodes_cannot_run(run_inputs, tmp_path):
    def config(*overrides):
        return _agent_config(run_inputs, tmp_path, *overrides)

    with pytest.raises(ValueError, match=r"reward.function got 'math'; allowed: null with env.class"):
        config("reward.function=math")
    with pytest.raises(ValueError, match=r"actor.hybrid_engine.tp_size got 2; allowed: 1 \(and pp_size 1\)"):
        config("actor.engine.layout=3d", "actor.engine.tp_size=2", "actor.hybrid_engine.tp_size=2",
               "placement.pools.global=[2]")
    with pytest.raises(ValueError, match=r"algorithm.dynamic_sampling got True; allowed: false with env"):
        config("algorithm.advantage_estimator=grpo", "algorithm.dynamic_sampling=true")
    if importlib.util.find_spec("vllm") is not None:  # the config names an installed backend only
        assert config("actor.generation.backend=vllm").env.class_path.endswith(":CountingEnv")
    with pytest.raises(ValueError, match="does not define step"):  # a bad class is refused before any model
        RLTrainer(config(f"env.class={__file__}:NoStep"), tensorboard=False)


class NoStep(Environment):
    def start(self, row):
        return EpisodeStart([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_a_multi_turn_step_on_the_vllm_backend_trains_the_sampled_tokens(run_inputs, tmp_path):
    pytest.importorskip("vllm")
    tiny = "actor.model.tiny={hidden_size: 128, intermediate_size: 256, num_attention_heads: 4}"  # vLLM: head dim 32
    history, batch = _train(_agent_config(run_inputs, tmp_path / "vllm", tiny, "actor.generation.backend=vllm",
                                          "actor.generation.vllm_kv_cache_gib=0.0625",
                                          "actor.loss.old_log_probs=recompute"))
    metrics = history[-1]
    assert metrics["agent/turns_mean"] > 1.5 and metrics["agent/observation_tokens_mean"] > 0
    assert metrics["rollout/logprob_abs_diff_max"] < 1e-3  # vLLM's kernels, not the training forward's
    records = [json.loads(line) for line in (tmp_path / "vllm" / "episodes.jsonl").read_text().splitlines()]
    for row, record in enumerate(records):
        real = batch["attention_mask"][row].bool()
        assert batch["input_ids"][row][real].tolist() == record["prompt_ids"] + record["response_ids"]
