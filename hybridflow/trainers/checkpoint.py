"""Run checkpoints: the driver's state plus every worker's engine checkpoint, committed atomically.

Layout under ``<output_dir>/checkpoints``: ``step_000010/driver.json`` and one directory per role;
``latest`` names the newest complete checkpoint. A checkpoint is written to ``step_N.partial`` and
renamed only when every part is on disk, and ``latest`` is replaced last (write + rename), so a
crash at any point leaves the previous checkpoint intact and resumable.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path


class RunCheckpointer:
    """Saves and finds run checkpoints in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def save(self, step: int, driver_state: dict, save_roles) -> Path:
        """Write ``driver_state`` and call ``save_roles(partial_dir)`` (it fills one directory per role)."""
        final = self.directory / f"step_{step:06d}"
        partial = self.directory / f"step_{step:06d}.partial"
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
        save_roles(partial)
        (partial / "driver.json").write_text(json.dumps({"step": step, **driver_state}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        pointer = self.directory / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, self.directory / "latest")
        return final

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
