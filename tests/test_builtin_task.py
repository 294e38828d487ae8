"""The built-in arithmetic task: shipped tokenizer and model config, generators, splits and the exact checker."""

from __future__ import annotations

import json

import pytest
import torch

from hybridflow.data.builtin import (
    ASSETS_DIR,
    ArithmeticTaskConfig,
    Problem,
    builtin_model_config,
    builtin_tokenizer,
    carry_free_sum,
    parse_prompt,
    preference_rows,
    prompt_rows,
    sample_problems,
    score,
    sft_rows,
)
from hybridflow.data.builtin.build_assets import main as build_assets_main
from hybridflow.data.builtin.build_assets import write_assets

CONFIG = ArithmeticTaskConfig(min_digits=1, max_digits=3, operations=("+", "-", "*"))


def test_shipped_tokenizer_is_a_fast_tokenizer_with_special_tokens_and_left_padding():
    from transformers import PreTrainedTokenizerFast

    tokenizer = builtin_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.padding_side == "left"
    assert tokenizer.chat_template is None


def test_tokenizer_is_character_level_and_round_trips_every_task_string():
    tokenizer = builtin_tokenizer()
    ids = tokenizer("12+345=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 8
    expected = [tokenizer.convert_tokens_to_ids(character) for character in "-357"]
    assert tokenizer("-357", add_special_tokens=False)["input_ids"] == expected
    for row in prompt_rows(50, split="train", seed=3, config=CONFIG):
        text = row["prompt"] + row["answer"]
        assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text
        assert tokenizer.unk_token_id not in tokenizer(text)["input_ids"]


def test_shipped_assets_are_exactly_what_the_build_script_writes(tmp_path):
    write_assets(tmp_path)
    for name in ("tokenizer.json", "config.json"):
        assert json.loads((tmp_path / name).read_text()) == json.loads((ASSETS_DIR / name).read_text())


def _package_files() -> dict[str, int]:
    return {path.name: path.stat().st_mtime_ns for path in ASSETS_DIR.iterdir()}


@pytest.mark.parametrize("argv", [["--help"], []])
def test_build_assets_help_or_no_arguments_exits_without_writing_into_the_package(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    before = _package_files()
    with pytest.raises(SystemExit) as exit_info:
        build_assets_main(argv)
    assert exit_info.value.code == (0 if argv else 2)
    captured = capsys.readouterr()
    assert "(--out DIR | --check | --in-package)" in (captured.out if argv else captured.err)
    assert _package_files() == before
    assert list(tmp_path.iterdir()) == []


def test_build_assets_writes_into_the_given_folder_and_checks_the_shipped_files(tmp_path, capsys):
    before = _package_files()
    assert build_assets_main(["--out", str(tmp_path / "assets")]) == 0
    assert sorted(path.name for path in (tmp_path / "assets").iterdir()) == sorted(before)
    assert build_assets_main(["--check"]) == 0
    assert "match a fresh build" in capsys.readouterr().out
    assert _package_files() == before


def test_tiny_model_config_fits_the_vocabulary_and_builds_a_llama_that_runs():
    from transformers import LlamaForCausalLM

    config = builtin_model_config()
    tokenizer = builtin_tokenizer()
    assert config.model_type == "llama"
    assert config.vocab_size >= len(tokenizer) and config.vocab_size % 8 == 0
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (128, 4, 4)
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 2e6
    batch = tokenizer(["1+2=", "123+45="], padding=True, return_tensors="pt")
    logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


def test_train_and_eval_splits_are_disjoint_for_any_seeds():
    train = {p.prompt for p in sample_problems(3000, split="train", seed=0, config=CONFIG)}
    evaluation = {p.prompt for p in sample_problems(300, split="eval", seed=1, config=CONFIG)}
    assert len(evaluation) > 250 and not train & evaluation


def test_generators_are_deterministic_in_the_seed():
    first = prompt_rows(20, split="train", seed=5, config=CONFIG)
    assert first == prompt_rows(20, split="train", seed=5, config=CONFIG)
    assert first != prompt_rows(20, split="train", seed=6, config=CONFIG)


def test_operands_respect_the_digit_range_and_operations():
    config = ArithmeticTaskConfig(min_digits=2, max_digits=3, operations=("-",))
    for problem in sample_problems(200, split="train", seed=0, config=config):
        assert problem.operation == "-"
        assert 10 <= problem.left <= 999 and 10 <= problem.right <= 999


def test_sft_answers_are_correct_and_preference_pairs_are_correct_versus_wrong():
    for row in sft_rows(100, split="train", seed=0, config=CONFIG):
        assert score(row["prompt"], row["response"]) == 1.0
    rows = preference_rows(200, split="train", seed=0, config=CONFIG)
    for row in rows:
        assert score(row["prompt"], row["chosen"]) == 1.0
        assert score(row["prompt"], row["rejected"]) == 0.0
        assert row["rejected"].lstrip("-").isdigit()
    assert len({row["rejected"] for row in rows}) > 100


def test_exact_checker_values():
    assert score("12+345=", "357") == 1.0
    assert score("12+345=", " 357\n") == 1.0
    assert score("12-345=", "-333") == 1.0
    assert score("12*34=", "408") == 1.0
    assert score("12+345=", "358") == 0.0
    assert score("12+345=", "357 ") == 1.0
    assert score("12+345=", "3570") == 0.0
    assert score("anything", "7", answer="7") == 1.0
    assert parse_prompt("12 + 345 =").answer == "357"
    with pytest.raises(ValueError, match="not an arithmetic prompt"):
        score("what is 2+2?", "4")


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "min_digits"),
        ({"max_digits": 12}, "max_digits"),
        ({"operations": ("/",)}, "operations"),
        ({"eval_percent": 0}, "eval_percent"),
    ],
)
def test_task_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ArithmeticTaskConfig(**kwargs)


def test_reversed_answers_write_the_digits_least_significant_first_and_the_checker_uses_the_answer_field():
    config = ArithmeticTaskConfig(max_digits=2, reverse_answer=True)
    rows = prompt_rows(200, split="train", seed=0, config=config)
    for row in rows:
        problem = parse_prompt(row["prompt"])
        assert row["answer"] == str(problem.left + problem.right)[::-1]
        assert score(row["prompt"], row["answer"], answer=row["answer"]) == 1.0
    assert Problem(57, "+", 68, reverse_answer=True).answer == "521"
    assert Problem(3, "-", 45, reverse_answer=True).answer == "-24"
    assert score("57+68=", "521", answer="521") == 1.0 and score("57+68=", "125", answer="521") == 0.0


def test_reversed_preference_pairs_reject_a_wrong_answer_written_in_the_same_order():
    config = ArithmeticTaskConfig(max_digits=2, reverse_answer=True)
    for row in preference_rows(300, split="train", seed=1, config=config):
        expected = str(sum(int(x) for x in row["prompt"][:-1].split("+")))
        assert row["chosen"] == expected[::-1]
        assert row["rejected"] != row["chosen"] and row["rejected"].isdigit()


def test_carry_free_sum_drops_every_carry():
    assert carry_free_sum(57, 68) == 15
    assert carry_free_sum(99, 1) == 90
    assert carry_free_sum(12, 34) == 46
    assert carry_free_sum(0, 0) == 0


def test_an_imperfect_demonstrator_forgets_carries_at_the_given_rate_and_only_on_carrying_sums():
    config = ArithmeticTaskConfig(max_digits=2)
    clean = sft_rows(2000, split="train", seed=0, config=config)
    noisy = sft_rows(2000, split="train", seed=0, config=config, forget_carry_rate=0.6)
    assert [row["prompt"] for row in clean] == [row["prompt"] for row in noisy]
    carrying = forgotten = 0
    for clean_row, noisy_row in zip(clean, noisy):
        left, right = map(int, clean_row["prompt"][:-1].split("+"))
        if carry_free_sum(left, right) == left + right:
            assert noisy_row["response"] == clean_row["response"]
            continue
        carrying += 1
        if noisy_row["response"] != clean_row["response"]:
            assert noisy_row["response"] == str(carry_free_sum(left, right))
            forgotten += 1
    assert carrying > 500 and 0.55 < forgotten / carrying < 0.65
    with pytest.raises(ValueError, match="forget_carry_rate"):
        sft_rows(1, split="train", seed=0, config=config, forget_carry_rate=1.5)


def test_fixed_width_pads_operands_and_answers_so_every_digit_has_a_fixed_position():
    config = ArithmeticTaskConfig(max_digits=2, reverse_answer=True, fixed_width=True)
    assert Problem(7, "+", 68, reverse_answer=True, width=2).prompt == "07+68="
    assert Problem(7, "+", 68, reverse_answer=True, width=2).answer == "570"
    assert Problem(7, "+", 68, width=2).answer == "075"
    assert Problem(12, "*", 34, width=2).answer == "0408"
    assert Problem(3, "-", 45, width=2).answer == "-42"
    rows = prompt_rows(300, split="train", seed=0, config=config)
    assert {len(row["prompt"]) for row in rows} == {6} and {len(row["answer"]) for row in rows} == {3}
    for row in rows:
        problem = parse_prompt(row["prompt"])
        assert int(row["answer"][::-1]) == problem.left + problem.right
    for row in preference_rows(300, split="train", seed=0, config=config):
        assert len(row["chosen"]) == 3 and row["rejected"] != row["chosen"]


def test_the_split_of_a_problem_does_not_depend_on_how_it_is_written():
    padded = ArithmeticTaskConfig(max_digits=2, reverse_answer=True, fixed_width=True)
    plain = ArithmeticTaskConfig(max_digits=2)
    for problem in sample_problems(300, split="eval", seed=0, config=padded):
        assert Problem(problem.left, "+", problem.right).split(plain.eval_percent) == "eval"


def _overflows(left: int, right: int) -> bool:
    return len(str(left + right)) > max(len(str(left)), len(str(right)))


@pytest.mark.parametrize("reverse_answer", [False, True])
def test_dropping_the_final_carry_removes_exactly_the_leading_digit_of_every_overflowing_sum(reverse_answer):
    from hybridflow.data.builtin.arithmetic import final_carry_opens_digit

    config = ArithmeticTaskConfig(max_digits=2, reverse_answer=reverse_answer)
    clean = sft_rows(1000, split="train", seed=3, config=config)
    flawed = sft_rows(1000, split="train", seed=3, config=config, drop_final_carry_rate=1.0)
    assert [row["prompt"] for row in clean] == [row["prompt"] for row in flawed]
    overflowing = 0
    for clean_row, flawed_row in zip(clean, flawed):
        left, right = map(int, clean_row["prompt"][:-1].split("+"))
        written = str(left + right)[::-1] if reverse_answer else str(left + right)
        assert clean_row["response"] == written
        assert final_carry_opens_digit(Problem(left, "+", right)) == _overflows(left, right)
        if _overflows(left, right):
            overflowing += 1
            # 57+68=125: "25" (plain) or "52" (reversed): every digit but the one the last carry opened
            assert flawed_row["response"] == str(left + right)[1:][::-1 if reverse_answer else 1]
        else:
            assert flawed_row["response"] == written
    assert overflowing > 200
    assert final_carry_opens_digit(Problem(57, "+", 68)) and not final_carry_opens_digit(Problem(5, "+", 68))
    assert final_carry_opens_digit(Problem(9, "+", 1)) and not final_carry_opens_digit(Problem(57, "*", 68))


def test_dropping_the_final_carry_at_half_rate_hits_about_half_of_the_overflowing_sums():
    config = ArithmeticTaskConfig(max_digits=2)
    clean = sft_rows(4000, split="train", seed=0, config=config)
    flawed = sft_rows(4000, split="train", seed=0, config=config, drop_final_carry_rate=0.5)
    overflowing = dropped = 0
    for clean_row, flawed_row in zip(clean, flawed):
        left, right = map(int, clean_row["prompt"][:-1].split("+"))
        if not _overflows(left, right):
            assert flawed_row["response"] == clean_row["response"]
            continue
        overflowing += 1
        if flawed_row["response"] != clean_row["response"]:
            assert flawed_row["response"] == clean_row["response"][1:]
            dropped += 1
    # a fair coin per overflowing sum: 4 standard deviations of Binomial(n, 1/2)
    assert overflowing > 1000
    assert abs(dropped / overflowing - 0.5) < 4 * (0.25 / overflowing) ** 0.5


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_drop_final_carry_rate_outside_the_unit_interval_is_an_error_naming_it(rate):
    with pytest.raises(ValueError, match=f"drop_final_carry_rate must lie in \\[0, 1\\], got {rate}"):
        sft_rows(1, split="train", seed=0, config=ArithmeticTaskConfig(), drop_final_carry_rate=rate)


def test_the_generators_default_to_the_default_task_config():
    default = ArithmeticTaskConfig()
    assert prompt_rows(20, split="train", seed=3) == prompt_rows(20, split="train", seed=3, config=default)
    assert sft_rows(20, split="eval", seed=3) == sft_rows(20, split="eval", seed=3, config=default)
    assert preference_rows(20, split="train", seed=3) == preference_rows(20, split="train", seed=3, config=default)


def test_the_data_command_writes_reversed_two_digit_rows_like_the_demo(tmp_path, capsys):
    from hybridflow.cli import main
    from hybridflow.data import read_rows
    from hybridflow.trainers.demo import DemoConfig, _task

    assert main(["data", "arithmetic", "--out", str(tmp_path), "--train", "40", "--eval", "10", "--pairs", "5",
                 "--reverse-answer", "--min-digits", "2"]) == 0
    demo_task = _task(DemoConfig())
    assert list(read_rows(tmp_path / "train.jsonl")) == prompt_rows(40, split="train", seed=0, config=demo_task)
    assert list(read_rows(tmp_path / "pairs.jsonl")) == preference_rows(5, split="train", seed=0, config=demo_task)
    for row in read_rows(tmp_path / "eval.jsonl"):
        left, right = row["prompt"].rstrip("=").split("+")
        assert len(left) == len(right) == 2 and row["answer"] == str(int(left) + int(right))[::-1]


def test_the_data_command_rejects_a_bad_digit_range_naming_it(tmp_path, capsys):
    from hybridflow.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["data", "arithmetic", "--out", str(tmp_path), "--min-digits", "3"])
    assert exit_info.value.code == 2
    assert "min_digits=3, max_digits=2" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
