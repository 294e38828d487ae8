"""SFT and reward-model runs: evaluation before the first step, greedy-answer task metrics for SFT, timed records
(issue 16)."""

from __future__ import annotations

import pytest

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, sft_rows
from hybridflow.rewards import RuleReward
from hybridflow.trainers.supervised import SFTConfig, load_supervised_config, run_supervised

TASK = ArithmeticTaskConfig(max_digits=1)


def _sft(tmp_path, *extra) -> SFTConfig:
    write_jsonl(tmp_path / "sft.jsonl", sft_rows(32, split="train", seed=0, config=TASK))
    write_jsonl(tmp_path / "sft_val.jsonl", sft_rows(6, split="eval", seed=0, config=TASK))
    return load_supervised_config(SFTConfig, None, [
        "model.builtin=arithmetic", f"data.train_path={tmp_path / 'sft.jsonl'}",
        f"data.val_path={tmp_path / 'sft_val.jsonl'}", f"output_dir={tmp_path / 'sft'}", "batch_size=8",
        "max_steps=2", "engine.optim.lr=3e-3", "progress_bar=false", *extra])


def test_sft_evaluates_before_training_and_scores_greedy_answers_with_the_validation_function(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = _sft(tmp_path, "val_function=arithmetic", "val_max_new_tokens=4")
    history = run_supervised(config, mode="local", tensorboard=False)["history"]
    assert [record["step"] for record in history] == [0, 1, 2]
    assert sorted(key for key in history[0] if not key.startswith("time/")) == [
        "step", "val/exact_match", "val/function_mean", "val/nll"]
    assert history[2]["time/validate_s"] > 0 and history[2]["time/step_s"] >= history[2]["time/validate_s"]
    # the logged final numbers are those of greedy answers of the exported model, recomputed here
    model_dir = tmp_path / "sft" / "model"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(str(model_dir)), AutoTokenizer.from_pretrained(str(model_dir))
    rows = sft_rows(6, split="eval", seed=0, config=TASK)
    answers = []
    for row in rows:
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        output = model.generate(ids, do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id)
        answers.append(tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True))
    scores = RuleReward("arithmetic").score_batch([row["prompt"] for row in rows], answers,
                                                  [{"response": row["response"]} for row in rows])
    assert history[2]["val/function_mean"] == pytest.approx(float(scores.mean()))
    exact = sum(answer.strip() == row["response"] for answer, row in zip(answers, rows)) / len(rows)
    assert history[2]["val/exact_match"] == pytest.approx(exact)
    assert not (tmp_path / "sft" / "eval_model.tmp").exists()


def test_a_validation_function_without_validation_prompts_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"val_function got 'arithmetic'; allowed: null unless data.val_path"):
        _sft(tmp_path, "val_function=arithmetic", "data.val_path=null")
