"""The coding example that learns (examples/agents/coding_learns.py): the grading rule (the last ```python block
that defines the task's function), the task set (every row's tests pass with a reference solution in the sandbox
and fail without one), the python tool in the system prompt for templates that render no ``tools=``, and, in a
short form, held-out episodes -> GRPO with the coding environment -> held-out episodes."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from hybridflow.agents import AssistantTurn, ToolCall, checked_start, checked_step, make_environment
from hybridflow.agents.episode import ChatTokens
from hybridflow.models import smollm2_path
from hybridflow.rewards import SandboxConfig, code_reward, extract_code, run_python

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "agents"
FAST = SandboxConfig(timeout_s=20.0)
SOLUTION = "```python\ndef add(a, b):\n    return a + b\n```"
USAGE = "\nExample usage:\n```python\nprint(add(2, 3))  # 5\n```"


def _sandbox_available() -> bool:
    from hybridflow.rewards.sandbox import isolation_problem

    return isolation_problem(SandboxConfig().interpreter) is None


needs_sandbox = pytest.mark.skipif(not _sandbox_available(), reason="bubblewrap cannot run here")


@pytest.fixture(scope="module")
def learns():
    return runpy.run_path(str(EXAMPLES / "coding_learns.py"))


@pytest.fixture(scope="module")
def coding_env(learns):
    return learns["coding_env"]


def test_the_graded_block_is_the_last_python_block_that_defines_the_entry_point():
    response = SOLUTION + USAGE
    assert extract_code(response) == "print(add(2, 3))  # 5\n"  # without entry_point: the last block, as before
    assert extract_code(response, entry_point="add") == "def add(a, b):\n    return a + b\n"
    revised = response + "\nFaster:\n```python\nadd = lambda a, b: a + b\n```\n```python\nadd(1, 2) == 3\n```"
    assert extract_code(revised, entry_point="add") == "add = lambda a, b: a + b\n"
    # a block that only calls, compares or defines another function does not count; no defining block: the last
    assert extract_code(USAGE + "\n```python\nadd == 3\ndef add_one(x):\n    return x\n```", entry_point="add") \
        == "add == 3\ndef add_one(x):\n    return x\n"
    assert extract_code("```python\nclass A:\n    def add(a, b):\n        return 0\n```\n```python\nx = 1\n```",
                        entry_point="add") == "x = 1\n"  # a method is not the top-level function asked for
    assert extract_code("def add(a, b): return a + b", entry_point="add") == "def add(a, b): return a + b"


@needs_sandbox
def test_code_reward_with_an_entry_point_grades_a_solution_followed_by_an_example_block():
    tests = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
    assert code_reward("p", SOLUTION + USAGE, tests=tests, sandbox=FAST) == 0.0
    assert code_reward("p", SOLUTION + USAGE, tests=tests, sandbox=FAST, entry_point="add") == 1.0


def _task_check_program(rows: list[dict], references: dict[str, str]) -> str:
    """One sandboxed program that runs each row's tests after its reference solution and after a stub returning
    None, in fresh namespaces, and prints the entry points whose reference fails or whose stub passes."""
    cases = [{"name": row["entry_point"], "reference": references[row["entry_point"]], "tests": row["tests"]}
             for row in rows]
    return f"""import json
cases = json.loads({json.dumps(json.dumps(cases))})
failed, unfailing = [], []
for case in cases:
    stub = "def " + case["name"] + "(*args, **kwargs):\\n    return None\\n"
    for code, failures, wanted in ((case["reference"], failed, True), (stub, unfailing, False)):
        namespace = {{}}
        try:
            exec(code, namespace)
            for test in case["tests"]:
                exec(test, namespace)
            passed = True
        except Exception:
            passed = False
        if passed != wanted:
            failures.append(case["name"])
print(json.dumps({{"reference_fails": failed, "stub_passes": unfailing}}))
"""


@needs_sandbox
def test_every_task_passes_its_tests_with_a_reference_solution_in_the_sandbox_and_fails_them_without_one(
        coding_env):
    rows = coding_env.task_rows()
    references = {entry["entry_point"]: entry["reference"] for entry in map(
        json.loads, (EXAMPLES / "coding_tasks_reference.jsonl").read_text().splitlines())}
    names = [row["entry_point"] for row in rows]
    assert len(rows) >= 60 and len(set(names)) == len(names) and set(names) == set(references)
    for row in rows:
        assert f"{row['entry_point']}(" in row["prompt"] and 2 <= len(row["tests"]) <= 4
        assert all(f"{row['entry_point']}(" in test for test in row["tests"])
    splits = {split: coding_env.task_rows(split) for split in coding_env.SPLITS}
    assert len(splits["train"]) + len(splits["heldout"]) == len(rows) and len(splits["heldout"]) >= 20
    assert not {row["entry_point"] for row in splits["train"]} & {row["entry_point"] for row in splits["heldout"]}
    result = run_python(_task_check_program(rows, references), config=SandboxConfig(timeout_s=60.0))
    assert result.ok, result.stderr
    assert json.loads(result.stdout) == {"reference_fails": [], "stub_passes": []}
    # and through the reward itself, for two rows
    for row in rows[:2]:
        response = f"```python\n{references[row['entry_point']]}```"
        assert code_reward(row["prompt"], response, tests=row["tests"], sandbox=FAST) == 1.0
    with pytest.raises(ValueError, match="split got 'test'"):
        coding_env.task_rows("test")


@needs_sandbox
def test_the_prompted_environment_describes_the_python_tool_in_its_system_prompt_and_grades_the_defining_block(
        coding_env):
    row = coding_env.task_rows()[0]
    environment = make_environment(coding_env.PromptedCodingEnvironment, {"timeout_s": 20.0})
    opening = checked_start(environment, row)
    system = opening.messages[0]
    assert system["role"] == "system" and system["content"].startswith(coding_env.SYSTEM_PROMPT)
    assert "- python(code: string): Run a Python program in a sandbox" in system["content"]
    assert '<tool_call>{"name": <tool name>, "arguments": <arguments as JSON>}</tool_call>' in system["content"]
    assert [tool.name for tool in opening.tools] == ["python"]
    call = ToolCall(name="python", arguments={"code": "print(2 + 3)"}, id="c0")
    trial = checked_step(environment, AssistantTurn("<tool_call>...</tool_call>", [call], [], 0))
    assert trial.messages[0]["content"] == "5\n" and not trial.done
    final = checked_step(environment, AssistantTurn(SOLUTION + USAGE, [], [], 1))
    assert final.done and final.reward == 1.0
    plain = checked_start(make_environment(coding_env.CodingEnvironment, {"timeout_s": 20.0}), row)
    assert plain.messages[0]["content"] == coding_env.SYSTEM_PROMPT


@pytest.mark.needs_smollm2
@pytest.mark.skipif(smollm2_path() is None, reason="SmolLM2-135M not converted; run `python scripts/get_smollm2.py`")
@needs_sandbox
def test_smollm2_gets_the_python_tool_in_its_system_prompt_and_the_rendering_is_the_runners_ids(learns, coding_env):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    environment = learns["environment_for"](tokenizer)
    assert environment is coding_env.PromptedCodingEnvironment
    row = coding_env.task_rows("heldout")[0]
    opening = checked_start(make_environment(environment), row)
    tools = [tool.schema for tool in opening.tools]
    chat = ChatTokens(tokenizer)
    prompt_ids = chat.prompt_ids(opening.messages, tools)  # what the episode runner and evaluate sample after
    rendered = tokenizer.decode(prompt_ids)
    assert "- python(code: string): Run a Python program in a sandbox" in rendered
    assert rendered.count("<|im_start|>system") == 1 and rendered.endswith("<|im_start|>assistant\n")
    assert rendered.endswith(f"{row['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    # a tool turn and its result, appended as ids, are the ids of the whole conversation rendered at once
    call_text = '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    call_ids = tokenizer.encode(call_text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    result = {"role": "tool", "name": "python", "content": "1\n"}
    observation = chat.observation_ids([result], tools, closed_by="<|im_end|>")
    whole = opening.messages + [{"role": "assistant", "content": call_text}, result]
    assert prompt_ids + call_ids + observation == chat.prompt_ids(whole, tools)


def test_the_config_refuses_an_unknown_model_and_negative_sizes(learns, tmp_path):
    with pytest.raises(ValueError, match="model got .*a Hugging Face directory"):
        learns["CodingLearnsConfig"](model=str(tmp_path))
    with pytest.raises(ValueError, match="num_val got -1"):
        learns["CodingLearnsConfig"](num_val=-1)
    with pytest.raises(ValueError, match="samples_per_prompt got 0"):
        learns["CodingLearnsConfig"](samples_per_prompt=0)
    with pytest.raises(ValueError, match="grpo_steps got -2"):
        learns["CodingLearnsConfig"](grpo_steps=-2)
    with pytest.raises(ValueError, match="eval_samples got -1"):
        learns["CodingLearnsConfig"](eval_samples=-1)
    with pytest.raises(ValueError, match="eval_temperature got 0"):
        learns["CodingLearnsConfig"](eval_temperature=0.0)


def test_the_paired_change_is_the_mean_per_task_difference_with_its_standard_error(learns):
    change = learns["paired_change"]([0.0, 0.5, 1.0, 0.25], [0.5, 0.5, 0.75, 0.75])
    assert change["mean"] == pytest.approx(0.1875)  # (0.5 + 0 - 0.25 + 0.5) / 4
    # the changes' sample standard deviation (0.375) over sqrt(4)
    assert change["standard_error"] == pytest.approx(0.375 / 2)
    assert (change["tasks"], change["rose"], change["fell"]) == (4, 2, 1)
    with pytest.raises(ValueError, match="two equal lists"):
        learns["paired_change"]([0.0], [1.0])


@needs_sandbox
def test_held_out_episodes_then_grpo_with_the_coding_environment_then_held_out_episodes_run(learns, tmp_path):
    config = learns["CodingLearnsConfig"](output_dir=str(tmp_path), model="tiny", num_train=4, num_val=2,
                                          grpo_steps=2, prompts_per_step=2, samples_per_prompt=2, val_every=1,
                                          max_new_tokens=16, eval_samples=2)
    summary = learns["run"](config)
    assert summary["environment"] == "CodingEnvironment"  # the tiny model's template renders tools=
    assert summary["tasks"] == {"train": 4, "heldout": 2}
    for stage in ("before", "after", "sampled_before", "sampled_after"):
        assert set(summary[stage]) == {"pass_rate", "solved_rate", "tool_call_rate", "turns_mean", "task_pass_rates"}
        assert 0.0 <= summary[stage]["solved_rate"] <= summary[stage]["pass_rate"] <= 1.0
        assert 1.0 <= summary[stage]["turns_mean"] <= 3.0
        assert len(summary[stage]["task_pass_rates"]) == 2
        assert summary[stage]["pass_rate"] == pytest.approx(sum(summary[stage]["task_pass_rates"]) / 2)
    for name, (early, late) in {"greedy": ("before", "after"), "sampled": ("sampled_before", "sampled_after")}.items():
        change = summary["change"][name]
        assert change["mean"] == pytest.approx(summary[late]["pass_rate"] - summary[early]["pass_rate"])
        assert change["tasks"] == 2 and change["rose"] + change["fell"] <= 2
    assert [record["step"] for record in summary["curve"]] == [0, 1, 2]
    assert all("reward/score_mean" in record and "val/score_mean" in record and "time/step_s" in record
               for record in summary["curve"][1:])
    assert set(summary["times"]) == {"eval_before_s", "grpo_s", "eval_after_s", "total_s"}
    assert json.loads((tmp_path / "summary.json").read_text())["after"] == summary["after"]
    trained = [json.loads(line)["entry_point"] for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert trained == [row["entry_point"] for row in learns["coding_env"].task_rows("train")[:4]]
    assert (tmp_path / "grpo" / "final" / "actor" / "config.json").exists()
    only = learns["run"](learns["CodingLearnsConfig"](output_dir=str(tmp_path / "only"), model="tiny", num_val=2,
                                                      grpo_steps=0, max_new_tokens=16))
    assert only["before"] == summary["before"] and only["after"] is None and only["curve"] == []
    assert only["sampled_before"]["task_pass_rates"] and only["sampled_after"] is None and only["change"] == {}
    assert not (tmp_path / "only" / "grpo").exists()
