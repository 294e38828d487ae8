"""Multi-turn episodes on the native rollout: episodes per second with 1, 2 and 4 turns against single-turn
generation of the same number of sampled tokens, and a step whose every episode calls a tool that sleeps (the
step's time against the sum of the tool times: episodes wait for their own tools, not for each other's).

A random tiny Llama with the chat tokenizer of examples/episodes/make_chat_model.py; end-of-turn tokens are
suppressed so that every turn samples exactly ``--tokens`` tokens; observations are a short tool message.

    python benchmarks/bench_agents.py [--episodes 16] [--tokens 16] [--sleep 0.5]

`--pipelined` instead trains GRPO on episodes of very different lengths (examples/episodes/long_tail_env.py: 1 to 6
turns, tools that sleep a heavy-tailed time, ``--slow-s`` scaling it) on the split placement (the actor on pool
``trainer``, one rollout replica on pool ``gen``, Ray), with ``async.max_staleness`` 0 and then 1: steps per
second over steps 2..N, the driver's wait for generation per step (``async/wait_generation_s``), the slowest
episode's time per step, and the load average before and after each run (docs/async.md, "Episodes on the rollout
pool").

    python benchmarks/bench_agents.py --pipelined [--steps 8] [--slow-s 0.5]
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


def pipelined_run(staleness: int, *, directory: Path, steps: int, prompts: int, tokens: int) -> dict[str, float]:
    """GRPO on the long-tail episodes with ``async.max_staleness=staleness`` on the split placement (Ray)."""
    import json

    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    long_tail = Path(__file__).resolve().parents[1] / "examples" / "episodes" / "long_tail_env.py"
    output_dir = directory / f"k{staleness}"
    config = load_rl_config(None, [
        f"data.train_path={directory / 'train.jsonl'}", f"actor.model.path={directory / 'base'}",
        f"env.class={long_tail}:LongTailEnvironment", "env.max_episode_tokens=512", f"env.decode_chunk_tokens={tokens}",
        "env.record_every=1", f"env.record_episodes={prompts * 4}", f"actor.generation.max_new_tokens={tokens}",
        "actor.engine.optim.lr=1e-4", "actor.loss.tis_cap=2.0", "algorithm.advantage_estimator=grpo",
        f"batch.prompts_per_step={prompts}", "batch.samples_per_prompt=4", f"batch.mini_batch_size={prompts * 4}",
        f"trainer.total_steps={steps}", "trainer.progress_bar=false", f"trainer.output_dir={output_dir}",
        "placement.pools={trainer: [1], gen: [1]}", "placement.roles={actor: trainer, rollout: gen}",
        "placement.runtime=ray", f"async.max_staleness={staleness}"])
    load_before = os.getloadavg()[0]
    trainer = RLTrainer(config, tensorboard=False)
    stamps = []
    try:
        trainer.fit(on_step=lambda step, metrics: stamps.append(time.perf_counter()))
        history = trainer.logger.history[1:]  # step 1 pays the workers' warm-up
    finally:
        trainer.shutdown()
    finished: dict[int, list[float]] = {}  # per step: when each episode ended, from the start of the replica's call
    for line in (output_dir / "episodes.jsonl").read_text().splitlines():
        record = json.loads(line)
        finished.setdefault(record["step"], []).append(record["finished_s"])
    ends = [sorted(times) for step, times in finished.items() if step > 1]

    def mean(values) -> float:
        values = list(values)
        return sum(values) / len(values)

    return {"k": staleness, "steps_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "wait_generation_s": mean(metrics["async/wait_generation_s"] for metrics in history),
            "update_s": mean(metrics["time/update_s"] for metrics in history),
            "episode_median_s": mean(times[len(times) // 2] for times in ends),
            "episode_slowest_s": mean(times[-1] for times in ends),
            "turns_mean": mean(metrics["agent/turns_mean"] for metrics in history),
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def pipelined(args) -> None:
    import tempfile

    from hybridflow.data import write_jsonl

    long_tail = runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "episodes" / "long_tail_env.py"))
    with tempfile.TemporaryDirectory() as name:
        directory = Path(name)
        tokenizer = EXAMPLE["chat_tokenizer"]()
        EXAMPLE["build_model"](tokenizer).save_pretrained(str(directory / "base"))
        tokenizer.save_pretrained(str(directory / "base"))
        write_jsonl(directory / "train.jsonl", long_tail["make_rows"](256, seed=0, slow_s=args.slow_s))
        for staleness in (0, 1):
            result = pipelined_run(staleness, directory=directory, steps=args.steps, prompts=args.prompts,
                                   tokens=args.tokens)
            print(" | ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                             for key, value in result.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16, help="sampled tokens per turn")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds each tool call sleeps (last table)")
    parser.add_argument("--chunk", type=int, default=32, help="env.decode_chunk_tokens")
    parser.add_argument("--pipelined", action="store_true", help="GRPO on long-tail episodes, k = 0 against k = 1")
    parser.add_argument("--steps", type=int, default=8, help="--pipelined: RL steps per run")
    parser.add_argument("--prompts", type=int, default=8, help="--pipelined: prompts per step (4 episodes each)")
    parser.add_argument("--slow-s", type=float, default=0.5, help="--pipelined: the tools' time scale (seconds)")
    args = parser.parse_args()
    if args.pipelined:
        return pipelined(args)
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
