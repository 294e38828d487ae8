"""The built-in code reward: run the response's program against the row's test cases, each in a sandboxed subprocess."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

from hybridflow.rewards.sandbox import SandboxConfig, check_available, run_python

_FENCE_RE = re.compile(r"```([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(response: str, *, entry_point: str | None = None) -> str:
    """The last ```python fenced block of the response, else its last fenced block, else the whole text.

    With ``entry_point`` (the name of the function the task asks for), the last ```python block that defines it
    at top level (``def entry_point(`` or ``entry_point = ...``) comes first: models often end a correct solution
    with an "example usage" block that calls the function without defining it, and grading that block would fail
    every test. Where no block defines it, the rule above applies.
    """
    blocks = _FENCE_RE.findall(response)
    python_blocks = [body for language, body in blocks if language.lower() in ("python", "py", "python3")]
    if entry_point is not None:
        name = re.escape(entry_point)
        defines = re.compile(rf"^(?:async\s+)?def\s+{name}\s*\(|^{name}\s*=(?!=)", re.MULTILINE)
        defining = [body for body in python_blocks if defines.search(body)]
        if defining:
            return defining[-1]
    if python_blocks:
        return python_blocks[-1]
    if blocks:
        return blocks[-1][1]
    return response


def _normalized_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _parse_tests(tests) -> list:
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            tests = [tests]  # a single block of assert statements
    if not isinstance(tests, (list, tuple)) or not tests:
        raise ValueError(f"field 'tests' must be a non-empty list of test cases, got {tests!r:.200}")
    for test in tests:
        if not (isinstance(test, str) or (isinstance(test, dict) and "output" in test)):
            raise ValueError(
                "each entry of field 'tests' must be assert-style code (a string) or a dict with 'input' "
                f"(stdin) and 'output' (expected stdout); got {test!r:.200}"
            )
    return list(tests)


def run_test(program: str, test, config: SandboxConfig) -> bool:
    """Whether the program passes one test: assert code appended to it exits 0, or stdin -> expected stdout."""
    if isinstance(test, str):
        return run_python(f"{program}\n\n{test}\n", config=config).ok
    result = run_python(program, stdin=str(test.get("input", "")), config=config)
    return result.ok and _normalized_output(result.stdout) == _normalized_output(str(test["output"]))


def code_reward(prompt: str, response: str, *, tests, sandbox: SandboxConfig | None = None,
                entry_point: str | None = None, **extra_fields) -> float:
    """Fraction of the row's `tests` that the response's code passes, each run in its own sandbox.

    `tests`: a list (or its JSON text) of assert-style code strings (run after the program, pass =
    exit status 0) and/or {"input": stdin, "output": expected stdout} dicts (pass = same output
    up to trailing whitespace). A runaway, crashing or hostile program fails its tests and
    nothing else happens (see hybridflow.rewards.sandbox).

    `entry_point` (a row field, as in HumanEval and MBPP rows): the name of the function the task asks for; the
    graded code is then the last ```python block that defines it (see `extract_code`). Without it, the last block.
    """
    cases = _parse_tests(tests)
    program = extract_code(response, entry_point=entry_point)
    config = sandbox or SandboxConfig()
    workers = min(len(cases), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = list(pool.map(lambda test: run_test(program, test, config), cases))
    return sum(passed) / len(cases)


code_reward.preflight = check_available
"""Run by RuleReward when it is built: no model is loaded before a missing sandbox is reported."""
