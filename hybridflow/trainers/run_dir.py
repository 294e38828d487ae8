"""The run directory as a guarded resource: one writer at a time, and never two runs mixed in one directory.

``claim_run_directory`` is called by every training command (``train``, ``sft``, ``rm``) before it writes
anything. It checks the path (not empty, not a file), takes a lock for the whole run (``.hybridflow.lock``:
an ``flock`` held by this process, so a run killed with SIGKILL leaves a stale lock that the next run
recovers, saying so), and decides what happens to what is already there:

- an empty or new directory: a new run;
- a directory holding a previous run and ``resume`` asked for with a checkpoint to resume from: the caller
  resumes (the checkpointer picks the newest complete checkpoint);
- ``overwrite``: the previous run's files are deleted, each named on stdout (only what a run writes: other
  files in the directory stay);
- anything else is refused, naming the keys that decide it.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = ".hybridflow.lock"
# what a run writes into its directory: a previous run is found by, and `overwrite` deletes, only these
# (other files, such as data kept next to the run, are neither a run nor deleted)
RUN_ENTRIES = ("checkpoints", "final", "best", "model", "export", "metrics.jsonl", "tensorboard", "config.yaml",
               "errors", "eval_model.tmp", "wandb")
AFTER_STEP_GLOB = "metrics.after-step-*.jsonl"
# entries a failed or empty start leaves behind: they alone do not make the directory hold a run
START_LEFTOVERS = ("errors", "config.yaml", "tensorboard", "eval_model.tmp")


class RunDirectoryBusyError(RuntimeError):
    """Another live process holds the run directory's lock."""


@dataclass
class RunDirectory:
    """A claimed run directory: ``path``, the open lock file, and whether it holds a run to resume."""

    path: Path
    lock_handle: object
    resumes: bool

    def release(self) -> None:
        """Drop the lock and remove the lock file (idempotent)."""
        handle, self.lock_handle = self.lock_handle, None
        if handle is None:
            return
        try:
            (self.path / LOCK_FILE).unlink(missing_ok=True)
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            handle.close()


def check_output_path(value: object, key: str) -> Path:
    """The output directory as a Path; ValueError naming ``key`` for an empty value or a path that is a file."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ValueError(f"config key {key} got {value!r}; allowed: a directory path (an empty value would write the "
                         f"run into the current directory)")
    if str(value).startswith("~"):
        raise ValueError(f"config key {key} got {str(value)!r}; '~' is not expanded here (it would make a directory "
                         f"named '~'); allowed: the full path, e.g. {str(Path(value).expanduser())!r}")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"config key {key} got {str(value)!r}, which is a file, not a directory; allowed: a new or "
                         f"existing directory")
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"config key {key} got {str(value)!r}: {str(parent)!r} is a file, not a directory")
    return path


def _holder(lock_path: Path) -> str:
    try:
        record = json.loads(lock_path.read_text())
        same = record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        return (f"pid {record['pid']} on host {record['host']}, started {record['started']}"
                + ("; that is this process: shut the earlier trainer down first" if same else ""))
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose lock record is unreadable"


def acquire_lock(path: Path, key: str) -> object:
    """Lock ``path`` for this process; RunDirectoryBusyError naming the holder when another live process has it."""
    lock_path = path / LOCK_FILE
    try:
        path.mkdir(parents=True, exist_ok=True)
        previous = lock_path.read_text() if lock_path.is_file() else ""
        handle = open(lock_path, "a+")
    except OSError as error:  # a read-only or virtual file system, no permission
        raise ValueError(f"config key {key}: cannot write the run directory {str(path)!r}: "
                         f"{error.strerror or error}; give a writable directory") from None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RunDirectoryBusyError(
            f"config key {key}: {str(path)!r} is in use by another run ({_holder(lock_path)}); wait for it to end or "
            f"give another {key}") from None
    if previous.strip():  # the flock died with its process: the record is a killed run's
        print(f"{key}: recovered the lock of a run that ended without releasing it ({_holder(lock_path)})", flush=True)
    handle.seek(0)
    handle.truncate()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    handle.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}))
    handle.flush()
    return handle


def _metrics_lines(path: Path) -> int:
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    with metrics.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def _run_entries(path: Path) -> list[Path]:
    if not path.is_dir():
        return []
    return sorted([path / name for name in RUN_ENTRIES if (path / name).exists() or (path / name).is_symlink()]
                  + list(path.glob(AFTER_STEP_GLOB)))


def previous_run(path: Path) -> list[str]:
    """What in ``path`` belongs to an earlier run ([] when nothing does), as short descriptions."""
    found = []
    for entry in _run_entries(path):
        if entry.name in START_LEFTOVERS:
            continue
        if entry.name == "metrics.jsonl":
            lines = _metrics_lines(path)
            if lines:
                found.append(f"metrics.jsonl ({lines} lines)")
        elif entry.name == "checkpoints":  # an empty one (or a file in its place) holds nothing to lose
            steps = sorted(child.name for child in entry.iterdir() if child.name.startswith("step_")) \
                if entry.is_dir() else []
            if steps:
                found.append(f"checkpoints/ ({len(steps)}: {', '.join(steps)})")
        else:
            found.append(entry.name + ("/" if entry.is_dir() else ""))
    return found


def _remove_previous_run(path: Path, found: list[str]) -> None:
    for entry in _run_entries(path):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    print(f"overwrite: deleted the previous run in {str(path)!r}: {', '.join(found)}", flush=True)


def claim_run_directory(value: object, *, key: str, overwrite_key: str, resume_key: str | None = None,
                        resume: bool = False, has_checkpoint=None, overwrite: bool = False) -> RunDirectory:
    """Check and lock the output directory, then keep (to resume), delete (``overwrite``) or refuse its contents.

    ``has_checkpoint(path) -> bool`` says whether a resume has something to start from; ``resume_key`` is None
    for commands that cannot resume. The lock is released by ``RunDirectory.release`` (and by the process ending).
    """
    path = check_output_path(value, key)
    handle = acquire_lock(path, key)
    claimed = RunDirectory(path=path, lock_handle=handle, resumes=False)
    try:
        found = previous_run(path)
        if not found:
            return claimed
        if overwrite:
            _remove_previous_run(path, found)
            return claimed
        if resume and has_checkpoint is not None and has_checkpoint(path):
            claimed.resumes = True
            return claimed
        if resume_key is None:
            resume_hint = ""
        elif resume:
            resume_hint = f"({resume_key} is on, but there is no checkpoint to resume from) "
        else:
            resume_hint = f"{resume_key}=true to continue it, "
        raise ValueError(f"config key {key}: {str(path)!r} holds a previous run ({', '.join(found)}); allowed: "
                         f"{resume_hint}{overwrite_key}=true to delete it and start over, or another {key}")
    except BaseException:
        claimed.release()
        raise


def set_aside_later_metrics(path: Path, step: int) -> Path | None:
    """Before a run (re)starts at ``step``, move the metrics.jsonl lines of later steps (the lost end of the
    interrupted run) to ``metrics.after-step-<step>-<time>.jsonl``, saying so; returns that file (None: none)."""
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        return None
    kept, later = [], []
    for line in metrics.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        if not line.strip():
            continue
        try:
            record_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            record_step = None  # an unreadable line (a crash mid-write) is kept aside too
        (kept if isinstance(record_step, int) and record_step <= step else later).append(line)
    if not later:
        return None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    aside = path / f"metrics.after-step-{step}-{stamp}.jsonl"
    aside.write_text("".join(later), encoding="utf-8")
    metrics.write_text("".join(kept), encoding="utf-8")
    print(f"metrics.jsonl: kept the {len(kept)} lines up to step {step}; moved the {len(later)} later lines of the "
          f"interrupted run to {str(aside)!r}", flush=True)
    return aside
