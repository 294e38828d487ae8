"""An OpenAI-compatible chat-completions endpoint served while a step generates: agent programs written against the
``openai`` client drive the step's episodes, and the endpoint records the token ids of every call (docs/agents.md).

``EndpointRunner.run`` serves FastAPI under uvicorn on 127.0.0.1 (a free port) in a thread with its own event loop
and runs each episode's ``OpenAIAgentEnvironment.agent`` as a task on that loop, with a client whose ``base_url`` is
the episode's path, ``http://127.0.0.1:<port>/episodes/<index>/v1``. A call to ``/chat/completions`` is continued
token-exactly: its messages must extend the episode's conversation so far (the earlier messages and the replies,
as the endpoint returned them); the prompt of the call is the episode's ids (prompt, sampled and observation ids,
as ``Episode`` keeps them) plus the observation ids of the new messages (``ChatTokens.observation_ids``), never a
re-tokenization of the decoded history. A call that edits the history is refused (HTTP 400) and its episode fails.
The calls go to the rollout from the thread that called ``run`` (the rollout is only ever touched there), in waves
that share one seed, batched with the other episodes' calls, exactly as ``EpisodeRunner`` batches turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import math
import numbers
import queue
import socket
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass

from hybridflow.agents.endpoint_messages import EndpointError, check_body, new_messages, sampling_changes
from hybridflow.agents.env import EnvironmentFailure
from hybridflow.agents.episode import Episode
from hybridflow.agents.runner import WAVE_GRACE_S, EpisodeRunner
from hybridflow.engine.rollout import RolloutOutput, RolloutRequest

MODEL_NAME = "hybridflow-policy"
"""The model id ``/v1/models`` lists (any ``model`` a call names is served by the policy)."""
API_KEY = "hybridflow"
"""The key the clients are built with (the endpoint checks none: it listens on 127.0.0.1 only)."""
CLIENT_TIMEOUT_S = 3600.0
"""The clients' request timeout: a call waits for its turn in the batch."""


@dataclass
class _Session:
    """One episode as the endpoint serves it."""

    episode: Episode
    env: object
    row: dict
    busy: bool = False
    """A call of this episode is being generated (calls of one episode are sequential)."""
    closed: str | None = None
    """Why further calls are refused (the episode ended truncated or failed)."""
    last_output: RolloutOutput | None = None
    started: float = 0.0


@dataclass
class _Call:
    """A call handed from the server's loop to the rollout thread, and the future its output resolves."""

    session: _Session
    context_ids: list[int]
    changes: dict
    """Sampling options the call sets (``max_tokens`` -> ``max_new_tokens``, ``temperature``, ``seed``, ...)."""
    future: asyncio.Future
    request_id: str


class EndpointRunner(EpisodeRunner):
    """Runs one step's episodes by running each episode's agent program against the endpoint (see the module
    docstring); built like ``EpisodeRunner``, with ``make_env`` making ``OpenAIAgentEnvironment`` instances."""

    def run(self, rows: list[dict], fallback_prompt_ids: list[list[int]]) -> list[Episode]:
        """An episode per row (``fallback_prompt_ids``: the ids of an episode that made no call); every episode ends
        done, truncated or failed once its agent returned."""
        self._sessions = [_Session(Episode(index=index, prompt_ids=list(ids)), self.make_env(), dict(row))
                          for index, (row, ids) in enumerate(zip(rows, fallback_prompt_ids))]
        self._inbox: queue.Queue[_Call] = queue.Queue()
        self._calls: dict[str, _Call] = {}
        self._agent_slots = asyncio.Semaphore(self.limits.env_threads)  # plain-def agents running at once
        with _Server(self._app()) as server:
            self._loop = server.loop
            agents = [server.submit(self._drive(session, f"{server.url}/episodes/{session.episode.index}/v1"))
                      for session in self._sessions]
            while not all(agent.done() for agent in agents) or self.rollout.pending():
                wave = self._collect(idle=not self.rollout.pending())
                if wave:
                    self._submit_calls(wave)
                if self.rollout.pending():
                    started = time.perf_counter()
                    outputs = self.rollout.step(max_tokens=self.limits.decode_chunk_tokens)
                    self.generation_seconds += time.perf_counter() - started
                    for output in outputs:
                        call = self._calls.pop(output.request_id)
                        self._loop.call_soon_threadsafe(call.future.set_result, output)
            for agent in agents:
                agent.result()  # _drive catches what the agent raises: anything here is the endpoint's own bug
        return [session.episode for session in self._sessions]

    # ----- the rollout thread --------------------------------------------------------------------------
    def _collect(self, *, idle: bool) -> list[_Call]:
        """The calls that arrived; an idle rollout waits a little for the first, then ``WAVE_GRACE_S`` for more."""
        calls = []
        if idle:
            try:
                calls.append(self._inbox.get(timeout=0.05))
            except queue.Empty:
                return []
            deadline = time.perf_counter() + WAVE_GRACE_S
            while (left := deadline - time.perf_counter()) > 0:
                try:
                    calls.append(self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        while True:
            try:
                calls.append(self._inbox.get_nowait())
            except queue.Empty:
                return calls

    def _submit_calls(self, calls: list[_Call]) -> None:
        options = self._next_wave_options()
        for call in calls:
            self._calls[call.request_id] = call
            changes = dict(call.changes)
            if "stop_sequences" in changes:  # the call's stop strings add to the step's
                changes["stop_sequences"] = options.stop_sequences + changes["stop_sequences"]
            self.rollout.submit(RolloutRequest(call.request_id, tuple(call.context_ids),
                                               dataclasses.replace(options, **changes)))

    # ----- the server's loop ---------------------------------------------------------------------------
    def _app(self):
        """The routes: ``/episodes/<index>/v1/chat/completions`` and the models list (plain Starlette routes:
        the handlers read the request themselves)."""
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        models = {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "created": 0,
                                              "owned_by": "hybridflow"}]}

        async def list_models(request):
            return JSONResponse(models)

        async def chat_completions(request):
            try:
                body = await request.json()
            except ValueError:
                body = None
            try:
                return JSONResponse(await self.complete(request.path_params["index"], body))
            except EndpointError as error:
                return JSONResponse(status_code=400, content={"error": {
                    "message": str(error), "type": "invalid_request_error", "param": None, "code": error.code}})

        app = FastAPI(title="hybridflow episode endpoint")
        app.router.add_route("/v1/models", list_models, methods=["GET"])
        app.router.add_route("/episodes/{index:int}/v1/models", list_models, methods=["GET"])
        app.router.add_route("/episodes/{index:int}/v1/chat/completions", chat_completions, methods=["POST"])
        return app

    async def complete(self, index: int, body) -> dict:
        """One chat-completion call of episode ``index`` (an OpenAI request body): its reply as OpenAI's dict."""
        if not 0 <= index < len(self._sessions):
            raise EndpointError("unknown_episode", f"no episode {index} in this step (0..{len(self._sessions) - 1})")
        session = self._sessions[index]
        call = self._prepare(session, body)
        session.busy, session.started = True, time.perf_counter()
        # the episode stays busy until the rollout answers, even if the client stops waiting: one request per
        # episode is ever in the rollout (its ids stay unique), and an abandoned reply is not recorded
        call.future.add_done_callback(lambda _: setattr(session, "busy", False))
        self._inbox.put(call)
        output = await asyncio.shield(call.future)
        return self._reply(session, call, output)

    def _prepare(self, session: _Session, body) -> _Call:
        """Check a call against its episode and append its new messages' observation ids (module docstring)."""
        if session.closed:
            raise EndpointError("episode_over", f"episode {session.episode.index} is over ({session.closed})")
        if session.busy:
            raise EndpointError("concurrent_call", f"episode {session.episode.index} already has a call in "
                                "flight; the calls of one episode are sequential")
        messages, tools = check_body(body)
        episode = session.episode
        if session.last_output is None:
            episode.prompt_ids = _rendered(self.chat.prompt_ids, messages, tools)
            episode.tools, episode.messages = tools, messages
        else:
            try:
                new = new_messages(episode.messages, episode.tools, messages, tools)
            except EndpointError as error:
                episode.failed = session.closed = f"history_edited: {error}"
                raise
            if episode.turns >= (self.limits.max_turns or session.env.max_turns):
                episode.truncated = session.closed = "max_turns"
                raise EndpointError("max_turns", f"episode {episode.index} had its {episode.turns} turns")
            observation = _rendered(self.chat.observation_ids, new, tools,
                                    closed_by=self._closed_by(session.last_output))
            if episode.length + len(observation) >= self._budget:
                episode.truncated = session.closed = "token_budget"
                raise EndpointError("token_budget", f"episode {episode.index} has no tokens left")
            episode.add_observation(observation)
            episode.messages = episode.messages + new
        room = self._budget - episode.length
        if room < 1:
            episode.truncated = session.closed = "token_budget"
            raise EndpointError("token_budget", f"episode {episode.index}'s prompt fills its token budget")
        changes = sampling_changes(body, self.chat.encode, max_new_tokens=min(self.options.max_new_tokens, room))
        return _Call(session, episode.prompt_ids + episode.response_ids, changes,
                     asyncio.get_running_loop().create_future(), f"episode-{episode.index}-turn-{episode.turns}")

    def _reply(self, session: _Session, call: _Call, output: RolloutOutput) -> dict:
        """Record the sampled ids and answer in OpenAI's format (text, parsed tool calls, usage)."""
        episode = session.episode
        episode.generation_seconds += time.perf_counter() - session.started
        episode.add_sampled(output.token_ids, output.logprobs)
        session.last_output = output
        text = self.turn_text(output)
        parsed = self.parser.parse(text, id_prefix=f"call-{episode.turns}")
        episode.turns += 1
        message = {"role": "assistant", "content": text}
        if parsed.calls:
            message["tool_calls"] = [{"id": item.id, "type": "function", "function": {
                "name": item.name, "arguments": json.dumps(item.arguments)}} for item in parsed.calls]
        episode.messages = episode.messages + [message]
        finish = "tool_calls" if parsed.calls else ("stop" if output.finish_reason == "stop" else "length")
        return {"id": f"chatcmpl-{call.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL_NAME, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                  "logprobs": None}],
                "usage": {"prompt_tokens": len(call.context_ids), "completion_tokens": len(output.token_ids),
                          "total_tokens": len(call.context_ids) + len(output.token_ids)}}

    async def _drive(self, session: _Session, base_url: str) -> None:
        """Run the episode's agent; its reward goes on the last turn. An agent that raises fails its episode,
        unless the endpoint had ended it truncated (then its reward is 0 and it stays truncated)."""
        from hybridflow.agents.loading import checked_close

        episode, env = session.episode, session.env
        if isinstance(env, EnvironmentFailure):
            episode.failed = env.describe()
            episode.finished_at = time.perf_counter()
            return
        try:
            reward = await self._agent_reward(env, base_url, session.row)
        except Exception as error:  # noqa: BLE001 - an agent that raises fails its episode, not the run
            reward = 0.0
            session.closed = session.closed or f"its agent ended with {type(error).__name__}"
            if episode.truncated is None and episode.failed is None:
                episode.failed = _agent_failure(env, error).describe()
        session.closed = session.closed or "agent returned"
        episode.turn_rewards = [0.0] * max(episode.turns - 1, 0) + [float(reward)]
        episode.done = episode.truncated is None and episode.failed is None
        failure = checked_close(env)
        if failure is not None and episode.failed is None:
            episode.failed = failure.describe()
        episode.finished_at = time.perf_counter()

    async def _agent_reward(self, env, base_url: str, row: dict) -> float:
        """The episode's reward from its agent, within ``limits.agent_timeout_s`` (a TimeoutError saying so past it:
        an async agent is cancelled, a plain-def one abandoned in its daemon thread, its later calls refused)."""
        timeout = self.limits.agent_timeout_s
        try:
            async with asyncio.timeout(timeout) as deadline:
                reward = await self._run_agent(env, base_url, row)
        except TimeoutError:
            if not deadline.expired():
                raise  # the agent's own (its client's, say)
            raise TimeoutError(f"{type(env).__name__}.agent did not return within {timeout:g} s "
                               "(env.agent_timeout_s)") from None
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise TypeError(f"{type(env).__name__}.agent returned {reward!r}; allowed: a finite number")
        return float(reward)

    async def _run_agent(self, env, base_url: str, row: dict):
        import openai

        settings = {"base_url": base_url, "api_key": API_KEY, "max_retries": 0, "timeout": CLIENT_TIMEOUT_S}
        if inspect.iscoroutinefunction(env.agent):
            async with openai.AsyncOpenAI(**settings, http_client=openai.DefaultAsyncHttpxClient(trust_env=False)) \
                    as client:
                return await env.agent(client, row)

        def run_sync():
            with openai.OpenAI(**settings, http_client=openai.DefaultHttpxClient(trust_env=False)) as client:
                return env.agent(client, row)

        async with self._agent_slots:
            return await _in_daemon_thread(run_sync)


async def _in_daemon_thread(function):
    """``function()`` in a daemon thread of its own, awaited: when the episode's time runs out the wait is cancelled
    and the thread abandoned (a daemon thread never holds the process open; a pool's thread would, at exit)."""
    loop = asyncio.get_running_loop()
    result = loop.create_future()

    def settle(value, error) -> None:
        if not result.done():  # cancelled: the episode timed out
            result.set_result(value) if error is None else result.set_exception(error)

    def target() -> None:
        value, error = None, None
        try:
            value = function()
        except BaseException as caught:  # noqa: BLE001 - handed to the awaiting episode
            error = caught
        with contextlib.suppress(RuntimeError):  # the step's loop may be closed by now
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=target, name="hybridflow-agent", daemon=True).start()
    return await result


def _rendered(render, messages: list[dict], tools: list[dict], **kwargs) -> list[int]:
    """``render(messages, tools)``'s ids; a chat template that cannot render the call's messages refuses the call."""
    try:
        return render(messages, tools, **kwargs)
    except Exception as error:  # noqa: BLE001 - jinja raises its own errors (and templates raise_exception)
        raise EndpointError("template_error", f"the chat template cannot render the messages: "
                            f"{type(error).__name__}: {error}") from None


def _agent_failure(env, error: BaseException) -> EnvironmentFailure:
    return EnvironmentFailure(class_name=f"{type(env).__module__}.{type(env).__qualname__}", method="agent",
                              error_type=type(error).__name__, message=str(error)[:2000],
                              traceback="".join(traceback.format_exception(error))[-8000:])


class _Server:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a thread running its own event loop."""

    def __init__(self, app) -> None:
        import uvicorn

        self.loop = asyncio.new_event_loop()
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off"))
        self._thread = threading.Thread(target=self.loop.run_forever, name="hybridflow-endpoint", daemon=True)

    def __enter__(self) -> _Server:
        self._thread.start()
        self._serving = self.submit(self._server.serve(sockets=[self._socket]))
        deadline = time.perf_counter() + 60
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises why it could not serve
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the episode endpoint did not start serving {self.url} within 60 s")
            time.sleep(0.005)
        return self

    def submit(self, coroutine) -> Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        try:
            self._serving.result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()
            self._socket.close()
