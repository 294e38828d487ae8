"""Bad inputs a new user tried after issue 37's fixes (NEWUSER_REPORT.md): each answered in one line naming the flag,
key or file, and nothing the user had is replaced or left half-written."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from hybridflow.cli import main
from hybridflow.data import read_rows, write_jsonl


def _one_error_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(prefix), err
    return err


def test_a_utf8_bom_at_the_start_of_a_jsonl_file_is_read_not_refused(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+1=", "answer": "2"}\n')
    assert read_rows(path) == [{"prompt": "1+1=", "answer": "2"}]


def test_a_null_field_is_named_as_null_not_as_missing():
    from hybridflow.data.files import require_field

    with pytest.raises(ValueError, match=r"row 3 of 'x.jsonl': field 'response' is null; give it a value"):
        require_field({"prompt": "p", "response": None}, "response", row_index=3, source_name="'x.jsonl'")


def test_a_failed_write_leaves_no_truncated_file_under_the_real_name(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "mine"}\n')
    with pytest.raises(OSError):
        write_jsonl(tmp_path / "train.jsonl", _Rows())
    assert (tmp_path / "train.jsonl").read_text() == '{"prompt": "mine"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.jsonl"]


class _Rows:
    """Rows whose iteration fails half-way, as a full disk does during the write."""

    def __iter__(self):
        yield {"prompt": "a"}
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_data_with_an_empty_out_is_refused_not_written_into_the_working_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["data", "arithmetic", "--out", "", "--train", "2", "--eval", "1"]) == 2
    assert _one_error_line(capsys, "hybridflow data: error: --out got ''; allowed: a directory path")
    assert list(tmp_path.iterdir()) == []


def test_data_on_a_full_disk_names_the_file_and_leaves_nothing_half_written(tmp_path, monkeypatch, capsys):
    import hybridflow.data.files as files

    real_open = Path.open

    def full_disk_open(self, mode="r", *args, **kwargs):
        handle = real_open(self, mode, *args, **kwargs)
        if "w" in mode and self.name.endswith(".partial"):
            handle.close()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return handle

    monkeypatch.setattr(files.Path, "open", full_disk_open)
    assert main(["data", "arithmetic", "--out", str(tmp_path), "--train", "2", "--eval", "1"]) == 2
    assert _one_error_line(capsys, f"hybridflow data: error: could not write {str(tmp_path / 'train.jsonl')!r}: "
                                   f"No space left on device; nothing was written under that name")
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_that_alone_fills_the_models_positions_names_max_prompt_tokens_not_a_negative_bound():
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.preflight import check_sequence_length

    config = load_rl_config(None, ["data.train_path=x.jsonl", "actor.model.builtin=arithmetic",
                                   "reward.function=arithmetic", "actor.generation.max_new_tokens=3"])
    with pytest.raises(ValueError) as caught:
        check_sequence_length(config, 83)
    assert str(caught.value) == (
        "config key data.max_prompt_tokens got 256; allowed: at most 61: the longest prompt kept has 83 tokens, which "
        "alone fill the actor model's max_position_embeddings = 64; with actor.generation.max_new_tokens=3, "
        "data.max_prompt_tokens=61 drops the prompts that cannot fit")


def _model_dir(tmp_path: Path) -> Path:
    from hybridflow.data.builtin import builtin_model_config

    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(builtin_model_config().to_dict()))
    (directory / "tokenizer.json").write_text("{}")
    return directory


def test_a_file_given_as_a_model_or_tokenizer_directory_is_named_as_a_file(tmp_path):
    from hybridflow.models.config import ModelConfig
    from hybridflow.trainers.preflight import check_model

    directory = _model_dir(tmp_path)
    with pytest.raises(ValueError, match=r"config key actor.model.path: '.*config.json' is a file, not a model "
                                         r"directory; give the directory holding it"):
        check_model("actor.model", ModelConfig(path=str(directory / "config.json")), needs_tokenizer=True)
    with pytest.raises(ValueError, match=r"config key actor.model.tokenizer_path: '.*tokenizer.json' is a file, not "
                                         r"a tokenizer directory"):
        check_model("actor.model", ModelConfig(builtin="arithmetic", tokenizer_path=str(directory / "tokenizer.json")),
                    needs_tokenizer=True)


def test_a_shard_missing_from_a_sharded_model_is_named_not_reported_as_missing_tensors(tmp_path):
    from hybridflow.models.config import ModelConfig
    from hybridflow.trainers.preflight import check_model

    directory = _model_dir(tmp_path)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"names shard files that are not in the directory: "
                                         r"model-00002-of-00002.safetensors; copy every shard"):
        check_model("actor.model", ModelConfig(path=str(directory)), needs_tokenizer=True)


def _fake_checkpoint(run: Path, step: int, *, metadata: bool = True, engine: str = '{"step": 1}') -> Path:
    path = run / "checkpoints" / f"step_{step:06d}"
    (path / "actor").mkdir(parents=True)
    (path / "driver.json").write_text(json.dumps({"step": step}))
    (path / "actor" / "__0_0.distcp").write_bytes(b"x")
    if metadata:
        (path / "actor" / ".metadata").write_bytes(b"x")
    (path / "actor" / "engine.json").write_text(engine)
    return path


def test_a_checkpoint_whose_engine_files_are_missing_or_broken_is_incomplete_and_named(tmp_path, capsys):
    from hybridflow.trainers.checkpoint import RunCheckpointer

    _fake_checkpoint(tmp_path, 1)
    _fake_checkpoint(tmp_path, 2, metadata=False)
    _fake_checkpoint(tmp_path, 3, engine="{")
    checkpointer = RunCheckpointer(tmp_path / "checkpoints")
    assert checkpointer.resume_point().name == "step_000001"
    assert ("skipping incomplete checkpoints step_000002 (actor/.metadata is missing (the index of its weight "
            "files)), step_000003 (actor/engine.json is unreadable)") in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"step_000002' is incomplete: actor/.metadata is missing .*; complete "
                                         r"steps: \[1\]"):
        checkpointer.at_step(2)


def test_export_refuses_a_bad_run_directory_step_or_out_before_loading_a_model(tmp_path):
    from hybridflow.trainers.export import export_checkpoint

    _fake_checkpoint(tmp_path / "run", 1)
    with pytest.raises(ValueError, match=r"run directory '.*nowhere' does not exist"):
        export_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"step must be an integer \(or None for the latest\), got '1'"):
        export_checkpoint(tmp_path / "run", step="1")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"--out '.*file': '.*file' is a file, not a directory"):
        export_checkpoint(tmp_path / "run", out=tmp_path / "file")


def test_export_never_replaces_a_directory_holding_files_unless_asked(tmp_path, capsys):
    _fake_checkpoint(tmp_path / "run", 1)
    mine = tmp_path / "out" / "actor" / "mine.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("precious")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    assert _one_error_line(capsys, f"hybridflow export: error: --out {str(tmp_path / 'out')!r} already holds "
                                   f"{str(tmp_path / 'out' / 'actor')}; allowed: another --out, or --overwrite")
    assert mine.read_text() == "precious"


@pytest.mark.parametrize("overrides", ["trainer.total_steps=3", {"trainer.total_steps": 3}])
def test_overrides_given_as_a_string_or_a_dict_are_refused_saying_a_list_is_needed(overrides):
    from hybridflow.trainers.config.rl import load_rl_config

    with pytest.raises(ValueError, match=r"overrides must be a list of 'key.path=value' strings, got"):
        load_rl_config(None, overrides)


def test_a_second_config_file_is_named_as_such_not_as_a_bad_override(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("trainer: {total_steps: 3}\n")
    with pytest.raises(SystemExit):
        main(["train", str(tmp_path / "a.yaml"), str(tmp_path / "a.yaml")])
    assert "a second config file" in capsys.readouterr().err


def test_a_latin1_config_file_is_named_with_its_line(tmp_path, capsys):
    (tmp_path / "latin1.yaml").write_bytes(b"trainer:\n  total_steps: 3\n  output_dir: caf\xe9\n")
    assert main(["train", str(tmp_path / "latin1.yaml")]) == 2
    _one_error_line(capsys, f"hybridflow train: error: config file {str(tmp_path / 'latin1.yaml')!r} line 3 is not "
                            f"UTF-8 text (byte 0xe9); re-save the file as UTF-8")


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0"], "--devices got 0; allowed: an integer >= 1"),
    (["--devices", "8", "--per-node", "0"], "--per-node got 0; allowed: an integer >= 1"),
    (["--devices", "12"], "--devices got 12; allowed: at most --per-node (8) or a multiple of it (whole nodes)"),
    (["--devices", "8", "--hardware", "/nonexistent.json"], "--hardware '/nonexistent.json': the profile file does "
                                                            "not exist"),
])
def test_plan_names_the_flag_not_the_planners_field(argv, message, capsys):
    args = ["plan", "--actor", "llama-7b", "--algorithm", "grpo", "--prompt-len", "128", "--response-len", "128",
            "--batch", "8", *argv]
    assert main(args) == 2
    assert capsys.readouterr().err == f"hybridflow plan: {message}\n"


def test_a_disk_error_outside_a_checkpoint_is_said_in_words_with_where_the_run_stands(tmp_path, capsys):
    from hybridflow.trainers.boundary import errors_directory, run_guarded

    def body():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert run_guarded("hybridflow train", body, errors_dir=lambda: errors_directory(tmp_path / "run"),
                       interrupted=lambda error: "at step 19; no checkpoint was saved") == 2
    err = _one_error_line(capsys, "hybridflow train: error: no space left on the device (OSError: [Errno 28] No "
                                  "space left on device); at step 19; no checkpoint was saved; free disk space under ")
    assert f"'{tmp_path / 'run'}' (full traceback: {tmp_path / 'run' / 'errors'}" in err


def test_a_final_export_failing_on_a_full_disk_leaves_no_half_written_role_directory(tmp_path):
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.export import export_roles

    class FullDisk:
        def export_hf(self, directory: str) -> None:
            Path(f"{directory}.tmp").mkdir(parents=True)
            (Path(f"{directory}.tmp") / "model.safetensors").write_bytes(b"half")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    config = load_rl_config(None, ["data.train_path=x.jsonl", "actor.model.builtin=arithmetic",
                                   "reward.function=arithmetic", "actor.generation.max_new_tokens=3"])
    with pytest.raises(OSError, match="No space left"):
        export_roles({"actor": FullDisk()}, config, tmp_path / "final")
    assert list((tmp_path / "final").iterdir()) == []


def test_a_stopped_sft_run_says_overwrite_is_needed_to_run_it_again(tmp_path, monkeypatch, capsys):
    import signal

    import hybridflow.trainers.supervised as supervised
    from hybridflow.trainers.boundary import RunInterrupted

    def stopped(config, mode=None):
        raise RunInterrupted(signal.SIGTERM)

    monkeypatch.setattr(supervised, "run_supervised", stopped)
    assert main(["sft", "model.builtin=arithmetic", f"data.train_path={tmp_path / 'x.jsonl'}",
                 f"output_dir={tmp_path / 'run'}"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == (
        "hybridflow sft: stopped by SIGTERM; sft runs keep no checkpoint: run it again with overwrite=true to train "
        "from the start (its output_dir now holds this run's metrics)\n")


def test_a_ray_address_where_nothing_listens_is_refused_at_once_not_retried_for_minutes():
    import socket

    from hybridflow.trainers.cli import check_ray_address

    with socket.socket() as probe:  # a port nothing listens on: bound, never listening
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        with pytest.raises(ValueError, match=rf"environment variable RAY_ADDRESS='127.0.0.1:{port}': nothing answers "
                                             r"there \(Connection refused\); start the cluster"):
            check_ray_address({"RAY_ADDRESS": f"127.0.0.1:{port}"})
    with pytest.raises(ValueError, match=r"the port 'x' is not a number"):
        check_ray_address({"RAY_ADDRESS": "head:x"})
    for fine in ({}, {"RAY_ADDRESS": "auto"}, {"RAY_ADDRESS": "ray://head:10001"}):
        check_ray_address(fine)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        check_ray_address({"RAY_ADDRESS": f"127.0.0.1:{server.getsockname()[1]}"})


# -- the new-user pass's leftovers, fixed by the lead (#16, #107, #111, #116, #117, #119, #127) -------------------


def test_an_unknown_builtin_model_is_named_with_its_key_when_the_config_loads():
    from hybridflow.trainers.config.rl import load_rl_config

    with pytest.raises(ValueError, match=r"^config key actor.model.builtin got 'gpt5'; allowed: arithmetic$"):
        load_rl_config(None, ["actor.model.builtin=gpt5", "data.train_path=x.jsonl", "reward.function=arithmetic"])


def _huge(prompt, response):
    return 1e300


def _interrupting(prompt, response):
    raise KeyboardInterrupt


async def _async_reward(prompt, response):
    return 1.0


def test_a_reward_beyond_float32_is_refused_naming_the_sample_not_stored_as_inf():
    from hybridflow.rewards.plugin import RewardError, RuleReward

    with pytest.raises(RewardError, match=r"returned 1e\+300 on sample 0 .*finite in float32"):
        RuleReward(_huge).score_batch(["1+1="], ["2"])


def test_a_reward_raising_keyboardinterrupt_is_a_reward_error_not_a_sigint():
    from hybridflow.rewards.plugin import RewardError, RuleReward

    with pytest.raises(RewardError, match=r"raised KeyboardInterrupt on sample 0"):
        RuleReward(_interrupting).score_batch(["1+1="], ["2"])


def test_an_async_def_reward_is_refused_where_it_is_named(tmp_path):
    from hybridflow.rewards.plugin import RuleReward

    with pytest.raises(ValueError, match=r"is an async def; allowed: a plain def returning a float"):
        RuleReward(_async_reward)
    (tmp_path / "areward.py").write_text("async def reward(prompt, response):\n    return 1.0\n")
    with pytest.raises(ValueError, match=r"areward.py:reward' is an async def"):
        RuleReward(f"{tmp_path / 'areward.py'}:reward")


def test_run_supervised_given_a_dict_names_the_config_it_needs():
    from hybridflow.trainers.supervised import run_supervised

    with pytest.raises(ValueError, match=r"run_supervised needs an SFTConfig or RMConfig .* got a dict"):
        run_supervised({"model": {"builtin": "arithmetic"}})


def test_fit_after_shutdown_is_refused_and_a_finished_run_says_no_step_runs(tmp_path, capsys):
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    rows = prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1))
    write_jsonl(tmp_path / "train.jsonl", rows)
    overrides = [f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic",
                 "reward.function=arithmetic", "algorithm.advantage_estimator=grpo",
                 "actor.generation.max_new_tokens=3",
                 "batch.prompts_per_step=2", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
                 "trainer.progress_bar=false", "trainer.save_every=1", f"trainer.output_dir={tmp_path / 'run'}"]
    trainer = RLTrainer(load_rl_config(None, [*overrides, "trainer.total_steps=2"]), mode="local", tensorboard=False)
    trainer.fit()
    trainer.shutdown()
    with pytest.raises(ValueError, match=r"this RLTrainer was shut down .* build a new RLTrainer"):
        trainer.fit()
    capsys.readouterr()
    again = RLTrainer(load_rl_config(None, [*overrides, "trainer.total_steps=1"]), mode="local", tensorboard=False)
    again.shutdown()
    assert "(step 2 of 1); trainer.total_steps=1 is reached already, so no step runs" in capsys.readouterr().out


def test_preference_pairs_whose_two_responses_are_equal_are_counted_in_a_warning():
    from hybridflow.data import PreferenceDataset
    from hybridflow.data.builtin import builtin_tokenizer

    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "2+2=", "chosen": "4", "rejected": "4"}]
    with pytest.warns(UserWarning, match=r"1 of 2 pairs of .* have the same chosen and rejected response \(first: "
                                         r"row 1\)"):
        PreferenceDataset(rows, builtin_tokenizer(), max_prompt_tokens=16, max_response_tokens=4)


def test_sft_with_a_val_function_that_does_not_load_names_the_key(tmp_path):
    from hybridflow.trainers.config.supervised import SFTConfig, load_supervised_config
    from hybridflow.trainers.supervised import run_supervised

    write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "1+1=", "response": "2"}])
    config = load_supervised_config(SFTConfig, None, [
        "model.builtin=arithmetic", f"data.train_path={tmp_path / 'sft.jsonl'}",
        f"data.val_path={tmp_path / 'sft.jsonl'}", "val_function=nosuch_module_xyz:f", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=r"^config key val_function: reward function 'nosuch_module_xyz:f'"):
        run_supervised(config, mode="local", tensorboard=False)
