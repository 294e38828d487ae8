"""Running untrusted Python (e.g. a model's code answer) inside an operating-system sandbox (bubblewrap).

The boundary is the kernel, not Python: nothing the guest does inside its interpreter can switch
it off. Each run gets (see docs/rewards.md for the threat model and its limits):
- new pid, network, IPC, UTS and mount namespaces (bubblewrap `bwrap`): the guest sees only its
  own processes, has no network but its own loopback, and sees a file system made of read-only
  binds of /usr and the interpreter's prefix, a fresh /proc and /dev, and one small writable
  scratch tmpfs; nothing of the host's /tmp, /run, /home, /root or the trainer's files;
- an unprivileged uid (65534) outside any namespace when the caller is root (bwrap then needs no
  user namespace; the guest drops to `nobody` before its code runs, with no capabilities and
  no_new_privs), or a user namespace mapping the caller's uid to 65534 when it is not root;
- a seccomp filter (hybridflow.rewards.seccomp) refusing tracing, namespaces, mounts, BPF,
  keyrings, io_uring, device nodes, xattrs and non-Unix sockets;
- resource limits set before the code runs and unraisable by it: address space, CPU seconds,
  file size (which also bounds captured output), process count, no core dumps; the scratch
  tmpfs has a fixed size;
- an empty environment (PATH and LANG only); a new session (no terminal to inject into);
- at the wall-clock limit the sandbox's init process is killed, and the kernel kills every
  process of its pid namespace with it, so nothing outlives `run_python`.
When bubblewrap cannot run here, `run_python` refuses (SandboxUnavailableError says what to
install) unless the user opts out explicitly: `SandboxConfig(isolation="none")` or the
environment variable HYBRIDFLOW_SANDBOX=none.
"""

from __future__ import annotations

import functools
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from hybridflow.rewards import seccomp

CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
GUEST_UID = 65534
_INIT_EXIT_WAIT_S = 30.0  # bound on waiting for the kernel to reap a killed pid namespace
ISOLATION_MODES = ("bwrap", "none")
OPT_OUT_ENV = "HYBRIDFLOW_SANDBOX"
"""Set to "none" to run code rewards without isolation (only for code you trust)."""
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`); "
    "as a non-root user the kernel must also allow unprivileged user namespaces "
    "(sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04+ "
    "kernel.apparmor_restrict_unprivileged_userns=0); inside a container, the container must allow "
    "namespaces (e.g. Docker: --security-opt seccomp=unconfined --cap-add SYS_ADMIN, or use a VM). "
    "To run untrusted code WITHOUT isolation anyway, "
    f"set {OPT_OUT_ENV}=none or SandboxConfig(isolation='none')"
)


class SandboxUnavailableError(ValueError):
    """The operating-system sandbox cannot run here (the message says what to install)."""


@dataclass(frozen=True, kw_only=True)
class SandboxConfig:
    """Limits of one sandboxed run."""

    timeout_s: float = 5.0
    """Wall-clock limit; the whole sandbox is killed when it passes (CPU time is capped at ceil(timeout_s) + 1 s)."""
    memory_mb: int = 512
    """Address-space limit (RLIMIT_AS) of each guest process in MiB; allocations past it raise MemoryError."""
    max_output_bytes: int = 1_000_000
    """Largest file the guest may write (RLIMIT_FSIZE), which also bounds its captured stdout and stderr."""
    max_processes: int = 16
    """Most processes (and threads) the guest may run at once (RLIMIT_NPROC of its own uid)."""
    scratch_mb: int = 16
    """Size of the guest's only writable directory (a tmpfs, its working directory)."""
    isolation: str = "bwrap"
    """"bwrap": the operating-system sandbox, refusing to run without it; "none": a plain limited subprocess
    (NOT a security boundary: only for trusted code; the env variable HYBRIDFLOW_SANDBOX=none does the same)."""
    python_executable: str | None = None
    """Interpreter for the guest; default: the base interpreter of the running Python (not a venv's)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.memory_mb < 64:
            raise ValueError(f"memory_mb must be >= 64 (the interpreter itself needs it), got {self.memory_mb}")
        if self.max_output_bytes < 1024:
            raise ValueError(f"max_output_bytes must be >= 1024, got {self.max_output_bytes}")
        if self.max_processes < 1:
            raise ValueError(f"max_processes must be >= 1, got {self.max_processes}")
        if self.scratch_mb < 1:
            raise ValueError(f"scratch_mb must be >= 1, got {self.scratch_mb}")
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(f"isolation must be one of {ISOLATION_MODES}, got {self.isolation!r}")

    @property
    def interpreter(self) -> str:
        return os.path.realpath(self.python_executable or getattr(sys, "_base_executable", sys.executable))

    @property
    def effective_isolation(self) -> str:
        """The isolation actually used: "none" when this config or HYBRIDFLOW_SANDBOX says so."""
        env = os.environ.get(OPT_OUT_ENV, "")
        if env not in ("", *ISOLATION_MODES):
            raise ValueError(f"environment variable {OPT_OUT_ENV} must be one of {ISOLATION_MODES}, got {env!r}")
        return "none" if "none" in (self.isolation, env) else "bwrap"


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: int | None
    """Exit status; a guest killed by signal N reports 128 + N (bubblewrap's convention), -9 after a timeout."""
    stdout: str
    """Captured standard output (at most max_output_bytes, decoded with replacement)."""
    stderr: str
    """Captured standard error (tracebacks of the untrusted code land here)."""
    timed_out: bool
    """True when the wall-clock limit killed the run."""
    isolated: bool
    """True when the run was inside the operating-system sandbox (False only after an explicit opt-out)."""

    @property
    def ok(self) -> bool:
        """The code ran to completion and exited with status 0."""
        return self.returncode == 0 and not self.timed_out


def _interpreter_prefix(interpreter: str) -> str:
    """The directory tree the interpreter needs besides /usr (its installation prefix), mounted read-only."""
    prefix = os.path.dirname(os.path.dirname(interpreter))
    if interpreter == os.path.realpath(getattr(sys, "_base_executable", sys.executable)):
        prefix = os.path.realpath(sys.base_prefix)
    if prefix == "/usr" or prefix.startswith("/usr/"):
        return "/usr"  # mounted anyway
    # Never mount a top-level directory (or the whole root): that would show the guest far more than Python.
    if len(Path(prefix).parts) < 3:
        raise ValueError(f"python_executable {interpreter!r} lives under {prefix!r}, too broad a tree to mount in "
                         "the sandbox; use an interpreter installed under /usr or in its own prefix "
                         "(e.g. /opt/python3.11/bin/python3)")
    return prefix


def _bwrap_command(config: SandboxConfig, inputs: Path, info_fd: int, seccomp_fd: int | None) -> list[str]:
    as_root = os.geteuid() == 0
    command = [
        "bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc",
        "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox", "--clearenv",
        "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/sandbox/work",
        "--setenv", "TMPDIR", "/sandbox/work",
        "--ro-bind", "/usr", "/usr",
    ]
    if not as_root:
        # Rootless: a user namespace maps the caller's uid to 65534 and forbids nested namespaces.
        command += ["--unshare-user", "--disable-userns", "--uid", str(GUEST_UID), "--gid", str(GUEST_UID)]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/", top)
        if host.is_symlink():
            command += ["--symlink", os.readlink(host), f"/{top}"]
        elif host.is_dir():
            command += ["--ro-bind", str(host), f"/{top}"]
    for name in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        if os.path.exists(name):
            command += ["--ro-bind", name, name]
    prefix = _interpreter_prefix(config.interpreter)
    if prefix != "/usr":
        # Mount points are created on the sandbox's own root; let the guest traverse them.
        parents = list(Path(prefix).parents)[::-1][1:]
        for parent in parents:
            command += ["--perms", "0755", "--dir", str(parent)]
        command += ["--ro-bind", prefix, prefix]
    command += [
        "--proc", "/proc", "--dev", "/dev",
        # POSIX semaphores (multiprocessing) need a writable /dev/shm; it is capped like the scratch directory.
        "--perms", "1777", "--size", str(config.scratch_mb * 2**20), "--tmpfs", "/dev/shm",
        "--perms", "0755", "--dir", "/sandbox",  # traversable by the guest once it is no longer root
        "--ro-bind", str(inputs), "/sandbox/in",
        "--perms", "1777", "--size", str(config.scratch_mb * 2**20), "--tmpfs", "/sandbox/work",
        "--remount-ro", "/", "--chdir", "/sandbox/work", "--info-fd", str(info_fd),
    ]
    if seccomp_fd is not None:
        command += ["--seccomp", str(seccomp_fd)]
    return [*command, "--", config.interpreter, "-I", "-B", "/sandbox/in/child.py", "/sandbox/in/settings.json"]


@functools.cache
def isolation_problem(interpreter: str) -> str | None:
    """Why the bubblewrap sandbox cannot run `interpreter` here, or None when it works (probed once)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (`bwrap`) is not installed"
    try:
        # Importing a module not loaded yet checks the guest can read the standard library after the uid drop.
        result = run_python("import fractions; print('ok')",
                            config=SandboxConfig(timeout_s=30.0, python_executable=interpreter), _probe=True)
    except OSError as error:
        return f"bwrap could not start: {error}"
    except ValueError as error:
        return str(error)
    if result.stdout.strip() != "ok":
        return f"bwrap could not run the interpreter {interpreter} (exit status {result.returncode}): " \
               f"{result.stderr.strip()[-500:]}"
    return None


def check_available(config: SandboxConfig = SandboxConfig()) -> None:
    """Raise SandboxUnavailableError (saying what to install) unless `config` can run here."""
    if config.effective_isolation == "bwrap":
        problem = isolation_problem(config.interpreter)
        if problem is not None:
            raise SandboxUnavailableError(f"cannot sandbox the model's code: {problem}. To fix: {INSTALL_HINT}")


@functools.cache
def _warn_unisolated() -> None:
    warnings.warn(f"code rewards run WITHOUT operating-system isolation ({OPT_OUT_ENV}=none or "
                  "SandboxConfig(isolation='none')): the model's code can read and change anything this user can",
                  stacklevel=4)


@functools.cache
def _warn_no_seccomp() -> None:
    warnings.warn("libseccomp is not available (Debian: apt-get install libseccomp2): the code sandbox runs "
                  "without its seccomp filter (namespaces still isolate it)", stacklevel=4)


def run_python(code: str, *, stdin: str = "", config: SandboxConfig = SandboxConfig(),
               _probe: bool = False) -> SandboxResult:
    """Run `code` as a script in a sandbox, feeding it `stdin`; never raises for what the code does.

    Raises SandboxUnavailableError when the operating-system sandbox cannot run here and the
    user has not opted out.
    """
    isolated = _probe or config.effective_isolation == "bwrap"
    if not _probe:
        check_available(config)
    if not isolated:
        _warn_unisolated()
    root = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
    try:
        inputs = root / "in"
        inputs.mkdir()
        shutil.copyfile(CHILD_SCRIPT, inputs / "child.py")
        (inputs / "solution.py").write_text(code)
        settings = {
            "code_path": "/sandbox/in/solution.py" if isolated else str(inputs / "solution.py"),
            "memory_bytes": config.memory_mb * 2**20,
            "cpu_seconds": math.ceil(config.timeout_s) + 1,
            "max_file_bytes": config.max_output_bytes,
            "max_processes": config.max_processes,
            "drop_to_uid": GUEST_UID if isolated and os.geteuid() == 0 else None,
        }
        (inputs / "settings.json").write_text(json.dumps(settings))
        for path in inputs.iterdir():
            path.chmod(0o644)
        inputs.chmod(0o755)
        (root / "stdin").write_text(stdin)
        return _run(config, root, isolated)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(config: SandboxConfig, root: Path, isolated: bool) -> SandboxResult:
    info_read, info_write = os.pipe()
    seccomp_file = None
    init_pidfd = None
    try:
        if isolated:
            seccomp_fd = None
            if seccomp.available():
                seccomp_file = tempfile.TemporaryFile()  # noqa: SIM115 - closed in the finally below
                seccomp_file.write(seccomp.filter_bpf())
                seccomp_file.seek(0)
                seccomp_fd = seccomp_file.fileno()
            else:
                _warn_no_seccomp()
            command = _bwrap_command(config, root / "in", info_write, seccomp_fd)
            workdir = "/"
        else:
            scratch = root / "work"
            scratch.mkdir()
            command = [config.interpreter, "-I", "-B", str(root / "in" / "child.py"), str(root / "in" / "settings.json")]
            workdir = str(scratch)
        pass_fds = [info_write] + ([seccomp_file.fileno()] if seccomp_file is not None else [])
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        deadline = time.monotonic() + config.timeout_s
        with open(root / "stdin", "rb") as stdin_file, open(root / "stdout", "wb") as stdout_file, \
                open(root / "stderr", "wb") as stderr_file:
            process = subprocess.Popen(command, stdin=stdin_file, stdout=stdout_file, stderr=stderr_file, cwd=workdir,
                                       env=env, start_new_session=True, close_fds=True, pass_fds=pass_fds)
            os.close(info_write)
            info_write = -1
            timed_out = False
            try:
                if isolated:
                    init_pidfd = _open_init_pidfd(info_read, deadline)
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _end_sandbox(process, init_pidfd)
        return SandboxResult(
            returncode=-signal.SIGKILL if timed_out else process.returncode,
            stdout=_read_capped(root / "stdout", config.max_output_bytes),
            stderr=_read_capped(root / "stderr", config.max_output_bytes),
            timed_out=timed_out,
            isolated=isolated,
        )
    finally:
        for fd in (info_read, info_write, init_pidfd):
            if fd is not None and fd >= 0:
                os.close(fd)
        if seccomp_file is not None:
            seccomp_file.close()


def _open_init_pidfd(info_read: int, deadline: float) -> int | None:
    """A pidfd of the sandbox's init (pid 1 of its pid namespace), from what bwrap writes to --info-fd."""
    text = b""
    while True:  # bwrap may write its JSON in pieces
        ready, _, _ = select.select([info_read], [], [], max(deadline - time.monotonic(), 0.0))
        chunk = os.read(info_read, 65536) if ready else b""
        text += chunk
        try:
            child_pid = json.loads(text.decode()).get("child-pid")
            break
        except ValueError:
            if not chunk:
                return None  # bwrap failed before setting up the sandbox, or the deadline passed
    if not isinstance(child_pid, int) or child_pid <= 1:
        return None
    try:
        return os.pidfd_open(child_pid)
    except ProcessLookupError:
        return None  # it has already come and gone


def _end_sandbox(process: subprocess.Popen, init_pidfd: int | None) -> None:
    """Kill whatever is left of the sandbox and wait until all of it is gone.

    Killing the sandbox's init makes the kernel kill every process of its pid namespace, and the
    init's exit completes only once they are all dead, so waiting on its pidfd waits for all of
    them (bwrap itself may exit a moment earlier, as soon as the guest's main process does).
    Without isolation only the guest's process group is killed (what left it with setsid survives).
    """
    if init_pidfd is None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if init_pidfd is not None:
        try:
            signal.pidfd_send_signal(init_pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    if init_pidfd is not None:
        select.select([init_pidfd], [], [], _INIT_EXIT_WAIT_S)


def _read_capped(path: Path, max_bytes: int) -> str:
    with open(path, "rb") as handle:
        return handle.read(max_bytes).decode("utf-8", errors="replace")
