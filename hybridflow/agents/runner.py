"""The episode runner: every episode of a step in flight at once on a ``Rollout``'s requests, environments and tools
in a thread pool, so a slow tool holds back only its own episode.

The loop (``EpisodeRunner.run``), until no episode is left: hand the environment steps that finished their
results (append the observation ids, submit the next turn); submit the turns that became ready together as one
wave of requests (one sampling seed per wave, so they decode as one batch; an idle rollout first waits
``WAVE_GRACE_S`` for the environment steps about to finish); advance the rollout by a chunk of
tokens (``decode_chunk_tokens``) and hand each finished turn to its environment's ``step`` in the pool; when the
rollout has nothing queued, wait for the first environment step to finish. Token ids are kept as sampled
(``Episode``); the text of a turn is decoded only for the environment.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

from hybridflow.agents.episode import ChatTokens, Episode
from hybridflow.engine.rollout import Rollout, RolloutOutput, RolloutRequest, SamplingOptions

WAVE_GRACE_S = 0.02
"""While the rollout is idle, a wave of ready turns waits this long for the environment steps still running (most
return in microseconds): turns decode in fewer, larger batches; a slow tool delays the others by at most this."""
WAVE_SEED_STRIDE = 7919
"""Wave w of a step samples with the step's seed + w x this: turns submitted at different times draw fresh noise."""


@dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    """What bounds an episode and how the runner schedules them."""

    max_turns: int | None = None
    """Assistant turns per episode (None: the environment class's ``max_turns``); after the last one the episode
    ends (marked ``max_turns`` if the environment did not say it is done)."""
    max_episode_tokens: int | None = None
    """Tokens per episode, prompt included (None: no bound beyond the turns): a turn samples at most what is left;
    an observation that would leave no room for another token ends the episode (marked ``token_budget``, the
    observation not appended, so it is not trained either)."""
    decode_chunk_tokens: int = 32
    """Tokens the rollout advances its requests by between two looks at the environments."""
    env_threads: int = 16
    """Threads running environment starts and steps (tools) concurrently."""
    agent_timeout_s: float | None = None
    """Seconds an endpoint agent may run for its episode (``EndpointRunner``; None: no bound)."""


@dataclass
class _Pending:
    """An environment call in the pool, or a turn in the rollout, and whose episode it is."""

    episode: Episode
    env: object
    started: float


class EpisodeRunner:
    """Runs one step's episodes on ``rollout`` (see the module docstring)."""

    def __init__(self, rollout: Rollout, *, chat: ChatTokens, make_env: Callable[[], object], parser,
                 options: SamplingOptions, limits: EpisodeLimits) -> None:
        self.rollout, self.chat, self.make_env, self.parser = rollout, chat, make_env, parser
        self.options, self.limits = options, limits
        self.stop_ids = set(options.eos_token_ids) | set(options.stop_token_ids)
        self.generation_seconds = 0.0
        self._waves = 0
        self._budget = limits.max_episode_tokens or 2**62

    def run(self, rows: list[dict], fallback_prompt_ids: list[list[int]]) -> list[Episode]:
        """An episode per row (``fallback_prompt_ids``: each row's dataset prompt, the ids of an episode whose
        environment failed to start); every episode ends done, truncated or failed."""
        from hybridflow.agents.loading import checked_start

        episodes = [Episode(index=index, prompt_ids=list(ids)) for index, ids in enumerate(fallback_prompt_ids)]
        self._turns: dict[str, _Pending] = {}
        self._env_calls: dict[Future, tuple[str, _Pending, object]] = {}
        ready: list[_Pending] = []
        with ThreadPoolExecutor(max_workers=self.limits.env_threads) as pool:
            self._pool = pool
            for episode, row in zip(episodes, rows):
                env = self.make_env()  # an environment or the failure of its constructor
                self._env_calls[pool.submit(_timed, _start, checked_start, env, row)] = (
                    "start", _Pending(episode, env, 0.0), None)
            while self._env_calls or self.rollout.pending() or ready:
                ready += self._collect_env_calls()
                if ready and self._env_calls and not self.rollout.pending():
                    # the rollout is idle: let environment steps that are about to finish join this wave
                    wait(list(self._env_calls), timeout=WAVE_GRACE_S)
                    ready += self._collect_env_calls()
                if ready:
                    self._submit_wave(ready)
                    ready = []
                if self.rollout.pending():
                    started = time.perf_counter()
                    outputs = self.rollout.step(max_tokens=self.limits.decode_chunk_tokens)
                    self.generation_seconds += time.perf_counter() - started
                    for output in outputs:
                        self._on_turn(output)
                elif self._env_calls:
                    wait(list(self._env_calls), return_when=FIRST_COMPLETED)
        return episodes

    # ----- environments ----------------------------------------------------------------------------
    def _collect_env_calls(self) -> list[_Pending]:
        """Hand every finished environment call its episode; the episodes whose next turn may be sampled."""
        ready = []
        for future in [future for future in self._env_calls if future.done()]:
            kind, pending, turn = self._env_calls.pop(future)
            result, seconds = future.result()
            if kind == "start":
                continues = self._on_start(pending, result)
            else:
                pending.episode.tool_seconds += seconds
                continues = self._on_step(pending, turn, result)
            if continues:
                ready.append(pending)
            else:
                self._end(pending)
        return ready

    def _on_start(self, pending: _Pending, start) -> bool:
        from hybridflow.agents.env import EnvironmentFailure

        episode = pending.episode
        if isinstance(start, EnvironmentFailure):
            episode.failed = start.describe()
            return False
        episode.tools = [tool.schema for tool in start.tools]
        episode.messages = [dict(message) for message in start.messages]
        episode.prompt_ids = self.chat.prompt_ids(episode.messages, episode.tools)
        return self._has_room(episode)

    def _on_step(self, pending: _Pending, output: RolloutOutput, result) -> bool:
        from hybridflow.agents.env import EnvironmentFailure

        episode = pending.episode
        if isinstance(result, EnvironmentFailure):
            episode.failed = result.describe()
            return False
        episode.tool_records += list(result.info.get("tool_calls", []))
        episode.turn_rewards.append(float(result.reward or 0.0))
        episode.messages.extend(dict(message) for message in result.messages)
        if result.done:
            episode.done = True
            return False
        if episode.turns >= (self.limits.max_turns or pending.env.max_turns):
            episode.truncated = "max_turns"
            return False
        observation = self.chat.observation_ids(result.messages, episode.tools, closed_by=self._closed_by(output))
        if episode.length + len(observation) >= self._budget:
            episode.truncated = "token_budget"
            return False
        episode.add_observation(observation)
        return True

    def _end(self, pending: _Pending) -> None:
        from hybridflow.agents.env import EnvironmentFailure
        from hybridflow.agents.loading import checked_close

        episode = pending.episode
        episode.finished_at = time.perf_counter()
        if not isinstance(pending.env, EnvironmentFailure):
            failure = checked_close(pending.env)
            if failure is not None and episode.failed is None:  # a close that raises fails the episode too
                episode.failed = failure.describe()

    # ----- turns -----------------------------------------------------------------------------------
    def _has_room(self, episode: Episode) -> bool:
        if episode.length >= self._budget:
            episode.truncated = "token_budget"
            return False
        return True

    def _submit_wave(self, ready: list[_Pending]) -> None:
        """The next turn of every ready episode, as requests that share one seed (one decode batch), in episode order:
        a wave's batch does not depend on which of its environment steps returned first."""
        options = self._next_wave_options()
        now = time.perf_counter()
        for pending in sorted(ready, key=lambda pending: pending.episode.index):
            episode = pending.episode
            room = self._budget - episode.length
            request_options = (options if room >= options.max_new_tokens
                               else dataclasses.replace(options, max_new_tokens=room))
            request = RolloutRequest(f"episode-{episode.index}-turn-{episode.turns}",
                                     tuple(episode.prompt_ids + episode.response_ids), request_options)
            pending.started = now
            self._turns[request.request_id] = pending
            self.rollout.submit(request)

    def _on_turn(self, output: RolloutOutput) -> None:
        """A finished turn: keep its ids as sampled, decode its text for the environment, step it in the pool."""
        from hybridflow.agents.env import AssistantTurn
        from hybridflow.agents.loading import checked_step

        pending = self._turns.pop(output.request_id)
        episode = pending.episode
        episode.generation_seconds += time.perf_counter() - pending.started
        episode.add_sampled(output.token_ids, output.logprobs)
        text = self.turn_text(output)
        parsed = self.parser.parse(text, id_prefix=f"call-{episode.turns}")
        turn = AssistantTurn(text=text, tool_calls=list(parsed.calls), parse_errors=list(parsed.errors),
                             turn_index=episode.turns)
        episode.turns += 1
        message = {"role": "assistant", "content": text}
        if parsed.calls:
            message["tool_calls"] = [call.message_entry() for call in parsed.calls]
        episode.messages.append(message)
        self._env_calls[self._pool.submit(_timed, checked_step, pending.env, turn)] = ("step", pending, output)

    def _next_wave_options(self) -> SamplingOptions:
        """The step's options with the next wave's seed (turns submitted at different times draw fresh noise)."""
        options = dataclasses.replace(self.options, seed=self.options.seed + WAVE_SEED_STRIDE * self._waves)
        self._waves += 1
        return options

    def turn_text(self, output: RolloutOutput) -> str:
        """A finished turn's text, without the end-of-turn token it stopped at (for the environment only)."""
        closed = self._closed_by(output) is not None
        return self.chat.tokenizer.decode(list(output.token_ids[:-1] if closed else output.token_ids),
                                          skip_special_tokens=False)

    def _closed_by(self, output: RolloutOutput) -> str | None:
        """The text of the end-of-turn token a turn stopped at (None: cut by its length)."""
        if output.finish_reason == "stop" and output.token_ids and output.token_ids[-1] in self.stop_ids:
            return self.chat.tokenizer.decode([output.token_ids[-1]], skip_special_tokens=False)
        return None


@dataclass(frozen=True)
class EpisodeResult:
    """What one replica's episodes hand back to the actor: the batch tensors, a record per episode, the seconds the
    rollout spent generating."""

    tensors: dict
    records: list[dict]
    generation_seconds: float


_TOKENIZERS: dict = {}
"""Tokenizers loaded in this process, by source (a step's job would otherwise load its tokenizer every step)."""


@dataclass(frozen=True, kw_only=True)
class EpisodeJob:
    """Everything a rank needs to run a step's episodes: which environment, its limits, the actor's tokenizer.
    The driver puts one in the prompts' ``meta_info["episode_job"]``; ``ActorWorker.generate_episodes`` runs it."""

    env_class: str
    """``path.py:Class`` or ``package.module:Class`` of the ``Environment``."""
    env_kwargs: dict
    """Keyword arguments of the environment's constructor (one instance per episode)."""
    limits: EpisodeLimits
    tokenizer: object
    """Where the actor's tokenizer comes from (a ``TokenizerSource``: ``load()``)."""
    tool_format: str = "auto"
    """The tool-call format parsed from the model's turns ("auto": the chat template's)."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take, given to environments that run tools (a ``tool_timeout_s`` attribute)."""
    on_env_error: str = "drop"
    """What a failed episode trains (``episode_tensors``)."""

    def run(self, rollout: Rollout, prompts, config) -> EpisodeResult:
        """``config.samples_per_prompt`` episodes per row of ``prompts`` (a DataProto from ``PromptDataset.batch``),
        prompt-major, sampled under ``config`` (the call's ``SamplingConfig``)."""
        from hybridflow.agents.episode_batch import episode_tensors
        from hybridflow.engine.rollout import sampling_options

        from hybridflow.agents.loading import load_environment

        tokenizer = self._tokenizer()
        env_class = load_environment(self.env_class, dict(self.env_kwargs))
        runner_class = _runner_class(env_class)
        runner = runner_class(rollout, chat=ChatTokens(tokenizer), make_env=self._env_factory(env_class),
                              parser=self._parser(tokenizer), options=sampling_options(config), limits=self.limits)
        samples = config.samples_per_prompt
        rows, fallback = [], []
        for index in range(len(prompts)):
            mask = prompts["attention_mask"][index].bool()
            row = {**dict(prompts.non_tensor_batch["extra_fields"][index]),
                   "prompt": prompts.non_tensor_batch["raw_prompt"][index],
                   "messages": list(prompts.non_tensor_batch["messages"][index])}
            rows += [row] * samples
            fallback += [prompts["input_ids"][index][mask].tolist()] * samples
        started = time.perf_counter()
        episodes = runner.run(rows, fallback)
        eos = (*runner.options.eos_token_ids, runner.options.pad_token_id)[0]
        tensors = episode_tensors(episodes, pad_token_id=runner.options.pad_token_id, eos_token_id=eos,
                                  on_env_error=self.on_env_error)
        records = [{**episode.record(), "finished_s": episode.finished_at - started} for episode in episodes]
        return EpisodeResult(tensors, records, runner.generation_seconds)

    def _tokenizer(self):
        if self.tokenizer not in _TOKENIZERS:
            _TOKENIZERS[self.tokenizer] = self.tokenizer.load()
        return _TOKENIZERS[self.tokenizer]

    def _env_factory(self, env_class: type) -> Callable[[], object]:
        from hybridflow.agents.loading import make_environment

        kwargs = dict(self.env_kwargs)

        def make():
            environment = make_environment(env_class, kwargs, max_turns=self.limits.max_turns)
            if hasattr(environment, "tool_timeout_s"):  # ToolEnvironment: the config's default timeout
                environment.tool_timeout_s = self.tool_timeout_s
            return environment

        return make

    def _parser(self, tokenizer):
        from hybridflow.agents.tool_calls import make_parser

        return make_parser(self.tool_format, tokenizer.chat_template)


def _runner_class(env_class: type) -> type[EpisodeRunner]:
    """The runner of an environment class: agent programs run against the OpenAI-compatible endpoint
    (``OpenAIAgentEnvironment``), every other environment is stepped by ``EpisodeRunner``."""
    from hybridflow.agents.openai_env import OpenAIAgentEnvironment

    if issubclass(env_class, OpenAIAgentEnvironment):
        from hybridflow.agents.endpoint import EndpointRunner

        return EndpointRunner
    return EpisodeRunner


def _timed(function, *arguments):
    """(``function(*arguments)``, the seconds it took), measured in the thread that runs it."""
    started = time.perf_counter()
    return function(*arguments), time.perf_counter() - started


def _start(checked_start, env, row):
    """``checked_start(env, row)``, or the failure of the environment's constructor as it is."""
    from hybridflow.agents.env import EnvironmentFailure

    return env if isinstance(env, EnvironmentFailure) else checked_start(env, row)
