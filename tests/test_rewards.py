"""Reward plug-ins, the math checker, and the code sandbox under runaway, crashing and hostile programs."""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import pytest
import torch

from hybridflow.rewards import (
    RewardError,
    RewardMix,
    RuleReward,
    SandboxConfig,
    code_reward,
    combine_scores,
    extract_code,
    extract_final_answer,
    load_reward_function,
    math_reward,
)

FAST = SandboxConfig(timeout_s=2.0)


# ---- plug-in interface ------------------------------------------------------------------------


def length_reward(prompt, response, **extra_fields):
    return float(len(response))


def answer_reward(prompt, response, *, answer, **extra_fields):
    return 1.0 if response == answer else 0.0


def test_reward_specs_load_modules_files_and_builtin_names(tmp_path):
    from hybridflow.data.builtin.arithmetic import score

    assert load_reward_function("hybridflow.data.builtin.arithmetic:score") is score
    assert load_reward_function("arithmetic") is score
    assert load_reward_function("math") is math_reward
    assert load_reward_function("code") is code_reward
    path = tmp_path / "my_reward.py"
    path.write_text("def fn(prompt, response, **extra):\n    return 0.5\n")
    assert load_reward_function(f"{path}:fn")("p", "r") == 0.5


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "must look like 'module:function'"),
        ("hybridflow_missing_module:fn", "cannot import module 'hybridflow_missing_module'"),
        ("hybridflow.rewards.plugin:no_such_function", "has no attribute 'no_such_function'"),
        ("hybridflow.rewards.plugin:BUILTIN_REWARDS", "names a dict, not a function"),
        ("math:sqrt", "must accept \\(prompt, response"),
        ("missing_file.py:fn", "does not exist"),
    ],
)
def test_bad_reward_specs_raise_value_errors_naming_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        load_reward_function(spec)
    assert repr(spec) in str(info.value) or spec in str(info.value)


def test_score_batch_passes_row_fields_as_keyword_arguments():
    reward = RuleReward(answer_reward)
    scores = reward.score_batch(["1+1=", "2+2="], ["2", "5"], [{"answer": "2"}, {"answer": "4"}])
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0]


def raising_reward(prompt, response, **extra_fields):
    if response == "boom":
        raise ZeroDivisionError("division by zero")
    return 1.0


@pytest.mark.parametrize(
    "function, message",
    [
        (raising_reward, "raised ZeroDivisionError on sample 2 \\(prompt 'What is 2\\+2\\? x{30}"),
        (lambda p, r, **e: float("nan") if r == "boom" else 0.0, "returned nan on sample 2"),
        (lambda p, r, **e: math.inf if r == "boom" else 0.0, "returned inf on sample 2"),
        (lambda p, r, **e: "1.0" if r == "boom" else 0.0, "returned a str .* on sample 2"),
        (lambda p, r, **e: None if r == "boom" else 0.0, "returned a NoneType .* on sample 2"),
    ],
)
def test_a_failing_or_non_finite_reward_names_the_sample_and_its_prompt(function, message):
    long_prompt = "What is 2+2? " + "x" * 200
    with pytest.raises(RewardError, match=message) as info:
        RuleReward(function).score_batch(["a", "b", long_prompt], ["ok", "ok", "boom"])
    assert "x" * 100 not in str(info.value)  # the prompt is excerpted, not dumped


def test_numeric_types_of_all_kinds_are_accepted():
    values = iter([1, np.float32(0.5), torch.tensor(2.0), True])
    scores = RuleReward(lambda p, r, **e: next(values)).score_batch(["p"] * 4, ["r"] * 4)
    assert scores.tolist() == [1.0, 0.5, 2.0, 1.0]


def test_threaded_scoring_gives_the_same_scores_in_order():
    prompts = [f"p{i}" for i in range(20)]
    responses = ["x" * i for i in range(20)]
    serial = RuleReward(length_reward).score_batch(prompts, responses)
    threaded = RuleReward(length_reward, num_workers=4).score_batch(prompts, responses)
    assert threaded.tolist() == serial.tolist() == [float(i) for i in range(20)]


def test_a_reward_function_that_never_returns_fails_the_batch_naming_it_and_the_sample():
    release = threading.Event()

    def hangs_on_the_second(prompt, response, **extra_fields):
        if prompt == "second":
            release.wait(30)
        return 1.0

    reward = RuleReward(hangs_on_the_second, num_workers=2, timeout_s=0.5)
    try:
        with pytest.raises(RewardError, match=r"hangs_on_the_second.*did not finish a batch of 3 samples within "
                                              r"0.5 s.*sample 1 \(prompt 'second'\)"):
            reward.score_batch(["first", "second", "third"], ["a", "b", "c"])
    finally:
        release.set()
    with pytest.raises(ValueError, match="reward timeout_s must be > 0"):
        RuleReward(length_reward, timeout_s=0)


def test_a_reward_function_calling_sys_exit_is_reported_not_obeyed():
    def exits(prompt, response, **extra_fields):
        sys.exit(3)

    with pytest.raises(RewardError, match=r"called sys.exit\(3\) on sample 0 \(prompt 'p'\)"):
        RuleReward(exits).score_batch(["p"], ["r"])
    with pytest.raises(RewardError, match=r"called sys.exit\(3\) on sample"):
        RewardMix({f"{__file__}:exiting_reward": 1.0}, num_workers=2).score_batch(["p", "q"], ["r", "s"])


def exiting_reward(prompt, response, **extra_fields):
    raise SystemExit(3)


def test_weighted_combination_of_rule_and_model_scores():
    rule_B = torch.tensor([1.0, 0.0])
    model_B = torch.tensor([0.5, -1.0])
    total_B = combine_scores({"rule": rule_B, "model": model_B}, {"rule": 2.0, "model": 0.5})
    assert total_B.tolist() == [2.25, -0.5]
    with pytest.raises(ValueError, match="must name the same"):
        combine_scores({"rule": rule_B}, {"rule": 1.0, "modle": 1.0})
    with pytest.raises(ValueError, match="one score per sample"):
        combine_scores({"rule": rule_B, "model": torch.ones(3)}, {"rule": 1.0, "model": 1.0})


def test_reward_mix_reports_each_source_and_the_weighted_total(tmp_path):
    path = tmp_path / "lengths.py"
    path.write_text("def length(prompt, response, **extra):\n    return float(len(response))\n")
    mix = RewardMix({f"{path}:length": 0.5, "arithmetic": 3.0})
    total_B, per_source = mix.score_batch(["1+2=", "1+2="], ["3", "33"])
    assert per_source["arithmetic"].tolist() == [1.0, 0.0]
    assert per_source[f"{path}:length"].tolist() == [1.0, 2.0]
    assert total_B.tolist() == [3.5, 1.0]


# ---- math checker -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("So the total is \\boxed{1,234}.", "1234", 1.0),
        ("We get \\boxed{\\frac{3}{4}} at the end", "0.75", 1.0),
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("The answer is $42.50", "42.5", 1.0),
        ("first 12, then 7.000", "7", 1.0),
        ("first 12, then 7", "12", 0.0),
        ("no number at all", "3", 0.0),
        ("-5", "-5.0", 1.0),
        ("x = 5", "She has 2 + 3 = 5 apples.\n#### 5", 1.0),
        ("\\boxed{yes}", "Yes", 1.0),
    ],
)
def test_math_reward_compares_the_final_answer_numerically(response, answer, expected):
    assert math_reward("prompt", response, answer=answer) == expected


def test_final_answer_extraction_prefers_boxed_over_later_numbers():
    assert extract_final_answer("\\boxed{{7}} checked with 3 and 4") == "{7}"
    assert extract_final_answer("value 10, #### 11 and 12") == "11"
    assert extract_final_answer("So the answer is 42 because 6 * 7 = 42, not 41.") == "42"
    assert extract_final_answer("The answer is: yes.") == "yes"
    assert extract_final_answer("nothing") is None


# ---- code reward and sandbox ------------------------------------------------------------------


def test_code_is_extracted_from_the_last_python_fence():
    response = "try:\n```python\nx = 1\n```\nbetter:\n```python\nx = 2\n```\n"
    assert extract_code(response) == "x = 2\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("print(4)") == "print(4)"


def test_code_reward_is_the_fraction_of_tests_passed():
    response = "```python\ndef add(a, b):\n    return a + b\n```"
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]
    assert code_reward("p", response, tests=tests, sandbox=FAST) == pytest.approx(2 / 3)
    io_tests = '[{"input": "3\\n", "output": "6"}, {"input": "5", "output": "10\\n"}, {"input": "1", "output": "3"}]'
    assert code_reward("p", "print(int(input()) * 2)", tests=io_tests, sandbox=FAST) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="field 'tests' must be a non-empty list"):
        code_reward("p", "x = 1", tests=[])
