"""Issue 15's "errors a user can act on": each bad input is refused up front with a message naming the key or the
file, before any model is built (docs/failures.md lists them)."""

from __future__ import annotations

import errno
import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hybridflow.cli import main
from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ASSETS_DIR, builtin_tokenizer
from hybridflow.data.files import read_rows
from hybridflow.trainers import rl
from hybridflow.trainers.checkpoint import CheckpointSaveError, RunCheckpointer
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.rl import RLTrainer

BASE = ["data.train_path=train.jsonl", "actor.model.builtin=arithmetic", "reward.function=pkg.mod:score"]


def _load(*overrides: str):
    return load_rl_config(None, BASE + list(overrides))


# 1. rejected by the config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("override, message", [
    ("actor.engine.optim.lr=.inf", r"config key actor\.engine\.optim: optim\.lr must be a finite number > 0, got inf"),
    ("actor.engine.optim.lr=.nan", r"optim\.lr must be a finite number > 0, got nan"),
    ("critic.engine.optim.weight_decay=.inf", r"critic\.engine\.optim: optim\.weight_decay must be a finite number "
                                              r">= 0, got inf"),
    ("actor.engine.optim.eps=.nan", r"optim\.eps must be a finite number > 0, got nan"),
    ("actor.engine.optim.grad_clip=.inf", r"optim\.grad_clip must be a finite number > 0 or None"),
    ("actor.engine.optim.betas=[.nan, 0.999]", r"optim\.betas must be two numbers in \[0, 1\), got \(nan, 0\.999\)"),
])
def test_a_non_finite_optimizer_value_is_refused_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        _load(override)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused_naming_samples_per_prompt(estimator):
    with pytest.raises(ValueError, match=rf"config key batch\.samples_per_prompt got 1; allowed: an integer >= 2 with "
                                         rf"algorithm\.advantage_estimator='{estimator}'"):
        _load(f"algorithm.advantage_estimator={estimator}")
    config = _load(f"algorithm.advantage_estimator={estimator}", "batch.samples_per_prompt=2")
    assert config.batch.samples_per_prompt == 2


def test_val_every_without_a_validation_file_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=r"config key trainer\.val_every got 2; allowed: 0 unless data\.val_path "
                                         r"is set"):
        _load("trainer.val_every=2")
    assert _load("trainer.val_every=2", "data.val_path=v.jsonl").trainer.val_every == 2


# 2. messages that name the file ----------------------------------------------------------------------------------


def test_non_utf8_data_names_the_file_and_line(tmp_path):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"dataset file '.*latin1\.jsonl' line 2 is not UTF-8 text \(byte 0xe9 at "
                                         r"column 16\); re-save the file as UTF-8"):
        read_rows(tmp_path / "latin1.jsonl")
    (tmp_path / "latin1.json").write_bytes(b'[{"prompt": "caf\xe9"}]')
    with pytest.raises(ValueError, match=r"dataset file '.*latin1\.json' is not UTF-8 text \(byte 0xe9 at offset 16\)"):
        read_rows(tmp_path / "latin1.json")


def test_malformed_json_and_parquet_name_the_file(tmp_path):
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(ValueError, match=r"dataset file '.*broken\.json' is not valid JSON: Expecting property name"):
        read_rows(tmp_path / "broken.json")
    (tmp_path / "broken.parquet").write_text("nope")
    with pytest.raises(ValueError, match=r"dataset file '.*broken\.parquet' is not a readable parquet file"):
        read_rows(tmp_path / "broken.parquet")


def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("data:\n  train_path: [a\nactor: {x: 1}\n")
    assert main(["train", "bad.yaml"]) == 2
    err = capsys.readouterr().err
    assert err == ("hybridflow train: error: config file bad.yaml:3:6: YAML syntax error: expected ',' or ']', but "
                   "got ':' (while parsing a flow sequence at line 2)\n")
    (tmp_path / "indent.yaml").write_text("a: 1\n b: 2\n")
    assert main(["sft", "indent.yaml"]) == 2
    assert capsys.readouterr().err == ("hybridflow sft: error: config file indent.yaml:2:3: YAML syntax error: "
                                       "mapping values are not allowed here\n")


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_sft_and_rm_report_a_non_utf8_data_file_in_one_line(kind, tmp_path, capsys):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9", "response": "x"}\n')
    assert main([kind, f"data.train_path={tmp_path / 'latin1.jsonl'}", "model.builtin=arithmetic",
                 f"output_dir={tmp_path / 'out'}", "--local"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err == (f"hybridflow {kind}: error: dataset file '{tmp_path / 'latin1.jsonl'}' line 1 is not "
                          f"UTF-8 text (byte 0xe9 at column 16); re-save the file as UTF-8\n")


# 3. validated before any model is built --------------------------------------------------------------------------


@pytest.fixture()
def model_dir(tmp_path):
    """A Hugging Face directory the preflight accepts: the built-in task's config and tokenizer, and weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = tmp_path / "model"
    shutil.copytree(ASSETS_DIR, directory)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))  # weights that fit config.json
    save_file({name: tensor.contiguous() for name, tensor in model.state_dict().items()},
              str(directory / "model.safetensors"))
    return directory


@pytest.fixture()
def prompts(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+2="}, {"prompt": "3+4="}])


@pytest.fixture()
def no_models(monkeypatch):
    """Fail the test if the trainer gets as far as building worker groups."""
    def build_worker_groups(*args, **kwargs):
        raise AssertionError("the trainer built its models before finding the bad input")

    monkeypatch.setattr(rl, "build_worker_groups", build_worker_groups)


def _trainer(tmp_path, *overrides):
    return RLTrainer(load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        "actor.generation.max_new_tokens=4", "batch.prompts_per_step=2", "batch.mini_batch_size=2",
        f"trainer.output_dir={tmp_path / 'run'}", *overrides]), mode="local")


def test_data_files_are_checked_before_any_model_is_built(tmp_path, prompts, no_models):
    with pytest.raises(ValueError, match=r"config key data\.val_path: dataset file '.*missing\.jsonl' does not exist"):
        _trainer(tmp_path, f"data.val_path={tmp_path / 'missing.jsonl'}")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"config key data\.train_path: dataset file '.*empty\.jsonl' holds no rows"):
        _trainer(tmp_path, f"data.train_path={tmp_path / 'empty.jsonl'}")
    write_jsonl(tmp_path / "questions.jsonl", [{"question": "1+2="}])
    with pytest.raises(ValueError, match=r"config key data\.train_path: row 0 of '.*questions\.jsonl' has neither the "
                                         r"prompt field 'prompt' \(data\.prompt_key\) nor 'messages'; fields present: "
                                         r"\['question'\]"):
        _trainer(tmp_path, f"data.train_path={tmp_path / 'questions.jsonl'}")


def test_model_directories_are_checked_before_any_model_is_built(tmp_path, prompts, model_dir, no_models):
    key = "reference.model.path"
    with pytest.raises(ValueError, match=rf"config key {key}: model directory '.*nowhere' does not exist"):
        _trainer(tmp_path, f"reference.model.path={tmp_path / 'nowhere'}")
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match=r"config key actor\.model\.path: directory '.*model' has no tokenizer files "
                                         r"\(one of tokenizer\.json, .*\); copy the tokenizer there or set "
                                         r"actor\.model\.tokenizer_path"):
        _trainer(tmp_path, f"actor.model.path={model_dir}", "actor.model.builtin=null")
    shutil.copy(ASSETS_DIR / "tokenizer.json", model_dir)
    weights = model_dir / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-4])  # a copy cut short
    data = len(whole) - 8 - int.from_bytes(whole[:8], "little")
    with pytest.raises(ValueError, match=rf"config key {key}: weights file '.*model\.safetensors' is corrupt: its "
                                         rf"header lists {data} bytes of tensors but {data - 4} follow it "
                                         rf"\(truncated\); re-copy"):
        _trainer(tmp_path, f"reference.model.path={model_dir}")
    weights.write_bytes(whole[:40])  # cut inside the header
    with pytest.raises(ValueError, match=rf"config key {key}: weights file '.*model\.safetensors' is corrupt: its "
                                         rf"header length does not fit the file's 40 bytes"):
        _trainer(tmp_path, f"reference.model.path={model_dir}")
    (model_dir / "config.json").unlink()
    with pytest.raises(ValueError, match=rf"config key {key}: model directory '.*model' has no config\.json"):
        _trainer(tmp_path, f"reference.model.path={model_dir}")


def test_a_reward_function_that_does_not_import_is_refused_before_any_model_is_built(tmp_path, prompts, no_models):
    with pytest.raises(ValueError, match=r"config key reward\.function: reward function 'no_such_module:f': cannot "
                                         r"import module 'no_such_module'"):
        _trainer(tmp_path, "reward.function=no_such_module:f")
    with pytest.raises(ValueError, match=r"config key reward\.function: reward function 'math:sqrt' must accept "
                                         r"\(prompt, response, \*\*extra_fields\)"):
        _trainer(tmp_path, "reward.function=math:sqrt")


def test_a_generation_beyond_the_models_positions_is_refused_naming_the_key_and_the_limit(tmp_path, prompts,
                                                                                          no_models):
    # the built-in model has max_position_embeddings = 64
    with pytest.raises(ValueError, match=r"config key actor\.generation\.max_new_tokens got 64; allowed: an integer "
                                         r"below the actor model's max_position_embeddings = 64"):
        _trainer(tmp_path, "actor.generation.max_new_tokens=64")
    longest = max(len(ids) for ids in builtin_tokenizer()(["1+2=", "3+4="])["input_ids"])
    with pytest.raises(ValueError, match=rf"config key actor\.generation\.max_new_tokens got 62; allowed: at most "
                                         rf"{64 - longest}: the longest prompt kept has {longest} tokens "
                                         rf"\(data\.max_prompt_tokens=256\) and the actor model's "
                                         rf"max_position_embeddings is 64"):
        _trainer(tmp_path, "actor.generation.max_new_tokens=62")


def test_a_bad_data_path_fails_in_about_the_time_of_loading_the_config(tmp_path, capsys):
    """Measured, not asserted as a speed (the machine is shared): the CLI answers without building a worker."""
    argv = ["train", f"data.train_path={tmp_path / 'missing.jsonl'}", "actor.model.builtin=arithmetic",
            "reward.function=arithmetic", f"trainer.output_dir={tmp_path / 'run'}", "--local"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"hybridflow train: error: config key data.train_path: dataset file "
                                       f"'{tmp_path / 'missing.jsonl'}' does not exist\n")
    assert not (tmp_path / "run").exists()


# 4. a checkpoint that cannot be written --------------------------------------------------------------------------


def test_disk_full_during_a_checkpoint_names_it_its_path_and_the_intact_previous_one(tmp_path):
    checkpointer = RunCheckpointer(tmp_path / "checkpoints")
    previous = checkpointer.save(1, {"note": "first"}, lambda directory: (directory / "actor").mkdir())

    def disk_full(directory):
        (directory / "actor").mkdir()
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "actor" / "model.pt"))

    with pytest.raises(CheckpointSaveError) as caught:
        checkpointer.save(2, {"note": "second"}, disk_full)
    partial = tmp_path / "checkpoints" / "step_000002.partial"
    assert str(caught.value) == (
        f"could not save the checkpoint of step 2 to '{partial}': no space left on the device (OSError: [Errno 28] No "
        f"space left on device: '{partial / 'actor' / 'model.pt'}'); the previous checkpoint '{previous}' is intact "
        f"and a resume starts from it; free disk space under '{tmp_path / 'checkpoints'}'")
    assert checkpointer.latest() == previous and not partial.exists()
    assert json.loads((previous / "driver.json").read_text()) == {"step": 1, "note": "first"}


def test_an_unwritable_checkpoint_directory_is_reported_without_an_earlier_checkpoint(tmp_path, monkeypatch):
    checkpointer = RunCheckpointer(tmp_path / "checkpoints")

    def read_only(directory):
        raise PermissionError(errno.EACCES, "Permission denied", str(directory))

    with pytest.raises(CheckpointSaveError, match=r"could not save the checkpoint of step 3 to "
                                                  r"'.*step_000003\.partial': permission denied \(PermissionError: "
                                                  r"\[Errno 13\] Permission denied: .*\); no earlier "
                                                  r"checkpoint exists, so a resume starts from step 0; make '.*' "
                                                  r"writable"):
        checkpointer.save(3, {}, read_only)
    assert checkpointer.latest() is None and checkpointer.steps() == {}


def test_the_train_command_reports_a_checkpoint_it_cannot_write_in_one_line_with_exit_code_2(tmp_path, capsys):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+2="}, {"prompt": "3+4="}])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file where the checkpoint directory should be")
    argv = ["train", f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
            "reward.function=arithmetic", "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2",
            "batch.mini_batch_size=2", "trainer.total_steps=1", "trainer.save_every=1", "trainer.progress_bar=false",
            "trainer.tensorboard=false", f"trainer.output_dir={tmp_path / 'run'}", "--local"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    partial = tmp_path / "run" / "checkpoints" / "step_000001.partial"
    assert err == (f"hybridflow train: error: could not save the checkpoint of step 1 to '{partial}': a path on the "
                   f"way is a file, not a directory (NotADirectoryError: [Errno 20] Not a directory: '{partial}'); no "
                   f"earlier checkpoint exists, so a resume starts from step 0; make "
                   f"'{tmp_path / 'run' / 'checkpoints'}' a writable directory\n")


@pytest.mark.parametrize("kind", ["sft", "rm"])
def test_sft_and_rm_check_the_model_directory_before_loading_it_and_answer_in_one_line(kind, tmp_path, model_dir,
                                                                                       capsys):
    rows = tmp_path / "rows.jsonl"
    write_jsonl(rows, [{"prompt": "1+2=", "response": "3", "chosen": "3", "rejected": "4"}])
    argv = [kind, f"data.train_path={rows}", f"model.path={model_dir}", f"output_dir={tmp_path / 'out'}", "--local"]
    (model_dir / "tokenizer.json").unlink()
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"hybridflow {kind}: error: config key model.path: directory '{model_dir}' has no tokenizer files (one of "
        f"tokenizer.json, tokenizer.model, vocab.json, vocab.txt, spiece.model); copy the tokenizer there or set "
        f"model.tokenizer_path\n")
    shutil.copy(ASSETS_DIR / "tokenizer.json", model_dir)
    weights = model_dir / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-4])
    data = len(whole) - 8 - int.from_bytes(whole[:8], "little")
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"hybridflow {kind}: error: config key model.path: weights file '{weights}' is corrupt: its header lists {data} "
        f"bytes of tensors but {data - 4} follow it (truncated); re-copy or re-export the model\n")


def test_a_directory_given_as_a_data_file_is_named_as_a_directory(tmp_path):
    (tmp_path / "rows.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"dataset file '.*rows\.jsonl' is a directory; give a \.jsonl, \.json or "
                                         r"\.parquet file"):
        read_rows(tmp_path / "rows.jsonl")
