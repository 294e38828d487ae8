"""data.response_prefix: text that pre-starts every response, part of the prompt (never trained), used alike in
training, validation and the export-time evaluation, and read by rule rewards before the generated text."""

from __future__ import annotations

import json
import os

import pytest

from hybridflow.data import PromptDataset, SFTDataset, answer_texts, write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows
from hybridflow.protocol import DataProto

# the built-in tokenizer's characters only; the generation prompt is a space
CHAT_TEMPLATE = "{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %} {% endif %}"
ROWS = [{"prompt": "1+2=", "answer": "3", "hint": "3"}, {"prompt": "4+5=", "answer": "9", "hint": "(9"}]
LOG_ENV = "HYBRIDFLOW_TEST_REWARD_LOG"


def recording_reward(prompt: str, response: str, **extra_fields) -> float:
    """Appends each response it is given to the file $HYBRIDFLOW_TEST_REWARD_LOG (the reward runs in a module of
    its own, loaded from this file's path); scores whether the response starts with the prefix."""
    with open(os.environ[LOG_ENV], "a") as log:
        log.write(json.dumps(response) + "\n")
    return float(response.startswith("="))


@pytest.fixture()
def chat_tokenizer():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_fixed_prefix_follows_the_chat_templates_assistant_header(chat_tokenizer):
    dataset = PromptDataset(ROWS, chat_tokenizer, max_prompt_tokens=32, response_prefix="=(")
    assert dataset.examples[0].input_ids == _ids(chat_tokenizer, "(1+2=) =(")
    batch = dataset.batch([0, 1])
    assert list(batch["response_prefix"]) == ["=(", "=("]
    assert list(batch["raw_prompt"]) == ["1+2=", "4+5="]  # the user's prompt stays as written


def test_a_braced_field_name_takes_each_rows_own_prefix(chat_tokenizer):
    dataset = PromptDataset(ROWS, chat_tokenizer, max_prompt_tokens=32, response_prefix="{hint}")
    assert [example.input_ids for example in dataset.examples] == [_ids(chat_tokenizer, "(1+2=) 3"),
                                                                   _ids(chat_tokenizer, "(4+5=) (9")]
    assert [example.response_prefix for example in dataset.examples] == ["3", "(9"]


def test_without_a_chat_template_the_prefix_follows_the_prompt_text(chat_tokenizer):
    dataset = PromptDataset(ROWS, chat_tokenizer, max_prompt_tokens=32, chat_template="never", response_prefix="=")
    assert dataset.examples[0].input_ids == chat_tokenizer("1+2==")["input_ids"]


def test_no_prefix_leaves_prompts_and_batches_as_they_were(chat_tokenizer):
    dataset = PromptDataset(ROWS, chat_tokenizer, max_prompt_tokens=32)
    assert dataset.examples[0].input_ids == _ids(chat_tokenizer, "(1+2=) ")
    assert "response_prefix" not in dataset.batch([0])


def test_a_row_without_the_prefix_field_is_an_error_naming_row_and_field(chat_tokenizer):
    with pytest.raises(ValueError, match=r"row 0 of .*response_prefix '\{missing\}' takes the row's 'missing' field"):
        PromptDataset(ROWS, chat_tokenizer, max_prompt_tokens=32, response_prefix="{missing}")


def test_sft_rows_train_only_the_response_after_the_prefix(chat_tokenizer):
    rows = [{"prompt": "1+2=", "response": "3"}]
    dataset = SFTDataset(rows, chat_tokenizer, max_prompt_tokens=32, max_response_tokens=8, response_prefix="=")
    batch = dataset.batch([0])
    response_ids = batch["responses"][0][batch["response_mask"][0].bool()].tolist()
    assert response_ids == _ids(chat_tokenizer, "3") + [chat_tokenizer.eos_token_id]
    assert dataset.pairs[0].prompt_ids == _ids(chat_tokenizer, "(1+2=) =")


def test_rewards_read_the_prefix_before_the_generated_text():
    tokenizer = builtin_tokenizer()
    import torch

    data = DataProto.from_dict(tensors={"responses": torch.tensor([_ids(tokenizer, "12"), _ids(tokenizer, "3+")]),
                                        "response_mask": torch.tensor([[1, 1], [1, 0]])},
                               non_tensors={"response_prefix": ["=", "=("]})
    assert answer_texts(tokenizer, data) == ["=12", "=(3"]


def test_training_and_validation_prompts_end_in_the_prefix_and_the_reward_sees_it(tmp_path, monkeypatch):
    from hybridflow.controller import local_mode
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    task = ArithmeticTaskConfig(max_digits=1)
    write_jsonl(tmp_path / "train.jsonl", prompt_rows(8, split="train", seed=0, config=task))
    write_jsonl(tmp_path / "val.jsonl", prompt_rows(2, split="eval", seed=0, config=task))
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", f"data.val_path={tmp_path / 'val.jsonl'}",
        "data.response_prefix='='", "actor.model.builtin=arithmetic", f"reward.function={__file__}:recording_reward",
        "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2",
        "batch.samples_per_prompt=2", "batch.mini_batch_size=4", "trainer.total_steps=1", "trainer.val_every=1",
        "trainer.val_before_train=false", "trainer.progress_bar=false", f"trainer.output_dir={tmp_path / 'run'}"])
    prefix_id = _ids(builtin_tokenizer(), "=")
    log = tmp_path / "responses.jsonl"
    monkeypatch.setenv(LOG_ENV, str(log))
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            for dataset in (trainer.train_data, trainer.val_data):
                assert all(example.input_ids[-1:] == prefix_id for example in dataset.examples)
            history = trainer.fit()
        finally:
            trainer.shutdown()
    # 4 training samples, then 2 validation answers scored twice (val/score_mean and val/function_mean)
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(seen) == 8 and all(response.startswith("=") for response in seen)
    assert history[-1]["reward/score_mean"] == 1.0 and history[-1]["val/score_mean"] == 1.0
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
