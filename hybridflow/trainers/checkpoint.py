"""Run checkpoints: the driver's state plus every worker's engine checkpoint, committed atomically.

Layout under ``<output_dir>/checkpoints``: ``step_000010/driver.json`` and one directory per role;
``latest`` names the newest complete checkpoint. A checkpoint is written to ``step_N.partial`` and
renamed only when every part is on disk, and ``latest`` is replaced last (write + rename), so a
crash at any point leaves the previous checkpoint intact and resumable. With ``keep_last`` = K only
the newest K checkpoints stay on disk (older ones are deleted after the new one is committed).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from hybridflow.engine.generation_config import unset_before_it_was_optional


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory, ...); the previous one is untouched."""


class RunCheckpointer:
    """Saves and finds run checkpoints in ``directory``."""

    def __init__(self, directory: str | Path, *, keep_last: int = 0) -> None:
        self.directory = Path(directory)
        self.keep_last = keep_last

    def save(self, step: int, driver_state: dict, save_roles) -> Path:
        """Write ``driver_state`` and call ``save_roles(partial_dir)`` (it fills one directory per role)."""
        final = self.directory / f"step_{step:06d}"
        partial = self.directory / f"step_{step:06d}.partial"
        try:
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
            save_roles(partial)
            (partial / "driver.json").write_text(json.dumps({"step": step, **driver_state}))
        except Exception as error:  # ENOSPC, EACCES, EROFS, or a worker's OSError reported as WorkerError
            shutil.rmtree(partial, ignore_errors=True)  # give the space back; `latest` never named it
            raise CheckpointSaveError(self._save_failure(step, partial, error)) from error
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        pointer = self.directory / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.directory / "latest")
        self._prune()
        return final

    def _save_failure(self, step: int, partial: Path, error: Exception) -> str:
        previous = self.latest()
        kept = (f"the previous checkpoint {str(previous)!r} is intact and a resume starts from it"
                if previous is not None else "no earlier checkpoint exists, so a resume starts from step 0")
        cause = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        return (f"could not save the checkpoint of step {step} to {str(partial)!r}: {type(error).__name__}: {cause}; "
                f"{kept}; free disk space or make {str(self.directory)!r} writable")

    def steps(self) -> dict[int, Path]:
        """Every complete checkpoint by step, oldest first."""
        found = {}
        for path in self.directory.glob("step_*"):
            if path.suffix != ".partial" and (path / "driver.json").exists():
                found[int(path.name.removeprefix("step_"))] = path
        return dict(sorted(found.items()))

    def at_step(self, step: int | None) -> Path:
        """The checkpoint of ``step`` (None: the latest); ValueError listing the steps there are."""
        steps = self.steps()
        path = self.latest() if step is None else steps.get(step)
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
        """The newest complete checkpoint, or None."""
        pointer = self.directory / "latest"
        if not pointer.exists():
            return None
        path = self.directory / pointer.read_text().strip()
        return path if (path / "driver.json").exists() else None

    @staticmethod
    def driver_state(path: Path) -> dict:
        return json.loads((path / "driver.json").read_text())


# Keys that may change between a run and its resume without making it another experiment: reported, never
# refused. The loop's length and logging, and where and how the models are laid out (a checkpoint loads
# into any layout, tested by tests/test_trainer_multirank.py).
LOOP_KEYS = ("trainer.total_steps", "trainer.val_every", "trainer.val_before_train", "trainer.save_every",
             "trainer.keep_last", "trainer.keep_best", "trainer.keep_best_mode", "trainer.resume",
             "trainer.allow_config_change", "trainer.progress_bar", "trainer.log_every", "trainer.tensorboard",
             "trainer.wandb_project", "trainer.output_dir")
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
