"""trainer.loggers: JSONL, TensorBoard, Weights & Biases (offline), MLflow (a local file store) and trackio (local)
each receive the config, every step's metrics and, where the library has tables, the sampled episodes."""

from __future__ import annotations

import glob
import json
import struct
import sys
import uuid

import pytest

from hybridflow.trainers.metrics import MetricsLogger

ALL = ("jsonl", "tensorboard", "wandb", "mlflow", "trackio")
EPISODES = [(1, "1+2=", "3", 1.0), (1, "4+5=", "8", 0.0)]


@pytest.fixture()
def offline(monkeypatch, tmp_path):
    """W&B offline, trackio local, a fresh project name per test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return f"hf-test-{uuid.uuid4().hex[:8]}"


def wandb_records(run_dir) -> list:
    """The records of an offline W&B run: its .wandb file is a LevelDB-style log (32 KiB blocks of records with a
    7-byte header: crc, length, type) of protobuf ``Record`` messages after a 7-byte ':W&B' header."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, offset, pending, records = open(path, "rb").read(), 7, b"", []
    while offset + 7 <= len(data):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
            offset += 32768 - offset % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        chunk, offset = data[offset + 7:offset + 7 + length], offset + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start a record, MIDDLE/LAST continue
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for record in wandb_records(run_dir) if record.WhichOneof("record_type") == "history"]


def wandb_config(run_dir) -> dict:
    (run,) = [record.run for record in wandb_records(run_dir) if record.WhichOneof("record_type") == "run"]
    return {item.key: json.loads(item.value_json) for item in run.config.update}


def mlflow_run(run_dir):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name != "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run


def trackio_logs(project: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    (run,) = SQLiteStorage.get_runs(project)
    return SQLiteStorage.get_logs(project, run)


def test_every_logger_receives_the_config_metrics_and_episodes(offline, tmp_path):
    run_dir = tmp_path / "run"
    logger = MetricsLogger(run_dir, loggers=ALL, run_config={"actor": {"lr": 0.001}, "seed": 3}, project=offline)
    for step, score in ((1, 0.25), (2, 0.75)):
        logger.log_episodes(step, [(step, *row[1:]) for row in EPISODES])
        logger.log(step, {"reward/score_mean": score, "actor/pg_grad_share": float("nan")})
    logger.close()
    # JSONL and TensorBoard as before
    assert [json.loads(line)["reward/score_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        == [0.25, 0.75]
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
    # W&B (offline)
    history = wandb_history(run_dir)
    assert [record["reward/score_mean"] for record in history if "reward/score_mean" in record] == [0.25, 0.75]
    tables = [record for record in history if record.get("episodes/_type") == "table-file"]
    assert [table["episodes/nrows"] for table in tables] == [2, 2]
    assert wandb_config(run_dir)["actor"] == {"lr": 0.001}
    # MLflow (file store)
    client, run = mlflow_run(run_dir)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/score_mean")] == \
        [(1, 0.25), (2, 0.75)]
    assert run.data.params == {"actor.lr": "0.001", "seed": "3"}
    config_path = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path))
    assert json.load(open(config_path)) == {"actor": {"lr": 0.001}, "seed": 3}
    episodes = json.load(open(client.download_artifacts(run.info.run_id, "episodes/step_000002.json",
                                                        str(tmp_path))))
    assert episodes["columns"] == ["step", "prompt", "response", "reward"] and len(episodes["data"]) == 2
    # trackio (local)
    logs = trackio_logs(offline)
    assert [log["reward/score_mean"] for log in logs if "reward/score_mean" in log] == [0.25, 0.75]
    assert sum("episodes" in log for log in logs) == 2


def test_a_missing_library_names_the_extra_to_install(offline, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if mlflow-skinny were not installed
    with pytest.raises(ValueError, match=r"trainer\.loggers asks for mlflow but mlflow is not installed; allowed: "
                                         r"install the extra \(pip install 'hybridflow\[loggers\]'\)"):
        MetricsLogger(tmp_path / "run", loggers=("jsonl", "mlflow"), tensorboard=False)


def test_an_unknown_logger_is_refused_naming_the_choices():
    from hybridflow.trainers.config.rl import load_rl_config

    with pytest.raises(ValueError, match=r"trainer\.loggers got \['jsonl', 'neptune'\]; allowed: a list of jsonl, "
                                         r"tensorboard, wandb, mlflow, trackio"):
        load_rl_config(None, ["data.train_path=t.jsonl", "actor.model.builtin=arithmetic", "reward.function=math",
                              "trainer.loggers=[jsonl, neptune]"])


def test_an_rl_run_sends_its_metrics_and_sampled_episodes_to_mlflow_and_wandb(offline, tmp_path):
    from hybridflow.controller import local_mode
    from hybridflow.data import write_jsonl
    from hybridflow.data.builtin import ArithmeticTaskConfig, prompt_rows
    from hybridflow.trainers.config.rl import load_rl_config
    from hybridflow.trainers.rl import RLTrainer

    rows = prompt_rows(8, split="train", seed=0, config=ArithmeticTaskConfig(max_digits=1))
    write_jsonl(tmp_path / "train.jsonl", rows)
    run_dir = tmp_path / "run"
    config = load_rl_config(None, [
        f"data.train_path={tmp_path / 'train.jsonl'}", "actor.model.builtin=arithmetic", "reward.function=arithmetic",
        "algorithm.advantage_estimator=grpo", "actor.generation.max_new_tokens=3", "batch.prompts_per_step=2",
        "batch.samples_per_prompt=2", "batch.mini_batch_size=4", "trainer.total_steps=2", "trainer.progress_bar=false",
        "trainer.loggers=[jsonl, wandb, mlflow]", "trainer.episodes_per_log=3", f"trainer.project={offline}",
        f"trainer.output_dir={run_dir}"])
    with local_mode():
        trainer = RLTrainer(config, tensorboard=False)
        try:
            history = trainer.fit()
        finally:
            trainer.shutdown()
    assert not (run_dir / "tensorboard").exists()
    client, run = mlflow_run(run_dir)
    logged = client.get_metric_history(run.info.run_id, "signal/tied_groups")
    assert [(m.step, m.value) for m in logged] == [(r["step"], r["signal/tied_groups"]) for r in history]
    assert run.data.params["batch.samples_per_prompt"] == "2"
    episodes = json.load(open(client.download_artifacts(run.info.run_id, "episodes/step_000001.json",
                                                        str(tmp_path))))
    rows = [dict(zip(episodes["columns"], row)) for row in episodes["data"]]
    assert len(rows) == 3 and all(row["step"] == 1 and row["prompt"].endswith("=") for row in rows)
    wandb_scores = [record["reward/score_mean"] for record in wandb_history(run_dir) if "reward/score_mean" in record]
    assert wandb_scores == [record["reward/score_mean"] for record in history]
