"""Likelihood reward models and dense rewards: the loss, the preference and reward workers, RM training, PPO.

Shape legend: B = rows (pairs or samples), S = sequence tokens, P = prompt tokens, T = response tokens.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridflow.controller import ResourcePool, WorkerGroup, local_mode
from hybridflow.data import PreferenceDataset, prompt_response_tensors, write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, preference_rows, prompt_rows
from hybridflow.engine import EngineConfig, OptimConfig
from hybridflow.models.loader import build_model
from hybridflow.protocol import DataProto
from hybridflow.trainers.advantage import compute_advantages
from hybridflow.trainers.build import model_config_of, role_specs
from hybridflow.models.config import ModelConfig
from hybridflow.trainers.config.rl import AlgorithmSection, RewardSection, load_rl_config
from hybridflow.trainers.scoring import RewardScorer
from hybridflow.trainers.supervised import PreferenceData, RMConfig, load_supervised_config, run_supervised
from hybridflow.workers import EngineSpec, RewardSpec, RewardWorker, TokenizerSource
from hybridflow.workers.supervised import PreferenceWorker, likelihood_preference_loss_fn, likelihood_scores

BUILTIN = ModelConfig(builtin="arithmetic")
TASK = ArithmeticTaskConfig(max_digits=2)


def _spec(lr: float = 1e-3) -> EngineSpec:
    return EngineSpec(model=model_config_of(BUILTIN), engine=EngineConfig(optim=OptimConfig(lr=lr)), head="lm", seed=0)


def _hf_response_logprobs(model, input_ids_BS, attention_mask_BS, position_ids_BS, num_response_tokens):
    """Independent reference: log p(token_s | tokens_<s) of the last T positions, from a plain transformers forward."""
    with torch.no_grad():
        logits_BSV = model(input_ids=input_ids_BS, attention_mask=attention_mask_BS,
                           position_ids=position_ids_BS).logits.float()
    start = input_ids_BS.shape[1] - num_response_tokens
    logprobs_BTV = F.log_softmax(logits_BSV[:, start - 1:-1], dim=-1)
    return logprobs_BTV.gather(-1, input_ids_BS[:, start:, None]).squeeze(-1)


def _log_sigmoid(value: float) -> float:
    return -math.log1p(math.exp(-value))


# 1. the loss ------------------------------------------------------------------------------------------------


def test_likelihood_loss_is_bradley_terry_on_beta_scaled_summed_logprobs_and_ignores_padding():
    # rows: chosen0, rejected0, chosen1, rejected1; 99.0 sits on padding and must not count
    logprobs_BT = torch.tensor([[-0.5, -1.0, 99.0], [-2.0, -0.25, -0.25], [-3.0, 99.0, 99.0], [-1.0, -0.5, 99.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    batch = {"response_mask": mask_BT, "num_sequences_global": torch.tensor(4.0)}
    beta = 0.5
    # sums: chosen0 -1.5, rejected0 -2.5, chosen1 -3.0, rejected1 -1.5 -> margins 0.5 * (1.0, -1.5)
    margins = [0.5, -0.75]
    loss, metrics = likelihood_preference_loss_fn(beta, 0.0)({"logprobs": logprobs_BT}, batch)
    assert float(loss) == pytest.approx(-(_log_sigmoid(0.5) + _log_sigmoid(-0.75)) / 2, rel=1e-6)
    assert float(metrics["accuracy"]) == 0.5
    assert float(metrics["margin"]) == pytest.approx(sum(margins) / 2, rel=1e-6)
    assert "chosen_nll" not in metrics

    loss_nll, metrics_nll = likelihood_preference_loss_fn(beta, 0.3)({"logprobs": logprobs_BT}, batch)
    chosen_mean_nll = [1.5 / 2, 3.0 / 1]  # per pair: summed chosen NLL / chosen tokens
    assert float(loss_nll) == pytest.approx(float(loss) + 0.3 * sum(chosen_mean_nll) / 2, rel=1e-6)
    assert float(metrics_nll["chosen_nll"]) == pytest.approx(sum(chosen_mean_nll) / 2, rel=1e-6)
    torch.testing.assert_close(likelihood_scores(logprobs_BT, mask_BT, 2.0), torch.tensor([-3.0, -5.0, -6.0, -3.0]))


def test_likelihood_loss_divides_by_the_global_pair_count_so_micro_batches_add_up():
    logprobs_BT = torch.tensor([[-1.0, -1.0], [-0.5, -0.5], [-0.2, -0.3], [-2.0, -0.1]])
    mask_BT = torch.ones(4, 2, dtype=torch.long)
    loss_fn = likelihood_preference_loss_fn(1.5, 0.2)
    whole, _ = loss_fn({"logprobs": logprobs_BT}, {"response_mask": mask_BT, "num_sequences_global": torch.tensor(4.0)})
    parts = [loss_fn({"logprobs": logprobs_BT[rows]},
                     {"response_mask": mask_BT[rows], "num_sequences_global": torch.tensor(4.0)})[0]
             for rows in (slice(0, 2), slice(2, 4))]
    assert float(parts[0] + parts[1]) == pytest.approx(float(whole), rel=1e-6)


# 2. PreferenceWorker with an lm head -------------------------------------------------------------------------


def _pairs(count: int, seed: int = 0) -> DataProto:
    rows = preference_rows(count, split="train", seed=seed, config=TASK)
    dataset = PreferenceDataset(rows, builtin_tokenizer(), max_prompt_tokens=16, max_response_tokens=8)
    return dataset.batch(range(len(dataset)))


def _independent_pair_scores(pairs: DataProto, beta: float, model=None) -> tuple[torch.Tensor, torch.Tensor]:
    """beta x summed response log-probs of each side, from a plain transformers forward (default: the seeded tiny model)."""
    model = model if model is not None else build_model(model_config_of(BUILTIN), head="lm", seed=0)
    scores = []
    for side in ("chosen", "rejected"):
        mask_BT = pairs.batch[f"{side}_response_mask"]
        logprobs_BT = _hf_response_logprobs(model, pairs.batch[f"{side}_input_ids"],
                                            pairs.batch[f"{side}_attention_mask"],
                                            pairs.batch[f"{side}_position_ids"], mask_BT.shape[1])
        scores.append(beta * (logprobs_BT * mask_BT).sum(dim=-1))
    return scores[0], scores[1]


def test_preference_worker_scores_pairs_with_beta_times_the_hf_models_summed_response_logprobs():
    pairs = _pairs(6)
    with local_mode():
        group = WorkerGroup(ResourcePool([1]), PreferenceWorker, _spec(), beta=0.5)
        evaluation = group.evaluate(pairs)
        group.shutdown()
    chosen_B, rejected_B = _independent_pair_scores(pairs, beta=0.5)
    torch.testing.assert_close(evaluation.batch["chosen_scores"], chosen_B, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(evaluation.batch["rejected_scores"], rejected_B, rtol=1e-4, atol=1e-4)


def test_preference_worker_training_step_reports_the_loss_of_its_scores_and_widens_the_margin():
    pairs = _pairs(8)
    with local_mode():
        group = WorkerGroup(ResourcePool([1]), PreferenceWorker, _spec(lr=3e-3), beta=1.0, nll_coef=0.1)
        before = group.evaluate(pairs)
        steps = [group.train_batch(pairs)[0] for _ in range(6)]
        after = group.evaluate(pairs)
        group.shutdown()
    margins_before = before.batch["chosen_scores"] - before.batch["rejected_scores"]
    margins_after = after.batch["chosen_scores"] - after.batch["rejected_scores"]
    # the first step's loss is computed on the weights `evaluate` saw: Bradley-Terry + 0.1 x chosen mean NLL
    chosen_tokens_B = pairs.batch["chosen_response_mask"].sum(dim=-1).float()
    chosen_nll_B = -before.batch["chosen_scores"] / chosen_tokens_B
    expected_loss = float(-F.logsigmoid(margins_before).mean() + 0.1 * chosen_nll_B.mean())
    assert steps[0]["loss"] == pytest.approx(expected_loss, rel=1e-4)
    assert steps[0]["accuracy"] == pytest.approx(float((margins_before > 0).float().mean()))
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert float(margins_after.mean()) > float(margins_before.mean()) + 1.0
    assert float((margins_after > 0).float().mean()) >= float((margins_before > 0).float().mean())
    assert float((margins_after > 0).float().mean()) >= 0.75


# 3. run_supervised with reward_type=likelihood ---------------------------------------------------------------


def _rm_overrides(tmp_path, *extra) -> list[str]:
    write_jsonl(tmp_path / "pairs.jsonl", preference_rows(32, split="train", seed=0, config=TASK))
    write_jsonl(tmp_path / "pairs_val.jsonl", preference_rows(8, split="eval", seed=0, config=TASK))
    return ["model.builtin=arithmetic", f"data.train_path={tmp_path / 'pairs.jsonl'}",
            f"data.val_path={tmp_path / 'pairs_val.jsonl'}", f"output_dir={tmp_path / 'rm'}", "batch_size=8",
            "max_steps=3", "engine.optim.lr=3e-3", "progress_bar=false", "eval_before_train=false", *extra]


def test_rm_training_with_likelihood_rewards_exports_a_causal_lm_whose_scores_give_the_logged_margin(tmp_path):
    from transformers import AutoModelForCausalLM

    config = load_supervised_config(RMConfig, None, _rm_overrides(tmp_path, "reward_type=likelihood", "beta=2.0",
                                                                  "nll_coef=0.1"))
    result = run_supervised(config, mode="local", tensorboard=False)
    assert [record["step"] for record in result["history"]] == [1, 2, 3]
    assert all(0.0 <= record["accuracy"] <= 1.0 and "chosen_nll" in record for record in result["history"])
    model = AutoModelForCausalLM.from_pretrained(result["model_dir"]).eval()
    dataset = PreferenceDataset(str(tmp_path / "pairs_val.jsonl"), builtin_tokenizer(), max_prompt_tokens=256,
                                max_response_tokens=256)
    pairs = dataset.batch(range(len(dataset)))
    chosen_B, rejected_B = _independent_pair_scores(pairs, 2.0, model)
    margins_B = chosen_B - rejected_B
    assert result["final"]["val/margin"] == pytest.approx(float(margins_B.mean()), rel=1e-3, abs=1e-3)
    assert result["final"]["val/accuracy"] == pytest.approx(float((margins_B > 0).float().mean()))


@pytest.mark.parametrize("override, key", [("reward_type=bradley", "reward_type"), ("beta=0", "beta"),
                                           ("beta=-1.0", "beta"), ("nll_coef=-0.5", "nll_coef")])
def test_rm_config_rejects_bad_likelihood_settings_naming_the_key(tmp_path, override, key):
    with pytest.raises(ValueError, match=key):
        load_supervised_config(RMConfig, None, _rm_overrides(tmp_path, override))
    value = override.split("=")[1]
    typed = {"reward_type": value, "beta": float(value) if key == "beta" else 1.0,
             "nll_coef": float(value) if key == "nll_coef" else 0.0}
    if key != "reward_type":
        typed["reward_type"] = "likelihood"
    with pytest.raises(ValueError, match=f"config key {key} "):
        RMConfig(model=BUILTIN, data=PreferenceData(train_path="pairs.jsonl"), **typed)


# 4. RewardWorker with a likelihood reward model ---------------------------------------------------------------


def _sequences() -> DataProto:
    tokenizer = builtin_tokenizer()
    prompts = ["12+3=", "7+8=", "40+41="]
    prompt_ids = tokenizer(prompts)["input_ids"]
    response_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                    for text in ("15", "1", "812")]  # 3, 2 and 4 tokens: rows 0 and 1 end in padding
    tensors = prompt_response_tensors(prompt_ids, response_ids, pad_token_id=tokenizer.pad_token_id)
    return DataProto.from_dict(tensors=tensors, non_tensors={"raw_prompt": prompts})


def test_likelihood_reward_worker_returns_per_token_logprobs_that_sum_to_the_scores(tmp_path):
    builtin_tokenizer().save_pretrained(tmp_path / "tokenizer")
    actor_tokenizer = TokenizerSource(builtin="arithmetic")
    direct = RewardSpec(engine=_spec(), actor_tokenizer=actor_tokenizer)
    reencoded = RewardSpec(engine=_spec(), actor_tokenizer=actor_tokenizer,
                           tokenizer=TokenizerSource(path=str(tmp_path / "tokenizer")))
    batch = _sequences()
    with local_mode():
        groups = WorkerGroup.colocate(ResourcePool([1]), {"direct": (RewardWorker, (direct,)),
                                                          "reencoded": (RewardWorker, (reencoded,))})
        out_direct = groups["direct"].compute_reward(batch)
        out_reencoded = groups["reencoded"].compute_reward(batch)
        groups["direct"].shutdown()
    token_scores_BT, scores_B = out_direct.batch["rm_token_scores"], out_direct.batch["rm_scores"]
    mask_BT = batch.batch["response_mask"]
    assert token_scores_BT.shape == (3, 4) and mask_BT.sum(dim=-1).tolist() == [3, 2, 4]
    torch.testing.assert_close(token_scores_BT.sum(dim=-1), scores_B)
    assert torch.all(token_scores_BT[mask_BT == 0] == 0)
    assert torch.all(token_scores_BT[mask_BT == 1] < 0)
    model = build_model(model_config_of(BUILTIN), head="lm", seed=0)
    expected_BT = _hf_response_logprobs(model, batch.batch["input_ids"], batch.batch["attention_mask"],
                                        batch.batch["position_ids"], 4) * mask_BT
    torch.testing.assert_close(token_scores_BT, expected_BT, rtol=1e-4, atol=1e-4)
    # re-tokenized responses no longer line up with the actor's tokens: only the sums come back
    assert "rm_token_scores" not in out_reencoded.batch
    torch.testing.assert_close(out_reencoded.batch["rm_scores"], scores_B, rtol=1e-4, atol=1e-4)


# 5. TokenizerSource.encodes_like -------------------------------------------------------------------------------


def test_tokenizers_encode_alike_when_vocabulary_special_tokens_and_template_agree(tmp_path):
    for name in ("first", "second"):
        builtin_tokenizer().save_pretrained(tmp_path / name)
    first, second = TokenizerSource(path=str(tmp_path / "first")), TokenizerSource(path=str(tmp_path / "second"))
    builtin = TokenizerSource(builtin="arithmetic")
    assert first.encodes_like(second) and second.encodes_like(first)
    assert first.encodes_like(builtin) and builtin.encodes_like(builtin)

    templated = builtin_tokenizer()
    templated.chat_template = "{% for message in messages %}{{ message['content'] }}={% endfor %}"
    templated.save_pretrained(tmp_path / "templated")
    extended = builtin_tokenizer()
    extended.add_tokens(["<sep>"])
    extended.save_pretrained(tmp_path / "extended")
    assert not TokenizerSource(path=str(tmp_path / "templated")).encodes_like(builtin)
    assert not builtin.encodes_like(TokenizerSource(path=str(tmp_path / "extended")))


def test_the_builtin_tokenizer_does_not_encode_like_smollm2():
    from hybridflow.models import smollm2_path

    path = smollm2_path()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct is not converted (scripts/get_smollm2.py)")
    assert not TokenizerSource(builtin="arithmetic").encodes_like(TokenizerSource(path=path))
    assert TokenizerSource(path=path).encodes_like(TokenizerSource(path=path))


# 6. compute_advantages with dense rewards -----------------------------------------------------------------------


def _advantages(dense_rewards_BT):
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ref_logprobs_BT = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    # k1 KL = old - ref = [[0.2, -0.4, 0.6], [0.1, 0.3, 0 (padding)]]
    old_logprobs_BT = ref_logprobs_BT + torch.tensor([[0.2, -0.4, 0.6], [0.1, 0.3, 0.0]])
    return compute_advantages(
        algorithm=AlgorithmSection(advantage_estimator="gae", gamma=1.0, lam=1.0, whiten_advantages=False),
        scores_B=torch.tensor([1.0, 2.0]), response_mask_BT=mask_BT, old_logprobs_BT=old_logprobs_BT,
        ref_logprobs_BT=ref_logprobs_BT, values_BT=torch.zeros(2, 3), group_ids=[0, 1], baseline_scores_B=None,
        kl_coef=0.5, dense_rewards_BT=dense_rewards_BT)


def test_dense_rewards_are_added_after_kl_shaping_and_returns_are_their_reward_to_go():
    # 9.0 sits on padding and must be dropped
    result = _advantages(torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]]))
    # rewards: -0.5 * KL + score on the last real token + dense
    expected_rewards_BT = torch.tensor([[-0.1 + 0.1, 0.2 + 0.2, -0.3 + 1.0 + 0.3],
                                        [-0.05 + 0.4, -0.15 + 2.0 + 0.5, 0.0]])
    torch.testing.assert_close(result.token_rewards_BT, expected_rewards_BT)
    expected_returns_BT = torch.tensor([[1.4, 1.4, 1.0], [2.7, 2.35, 0.0]])
    torch.testing.assert_close(result.returns_BT, expected_returns_BT)
    torch.testing.assert_close(result.advantages_BT, expected_returns_BT)  # zero values, no whitening
    assert result.returns_BT[1, 2] == 0.0 and result.advantages_BT[1, 2] == 0.0
    without = _advantages(None)
    torch.testing.assert_close(result.returns_BT - without.returns_BT,
                               torch.tensor([[0.6, 0.5, 0.3], [0.9, 0.5, 0.0]]))


def test_dense_rewards_of_the_wrong_shape_are_an_error_naming_the_response_shape():
    with pytest.raises(ValueError, match=r"dense_rewards_BT must have the response shape \(2, 3\), got \(2, 4\)"):
        _advantages(torch.zeros(2, 4))


# 7. RewardScorer.token_rewards ----------------------------------------------------------------------------------


def _scored_batch(with_token_scores: bool) -> DataProto:
    tokenizer = builtin_tokenizer()
    prompts = ["12+3=", "7+8=", "40+41="]
    response_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                    for text in ("15", "14", "81")]  # correct, wrong, correct
    tensors = prompt_response_tensors(tokenizer(prompts)["input_ids"], response_ids,
                                      pad_token_id=tokenizer.pad_token_id, response_length=4)
    token_scores_BT = torch.tensor([[-0.5, -1.0, -0.25, 0.0], [-2.0, -1.0, -0.5, 0.0], [-0.1, -0.2, -0.3, 0.0]])
    tensors["rm_scores"] = token_scores_BT.sum(dim=-1)
    if with_token_scores:
        tensors["rm_token_scores"] = token_scores_BT
    return DataProto.from_dict(tensors=tensors, non_tensors={"raw_prompt": prompts})


def test_token_rewards_split_a_rule_plus_likelihood_reward_into_sequence_and_dense_parts():
    scorer = RewardScorer(tokenizer=builtin_tokenizer(), function="arithmetic", function_weight=0.5,
                          model_weight=2.0, uses_model=True)
    batch = _scored_batch(with_token_scores=True)
    sequence_B, dense_BT, metrics = scorer.token_rewards(batch)
    torch.testing.assert_close(sequence_B, torch.tensor([0.5, 0.0, 0.5]))
    torch.testing.assert_close(dense_BT, 2.0 * batch.batch["rm_token_scores"])
    total_B, score_metrics = scorer.score(batch)
    assert metrics == score_metrics
    torch.testing.assert_close(sequence_B + dense_BT.sum(dim=-1), total_B)
    torch.testing.assert_close(total_B, torch.tensor([0.5 - 3.5, 0.0 - 7.0, 0.5 - 1.2]))

    score_head_batch = _scored_batch(with_token_scores=False)
    sequence_B, dense_BT, _ = scorer.token_rewards(score_head_batch)
    assert dense_BT is None
    torch.testing.assert_close(sequence_B, scorer.score(score_head_batch)[0])


# 8. PPO with a likelihood reward model -------------------------------------------------------------------------


def test_ppo_runs_two_steps_against_a_likelihood_reward_model_crediting_tokens_densely(tmp_path, monkeypatch):
    from hybridflow.trainers import rl
    from hybridflow.trainers.rl import run_rl

    advantage_calls = []

    def recording_compute_advantages(**kwargs):
        advantage_calls.append(kwargs)
        return compute_advantages(**kwargs)

    monkeypatch.setattr(rl, "compute_advantages", recording_compute_advantages)

    model_dir = tmp_path / "likelihood_rm"
    build_model(model_config_of(BUILTIN), head="lm", seed=7).save_pretrained(model_dir)
    builtin_tokenizer().save_pretrained(model_dir)
    task = ArithmeticTaskConfig(max_digits=1)
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(16, split="train", seed=0, config=task))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
        f"reward.model.path={model_dir}", "reward.model_type=likelihood", "reward.model_weight=0.5",
        "actor.generation.max_new_tokens=4", "actor.engine.optim.lr=1e-3", "critic.engine.optim.lr=1e-3",
        "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
        "trainer.total_steps=2", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'run'}"])
    # same tokenizer in another directory: the reward model reads the actor's tokens (dense credit possible)
    specs = role_specs(config)
    assert specs.reward.tokenizer is None and specs.reward.engine.head == "lm"
    history = run_rl(config, mode="local", tensorboard=False)
    assert [record["step"] for record in history] == [1, 2]
    for record in history:
        numbers = {name: value for name, value in record.items() if isinstance(value, float)}
        assert all(math.isfinite(value) for value in numbers.values()), numbers
        # summed log-probs of 1..4 tokens (EOS included) are negative; weighted by 0.5 in the score
        assert record["reward/model_mean"] < 0
        assert record["reward/score_mean"] == pytest.approx(0.5 * record["reward/model_mean"], rel=1e-5)
    assert len(advantage_calls) == 2
    for call, record in zip(advantage_calls, history):
        dense_BT, mask_BT = call["dense_rewards_BT"], call["response_mask_BT"]
        # no rule function: nothing is credited at the end, the whole reward arrives token by token
        assert dense_BT is not None and dense_BT.shape == mask_BT.shape
        assert torch.all(call["scores_B"] == 0)
        assert torch.all(dense_BT[mask_BT == 0] == 0) and torch.all(dense_BT[mask_BT == 1] < 0)
        assert float(dense_BT.sum(dim=-1).mean()) == pytest.approx(record["reward/score_mean"], rel=1e-5)


def test_reward_section_rejects_an_unknown_model_type_naming_the_key():
    with pytest.raises(ValueError, match="model_type"):
        RewardSection(model=BUILTIN, model_type="dpo")
