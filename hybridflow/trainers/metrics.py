"""MetricsLogger: one JSON line per step, TensorBoard scalars, and the history for plots and summaries."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """Appends ``{"step": n, **metrics}`` to ``metrics.jsonl`` and TensorBoard under ``directory``.

    On resume the JSONL keeps the lines of steps before the resume point and drops later ones (they
    belong to the run that crashed after its last checkpoint), so the file reads as one clean run.
    """

    def __init__(self, directory: str | Path, *, resume_step: int = 0, tensorboard: bool = True,
                 wandb_project: str | None = None, run_config: dict | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        self.history: list[dict] = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line)
                if record["step"] <= resume_step:
                    self.history.append(record)
        self.path.write_text("".join(json.dumps(record) + "\n" for record in self.history))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.directory / "tensorboard"))
        self.wandb_run = None
        if wandb_project is not None:
            try:
                import wandb
            except ImportError:
                raise ValueError(f"config key trainer.wandb_project got {wandb_project!r} but wandb is not "
                                 f"installed; allowed: null, or install it (pip install wandb)") from None
            self.wandb_run = wandb.init(project=wandb_project, dir=str(self.directory), config=run_config or {},
                                        resume="allow")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{name: float(value) for name, value in metrics.items()}}
        self.history.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in record.items():
                if name != "step" and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({name: value for name, value in record.items() if name != "step"}, step=step)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the logged steps that have it."""
        points = [(record["step"], record[name]) for record in self.history if name in record]
        return [step for step, _ in points], [value for _, value in points]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
