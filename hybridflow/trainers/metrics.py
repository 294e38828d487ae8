"""MetricsLogger: one JSON line per step, the chosen trackers (``loggers.py``), and the history for plots and summaries;
StepReporter: a progress bar on a terminal, one printed line per N steps elsewhere (CI, nohup, files);
Heartbeat: progress of the long phases between the steps' lines (loading models, validation, a step's generation),
from the first second: a bar on a terminal, one line every N seconds elsewhere."""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path


class MetricsLogger:
    """Appends ``{"step": n, "time/wall": unix seconds, **metrics}`` to ``metrics.jsonl`` under ``directory`` and
    hands the same metrics to each tracker of ``loggers`` (``trainers/loggers.py``: tensorboard, wandb, mlflow,
    trackio), with the run's config once and a table of sampled episodes where the library has tables.

    On resume the JSONL keeps the lines of steps before the resume point and drops later ones (they
    belong to the run that crashed after its last checkpoint), so the file reads as one clean run.
    ``tensorboard`` and ``wandb_project`` are the older switches (still honoured): TensorBoard on, and W&B under
    that project.
    """

    def __init__(self, directory: str | Path, *, resume_step: int = 0, tensorboard: bool = True,
                 wandb_project: str | None = None, run_config: dict | None = None, loggers: tuple[str, ...] = (),
                 project: str | None = None, mlflow_tracking_uri: str | None = None) -> None:
        from hybridflow.trainers.loggers import TRACKERS, RunInfo

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
        names = [name for name in loggers if name in TRACKERS and (name != "tensorboard" or tensorboard)]
        if tensorboard and not loggers:
            names.append("tensorboard")
        if wandb_project is not None and "wandb" not in names:
            names.append("wandb")
        info = RunInfo(directory=self.directory, project=project or wandb_project or "hybridflow",
                       name=self.directory.resolve().name, config=run_config or {},
                       mlflow_tracking_uri=mlflow_tracking_uri)
        self.trackers = {}
        try:
            for name in names:
                asked_by_project = name == "wandb" and name not in loggers  # the older switch, wandb_project
                self.trackers[name] = TRACKERS[name](replace(info, config_key="trainer.wandb_project")
                                                     if asked_by_project else info)
        except BaseException:
            self.close()
            raise

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time/wall": round(time.time(), 3),
                  **{name: float(value) for name, value in metrics.items()}}
        self.history.append(record)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        scalars = {name: value for name, value in record.items() if name not in ("step", "time/wall")}
        for tracker in self.trackers.values():
            tracker.log(step, scalars)

    def log_episodes(self, step: int, rows: list[tuple]) -> None:
        """A table of sampled episodes, ``(step, prompt, response, reward)`` rows, to the trackers that have tables."""
        if rows:
            for tracker in self.trackers.values():
                tracker.log_episodes(step, rows)

    def series(self, name: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the logged steps that have it."""
        points = [(record["step"], record[name]) for record in self.history if name in record]
        return [step for step, _ in points], [value for _, value in points]

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()
        self.trackers = {}


class StepReporter:
    """Progress of a loop: a tqdm bar when ``stream`` is a terminal and ``progress_bar`` is on; otherwise one line
    every ``every`` steps (and at the last), ``[name] step 3/10 | 1.52 s | loss 0.412 | val/nll 1.03``, flushed, so
    logs of CI or nohup runs show progress without a bar's carriage returns."""

    def __init__(self, name: str, *, total: int, initial: int = 0, progress_bar: bool = True, every: int = 1,
                 keys: tuple[str, ...] = (), stream=None) -> None:
        self.name, self.total, self.every, self.keys = name, total, every, keys
        self.stream = stream if stream is not None else sys.stdout
        self.bar = None
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=name, unit="step")

    def update(self, step: int, metrics: dict[str, float], *, advance: bool = True) -> None:
        """Step ``step`` finished with ``metrics`` (``advance=False``: a record outside the loop, e.g. step 0)."""
        shown = {key: metrics[key] for key in self.keys if key in metrics}
        shown.update({key: value for key, value in metrics.items() if key.startswith("val/")})
        if self.bar is not None:
            if advance:
                self.bar.update(1)
            self.bar.set_postfix({key.split("/")[-1]: f"{value:.3g}" for key, value in shown.items()})
            return
        if advance and step % self.every and step != self.total:
            return
        parts = [f"[{self.name}] step {step}/{self.total}"]
        if "time/step_s" in metrics:
            parts.append(f"{metrics['time/step_s']:.2f} s")
        parts += [f"{key} {value:.4g}" for key, value in shown.items()]
        print(" | ".join(parts), file=self.stream, flush=True)

    def warn(self, message: str | None) -> None:
        """Print a warning line (above the bar on a terminal); None prints nothing."""
        if message is None:
            return
        if self.bar is not None:
            self.bar.write(f"WARNING: {message}", file=sys.stderr)
        else:
            print(f"WARNING: {message}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Heartbeat:
    """Says what a run is doing while it does it. ``with heartbeat.phase("loading models"):`` prints the phase at
    once; while it lasts, a terminal (stderr a TTY, ``progress_bar`` on) shows a tqdm bar with the elapsed
    seconds (and ``done/total`` when the phase counts items: ``phase(..., total=16)`` and ``advance()``);
    elsewhere one line every ``every_s`` seconds, ``[rl] validation: 3/16, 45 s``, flushed. ``describe()`` is
    the current phase, for messages such as the worker watchdog's."""

    def __init__(self, name: str, *, every_s: float = 30.0, progress_bar: bool = True, stream=None) -> None:
        self.name, self.every_s = name, every_s
        self.stream = stream if stream is not None else sys.stdout
        self.use_bar = progress_bar and sys.stderr.isatty()
        self._lock = threading.Lock()
        self._phase: tuple[str, int | None, float] | None = None  # (description, total, start)
        self._done = 0
        self._bar = None

    def describe(self) -> str | None:
        """``'validation (3/16, 45 s)'`` while a phase runs, else None."""
        with self._lock:
            if self._phase is None:
                return None
            description, total, start = self._phase
            count = f"{self._done}/{total}, " if total is not None else ""
            return f"{description} ({count}{time.monotonic() - start:.0f} s)"

    @contextmanager
    def phase(self, description: str, *, total: int | None = None, announce: bool = True):
        """Report ``description`` from now until the block ends (phases do not nest: an inner one replaces the
        outer one's report for its duration). ``announce=False``: off a terminal, no line at the start (a step's
        phases: the step's own line follows them), only the ones every ``every_s`` seconds."""
        outer = self._phase, self._done
        with self._lock:
            self._phase, self._done = (description, total, time.monotonic()), 0
        if announce or self.use_bar:
            self._emit(started=True)
        stop = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(stop,), daemon=True, name=f"heartbeat-{self.name}")
        ticker.start()
        try:
            yield self
        finally:
            stop.set()
            ticker.join()
            if self._bar is not None:
                self._bar.close()
                self._bar = None
            with self._lock:
                self._phase, self._done = outer

    def advance(self, count: int = 1) -> None:
        """``count`` more items of the current phase are done."""
        with self._lock:
            self._done += count
        if self._bar is not None:
            self._bar.update(count)

    def _tick(self, stop: threading.Event) -> None:
        interval = 1.0 if self.use_bar else self.every_s
        while not stop.wait(interval):
            self._emit(started=False)

    def _emit(self, *, started: bool) -> None:
        if self.use_bar:
            if started:
                from tqdm import tqdm

                description, total, _ = self._phase
                self._bar = tqdm(total=total, desc=f"[{self.name}] {description}", leave=False)
            elif self._bar is not None:
                self._bar.refresh()  # the elapsed time moves even when no item finished
            return
        if started:
            description, total, _ = self._phase
            line = f"[{self.name}] {description}{'' if total is None else f' (0/{total})'}..."
        else:
            line = f"[{self.name}] {self.describe()}"
        print(line, file=self.stream, flush=True)
