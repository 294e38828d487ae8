"""Multi-turn episodes on the native rollout: episodes per second with 1, 2 and 4 turns against single-turn
generation of the same number of sampled tokens, and a step whose every episode calls a tool that sleeps (the
step's time against the sum of the tool times: episodes wait for their own tools, not for each other's).

A random tiny Llama with the chat tokenizer of examples/episodes/make_chat_model.py; end-of-turn tokens are
suppressed so that every turn samples exactly ``--tokens`` tokens; observations are a short tool message.

    python benchmarks/bench_agents.py [--episodes 16] [--tokens 16] [--sleep 0.5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import time
from pathlib import Path

import torch

from hybridflow.agents import AssistantTurn, Environment, EpisodeStart, TurnResult
from hybridflow.agents.episode import ChatTokens
from hybridflow.agents.runner import EpisodeLimits, EpisodeRunner
from hybridflow.agents.tool_calls import make_parser
from hybridflow.device import current_device
from hybridflow.engine.generation import SamplingConfig
from hybridflow.engine.native_rollout import NativeRollout
from hybridflow.engine.rollout import GenerationShard, RolloutRequest, SamplingOptions

EXAMPLE = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "episodes" / "make_chat_model.py"))


def fixed_turns_env(turns: int, sleep_s: float):
    class FixedTurns(Environment):
        """``turns`` turns; after each but the last a tool message, after a tool that sleeps ``sleep_s``."""

        max_turns = turns

        def start(self, row: dict) -> EpisodeStart:
            return EpisodeStart([{"role": "user", "content": row["prompt"]}])

        def step(self, turn: AssistantTurn) -> TurnResult:
            if turn.turn_index + 1 >= turns:
                return TurnResult([], reward=1.0, done=True)
            time.sleep(sleep_s)
            return TurnResult([{"role": "tool", "content": "42"}])

    return FixedTurns


def build_rollout(tokenizer) -> NativeRollout:
    model = EXAMPLE["build_model"](tokenizer).eval()
    weights = {name: [tensor.detach().to(current_device())] for name, tensor in model.state_dict().items()}
    rollout = NativeRollout(model.config, dtype=torch.float32, config=SamplingConfig())
    rollout.load(GenerationShard(weights, layers=range(model.config.num_hidden_layers), has_embedding=True,
                                 has_final_norm=True, has_head=True), version=0)
    return rollout


def run_episodes(rollout, tokenizer, options, *, episodes: int, turns: int, sleep_s: float, chunk: int):
    runner = EpisodeRunner(rollout, chat=ChatTokens(tokenizer), make_env=fixed_turns_env(turns, sleep_s),
                           parser=make_parser("hermes"), options=options,
                           limits=EpisodeLimits(max_episode_tokens=1024, decode_chunk_tokens=chunk))
    rows = [{"prompt": f"What is {index} + {index}?"} for index in range(episodes)]
    started = time.perf_counter()
    result = runner.run(rows, [[1]] * episodes)
    seconds = time.perf_counter() - started
    return seconds, result, runner.generation_seconds


def single_turn(rollout, tokenizer, options, *, episodes: int, tokens: int) -> float:
    """The same prompts, each sampling ``tokens`` tokens in one request (all submitted at once)."""
    chat = ChatTokens(tokenizer)
    longer = dataclasses.replace(options, max_new_tokens=tokens)
    started = time.perf_counter()
    for index in range(episodes):
        prompt = chat.prompt_ids([{"role": "user", "content": f"What is {index} + {index}?"}])
        rollout.submit(RolloutRequest(f"single-{index}", tuple(prompt), longer))
    while rollout.pending():
        rollout.step(max_tokens=None)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="sampled tokens per turn")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds each tool call sleeps (last table)")
    parser.add_argument("--chunk", type=int, default=32, help="env.decode_chunk_tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = EXAMPLE["chat_tokenizer"]()
    rollout = build_rollout(tokenizer)
    ends = tuple(tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<eos>"))
    options = SamplingOptions(max_new_tokens=args.tokens, suppress_tokens=ends, eos_token_ids=ends, seed=1)
    run_episodes(rollout, tokenizer, options, episodes=args.episodes, turns=1, sleep_s=0.0, chunk=args.chunk)  # warm-up
    single_turn(rollout, tokenizer, options, episodes=args.episodes, tokens=args.tokens)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.episodes} episodes, {args.tokens} tokens per turn")
    print("| turns | episodes/s | sampled tok/s | single-turn, same tokens: episodes/s | tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for turns in (1, 2, 4):
        seconds, episodes, _ = run_episodes(rollout, tokenizer, options, episodes=args.episodes, turns=turns,
                                            sleep_s=0.0, chunk=args.chunk)
        sampled = sum(episode.num_tokens("sampled") for episode in episodes)
        assert sampled == args.episodes * turns * args.tokens, sampled
        baseline = single_turn(rollout, tokenizer, options, episodes=args.episodes, tokens=turns * args.tokens)
        print(f"| {turns} | {args.episodes / seconds:.2f} | {sampled / seconds:.0f} | {args.episodes / baseline:.2f} | "
              f"{sampled / baseline:.0f} | {baseline / seconds:.2f} |")
    seconds, episodes, generation = run_episodes(rollout, tokenizer, options, episodes=args.episodes, turns=2,
                                                 sleep_s=args.sleep, chunk=args.chunk)
    tools = sum(episode.tool_seconds for episode in episodes)
    print(f"\n2 turns, every episode's tool sleeps {args.sleep} s: step {seconds:.2f} s (generation {generation:.2f} s)"
          f" against {tools:.2f} s of tool time summed over the {args.episodes} episodes; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
