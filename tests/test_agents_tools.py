"""Tools for agentic RL: schemas from type hints and docstrings, tool-call parsing in the hermes and llama3 formats,
execution with timeouts where every failure is data, and the shipped calculator, sandboxed Python and BM25 search."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest

from hybridflow.agents import (
    DocumentSearch,
    HermesParser,
    Llama3Parser,
    Tool,
    ToolArgumentError,
    ToolCall,
    calculator,
    make_parser,
    parser_for_template,
    run_tool_calls,
    tool,
    tool_metrics,
)
from hybridflow.agents.tool_calls import arun_tool_calls


def lookup(city: str, units: Literal["metric", "imperial"] = "metric", days: list[int] | None = None,
           strict: bool = False) -> dict:
    """Look up the weather of a city.

    A second paragraph that is not part of the description.

    Args:
        city: The city's name,
            as written on a map.
        units (str): Which units to report.
        days: Days ahead to report.
        strict: Fail on an unknown city.

    Returns:
        The weather.
    """
    return {"city": city, "units": units, "days": days or []}


def test_a_functions_hints_and_google_docstring_become_an_openai_function_schema():
    assert tool(lookup).schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather of a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "The city's name, as written on a map."},
            "units": {"type": "string", "enum": ["metric", "imperial"], "description": "Which units to report."},
            "days": {"type": "array", "items": {"type": "integer"}, "nullable": True,
                     "description": "Days ahead to report."},
            "strict": {"type": "boolean", "description": "Fail on an unknown city."}}}}}


def test_sphinx_docstrings_the_decorator_with_options_and_a_name_override_work():
    @tool(name="scale-it", timeout_s=2.5)
    def scale(value: float, factor: int = 2) -> float:
        """Multiply a value.

        :param value: what to scale
        :param factor: by how much
        """
        return value * factor

    assert scale.name == "scale-it" and scale.timeout_s == 2.5
    properties = scale.schema["function"]["parameters"]["properties"]
    assert properties == {"value": {"type": "number", "description": "what to scale"},
                          "factor": {"type": "integer", "description": "by how much"}}
    assert scale.call({"value": 3}) == "6.0"  # an integer is accepted for a float, the result sent as JSON


def test_a_function_the_model_cannot_call_is_refused_when_the_tool_is_built():
    def no_hint(x) -> str:
        """Doc."""
    def no_doc(x: int) -> str:
        return ""
    def star(*values: int) -> str:
        """Doc."""
    def opaque(x: threading.Lock) -> str:
        """Doc."""
    with pytest.raises(ValueError, match=r"no_hint.*parameter 'x' needs a type hint"):
        tool(no_hint)
    with pytest.raises(ValueError, match=r"no_doc needs a docstring"):
        tool(no_doc)
    with pytest.raises(ValueError, match=r"star.*'values' must be a named parameter"):
        tool(star)
    with pytest.raises(ValueError, match=r"opaque.*has no JSON form"):
        tool(opaque)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        tool(lookup, timeout_s=0)


def test_arguments_are_checked_against_the_schema_before_the_function_runs():
    weather = tool(lookup)
    assert json.loads(weather.call({"city": "Oslo", "days": [1, 2]})) == {"city": "Oslo", "units": "metric",
                                                                         "days": [1, 2]}
    for arguments, message in (({}, "requires the argument 'city'"),
                               ({"city": "Oslo", "wind": 1}, "no parameter 'wind'"),
                               ({"city": 3}, "'city' of lookup must be string, got integer 3"),
                               ({"city": "Oslo", "units": "kelvin"}, r"'units' of lookup must be \['metric'"),
                               ({"city": "Oslo", "days": [1, "2"]}, "'days'"),
                               ({"city": "Oslo", "strict": 1}, "'strict' of lookup must be boolean"),
                               ("Oslo", "must be a JSON object")):
        with pytest.raises(ToolArgumentError, match=message):
            weather.call(arguments)


def test_the_hermes_parser_reads_several_calls_and_reports_malformed_ones_without_raising():
    text = ('Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
            '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"cats\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*"</tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
            '<tool_call>{"name": "x"')
    parsed = HermesParser().parse(text, id_prefix="t1")
    assert [(call.name, call.arguments, call.id) for call in parsed.calls] == [
        ("calculator", {"expression": "1+2"}, "t1_0"), ("search", {"query": "cats"}, "t1_1")]
    assert parsed.calls[0].raw == '{"name": "calculator", "arguments": {"expression": "1+2"}}'
    assert len(parsed.errors) == 4
    assert parsed.errors[0].startswith("invalid JSON in tool call")
    assert 'must be a JSON object with a "name"' in parsed.errors[1]
    assert 'the "arguments" of a tool call must be a JSON object' in parsed.errors[2]
    assert parsed.errors[3].startswith("unterminated tool call")
    assert HermesParser().parse("The answer is 42.") == HermesParser().parse("")
    assert HermesParser().parse("The answer is 42.").calls == []


def test_the_llama3_parser_reads_a_json_turn_with_one_or_more_calls_and_leaves_prose_alone():
    parser = Llama3Parser()
    one = parser.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": "3*4"}}<|eom_id|>')
    assert [(call.name, call.arguments) for call in one.calls] == [("calculator", {"expression": "3*4"})]
    several = parser.parse('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}\n{"name": "c"}')
    assert [(call.name, call.arguments, call.id) for call in several.calls] == [
        ("a", {}, "call_0"), ("b", {"x": 1}, "call_1"), ("c", {}, "call_2")]
    broken = parser.parse('{"name": "a", "parameters": {"x": 1}; {"name": "b"}')
    assert broken.calls == [] and broken.errors[0].startswith("invalid JSON in tool call")
    assert parser.parse("The result is 12.") == parser.parse("  ")
    assert parser.parse("The result is 12.").errors == []
    assert parser.parse("<|python_tag|>print(1)").errors[0].startswith("<|python_tag|> must be followed")


QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions. <tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Return each call as <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA3_STYLE_TEMPLATE = (
    "{%- if tools %}Given the following functions, respond with a JSON for a function call with its proper "
    "arguments. Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and "
    "its value}.{%- for t in tools %}{{ t | tojson }}{%- endfor %}{%- endif %}"
    "{%- for message in messages %}{{ message.content }}<|eot_id|>{%- endfor %}"
)


def test_the_parser_is_chosen_from_the_chat_template_or_named_in_the_config():
    assert isinstance(parser_for_template(QWEN_STYLE_TEMPLATE), HermesParser)
    assert isinstance(parser_for_template(LLAMA3_STYLE_TEMPLATE), Llama3Parser)
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }}"), Llama3Parser)
    with pytest.warns(UserWarning, match="no known tool-call format"):
        assert isinstance(parser_for_template("{{ messages }}"), HermesParser)
    assert isinstance(make_parser("llama3", QWEN_STYLE_TEMPLATE), Llama3Parser)
    assert isinstance(make_parser("auto", QWEN_STYLE_TEMPLATE), HermesParser)
    with pytest.raises(ValueError, match="env.tool_format got 'json'; allowed: auto, hermes, llama3"):
        make_parser("json")


def test_a_chat_template_renders_the_tool_schemas_of_the_shipped_tools():
    from hybridflow.data.builtin import builtin_tokenizer

    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    search = DocumentSearch(["a document"])
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1"}], tools=[calculator.schema, search.schema],
                                         tokenize=False, add_generation_prompt=True)
    assert '"name": "calculator"' in text and '"name": "search"' in text
    assert '"required": ["expression"]' in text and text.endswith("<|im_start|>assistant")


def _sleepy(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def _fail(reason: str) -> str:
    """Always raise.

    Args:
        reason: The message.
    """
    raise RuntimeError(reason)


def _exit(code: int) -> str:
    """Exit the process (a tool must not be able to).

    Args:
        code: The exit status.
    """
    raise SystemExit(code)


def test_unknown_tools_bad_arguments_raising_and_slow_tools_become_error_messages_and_the_others_still_return():
    tools = [tool(_sleepy, name="sleep"), tool(_fail, name="fail"), calculator, tool(_exit, name="exit")]
    calls = [ToolCall("sleep", {"seconds": 3.0}, id="c0"), ToolCall("calculator", {"expression": "6*7"}, id="c1"),
             ToolCall("fail", {"reason": "disk on fire"}, id="c2"), ToolCall("nope", {}, id="c3"),
             ToolCall("calculator", {"expr": "1"}, id="c4"), ToolCall("sleep", {"seconds": 0.05}, id="c5"),
             ToolCall("exit", {"code": 3}, id="c6")]
    executor = ThreadPoolExecutor(8)
    started = time.monotonic()
    outcomes = run_tool_calls(calls, tools, 0.5, executor, parse_errors=["invalid JSON in tool call: {x"])
    elapsed = time.monotonic() - started
    executor.shutdown(wait=False)
    assert elapsed < 2.0  # the 3 s sleeper is abandoned at its timeout; nothing waits for it
    assert [(outcome.tool, outcome.error_kind) for outcome in outcomes] == [
        ("sleep", "timeout"), ("calculator", None), ("fail", "raised"), ("nope", "unknown_tool"),
        ("calculator", "bad_arguments"), ("sleep", None), ("exit", "raised"), ("<unparsed>", "parse")]
    assert outcomes[0].content == "error: tool sleep did not finish within 0.5 s" and outcomes[0].seconds == 0.5
    assert outcomes[1].content == "42" and outcomes[5].content == "slept 0.05"
    assert outcomes[2].content == "error: fail raised RuntimeError: disk on fire"
    assert outcomes[3].content == "error: unknown tool 'nope'; the tools are: calculator, exit, fail, sleep"
    assert "calculator has no parameter 'expr'" in outcomes[4].content
    assert outcomes[6].content == "error: exit raised SystemExit: 3"
    assert outcomes[7].content == "error: could not parse a tool call: invalid JSON in tool call: {x"
    assert outcomes[1].message() == {"role": "tool", "name": "calculator", "content": "42", "tool_call_id": "c1"}
    assert 0.04 < outcomes[5].seconds < 0.5 and outcomes[2].seconds < 0.5  # each measured on its own thread
    metrics = tool_metrics([outcome.record() for outcome in outcomes])
    assert metrics["agent/tool_calls"] == 8 and metrics["agent/tool_errors"] == 6
    assert metrics["agent/tool_calls/calculator"] == 2 and metrics["agent/tool_errors/calculator"] == 1
    assert metrics["agent/tool_calls/<unknown>"] == 1 and "agent/tool_calls/nope" not in metrics
    assert metrics["agent/tool_errors_timeout"] == 1 and metrics["agent/tool_errors_parse"] == 1
    assert metrics["agent/tool_seconds"] >= 0.5


def test_a_tools_own_timeout_overrides_the_environments_and_the_async_form_matches():
    import asyncio

    slow = tool(_sleepy, name="sleep", timeout_s=0.1)
    outcomes = asyncio.run(arun_tool_calls([ToolCall("sleep", {"seconds": 1.0})], [slow], 30.0))
    assert outcomes[0].error_kind == "timeout" and "within 0.1 s" in outcomes[0].content
    with pytest.raises(ValueError, match="env.tool_timeout_s got 0"):
        run_tool_calls([], [slow], 0)


def test_the_calculator_is_exact_and_refuses_anything_but_arithmetic():
    cases = {"(12 + 7) * 3": "57", "7 / 2": "3.5", "1/3": "0.333333333333", "2 ** 10 - 7 // 2 + 10 % 4": "1023",
             "-3 * -(2)": "6", "0.1 + 0.2": "0.3", "123456789 * 987654321": "121932631112635269", "6/3": "2"}
    for expression, expected in cases.items():
        assert calculator.call({"expression": expression}) == expected, expression
    for expression, message in (("__import__('os').system('ls')", "not arithmetic"), ("x + 1", "not arithmetic"),
                                ("[1, 2]", "not arithmetic"), ("1 / 0", "division by zero"),
                                ("9 ** 9 ** 9", "exponents must be whole numbers of at most 1000"),
                                ("2 ** 0.5", "exponents must be whole"), ("1 +", "cannot read"),
                                ("1" * 600, "longer than 500")):
        with pytest.raises(ValueError, match=message):
            calculator.call({"expression": expression})


def test_document_search_ranks_by_bm25_and_reads_a_jsonl_collection(tmp_path):
    documents = ["Paris is the capital and largest city of France.", "The cat sat on the mat and slept.",
                 "Berlin is the capital of Germany; France borders Germany.", "Bananas are rich in potassium."]
    search = DocumentSearch(documents, top_k=2)
    result = search.call({"query": "capital of France"})
    assert result.startswith("[1] Paris is the capital") and "\n\n[2] Berlin is the capital" in result
    assert "cat" not in result
    assert search.call({"query": "the of"}) == "no results (the query has no searchable words)"
    assert search.call({"query": "quantum chromodynamics"}) == "no results"
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"title": f"doc{index}", "text": text})
                              for index, text in enumerate(documents)) + "\n")
    from_file = DocumentSearch(path, top_k=1, max_chars_per_document=20)
    assert from_file.call({"query": "potassium bananas"}) == "[1] doc3: Bananas are rich in ..."
    assert isinstance(from_file, Tool) and from_file.name == "search"
    with pytest.raises(ValueError, match="does not exist"):
        DocumentSearch(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="at least one document"):
        DocumentSearch([])
    with pytest.raises(ValueError, match="no searchable words"):
        DocumentSearch(["a b c", "the of"])


def _sandbox_available() -> bool:
    from hybridflow.rewards.sandbox import SandboxConfig, isolation_problem

    return isolation_problem(SandboxConfig().interpreter) is None


@pytest.mark.skipif(not _sandbox_available(), reason="bubblewrap cannot run here")
def test_the_python_tool_runs_the_models_program_in_the_sandbox_and_reports_errors_and_timeouts():
    from hybridflow.agents import python_tool
    from hybridflow.rewards.sandbox import SandboxConfig

    python = python_tool(SandboxConfig(timeout_s=20.0))  # generous: a loaded CI host starts interpreters slowly
    assert python.name == "python" and python.timeout_s == 50.0
    assert python.call({"code": "print(sum(range(10)))"}) == "45\n"
    failed = python.call({"code": "import os\nprint(os.getuid())\nraise SystemExit(3)"})
    assert failed == "65534\n\n(exit status 3)"  # the guest runs as nobody
    assert "ZeroDivisionError" in python.call({"code": "1/0"})
    assert "FileNotFoundError" in python.call({"code": f"open({__file__!r})"})  # the host's files are not there
    runaway = python_tool(SandboxConfig(timeout_s=2.0))
    assert runaway.call({"code": "while True: pass"}).endswith("(stopped: the program ran past 2 s)")
    assert python.call({"code": "pass"}) == "(no output)"


def test_the_python_tool_refuses_to_be_built_where_the_sandbox_cannot_run(monkeypatch):
    from hybridflow.agents import python_tool
    from hybridflow.rewards.sandbox import SandboxConfig, SandboxUnavailableError

    monkeypatch.delenv("HYBRIDFLOW_SANDBOX", raising=False)  # the opt-out would skip the check
    with pytest.raises(SandboxUnavailableError, match="cannot sandbox"):
        python_tool(SandboxConfig(python_executable="/usr/bin/no-such-python3"))


def test_the_search_tool_leaves_numba_unloaded_so_a_vllm_engine_can_start_in_the_same_process():
    # numba's llvmlite wrappers break vLLM 0.32's kernel-registration scan of sys.modules (the tool runs in the actor)
    import subprocess
    import sys

    program = ("import sys; from hybridflow.agents.builtin_tools import DocumentSearch; "
               "tool = DocumentSearch(['the cat sat on the mat', 'python is a programming language']); "
               "assert 'python' in tool.search('python programming'); "
               "print(sorted(name for name in sys.modules if name.split('.')[0] in ('numba', 'llvmlite')))")
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
