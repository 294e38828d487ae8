"""Environments for agentic RL: loading refuses bad definitions naming class and method, checked calls turn what an
environment raises or returns wrongly into failures, the standard tool loop, the reward-function adapter, examples."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest

from hybridflow.agents import (
    AssistantTurn,
    EnvConfig,
    Environment,
    EnvironmentDefinitionError,
    EnvironmentFailure,
    EpisodeStart,
    HermesParser,
    RewardFunctionEnvironment,
    ToolEnvironment,
    TurnResult,
    calculator,
    check_environment,
    checked_close,
    checked_start,
    checked_step,
    load_environment,
    make_environment,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"


def _turn(text: str, index: int = 0) -> AssistantTurn:
    parsed = HermesParser().parse(text, id_prefix=f"turn{index}")
    return AssistantTurn(text=text, tool_calls=parsed.calls, parse_errors=parsed.errors, turn_index=index)


class Echo(Environment):
    max_turns = 2

    def __init__(self, greeting: str = "hi") -> None:
        self.greeting = greeting

    def start(self, row):
        return EpisodeStart([{"role": "user", "content": f"{self.greeting} {row['name']}"}])

    def step(self, turn):
        return TurnResult([{"role": "user", "content": "again"}], reward=0.5, done=turn.turn_index == 1)


def _user_file(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "my_env.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_an_environment_class_loads_from_a_file_or_a_module_with_its_kwargs(tmp_path):
    path = _user_file(tmp_path, """
        from hybridflow.agents import Environment, EpisodeStart, TurnResult

        class MyEnv(Environment):
            max_turns = 3
            def __init__(self, level: int = 1):
                self.level = level
            def start(self, row):
                return EpisodeStart([{"role": "user", "content": row["prompt"]}])
            def step(self, turn):
                return TurnResult([], reward=float(self.level), done=True)
    """)
    cls = load_environment(f"{path}:MyEnv", {"level": 2})
    environment = make_environment(cls, {"level": 2})
    assert environment.max_turns == 3 and environment.level == 2
    assert make_environment(cls, max_turns=5).max_turns == 5 and cls.max_turns == 3
    assert load_environment("hybridflow.agents.single_turn:RewardFunctionEnvironment", {"function": "math"}) \
        is RewardFunctionEnvironment
    assert load_environment(Echo) is Echo


@pytest.mark.parametrize(("source", "message"), [
    ("def MyEnv(): pass", "names a function, not a class"),
    ("class MyEnv:\n    def start(self, row): pass\n    def step(self, turn): pass",
     r"my_env\.MyEnv is not a subclass of hybridflow\.agents\.Environment"),
    ("from hybridflow.agents import Environment\nclass MyEnv(Environment):\n    def start(self, row): pass",
     r"MyEnv does not define step\(\)"),
    ("from hybridflow.agents import ToolEnvironment\nclass MyEnv(ToolEnvironment): pass",
     r"MyEnv does not define reward\(\)"),
    ("from hybridflow.agents import Environment\nclass MyEnv(Environment):\n    def start(self, row, tools): pass\n"
     "    def step(self, turn): pass", r"MyEnv\.start has the signature start\(self, row, tools\); allowed: "
     r"start\(self, row\)"),
    ("from hybridflow.agents import Environment\nclass MyEnv(Environment):\n    def start(self, row): pass\n"
     "    def step(self): pass", r"MyEnv\.step has the signature step\(self\); allowed: step\(self, turn\)"),
    ("from hybridflow.agents import Environment\nclass MyEnv(Environment):\n    def start(self, row): pass\n"
     "    async def step(self, turn): pass", r"MyEnv\.step is async"),
    ("from hybridflow.agents import ToolEnvironment\nclass MyEnv(ToolEnvironment):\n    async def start(self, row): "
     "pass\n    def reward(self, row, messages): return 0.0", r"MyEnv\.start is async"),
    ("from hybridflow.agents import Environment\nclass MyEnv(Environment):\n    max_turns = 0\n"
     "    def start(self, row): pass\n    def step(self, turn): pass", r"MyEnv\.max_turns is 0"),
    ("from hybridflow.agents import Environment\nclass MyEnv(Environment):\n    def __init__(self, size): pass\n"
     "    def start(self, row): pass\n    def step(self, turn): pass",
     r"MyEnv\.__init__ cannot take env\.kwargs \[\]: missing a required argument: 'size'"),
])
def test_a_bad_environment_definition_is_refused_at_load_naming_the_class_and_method(tmp_path, source, message):
    path = _user_file(tmp_path, source)
    with pytest.raises(EnvironmentDefinitionError, match=message):
        load_environment(f"{path}:MyEnv")


def test_a_spec_that_names_nothing_loadable_says_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="file 'nowhere.py' does not exist"):
        load_environment("nowhere.py:Env")
    with pytest.raises(ValueError, match="has no attribute 'Missing'"):
        load_environment(f"{_user_file(tmp_path, 'x = 1')}:Missing")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        load_environment("no_such_module_xyz:Env")
    with pytest.raises(ValueError, match="must look like 'path/to/file.py:Class'"):
        load_environment("just_a_name")


class Returns(Environment):
    """start and step return whatever the test sets."""

    start_value = None
    step_value = None

    def start(self, row):
        return self.start_value

    def step(self, turn):
        return self.step_value


GOOD_START = EpisodeStart([{"role": "user", "content": "q"}])


@pytest.mark.parametrize(("method", "value", "message"), [
    ("start", {"messages": []}, r"Returns\.start returned \{'messages': \[\]\} \(dict\); allowed: an EpisodeStart"),
    ("start", EpisodeStart([]), r"Returns\.start returned messages \[\] \(list\); allowed: EpisodeStart\.messages as "
                                "a non-empty list"),
    ("start", EpisodeStart([{"role": "robot", "content": "x"}]), r"returned messages\[0\] \{'role': 'robot'"),
    ("start", EpisodeStart([{"role": "user", "content": 3}]), r"with a role in .* and a str content"),
    ("start", EpisodeStart([{"role": "user", "content": "q"}], [print]), r"returned tools .*allowed: EpisodeStart"
                                                                         r"\.tools as a list of Tool"),
    ("start", EpisodeStart([{"role": "user", "content": "q"}], [calculator, calculator]), "distinct names"),
    ("step", None, r"Returns\.step returned None \(NoneType\); allowed: a TurnResult"),
    ("step", TurnResult([{"role": "assistant", "content": "x"}]), r"returned messages\[0\] .*\('tool', 'user', "
                                                                  r"'system'\)"),
    ("step", TurnResult([], reward=math.nan), r"returned reward nan \(float\); allowed: TurnResult\.reward as None "
                                              "or a finite number"),
    ("step", TurnResult([], reward="1"), r"returned reward '1' \(str\)"),
    ("step", TurnResult([], reward=True), r"returned reward True \(bool\)"),
    ("step", TurnResult([], done=1), r"returned done 1 \(int\); allowed: TurnResult\.done as True or False"),
    ("step", TurnResult([], info=[]), r"returned info \[\] \(list\); allowed: TurnResult\.info as a dict"),
])
def test_a_wrong_return_value_becomes_a_failure_naming_class_method_value_and_what_is_allowed(method, value,
                                                                                               message):
    environment = Returns()
    setattr(environment, f"{method}_value", value)
    result = checked_start(environment, {}) if method == "start" else checked_step(environment, _turn("x"))
    assert isinstance(result, EnvironmentFailure)
    assert result.method == method and result.error_type == "EnvironmentDefinitionError"
    assert result.class_name == f"{__name__}.Returns"
    import re
    assert re.search(message, result.message), result.message


def test_good_return_values_pass_through_unchanged():
    environment = Returns()
    environment.start_value, environment.step_value = GOOD_START, TurnResult([], reward=2, done=True, info={"a": 1})
    assert checked_start(environment, {}) is GOOD_START
    assert checked_step(environment, _turn("x")) is environment.step_value


class Crashes(Environment):
    def __init__(self, where: str = "step") -> None:
        if where == "__init__":
            raise OSError("no GPU for the simulator")
        self.where = where

    def start(self, row):
        if self.where == "start":
            raise KeyError("prompt")
        return GOOD_START

    def step(self, turn):
        raise ZeroDivisionError("division by zero in the grader")

    def close(self):
        if self.where == "close":
            raise RuntimeError("cannot stop the container")


def test_what_an_environment_raises_becomes_a_failure_value_and_never_escapes():
    failure = checked_step(Crashes(), _turn("x"))
    assert isinstance(failure, EnvironmentFailure)
    assert (failure.class_name, failure.method, failure.error_type, failure.message) == (
        f"{__name__}.Crashes", "step", "ZeroDivisionError", "division by zero in the grader")
    assert "ZeroDivisionError" in failure.traceback and "def step" not in failure.describe()
    assert failure.describe() == f"{__name__}.Crashes.step raised ZeroDivisionError: division by zero in the grader"
    assert checked_start(Crashes("start"), {}).error_type == "KeyError"
    assert checked_close(Crashes("close")).method == "close" and checked_close(Crashes()) is None
    built = make_environment(Crashes, {"where": "__init__"})
    assert isinstance(built, EnvironmentFailure) and built.method == "__init__" and built.error_type == "OSError"


def test_the_preflight_builds_and_starts_one_episode_and_refuses_a_failing_environment():
    check_environment(Echo, {"greeting": "hello"}, {"name": "Ada"})
    with pytest.raises(ValueError, match=r"cannot build the environment: .*Crashes\.__init__ raised OSError"):
        check_environment(Crashes, {"where": "__init__"})
    with pytest.raises(ValueError, match=r"fails on the first data row: .*Crashes\.start raised KeyError"):
        check_environment(Crashes, {"where": "start"}, {"prompt": "x"})
    with pytest.raises(ValueError, match=r"Echo\.start raised KeyError"):
        check_environment(Echo, {}, {"no_name": 1})


def test_the_reward_function_adapter_scores_one_turn_exactly_like_the_single_turn_trainer():
    from hybridflow.rewards import RuleReward

    rows = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "What is 10-4?", "answer": "6"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "7*6?"}],
             "answer": "42"}]
    responses = ["The answer is \\boxed{5}", "It is 7", "42"]
    expected = RuleReward("math").score_batch(["What is 2+3?", "What is 10-4?", "7*6?"], responses,
                                              [{"answer": row["answer"]} for row in rows])
    cls = load_environment("hybridflow.agents.single_turn:RewardFunctionEnvironment", {"function": "math"})
    for row, response, value in zip(rows, responses, expected.tolist()):
        environment = make_environment(cls, {"function": "math", "system_prompt": "Think."})
        start = checked_start(environment, row)
        assert start.tools == [] and environment.max_turns == 1
        assert start.messages[-1]["role"] == "user" and start.messages[0]["role"] == "system"
        result = checked_step(environment, _turn(response))
        assert result.done and result.messages == [] and result.reward == value
    assert expected.tolist() == [1.0, 0.0, 1.0]


def test_a_reward_function_that_raises_fails_its_episode_only():
    def picky(prompt: str, response: str, *, answer) -> float:
        raise ValueError(f"cannot grade {response!r}")

    environment = RewardFunctionEnvironment(picky)
    checked_start(environment, {"prompt": "q", "answer": "1"})
    failure = checked_step(environment, _turn("blah"))
    assert isinstance(failure, EnvironmentFailure) and failure.error_type == "RewardError"
    assert "raised ValueError on sample 0" in failure.message and "cannot grade 'blah'" in failure.message


def _calculator_environment(**kwargs):
    cls = load_environment(f"{EXAMPLES / 'calculator_env.py'}:CalculatorEnvironment")
    return cls, make_environment(cls, **kwargs)


def test_the_calculator_environment_runs_tools_between_turns_and_rewards_the_right_final_answer():
    cls, environment = _calculator_environment()
    row = {"prompt": "What is 12 * 7 - 30?", "answer": "54"}
    start = checked_start(environment, row)
    assert start.messages[0]["role"] == "system" and start.messages[1] == {"role": "user", "content": row["prompt"]}
    assert [tool.name for tool in start.tools] == ["calculator"]
    first = checked_step(environment, _turn('<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}'
                                            '</tool_call><tool_call>{"name": "calculator", "arguments": {}}'
                                            '</tool_call><tool_call>oops</tool_call>'))
    assert not first.done and first.reward is None
    assert [message["content"] for message in first.messages] == [
        "84", "error: bad arguments for calculator: calculator requires the argument 'expression'",
        "error: could not parse a tool call: invalid JSON in tool call (Expecting value at char 0): oops"]
    assert [message.get("tool_call_id") for message in first.messages] == ["turn0_0", "turn0_1", None]
    assert [record["error_kind"] for record in first.info["tool_calls"]] == [None, "bad_arguments", "parse"]
    second = checked_step(environment, _turn('<tool_call>{"name": "calculator", "arguments": {"expression": '
                                             '"84-30"}}</tool_call>', 1))
    assert second.messages[0]["content"] == "54"
    final = checked_step(environment, _turn("Answer: 54", 2))
    assert final.done and final.reward == 1.0 and final.messages == [] and final.info == {"ended_by": "answer"}
    roles = [message["role"] for message in environment.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "tool", "assistant", "tool", "assistant"]
    assert environment.messages[2]["tool_calls"][0]["function"] == {"name": "calculator",
                                                                   "arguments": {"expression": "12*7"}}
    wrong = make_environment(cls)
    checked_start(wrong, row)
    assert checked_step(wrong, _turn("Answer: 55")).reward == 0.0


def test_a_tool_call_on_the_last_turn_ends_the_episode_unrun_and_scores_it():
    _, environment = _calculator_environment(max_turns=2)
    checked_start(environment, {"prompt": "What is 1 + 1?", "answer": "2"})
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    assert not checked_step(environment, _turn(call, 0)).done
    last = checked_step(environment, _turn(call + " Answer: 2", 1))
    assert last.done and last.reward == 0.0 and last.messages == []
    assert last.info == {"ended_by": "tool call on the last turn"}


def _calculator_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calculator_env_rows", EXAMPLES / "calculator_env.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_calculator_rows_have_two_to_four_operands_and_their_answers():
    module = _calculator_module()
    rows = module.make_rows(200, seed=3)
    assert rows == module.make_rows(200, seed=3)
    counts = {row["expression"].count(" ") // 2 + 1 for row in rows}
    assert counts == {2, 3, 4}
    for row in rows[:20]:
        assert int(row["answer"]) == eval(row["expression"])  # noqa: S307 - checking the example's own arithmetic
        assert row["prompt"] == f"What is {row['expression']}?"


@pytest.mark.parametrize("tool_format", ["hermes", "llama3"])
def test_the_calculator_demonstrations_replayed_through_the_environment_score_one(tool_format):
    from hybridflow.agents import make_parser

    module = _calculator_module()
    cls = load_environment(module.CalculatorEnvironment)
    parser = make_parser(tool_format)
    for row in module.make_rows(5, seed=1):
        demonstration = module.demonstration(row, tool_format=tool_format)
        environment = make_environment(cls)
        assert checked_start(environment, row).messages == demonstration[:2]
        turns = [message["content"] for message in demonstration if message["role"] == "assistant"]
        for index, text in enumerate(turns):
            parsed = parser.parse(text, id_prefix=f"turn{index}")
            result = checked_step(environment, AssistantTurn(text, parsed.calls, parsed.errors, index))
        assert result.done and result.reward == 1.0
        assert [message["content"] for message in environment.messages if message["role"] == "tool"] == [
            demonstration[3]["content"]]


def test_a_tool_environment_written_with_only_a_reward_opens_with_the_rows_chat():
    class Minimal(ToolEnvironment):
        def reward(self, row, messages):
            return float(len(messages))

    environment = make_environment(load_environment(Minimal))
    start = checked_start(environment, {"messages": [{"role": "user", "content": "hello"}]})
    assert start.messages == [{"role": "user", "content": "hello"}] and start.tools == []
    assert checked_step(environment, _turn("bye")).reward == 2.0


def test_the_env_config_checks_every_key():
    config = EnvConfig(class_path="examples/agents/calculator_env.py:CalculatorEnvironment")
    assert (config.max_turns, config.tool_timeout_s, config.tool_format, config.on_env_error) == (None, 30.0, "auto",
                                                                                                  "drop")
    for key, value, allowed in (("class", "calculator_env.py", "'path/to/file.py:Class'"),
                                ("max_turns", 0, "an integer >= 1 or null"),
                                ("max_episode_tokens", 2.5, "an integer >= 1 or null"),
                                ("tool_timeout_s", -1, "a number of seconds > 0"),
                                ("tool_format", "xml", "auto, hermes, llama3"),
                                ("on_env_error", "retry", "drop, zero_reward")):
        arguments = {"class_path": "m:C", ("class_path" if key == "class" else key): value}
        with pytest.raises(ValueError, match=f"config key {key} got {value!r}; allowed: {allowed}"):
            EnvConfig(**arguments)


def test_the_env_config_section_loads_from_yaml_keys_through_the_config_loader():
    from hybridflow.trainers.config.loader import build_dataclass, to_plain

    config = build_dataclass(EnvConfig, {"class": "my_env.py:MyEnv", "kwargs": {"level": 2}, "max_turns": 3},
                             path="env")
    assert config.class_path == "my_env.py:MyEnv" and config.kwargs == {"level": 2} and config.max_turns == 3
    assert to_plain(config)["class"] == "my_env.py:MyEnv" and build_dataclass(EnvConfig, to_plain(config)) == config
    with pytest.raises(ValueError, match="unknown config key env.class_path; allowed keys here: agent_timeout_s, class, kwargs, "):
        build_dataclass(EnvConfig, {"class_path": "my_env.py:MyEnv"}, path="env")
    with pytest.raises(ValueError, match="config key env.class is required but missing"):
        build_dataclass(EnvConfig, {}, path="env")
    with pytest.raises(ValueError, match="config key env.tool_format got 'json'"):
        build_dataclass(EnvConfig, {"class": "my_env.py:MyEnv", "tool_format": "json"}, path="env")


def _sandbox_available() -> bool:
    from hybridflow.rewards.sandbox import SandboxConfig, isolation_problem

    return isolation_problem(SandboxConfig().interpreter) is None


@pytest.mark.skipif(not _sandbox_available(), reason="bubblewrap cannot run here")
def test_the_coding_environment_runs_the_models_code_and_grades_the_final_solution_in_the_sandbox():
    import json

    rows = [json.loads(line) for line in (EXAMPLES / "coding_tasks.jsonl").read_text().splitlines()]
    cls = load_environment(f"{EXAMPLES / 'coding_env.py'}:CodingEnvironment", {"timeout_s": 20.0})
    check_environment(cls, {"timeout_s": 20.0}, rows[0])
    environment = make_environment(cls, {"timeout_s": 20.0})
    start = checked_start(environment, rows[0])
    assert [tool.name for tool in start.tools] == ["python"]
    trial = checked_step(environment, _turn('<tool_call>{"name": "python", "arguments": {"code": '
                                            '"def add(a, b):\\n    return a + b\\nprint(add(2, 3))"}}</tool_call>'))
    assert trial.messages[0]["content"] == "5\n" and not trial.done
    final = checked_step(environment, _turn("```python\ndef add(a, b):\n    return a + b\n```", 1))
    assert final.done and final.reward == 1.0
    half = make_environment(cls, {"timeout_s": 20.0})
    checked_start(half, rows[1])
    partial = checked_step(half, _turn("```python\ndef is_even(n):\n    return n == 4\n```"))
    assert partial.reward == pytest.approx(2 / 3)  # is_even(7) and is_even(4) pass, is_even(0) fails
