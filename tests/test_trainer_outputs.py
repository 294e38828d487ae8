"""What an RL run leaves behind and says: exported models, pruned checkpoints, the best model, step-0
validation, announced resumes, timed metrics records and non-terminal log lines (issue 16)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.data import write_jsonl
from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
from hybridflow.trainers.config.rl import load_rl_config
from hybridflow.trainers.export import export_main
from hybridflow.trainers.metrics import StepReporter
from hybridflow.trainers.rl import RLTrainer, run_rl

TASK = ArithmeticTaskConfig(max_digits=1)
TOKENIZER_FILES = ("tokenizer_config.json",)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("rl_outputs_data")
    write_jsonl(directory / "train.jsonl", prompt_rows(32, split="train", seed=0, config=TASK))
    write_jsonl(directory / "val.jsonl", prompt_rows(4, split="eval", seed=0, config=TASK))
    return directory


def _config(data_dir, output_dir, *overrides):
    return load_rl_config(None, [
        f"data.train_path={data_dir / 'train.jsonl'}", f"data.val_path={data_dir / 'val.jsonl'}",
        "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        "actor.generation.max_new_tokens=4", "actor.engine.optim.lr=1e-3", "critic.engine.optim.lr=1e-3",
        "batch.prompts_per_step=4", "batch.samples_per_prompt=2", "batch.mini_batch_size=4",
        "trainer.total_steps=2", "trainer.progress_bar=false", f"trainer.output_dir={output_dir}", *overrides])


def _run(config) -> list[dict]:
    return run_rl(config, mode="local", tensorboard=False)


def _weights(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def _assert_same_weights(left, right) -> None:
    assert sorted(left) == sorted(right)
    for name, tensor in left.items():
        assert torch.equal(tensor, right[name]), name


def test_a_run_ends_with_its_trained_models_exported_with_tokenizer_files_and_keeps_the_last_checkpoints(
        data_dir, tmp_path):
    run_dir = tmp_path / "run"
    history = _run(_config(data_dir, run_dir, "trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_last=2",
                           "trainer.val_every=1", "trainer.keep_best=val/function_mean"))
    for role in ("actor", "critic"):
        directory = run_dir / "final" / role
        assert (directory / "config.json").exists() and (directory / "model.safetensors").exists()
        for name in TOKENIZER_FILES:
            assert (directory / name).exists(), f"{role} lacks {name}"
    # checkpoints: only the newest two survive, and `latest` names the last
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("step_*")) == ["step_000002", "step_000003"]
    assert (checkpoints / "latest").read_text() == "step_000003"
    # keep_best: the step with the highest validation exact match (the first one on ties), exported
    values = [(record["val/function_mean"], -record["step"]) for record in history]
    best_value, best_step = max(values)[0], -max(values)[1]
    assert json.loads((run_dir / "best" / "best.json").read_text()) == {
        "metric": "val/function_mean", "value": best_value, "step": best_step}
    assert (run_dir / "best" / "actor" / "model.safetensors").exists()
    # hybridflow export turns the last checkpoint into the same directories the run ended with
    assert export_main([str(run_dir), "--step", "3", "--out", str(tmp_path / "exported")]) == 0
    for role in ("actor", "critic"):
        _assert_same_weights(_weights(tmp_path / "exported" / role), _weights(run_dir / "final" / role))
        assert (tmp_path / "exported" / role / "tokenizer_config.json").exists()


def test_export_of_a_step_that_was_not_kept_names_the_steps_there_are(data_dir, tmp_path, capsys):
    _run(_config(data_dir, tmp_path / "run", "algorithm.advantage_estimator=grpo", "trainer.total_steps=1",
                 "trainer.save_every=1"))
    assert export_main([str(tmp_path / "run"), "--step", "7"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 7 under" in err and "steps saved: [1]" in err
    assert export_main([str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "export" / "step_000001" / "actor" / "model.safetensors").exists()
    assert not (tmp_path / "run" / "export" / "step_000001" / "critic").exists()  # GRPO trains no critic


def test_the_exported_actor_loads_with_from_pretrained_and_as_the_next_runs_model(data_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _run(_config(data_dir, tmp_path / "first", "algorithm.advantage_estimator=grpo", "trainer.total_steps=1"))
    exported = tmp_path / "first" / "final" / "actor"
    model = AutoModelForCausalLM.from_pretrained(str(exported))
    tokenizer = AutoTokenizer.from_pretrained(str(exported))
    state = model.state_dict()
    for name, tensor in _weights(exported).items():
        assert torch.equal(state[name], tensor), name
    assert tokenizer.decode(tokenizer.encode("12+3=", add_special_tokens=False)) == "12+3="
    history = _run(_config(data_dir, tmp_path / "second", "actor.model.builtin=null", f"actor.model.path={exported}",
                           "algorithm.advantage_estimator=grpo", "trainer.total_steps=1"))
    assert [record["step"] for record in history] == [1]


def test_validation_runs_at_step_zero_and_every_record_carries_wall_clock_and_phase_times(data_dir, tmp_path):
    history = _run(_config(data_dir, tmp_path, "algorithm.advantage_estimator=grpo", "trainer.val_every=2"))
    assert [record["step"] for record in history] == [0, 1, 2]
    assert "val/function_mean" in history[0] and "reward/score_mean" not in history[0]
    assert history[0]["time/validate_s"] > 0 and history[2]["time/validate_s"] > 0
    assert "time/validate_s" not in history[1]
    for record in history[1:]:
        phases = record["time/generate_s"] + record["time/score_s"] + record["time/update_s"]
        assert record["time/step_s"] >= phases > 0
    walls = [record["time/wall"] for record in history]
    assert walls == sorted(walls) and walls[0] > 1.7e9  # unix seconds, in order


def test_a_resume_is_announced_and_a_changed_learning_rate_is_refused_unless_allowed(data_dir, tmp_path, capsys):
    grpo = ("algorithm.advantage_estimator=grpo", "trainer.save_every=1")
    _run(_config(data_dir, tmp_path, *grpo, "trainer.total_steps=1"))
    capsys.readouterr()
    with pytest.raises(ValueError, match=r"checkpoint step_000001 \(step 1\) of a run with a different config:\n"
                                         r"  actor\.engine\.optim\.lr: 0\.001 -> 0\.002\nallowed: the same config, "
                                         r"trainer\.allow_config_change=true"):
        RLTrainer(_config(data_dir, tmp_path, *grpo, "trainer.total_steps=2", "actor.engine.optim.lr=2e-3"),
                  tensorboard=False)
    history = _run(_config(data_dir, tmp_path, *grpo, "trainer.total_steps=2", "actor.engine.optim.lr=2e-3",
                           "trainer.allow_config_change=true"))
    out = capsys.readouterr().out
    assert f"resuming from {tmp_path / 'checkpoints' / 'step_000001'} (step 1 of 2)" in out
    assert "  actor.engine.optim.lr: 0.001 -> 0.002\n" in out and "  trainer.total_steps: 1 -> 2\n" in out
    assert [record["step"] for record in history] == [1, 2]


def test_off_a_terminal_the_reporter_prints_one_line_every_n_steps_and_the_last():
    stream = io.StringIO()
    reporter = StepReporter("rl", total=5, every=2, keys=("loss",), stream=stream)
    reporter.update(0, {"val/acc": 0.25}, advance=False)
    for step in range(1, 6):
        reporter.update(step, {"loss": 1.0 / step, "time/step_s": 0.5, "other": 3.0})
    reporter.close()
    assert stream.getvalue().splitlines() == [
        "[rl] step 0/5 | val/acc 0.25",
        "[rl] step 2/5 | 0.50 s | loss 0.5",
        "[rl] step 4/5 | 0.50 s | loss 0.25",
        "[rl] step 5/5 | 0.50 s | loss 0.2",
    ]


def test_loop_and_layout_changes_are_reported_on_resume_and_the_rest_refused():
    from hybridflow.trainers.checkpoint import config_changes

    saved = {"trainer": {"total_steps": 2, "seed": 0}, "placement": {"pools": {"all": [2]}},
             "actor": {"engine": {"tp_size": 2, "layout": "3d", "optim": {"lr": 1e-3}}, "hybrid_engine": {"tp_size": 2}}}
    current = {"trainer": {"total_steps": 3, "seed": 1}, "placement": {"pools": {"all": [1]}},
               "actor": {"engine": {"tp_size": 1, "layout": "fsdp", "optim": {"lr": 1e-3}}, "hybrid_engine": {"tp_size": 1}}}
    reported, refused = config_changes(saved, current)
    assert reported == ["actor.engine.layout: '3d' -> 'fsdp'", "actor.engine.tp_size: 2 -> 1",
                        "actor.hybrid_engine.tp_size: 2 -> 1", "placement.pools.all: [2] -> [1]",
                        "trainer.total_steps: 2 -> 3"]
    assert refused == ["trainer.seed: 0 -> 1"]
