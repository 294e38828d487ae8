"""`hybridflow demo`: config checks, checker-labelled reward-model pairs, and the pipeline end to end."""

from __future__ import annotations

import json

import pytest

from hybridflow.data import read_rows, write_jsonl
from hybridflow.data.builtin import score
from hybridflow.trainers.demo import DemoConfig, main, policy_preference_rows, run_demo

# A reduced demo: every stage runs and writes its outputs, in seconds rather than minutes.
SMALL = dict(base_steps=4, sft_steps=3, sft_batch_size=16, rm_policy_samples=2, rm_steps=3,
             rm_batch_size=16, ppo_steps=2, prompts_per_step=8, samples_per_prompt=2, mini_batch_size=8,
             num_eval_prompts=8, val_every=1)


def test_demo_config_rejects_bad_values_naming_the_key():
    with pytest.raises(ValueError, match=r"config key ppo_steps got 0; allowed: an integer >= 1"):
        DemoConfig(ppo_steps=0)
    with pytest.raises(ValueError, match=r"config key forget_carry_rate got 1.5; allowed: a float in \[0, 1\]"):
        DemoConfig(forget_carry_rate=1.5)
    with pytest.raises(ValueError, match=r"config key drop_final_carry_rate got -0.1; allowed: a float in \[0, 1\]"):
        DemoConfig(drop_final_carry_rate=-0.1)
    with pytest.raises(ValueError, match=r"config key rm_policy_samples got -1"):
        DemoConfig(rm_policy_samples=-1)
    with pytest.raises(ValueError, match=r"config key rm_type got 'mlp'; allowed: 'likelihood', 'score_head'"):
        DemoConfig(rm_type="mlp")
    with pytest.raises(ValueError, match=r"config keys min_digits, max_digits got 3, 2"):
        DemoConfig(min_digits=3)
    assert main(["mode=cluster"]) == 2


def test_policy_sampled_pairs_put_the_correct_answer_first_and_a_checker_rejected_sample_second(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    from hybridflow.data.builtin import builtin_model_config, builtin_tokenizer

    torch.manual_seed(0)
    LlamaForCausalLM(builtin_model_config()).save_pretrained(str(tmp_path / "policy"))  # random: mostly wrong
    builtin_tokenizer().save_pretrained(str(tmp_path / "policy"))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "57+68=", "answer": "521"},
                                                       {"prompt": "3+4=", "answer": "7"}])
    rows = policy_preference_rows(str(tmp_path / "policy"), prompts, samples_per_prompt=8, seed=0)
    assert 0 < len(rows) <= 16
    expected = {row["prompt"]: row["answer"] for row in read_rows(prompts)}
    for row in rows:
        assert row["chosen"] == expected[row["prompt"]]
        assert score(row["prompt"], row["rejected"], answer=row["chosen"]) == 0.0


def test_a_reduced_demo_runs_every_stage_and_its_summary_matches_the_files_it_wrote(tmp_path):
    summary = run_demo(DemoConfig(output_dir=str(tmp_path), **SMALL), tensorboard=True)
    assert (tmp_path / "progress.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "summary.json").read_text())["ppo_accuracy"] == summary["ppo_accuracy"]
    records = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2]
    assert summary["ppo_accuracy"] == records[-1]["val/function_mean"]
    assert summary["reward_last_step"] == records[-1]["reward/score_mean"]
    assert "reward/function_mean" not in records[0]  # the exact checker is no part of the PPO reward
    rm_records = [json.loads(line) for line in (tmp_path / "rm" / "metrics.jsonl").read_text().splitlines()]
    assert summary["rm_val_accuracy"] == rm_records[-1]["val/accuracy"]
    assert any((tmp_path / "ppo" / "tensorboard").iterdir())
    for stage in ("base", "sft", "rm"):
        assert (tmp_path / stage / "model" / "model.safetensors").exists()
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(str(tmp_path / "rm" / "model")).architectures == ["LlamaForCausalLM"]
    for key in ("sft_accuracy", "ppo_accuracy", "best_ppo_accuracy", "rm_val_accuracy"):
        assert 0.0 <= summary[key] <= 1.0
    train_prompts = {row["prompt"] for name in ("prompts", "rm_prompts") for row in read_rows(tmp_path / "data" / f"{name}.jsonl")}
    eval_prompts = {row["prompt"] for row in read_rows(tmp_path / "data" / "prompts_eval.jsonl")}
    assert len(eval_prompts) > 0 and not train_prompts & eval_prompts


@pytest.mark.slow
@pytest.mark.timeout(2400)  # about 3 minutes on a quiet 2-core machine; a shared one ran it past 10
def test_the_default_demo_lifts_a_policy_under_half_right_by_over_25_points_with_ppo(tmp_path):
    # The README's main command, unchanged (about 3 minutes on 2 cores). The exact checker only measures.
    # The seeded run is exact on one host but not across instruction sets: an AVX512-BF16 host measured 37.1% ->
    # 94.5% (RM 98.1%), an AVX2-only host 26.2% -> 58.6% (RM 90.4%), the same on the code before and after
    # issue 32 (docs/demo.md). What holds on both is a wide lift over the SFT policy.
    summary = run_demo(DemoConfig(output_dir=str(tmp_path)), tensorboard=False)
    assert summary["sft_accuracy"] < 0.5
    assert summary["rm_val_accuracy"] > 0.85
    assert summary["ppo_accuracy"] > summary["sft_accuracy"] + 0.25
    records = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["reward/score_mean"] > records[0]["reward/score_mean"]
