"""Running untrusted Python (e.g. a model's code answer) in a separate, limited, throw-away subprocess.

What is guaranteed, in layers (see docs/rewards.md for the full list and its limits):
- the code never runs in the calling process: a fresh interpreter (`python -I -B`, stdlib only, no
  environment variables but PATH and LANG) in its own session, killed with its whole process
  group at the wall-clock limit;
- OS limits set before the code runs and unraisable by it: address space (memory), CPU seconds,
  size of any file written (also caps stdout/stderr), process count, no core dumps;
- the working directory is a fresh temporary directory, deleted afterwards;
- no network: a new, empty network namespace (`unshare -n`, or `unshare -rn` without root) when
  the kernel allows it, and in every case a Python audit hook that refuses sockets;
- when the caller is root and the interpreter is readable by `nobody`, the code runs as uid
  65534, so the kernel itself stops it from touching the caller's files;
- in every case a Python audit hook (PEP 578) refuses new processes, signals, native code
  (ctypes), heap introspection, and writes/deletes/renames outside the working directory.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
NOBODY_UID = 65534
NETWORK_MODES = ("auto", "require", "off")
PRIVILEGE_MODES = ("auto", "never")


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit; the process group is killed when it passes (CPU time is capped at ceil(timeout_s) + 1 s)."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) in MiB; allocations past it raise MemoryError in the child."""
    max_output_bytes: int = 1_000_000
    """Largest file the child may write (RLIMIT_FSIZE), which also bounds its captured stdout and stderr."""
    max_processes: int = 64
    """RLIMIT_NPROC of the child's user (effective when it runs as `nobody`; new processes are refused anyway)."""
    network: str = "auto"
    """"auto": a new network namespace when available; "require": fail if unavailable; "off": audit hook only."""
    drop_privileges: str = "auto"
    """"auto": run as uid 65534 when the caller is root and the interpreter allows it; "never": keep the uid."""
    python_executable: str | None = None
    """Interpreter for the child; default: the base interpreter of the running Python (not a venv's)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (the interpreter itself needs it), got {self.memory_mb}")
        if self.max_output_bytes < 1024:
            raise ValueError(f"max_output_bytes must be >= 1024, got {self.max_output_bytes}")
        if self.max_processes < 1:
            raise ValueError(f"max_processes must be >= 1, got {self.max_processes}")
        if self.network not in NETWORK_MODES:
            raise ValueError(f"network must be one of {NETWORK_MODES}, got {self.network!r}")
        if self.drop_privileges not in PRIVILEGE_MODES:
            raise ValueError(f"drop_privileges must be one of {PRIVILEGE_MODES}, got {self.drop_privileges!r}")

    @property
    def interpreter(self) -> str:
        return self.python_executable or getattr(sys, "_base_executable", sys.executable)


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None
    """Exit status (negative: killed by that signal; None never happens after a finished run)."""
    stdout: str
    """Captured standard output (at most max_output_bytes, decoded with replacement)."""
    stderr: str
    """Captured standard error (tracebacks of the untrusted code land here)."""
    timed_out: bool
    """True when the wall-clock limit killed the run."""
    network_isolated: bool
    """True when the run had its own empty network namespace."""
    uid: int
    """The uid the untrusted code ran as."""

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited with status 0."""
        return self.returncode == 0 and not self.timed_out


@functools.cache
def network_namespace_prefix() -> tuple[str, ...] | None:
    """The command prefix that gives a child an empty network namespace here, or None if the kernel refuses."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ((unshare, "-n"), (unshare, "-rn")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return None


@functools.cache
def _can_run_as_nobody(interpreter: str) -> bool:
    if os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run(
            [interpreter, "-I", "-c", "import json, math, collections"],
            capture_output=True, timeout=20, user=NOBODY_UID, group=NOBODY_UID, extra_groups=[],
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def _network_prefix(config: SandboxConfig) -> tuple[str, ...]:
    if config.network == "off":
        return ()
    prefix = network_namespace_prefix()
    if prefix is None:
        if config.network == "require":
            raise RuntimeError(
                "sandbox network='require' but no network namespace can be created here (unshare -n failed)"
            )
        _warn_no_network_namespace()
        return ()
    return prefix


@functools.cache
def _warn_no_network_namespace() -> None:
    warnings.warn("no network namespace available (unshare -n failed): sandboxed code is kept off the network "
                  "only by the Python audit hook", stacklevel=4)


def run_python(code: str, *, stdin: str = "", config: SandboxConfig = SandboxConfig()) -> SandboxResult:
    """Run `code` as a script in a sandboxed subprocess, feeding it `stdin`; never raises for what the code does."""
    interpreter = config.interpreter
    run_as_nobody = config.drop_privileges == "auto" and _can_run_as_nobody(interpreter)
    prefix = _network_prefix(config)
    root = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
    try:
        workdir = root / "work"
        workdir.mkdir()
        (root / "solution.py").write_text(code)
        (root / "stdin").write_text(stdin)
        settings = {
            "code_path": str(root / "solution.py"),
            "workdir": str(workdir),
            "memory_bytes": config.memory_mb * 2**20,
            "cpu_seconds": math.ceil(config.timeout_s) + 1,
            "max_file_bytes": config.max_output_bytes,
            "max_processes": config.max_processes,
            "drop_to_uid": NOBODY_UID if run_as_nobody else None,
        }
        (root / "settings.json").write_text(json.dumps(settings))
        if run_as_nobody:
            root.chmod(0o711)
            os.chown(workdir, NOBODY_UID, NOBODY_UID)
        command = [*prefix, interpreter, "-I", "-B", str(CHILD_SCRIPT), str(root / "settings.json")]
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        with open(root / "stdin", "rb") as stdin_file, open(root / "stdout", "wb") as stdout_file, \
                open(root / "stderr", "wb") as stderr_file:
            process = subprocess.Popen(command, stdin=stdin_file, stdout=stdout_file, stderr=stderr_file,
                                       cwd=workdir, env=env, start_new_session=True, close_fds=True)
            timed_out = False
            try:
                process.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # The child leads its own process group: kill whatever of it is left, then reap.
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                process.wait()
        return SandboxResult(
            returncode=process.returncode,
            stdout=_read_capped(root / "stdout", config.max_output_bytes),
            stderr=_read_capped(root / "stderr", config.max_output_bytes),
            timed_out=timed_out,
            network_isolated=bool(prefix),
            uid=NOBODY_UID if run_as_nobody else os.geteuid(),
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _read_capped(path: Path, max_bytes: int) -> str:
    with open(path, "rb") as handle:
        return handle.read(max_bytes).decode("utf-8", errors="replace")
