"""Role workers in single-process mode: generation, log-probs, re-tokenization, SFT and Bradley-Terry losses."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.controller import ResourcePool, WorkerGroup, local_mode
from hybridflow.data import PromptDataset, prompt_response_tensors
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows
from hybridflow.engine import EngineConfig, OptimConfig
from hybridflow.engine.generation import GenerationConfig
from hybridflow.engine.generation_config import GenerationTokens
from hybridflow.protocol import DataProto
from hybridflow.trainers.build import model_config_of
from hybridflow.models.config import ModelConfig
from hybridflow.workers import ActorSpec, ActorWorker, EngineSpec, RewardSpec, RewardWorker, TokenizerSource
from hybridflow.workers.supervised import SFTWorker, bradley_terry_loss_fn, interleave_pairs

BUILTIN = ModelConfig(builtin="arithmetic")
TOKENS = GenerationTokens(eos_token_ids=(builtin_tokenizer().eos_token_id,),
                          pad_token_id=builtin_tokenizer().pad_token_id)


def _spec(head: str, lr: float = 1e-3) -> EngineSpec:
    return EngineSpec(model=model_config_of(BUILTIN), engine=EngineConfig(dtype="float32", optim=OptimConfig(lr=lr)),
                      head=head, seed=0)


def _prompts(count: int) -> DataProto:
    rows = prompt_rows(count, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=2))
    return PromptDataset(rows, builtin_tokenizer(), max_prompt_tokens=16).batch(range(count))


def test_generation_is_prompt_major_and_old_logprobs_match_the_sampler():
    spec = ActorSpec(engine=_spec("lm"), generation=GenerationConfig(max_new_tokens=5), tokens=TOKENS)
    with local_mode():
        actor = WorkerGroup(ResourcePool([1]), ActorWorker, spec)
        prompts = _prompts(3)
        prompts.meta_info.update(samples_per_prompt=2, seed=3)
        batch = actor.generate_sequences(prompts)
        old = actor.compute_log_prob(batch)
        actor.shutdown()
    assert len(batch) == 6 and batch.batch["responses"].shape == (6, 5)
    assert list(batch.non_tensor_batch["raw_prompt"]) == [p for p in prompts.non_tensor_batch["raw_prompt"]
                                                          for _ in range(2)]
    assert torch.equal(batch.batch["prompts"][0::2], prompts.batch["input_ids"])
    mask_BT = batch.batch["response_mask"].bool()
    # the training engine's recomputation agrees with the sampler's log-probs on every real token
    torch.testing.assert_close(old.batch["old_logprobs"][mask_BT], batch.batch["logprobs"][mask_BT],
                               rtol=1e-4, atol=1e-4)


def test_a_tempered_rollout_is_rescored_at_its_temperature_and_its_nll_at_temperature_one():
    spec = ActorSpec(engine=_spec("lm"), generation=GenerationConfig(max_new_tokens=5, temperature=0.6), tokens=TOKENS)
    prompts = _prompts(4)
    prompts.meta_info["seed"] = 3
    with local_mode():
        actor = WorkerGroup(ResourcePool([1]), ActorWorker, spec)
        batch = actor.generate_sequences(prompts)
        old = actor.compute_log_prob(batch)
        nll = actor.compute_loss(batch)
        actor.shutdown()
    assert batch.meta_info["rollout_temperature"] == 0.6
    mask_BT = batch.batch["response_mask"].bool()
    torch.testing.assert_close(old.batch["old_logprobs"][mask_BT], batch.batch["logprobs"][mask_BT],
                               rtol=1e-4, atol=1e-4)
    # the next-token loss is of the model itself: not minus the tempered log-probs' mean
    lengths_B = mask_BT.sum(-1)
    tempered_nll_B = -(batch.batch["logprobs"] * mask_BT).sum(-1) / lengths_B
    assert float((nll.batch["nll"] - tempered_nll_B).abs().max()) > 1e-3


def _sequences() -> DataProto:
    tokenizer = builtin_tokenizer()
    prompt_ids = tokenizer(["12+3=", "7+8=", "40+41="])["input_ids"]
    response_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                    for text in ("15", "15", "81")]
    tensors = prompt_response_tensors(prompt_ids, response_ids, pad_token_id=tokenizer.pad_token_id)
    return DataProto.from_dict(tensors=tensors, non_tensors={"raw_prompt": ["12+3=", "7+8=", "40+41="]})


def test_reward_model_with_another_tokenizer_scores_the_reencoded_text(tmp_path):
    builtin_tokenizer().save_pretrained(tmp_path / "tokenizer")
    direct = RewardSpec(engine=_spec("score"), actor_tokenizer=TokenizerSource(builtin="arithmetic"))
    reencoded = RewardSpec(engine=_spec("score"), actor_tokenizer=TokenizerSource(builtin="arithmetic"),
                           tokenizer=TokenizerSource(path=str(tmp_path / "tokenizer")))
    with local_mode():
        groups = WorkerGroup.colocate(ResourcePool([1]), {"direct": (RewardWorker, (direct,)),
                                                          "reencoded": (RewardWorker, (reencoded,))})
        batch = _sequences()
        scores_direct = groups["direct"].compute_reward(batch).batch["rm_scores"]
        # blank the actor's sequence ids: only the texts (raw prompt, decoded responses) can reach the model
        text_only = DataProto.from_dict(tensors={**dict(batch.batch.items()),
                                                 "input_ids": torch.zeros_like(batch.batch["input_ids"])},
                                        non_tensors=dict(batch.non_tensor_batch))
        scores_reencoded = groups["reencoded"].compute_reward(text_only).batch["rm_scores"]
        without_text = DataProto.from_dict(tensors=dict(batch.batch.items()))
        with pytest.raises(Exception, match="raw_prompt"):
            groups["reencoded"].compute_reward(without_text)
        groups["direct"].shutdown()
    assert scores_direct.shape == (3,)
    torch.testing.assert_close(scores_reencoded, scores_direct)


def test_sft_worker_lowers_the_response_loss_on_a_repeated_batch():
    with local_mode():
        sft = WorkerGroup(ResourcePool([1]), SFTWorker, _spec("lm", lr=3e-3))
        batch = _sequences()
        losses = [sft.train_batch(batch)[0]["loss"] for _ in range(5)]
        evaluation = sft.evaluate(batch)
        sft.shutdown()
    assert losses[-1] < losses[0] - 0.5
    assert evaluation.batch["num_tokens"].tolist() == [3.0, 3.0, 3.0]  # two digits + EOS each


def test_bradley_terry_loss_is_the_mean_negative_log_sigmoid_of_the_margins():
    outputs = {"scores": torch.tensor([1.0, 0.0, 0.0, 2.0])}  # rows: chosen0, rejected0, chosen1, rejected1
    loss, metrics = bradley_terry_loss_fn(outputs, {"num_sequences_global": torch.tensor(4.0)})
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(2.0))) / 2
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["accuracy"]) == 0.5
    assert float(metrics["margin"]) == pytest.approx(-0.5)


def test_pairs_are_interleaved_chosen_then_rejected():
    tensors = {f"{side}_{key}": torch.full((2, 3), value)
               for side, value in (("chosen", 1), ("rejected", 2))
               for key in ("input_ids", "attention_mask", "position_ids", "response_mask")}
    tensors["chosen_input_ids"] = torch.tensor([[1, 1, 1], [3, 3, 3]])
    rows = interleave_pairs(DataProto.from_dict(tensors=tensors))
    assert rows["input_ids"][:, 0].tolist() == [1, 2, 3, 2]
    assert rows["attention_mask"].shape == (4, 3)


def test_the_supervised_workers_are_exported_by_the_workers_package():
    import hybridflow.workers as workers
    import hybridflow.workers.supervised as supervised

    assert (workers.SFTWorker, workers.PreferenceWorker) == (supervised.SFTWorker, supervised.PreferenceWorker)
