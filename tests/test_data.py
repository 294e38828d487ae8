"""Prompt, SFT and preference datasets: file formats, chat templates, filtering, errors, padding and resumable order."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from hybridflow.data import (
    BatchLoader,
    PreferenceDataset,
    PromptDataset,
    ResumableSampler,
    SFTDataset,
    read_rows,
    write_jsonl,
)
from hybridflow.data.builtin import ArithmeticTaskConfig, builtin_tokenizer, prompt_rows

# A template written in the built-in tokenizer's characters only: system turns get a "*" mark,
# every turn is parenthesized, and the generation prompt is a space.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}*{% endif %}({{ m['content'] }}){% endfor %}"
    "{% if add_generation_prompt %} {% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture()
def chat_tokenizer():
    tokenizer = builtin_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


ROWS = [
    {"prompt": "1+2=", "answer": "3"},
    {"prompt": "10+20=", "answer": "30", "difficulty": 2},
    {"prompt": "123+456=", "answer": "579"},
]


def test_jsonl_and_parquet_files_give_the_same_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "3+4=", "answer": "7"}]
    write_jsonl(tmp_path / "p.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    (tmp_path / "p.json").write_text(json.dumps(rows))
    assert read_rows(tmp_path / "p.jsonl") == rows
    assert read_rows(tmp_path / "p.parquet") == rows
    assert read_rows(tmp_path / "p.json") == rows


def test_dataset_file_errors_name_the_problem(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt\n1+1=\n")
    with pytest.raises(ValueError, match="suffix '.csv'"):
        read_rows(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        read_rows(tmp_path / "empty.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1="}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")


def test_a_missing_prompt_field_names_the_field_the_file_and_the_fields_present(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "1+1=", "answer": "2"}])
    expected = r"row 0 of '.*q.jsonl' has neither a 'prompt' field.*\['answer', 'question'\]"
    with pytest.raises(ValueError, match=expected):
        PromptDataset(path, tokenizer, max_prompt_tokens=16)
    dataset = PromptDataset(path, tokenizer, max_prompt_tokens=16, prompt_key="question")
    assert dataset.examples[0].raw_prompt == "1+1=" and dataset.examples[0].extra_fields == {"answer": "2"}


def test_over_long_prompts_are_dropped_with_a_counted_warning_never_truncated(tokenizer):
    with pytest.warns(UserWarning, match=r"dropped 1 of 3 prompts .* max_prompt_tokens=7 \(longest: 9 tokens\)"):
        dataset = PromptDataset(ROWS, tokenizer, max_prompt_tokens=7)
    assert dataset.num_filtered == 1
    assert [example.raw_prompt for example in dataset.examples] == ["1+2=", "10+20="]
    with pytest.raises(ValueError, match="no prompt .* fits max_prompt_tokens=2"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            PromptDataset(ROWS, tokenizer, max_prompt_tokens=2)


def test_prompt_batch_is_left_padded_with_text_and_row_fields(tokenizer):
    dataset = PromptDataset(ROWS, tokenizer, max_prompt_tokens=32)
    batch = dataset.batch([0, 2])
    expected_long = tokenizer("123+456=")["input_ids"]
    expected_short = tokenizer("1+2=")["input_ids"]
    pad = tokenizer.pad_token_id
    assert batch["input_ids"].tolist() == [[pad] * 4 + expected_short, expected_long]
    assert batch["attention_mask"].tolist() == [[0] * 4 + [1] * 5, [1] * 9]
    assert list(batch["raw_prompt"]) == ["1+2=", "123+456="]
    assert list(batch["extra_fields"]) == [{"answer": "3"}, {"answer": "579"}]
    assert list(batch["messages"]) == [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "123+456="}]]
    assert list(batch["row_index"]) == [0, 2]


def test_chat_template_is_applied_when_the_tokenizer_has_one(chat_tokenizer):
    dataset = PromptDataset(ROWS[:1], chat_tokenizer, max_prompt_tokens=32)
    rendered = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    # The template writes no BOS and the encoder must not add one either.
    assert dataset.examples[0].input_ids == chat_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert chat_tokenizer.bos_token_id not in dataset.examples[0].input_ids
    raw = PromptDataset(ROWS[:1], chat_tokenizer, max_prompt_tokens=32, chat_template="never")
    assert raw.examples[0].input_ids == chat_tokenizer("1+2=")["input_ids"]


def test_the_data_config_chooses_how_every_trainer_renders_prompts(chat_tokenizer):
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.config.supervised import SFTConfig, load_supervised_config

    base = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score"]
    raw = load_rl_config(None, base + ["data.chat_template=never"]).data.prompt_format()
    assert PromptDataset(ROWS[:1], chat_tokenizer, max_prompt_tokens=32, **raw).examples[0].input_ids == \
        chat_tokenizer("1+2=")["input_ids"]
    system = load_rl_config(None, base + ["data.system_prompt=be brief"]).data.prompt_format()
    rendered = chat_tokenizer.apply_chat_template([{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "1+2="}],
                                                  tokenize=False, add_generation_prompt=True)
    assert PromptDataset(ROWS[:1], chat_tokenizer, max_prompt_tokens=32, **system).examples[0].input_ids == \
        chat_tokenizer(rendered, add_special_tokens=False)["input_ids"]
    sft = load_supervised_config(SFTConfig, None, ["data.train_path=t.jsonl", "model.builtin=arithmetic",
                                               "data.chat_template=never"])
    assert sft.data.prompt_format()["chat_template"] == "never"
    with pytest.raises(ValueError, match=r"config key data\.chat_template got 'sometimes'.*'auto', 'always', 'never'"):
        load_rl_config(None, base + ["data.chat_template=sometimes"])


def test_chat_messages_rows_use_the_template_and_the_last_user_turn_as_raw_prompt(chat_tokenizer, tokenizer):
    rows = [{"messages": [{"role": "system", "content": "1"}, {"role": "user", "content": "2+2="}], "answer": "4"}]
    dataset = PromptDataset(rows, chat_tokenizer, max_prompt_tokens=32)
    assert dataset.examples[0].raw_prompt == "2+2="
    assert dataset.examples[0].messages == rows[0]["messages"]
    assert chat_tokenizer.decode(dataset.examples[0].input_ids) == "*(1)(2+2=) "
    with pytest.raises(ValueError, match="no chat template is in use"):
        PromptDataset(rows, tokenizer, max_prompt_tokens=32)
    with pytest.raises(ValueError, match="chat_template is 'always' but the tokenizer has no chat template"):
        PromptDataset(ROWS, tokenizer, max_prompt_tokens=32, chat_template="always")
    with pytest.raises(ValueError, match="must be a non-empty list"):
        PromptDataset([{"messages": "2+2="}], chat_tokenizer, max_prompt_tokens=32)


def test_sft_batch_follows_the_sequence_convention_with_eos_ending_the_response(tokenizer):
    dataset = SFTDataset([{"prompt": "1+2=", "response": "3"}, {"prompt": "10+20=", "response": "30"}],
                         tokenizer, max_prompt_tokens=16, max_response_tokens=4)
    batch = dataset.batch([0, 1])
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    three, zero = tokenizer.convert_tokens_to_ids("3"), tokenizer.convert_tokens_to_ids("0")
    assert batch["responses"].tolist() == [[three, eos, pad], [three, zero, eos]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    assert batch["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1, 1, 1, 0]
    assert batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 6]
    with pytest.raises(ValueError, match=r"has no field 'response'; fields present: \['completion', 'prompt'\]"):
        SFTDataset([{"prompt": "1+2=", "completion": "3"}], tokenizer, max_prompt_tokens=16, max_response_tokens=4)


def test_sft_rows_with_a_response_longer_than_the_limit_are_dropped(tokenizer):
    rows = [{"prompt": "1+2=", "response": "3"}, {"prompt": "1+2=", "response": "3333"}]
    with pytest.warns(UserWarning, match="dropped 1 of 2 rows"):
        dataset = SFTDataset(rows, tokenizer, max_prompt_tokens=16, max_response_tokens=3)
    assert len(dataset) == 1


def test_preference_batch_gives_chosen_and_rejected_one_shape(tokenizer):
    rows = [{"prompt": "1+2=", "chosen": "3", "rejected": "33"}, {"prompt": "10+20=", "chosen": "30", "rejected": "3"}]
    batch = PreferenceDataset(rows, tokenizer, max_prompt_tokens=16, max_response_tokens=4).batch([0, 1])
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape == (2, 7 + 3)
    assert batch["chosen_response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["rejected_response_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert torch.equal(batch["chosen_input_ids"][:, :7], batch["rejected_input_ids"][:, :7])


def test_sampler_is_deterministic_and_covers_each_epoch_once():
    first = ResumableSampler(10, seed=3)
    second = ResumableSampler(10, seed=3)
    batches = [first.next_indices(5) for _ in range(4)]
    assert batches == [second.next_indices(5) for _ in range(4)]
    assert sorted(batches[0] + batches[1]) == list(range(10)) == sorted(batches[2] + batches[3])
    assert batches[:2] != batches[2:]
    assert ResumableSampler(10, seed=4).next_indices(10) != batches[0] + batches[1]
    assert ResumableSampler(4, seed=0, shuffle=False).next_indices(3) == [0, 1, 2]


def test_a_resumed_loader_sees_the_same_batches_as_an_uninterrupted_one(tokenizer):
    rows = prompt_rows(30, split="train", seed=0, config=ArithmeticTaskConfig())
    dataset = PromptDataset(rows, tokenizer, max_prompt_tokens=16)
    uninterrupted = BatchLoader(dataset, batch_size=7, seed=1)
    expected = [list(uninterrupted.next_batch()["row_index"]) for _ in range(9)]
    interrupted = BatchLoader(dataset, batch_size=7, seed=1)
    seen = [list(interrupted.next_batch()["row_index"]) for _ in range(5)]
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = BatchLoader(dataset, batch_size=7, seed=1)
    resumed.load_state_dict(state)
    seen += [list(resumed.next_batch()["row_index"]) for _ in range(4)]
    assert seen == expected and resumed.epoch == 2
    with pytest.raises(ValueError, match="seed=1"):
        BatchLoader(dataset, batch_size=7, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"batch_size must lie in \[1, 30\]"):
        BatchLoader(dataset, batch_size=31, seed=1)


def test_batches_in_order_visit_every_prompt_once(tokenizer):
    dataset = PromptDataset(ROWS, tokenizer, max_prompt_tokens=32)
    batches = list(dataset.batches_in_order(2))
    assert [len(batch) for batch in batches] == [2, 1]
    assert [index for batch in batches for index in batch["row_index"]] == [0, 1, 2]


def test_math_prompt_splits_are_disjoint_and_their_reference_solutions_pass_the_math_checker(tmp_path, tokenizer):
    pytest.importorskip("reasoning_gym")
    from hybridflow.data.math_prompts import write_math_prompt_splits
    from hybridflow.rewards import math_reward

    train_path, eval_path = write_math_prompt_splits(tmp_path, num_train=60, num_eval=20, seed=0)
    train, evaluation = read_rows(train_path), read_rows(eval_path)
    assert len(train) == 60 and len(evaluation) == 20
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in evaluation}
    assert all(math_reward(row["prompt"], row["solution"], answer=row["answer"]) == 1.0 for row in train + evaluation)
    assert all(math_reward(row["prompt"], "I do not know", answer=row["answer"]) == 0.0 for row in evaluation)
    again, _ = write_math_prompt_splits(tmp_path / "again", num_train=60, num_eval=20, seed=0)
    assert read_rows(again) == train


def test_math_prompt_options_reach_the_dataset_so_the_smollm2_quick_check_draws_two_term_arithmetic():
    pytest.importorskip("reasoning_gym")
    import re

    from hybridflow.data.math_prompts import math_prompt_rows

    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    rows = math_prompt_rows(40, seed=0, dataset="basic_arithmetic", options=options)
    for row in rows:
        numbers = re.findall(r"\d+", row["prompt"])
        assert len(numbers) == 2 and all(len(n) == 1 for n in numbers), row["prompt"]
    with pytest.raises(ValueError, match="basic_arithmetic"):
        math_prompt_rows(4, seed=0, dataset="basic_arithmetic", options={"no_such_option": 1})


def test_decoded_responses_keep_only_real_tokens_and_drop_special_ones(tokenizer):
    from hybridflow.data import decode_responses

    texts = ["12", "7", "305"]
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    width = max(map(len, ids)) + 2
    responses = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(responses)
    for row, row_ids in enumerate(ids):
        responses[row, :len(row_ids)] = torch.tensor(row_ids)
        responses[row, len(row_ids)] = tokenizer.eos_token_id  # a real token, but special: not in the text
        mask[row, :len(row_ids) + 1] = 1
    responses[1, -1] = ids[0][0]  # a token after the end (mask 0) is never decoded
    data = {"responses": responses, "response_mask": mask}

    class Rows(dict):
        def __len__(self):
            return len(texts)

    assert decode_responses(tokenizer, Rows(data)) == texts
