"""Experiment trackers beside the JSONL file: TensorBoard, Weights & Biases, MLflow, trackio (``trainer.loggers``).

Each is a small class over its own library, imported only when chosen (wandb, mlflow-skinny and trackio are the
``loggers`` extra: ``pip install 'hybridflow[loggers]'``). Every one receives the run's config once, each step's
metrics, and (where the library has tables) a table of sampled episodes: step, prompt, response, reward.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

EPISODE_COLUMNS = ("step", "prompt", "response", "reward")


@dataclass(frozen=True)
class RunInfo:
    """What every tracker is told about the run."""

    directory: Path
    """The run's output directory (local trackers write under it)."""
    project: str
    """W&B and trackio project, MLflow experiment."""
    name: str
    """The run's name."""
    config: dict
    """The resolved config, as plain dicts."""
    mlflow_tracking_uri: str | None = None
    """MLflow's store; None: $MLFLOW_TRACKING_URI, else a file store under the run's directory."""
    config_key: str = "trainer.loggers"
    """The config key that asked for the tracker (named when its library is missing)."""


def _import(module: str, name: str, info: RunInfo):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        asked = (f"got {info.project!r}" if info.config_key == "trainer.wandb_project" else f"asks for {name}")
        raise ValueError(f"config key {info.config_key} {asked} but {module.split('.')[0]} is not installed; "
                         f"allowed: install the extra (pip install 'hybridflow[loggers]'), or leave {name} "
                         "out") from None


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in metrics.items() if math.isfinite(value)}


class TensorBoardLogger:
    """Scalars under ``<output_dir>/tensorboard`` (no table: TensorBoard has none)."""

    def __init__(self, info: RunInfo) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(info.directory / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in _finite(metrics).items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def log_episodes(self, step: int, rows: list[tuple]) -> None:
        pass

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A W&B run under ``<output_dir>/wandb`` (WANDB_MODE=offline keeps it local); episodes as a ``wandb.Table``."""

    def __init__(self, info: RunInfo) -> None:
        self.wandb = _import("wandb", "wandb", info)
        self.run = self.wandb.init(project=info.project, name=info.name, dir=str(info.directory),
                                   config=info.config, resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_episodes(self, step: int, rows: list[tuple]) -> None:
        self.run.log({"episodes": self.wandb.Table(columns=list(EPISODE_COLUMNS), data=[list(r) for r in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowLogger:
    """An MLflow run (through ``MlflowClient``, not the process-wide active run): the config as ``config.json``
    and flattened params, metrics per step, episodes as ``episodes/step_<n>.json`` tables."""

    def __init__(self, info: RunInfo) -> None:
        mlflow = _import("mlflow", "mlflow", info)
        uri = info.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or (
            (info.directory / "mlruns").resolve().as_uri())
        if "://" not in uri or uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; a local run needs no database server or SQLAlchemy
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.entities = _import("mlflow.entities", "mlflow", info)
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(info.project)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(info.project))
        self.run_id = self.client.create_run(experiment_id, run_name=info.name).info.run_id
        self.client.log_dict(self.run_id, info.config, "config.json")
        params = [self.entities.Param(key, str(value)[:500]) for key, value in _flatten(info.config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        entries = [self.entities.Metric(name, value, now, step) for name, value in _finite(metrics).items()]
        for start in range(0, len(entries), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=entries[start:start + 1000])

    def log_episodes(self, step: int, rows: list[tuple]) -> None:
        columns = {name: [row[index] for row in rows] for index, name in enumerate(EPISODE_COLUMNS)}
        self.client.log_table(self.run_id, data=columns, artifact_file=f"episodes/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioLogger:
    """A local trackio run (its SQLite store under $TRACKIO_DIR, defaulting to ``<output_dir>/trackio`` when
    trackio is first imported by this process); episodes as a ``trackio.Table``."""

    def __init__(self, info: RunInfo) -> None:
        os.environ.setdefault("TRACKIO_DIR", str((info.directory / "trackio").resolve()))
        self.trackio = _import("trackio", "trackio", info)
        self.run = self.trackio.init(project=info.project, name=info.name, config=info.config, embed=False,
                                     auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def log_episodes(self, step: int, rows: list[tuple]) -> None:
        self.run.log({"episodes": self.trackio.Table(columns=list(EPISODE_COLUMNS), data=[list(r) for r in rows])},
                     step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger, "trackio": TrackioLogger}
"""``trainer.loggers`` names beside ``jsonl`` (always written: resume and the plots read it) -> tracker class."""
LOGGER_NAMES = ("jsonl", *TRACKERS)


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def episode_rows(tokenizer, batch, scores_B, *, step: int, limit: int) -> list[tuple]:
    """The first ``limit`` samples of a step as ``(step, prompt, response, reward)`` rows (the response as the
    reward read it: after the response prefix, when there is one)."""
    from hybridflow.data import answer_texts

    count = min(limit, len(batch))
    if count == 0:
        return []
    head = batch[:count]
    prompts = [str(prompt) for prompt in head["raw_prompt"]] if "raw_prompt" in head else [""] * count
    return [(step, prompt, response, float(score))
            for prompt, response, score in zip(prompts, answer_texts(tokenizer, head), scores_B[:count].tolist())]
