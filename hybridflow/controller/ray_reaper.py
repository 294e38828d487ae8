"""Cleans up the local Ray instance a driver started, when the driver dies without shutting it down.

A driver killed with SIGKILL never runs ``ray.shutdown()``; Ray's core processes notice and exit,
but its agent processes (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) outlive it. The
driver therefore starts this module as a small separate process (``start_reaper``) holding the
read end of a pipe whose write end only the driver has: when the driver's process ends, for any
reason, the read returns EOF and the reaper kills every process of that Ray node (found by the
node id in its environment or the session directory on its command line), then exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

GRACE_S = 3.0
"""After SIGTERM, how long the reaper waits before SIGKILL."""


def start_reaper(*, node_id: str, session_dir: str) -> subprocess.Popen:
    """Start the reaper for the Ray node this driver just started (call right after ``ray.init``)."""
    check_identity(node_id, session_dir)
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    # A new session: a Ctrl-C or a kill of the driver's process group must not take the reaper with it.
    # Run as a script (standard library only): importing hybridflow would hold torch and Ray in memory.
    reaper = subprocess.Popen([sys.executable, "-I", __file__, str(read_end), node_id, session_dir],
                              pass_fds=(read_end,), start_new_session=True,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(read_end)
    _driver_ends.append(write_end)  # held (never written) for the driver's whole life; not inherited by children
    return reaper


_driver_ends: list[int] = []


def check_identity(node_id: str, session_dir: str) -> None:
    """Refuse anything but a real Ray node id and session directory: they are what the reaper kills by."""
    if not re.fullmatch(r"[0-9a-f]{32,}", node_id):
        raise ValueError(f"node_id must be a Ray node id (32+ hex digits), got {node_id!r}")
    if not (os.path.isabs(session_dir) and os.path.basename(session_dir.rstrip("/")).startswith("session_")):
        raise ValueError(f"session_dir must be an absolute Ray session directory (.../session_*), got {session_dir!r}")


def node_processes(node_id: str, session_dir: str, *, exclude: set[int], proc: Path = Path("/proc")) -> list[int]:
    """Pids of this user's processes that belong to the Ray node: an environment entry exactly
    RAY_NODE_ID=<node_id>, or a command-line argument naming a path inside the session directory."""
    check_identity(node_id, session_dir)
    node_entry = f"RAY_NODE_ID={node_id}".encode()
    session = session_dir.rstrip("/").encode()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in exclude or int(entry.name) <= 1:
            continue
        try:
            if entry.stat().st_uid != os.getuid():
                continue
            arguments = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not readable
        in_session = any(argument == session or argument.endswith(b"=" + session) or session + b"/" in argument
                         for argument in arguments)
        if node_entry in environment or in_session:
            found.append(int(entry.name))
    return found


def reap(node_id: str, session_dir: str) -> list[int]:
    """SIGTERM the node's processes, then SIGKILL those still there after GRACE_S; returns the pids signalled."""
    exclude = {os.getpid(), os.getppid()}
    pids = node_processes(node_id, session_dir, exclude=exclude)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and node_processes(node_id, session_dir, exclude=exclude):
        time.sleep(0.1)
    for pid in node_processes(node_id, session_dir, exclude=exclude):
        _signal(pid, signal.SIGKILL)
    return pids


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    read_end, node_id, session_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    check_identity(node_id, session_dir)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while os.read(read_end, 1):  # the driver never writes: this returns b"" once it has exited
        pass
    reap(node_id, session_dir)


if __name__ == "__main__":
    main()
