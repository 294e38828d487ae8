"""Run checkpoints: the driver's state plus every worker's engine checkpoint, committed atomically.

Layout under ``<output_dir>/checkpoints``: ``step_000010/driver.json`` and one directory per role;
``latest`` names the newest complete checkpoint (for people; resume scans the step directories).
A checkpoint is written to ``step_N.partial`` and
renamed only when every part is on disk, and ``latest`` is replaced last (write + rename), so a
crash at any point leaves the previous checkpoint intact and resumable. With ``keep_last`` = K only
the newest K checkpoints stay on disk (older ones are deleted after the new one is committed).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from hybridflow.controller.errors import WorkerLostError
from hybridflow.engine.generation_config import unset_before_it_was_optional
from hybridflow.trainers.boundary import CAUSES, failure_cause


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory, ...); the previous one is untouched."""


# a file system with less free space than this after a failed save is taken to be full
FULL_BELOW_BYTES = 1 << 20
# the record an engine writes next to its weights (hybridflow.engine.checkpoint.ENGINE_FILE; not imported: torch)
ENGINE_FILE = "engine.json"


def directory_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def checkpoint_estimate(config) -> int:
    """A lower bound of a run checkpoint's size before the first one exists: the weights files of every role it
    saves (all but the reference; optimizer state comes on top)."""
    total = 0
    for role in config.active_roles:
        model = config.section_of(role).model
        if role != "reference" and model is not None and model.path is not None and Path(model.path).is_dir():
            total += sum(path.stat().st_size for path in Path(model.path).glob("*.safetensors"))
    return total


class RunCheckpointer:
    """Saves and finds run checkpoints in ``directory``.

    A save first checks that the file system has room for about the size of the newest checkpoint (or
    ``first_estimate_bytes`` before the first one). Resume scans the step directories for the newest complete
    one (a readable ``driver.json``, written last); the ``latest`` pointer is written for people and
    tools, never trusted.
    """

    def __init__(self, directory: str | Path, *, keep_last: int = 0, first_estimate_bytes: int = 0) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.first_estimate_bytes = first_estimate_bytes

    def save(self, step: int, driver_state: dict, save_roles) -> Path:
        """Write ``driver_state`` and call ``save_roles(partial_dir)`` (it fills one directory per role)."""
        final = self.directory / f"step_{step:06d}"
        partial = self.directory / f"step_{step:06d}.partial"
        try:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
            self._check_free_space(step)
            save_roles(partial)
            (partial / "driver.json").write_text(json.dumps({"step": step, **driver_state}))
        except (CheckpointSaveError, WorkerLostError):  # a lost worker is no fault of the disk: said as itself
            shutil.rmtree(partial, ignore_errors=True)
            raise
        except BaseException as error:  # ENOSPC, EACCES, EROFS, a worker's error, torch's CheckpointException, ...
            # torch's writer reports a full disk as "unexpected pos ..." without errno: read the free space now,
            # before removing the partial directory gives it back
            cause = failure_cause(error) or self._file_system_cause()
            shutil.rmtree(partial, ignore_errors=True)  # no half-written directory stays behind
            if isinstance(error, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise CheckpointSaveError(self._save_failure(step, partial, error, cause)) from error
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        pointer = self.directory / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.directory / "latest")
        self._prune()
        return final

    def _kept(self) -> str:
        previous = self.latest()
        return (f"the previous checkpoint {str(previous)!r} is intact and a resume starts from it"
                if previous is not None else "no earlier checkpoint exists, so a resume starts from step 0")

    def _check_free_space(self, step: int) -> None:
        previous = self.latest()
        needed = directory_bytes(previous) if previous is not None else self.first_estimate_bytes
        free = shutil.disk_usage(self.directory).free
        if needed and free < needed:
            basis = f"the size of {previous.name}" if previous is not None else "the size of the models' weights"
            raise CheckpointSaveError(
                f"not enough free space to save the checkpoint of step {step} under {str(self.directory)!r}: about "
                f"{_bytes(needed)} needed ({basis}), {_bytes(free)} free; {self._kept()}; free disk space there")

    def _file_system_cause(self) -> tuple[str, str] | None:
        """The cause read from the file system itself, when the error does not say: (almost) no free space, or a
        directory this process cannot write."""
        try:
            if shutil.disk_usage(self.directory).free < FULL_BELOW_BYTES:
                return CAUSES[errno.ENOSPC]
            if not os.access(self.directory, os.W_OK):
                return CAUSES[errno.EACCES]
        except OSError:
            return None
        return None

    def _save_failure(self, step: int, partial: Path, error: BaseException, cause: tuple[str, str] | None) -> str:
        plain, advice = cause or ("", "free disk space or make {dir} writable")
        cause = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        detail = f"{type(error).__name__}: {cause}"
        return (f"could not save the checkpoint of step {step} to {str(partial)!r}: "
                f"{f'{plain} ({detail})' if plain else detail}; {self._kept()}; "
                f"{advice.format(dir=repr(str(self.directory)))}")

    def remove_unfinished(self) -> list[str]:
        """Delete the ``step_N.partial`` directories a stopped run left (a driver killed mid-checkpoint); the names.
        Only for the run directory's holder: a live run's save writes one."""
        unfinished = sorted(self.directory.glob("step_*.partial")) if self.directory.is_dir() else []
        for path in unfinished:
            shutil.rmtree(path, ignore_errors=True)
        return [path.name for path in unfinished]

    def _step_dirs(self) -> dict[int, Path]:
        found = {}
        if self.directory.is_dir():
            for path in self.directory.glob("step_*"):
                number = path.name.removeprefix("step_")
                if path.suffix != ".partial" and path.is_dir() and number.isdigit():
                    found[int(number)] = path
        return dict(sorted(found.items()))

    @staticmethod
    def problem(path: Path) -> str | None:
        """Why the checkpoint directory ``path`` cannot be resumed from (None when it is complete)."""
        driver = path / "driver.json"
        if not driver.is_file():
            return "its driver state driver.json is missing"
        try:
            json.loads(driver.read_text())["step"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return "its driver state driver.json is unreadable"
        for role in sorted(child for child in path.iterdir() if child.is_dir()):
            problem = RunCheckpointer._role_problem(role)
            if problem is not None:
                return f"{role.name}/{problem}"
        return None  # a role directory deleted by hand is named when its engine loads the checkpoint

    @staticmethod
    def _role_problem(role: Path) -> str | None:
        """What is missing from an engine's checkpoint directory (``.metadata`` and ``engine.json`` are written with
        its weights); None for a complete one or for a directory that is no engine's."""
        if not any(role.glob("*.distcp")) and not (role / ENGINE_FILE).exists():
            return None
        if not (role / ".metadata").is_file():
            return ".metadata is missing (the index of its weight files)"
        try:
            json.loads((role / ENGINE_FILE).read_text())["step"]
        except FileNotFoundError:
            return f"{ENGINE_FILE} is missing"
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return f"{ENGINE_FILE} is unreadable"
        return None

    def steps(self) -> dict[int, Path]:
        """Every complete checkpoint by step, oldest first."""
        return {step: path for step, path in self._step_dirs().items() if self.problem(path) is None}

    def has_any(self) -> bool:
        """Whether any step directory exists, complete or not."""
        return bool(self._step_dirs())

    def resume_point(self) -> Path | None:
        """The newest complete checkpoint, saying which newer ones are broken and whether ``latest`` disagrees;
        None when there is no step directory; ValueError naming what is broken when none is complete."""
        every = self._step_dirs()
        broken = {path.name: self.problem(path) for path in every.values() if self.problem(path) is not None}
        complete = self.steps()
        if not every:
            return None
        if not complete:
            raise ValueError(f"{str(self.directory)!r} holds checkpoints but none is complete: "
                             + "; ".join(f"{name}: {why}" for name, why in broken.items())
                             + "; allowed: restore the missing files, or trainer.overwrite=true to delete the run and "
                               "start over")
        newest = list(complete.values())[-1]
        skipped = [f"{name} ({why})" for name, why in broken.items() if name > newest.name]
        pointer = self.directory / "latest"
        named = pointer.read_text().strip() if pointer.is_file() else None
        if skipped:
            print(f"resume: skipping incomplete checkpoints {', '.join(skipped)}; {newest.name} is the newest "
                  f"complete one", flush=True)
        elif named is not None and named != newest.name:
            print(f"resume: 'latest' names {named}, which is not a complete checkpoint; {newest.name} is the "
                  f"newest complete one", flush=True)
        return newest

    def at_step(self, step: int | None) -> Path:
        """The checkpoint of ``step`` (None: the latest); ValueError listing the steps there are."""
        steps = self.steps()
        path = self.latest() if step is None else steps.get(step)
        broken = self._step_dirs().get(step) if step is not None else None
        if path is None and broken is not None:
            raise ValueError(f"checkpoint {str(broken)!r} is incomplete: {self.problem(broken)}; complete steps: "
                             f"{list(steps) or 'none'}")
        if path is None:
            raise ValueError(f"no checkpoint {'' if step is None else f'of step {step} '}under {self.directory}; "
                             f"steps saved: {list(steps) or 'none (set trainer.save_every)'}")
        return path

    def _prune(self) -> None:
        if self.keep_last <= 0:
            return
        for path in list(self.steps().values())[:-self.keep_last]:
            shutil.rmtree(path)

    def latest(self) -> Path | None:
        """The newest complete checkpoint (found by scanning), or None."""
        complete = self.steps()
        return list(complete.values())[-1] if complete else None

    @staticmethod
    def driver_state(path: Path) -> dict:
        return json.loads((path / "driver.json").read_text())


# Keys that may change between a run and its resume without making it another experiment: reported, never
# refused. The loop's length and logging, and where and how the models are laid out (a checkpoint loads
# into any layout, tested by tests/test_trainer_multirank.py).
LOOP_KEYS = ("trainer.total_steps", "trainer.val_every", "trainer.val_before_train", "trainer.save_every",
             "trainer.keep_last", "trainer.keep_best", "trainer.keep_best_mode", "trainer.resume",
             "trainer.allow_config_change", "trainer.progress_bar", "trainer.log_every", "trainer.tensorboard",
             "trainer.wandb_project", "trainer.output_dir", "trainer.overwrite", "trainer.save_on_signal")
LAYOUT_FIELDS = ("layout", "pp_size", "tp_size", "fsdp_cpu_offload", "micro_batch_tokens", "pipeline_schedule",
                 "num_threads")


def _reported_only(key: str) -> bool:
    if key in LOOP_KEYS or key.startswith("placement.") or ".hybrid_engine." in key:
        return True
    return ".engine." in key and ".optim." not in key and key.rsplit(".", 1)[1] in LAYOUT_FIELDS


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and scalars are leaves)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(changes a resume reports, changes it refuses) between a checkpoint's config and this run's, as
    ``key: old -> new`` lines."""
    old, new = flatten(saved), flatten(current)
    reported, refused = [], []
    for key in sorted(set(old) | set(new)):
        if old.get(key, "<unset>") != new.get(key, "<unset>") and not unset_before_it_was_optional(
                key, old.get(key), new.get(key, "<unset>")):
            line = f"{key}: {old.get(key, '<unset>')!r} -> {new.get(key, '<unset>')!r}"
            (reported if _reported_only(key) else refused).append(line)
    return reported, refused
