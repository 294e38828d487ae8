"""Errors a worker group raises on the driver: a failing rank, a lost process, a call past its timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path


class WorkerError(RuntimeError):
    """A worker method raised (or its process died) on one rank; carries the remote traceback.

    Its first line says it all (``actor.update failed on rank 1: ValueError: lr must be > 0``);
    ``report(directory)`` writes the full traceback to a file and returns that line with the path,
    which is what a command-line tool should print.
    """

    def __init__(self, *, role: str, rank: int, method: str, remote_traceback: str) -> None:
        self.role = role
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        super().__init__(f"{self.summary}\n{remote_traceback}")

    @property
    def cause(self) -> str:
        """The last line of the remote traceback: the exception that ended the call."""
        lines = [line.strip() for line in self.remote_traceback.strip().splitlines() if line.strip()]
        return lines[-1] if lines else "(no traceback)"

    @property
    def summary(self) -> str:
        return f"{self.role}.{self.method} failed on rank {self.rank}: {self.cause}"

    def report(self, directory: str | Path) -> str:
        """Write the full remote traceback under ``directory``; one line naming role, rank, method, cause and file."""
        path = write_trace(directory, f"{self.role}-rank{self.rank}-{self.method}", str(self))
        return f"{self.summary} (full traceback: {path})"

    def __reduce__(self):
        # keyword-only constructor: pickle through a helper so the error crosses Ray intact
        return (_rebuild_worker_error, (self.role, self.rank, self.method, self.remote_traceback))


class WorkerLostError(WorkerError):
    """A worker process died, or stopped answering for longer than its timeout: its calls will never finish.

    Its first line names the role, the rank, the process (pid and host, where known) and the call it was in:
    ``rollout rank 0 (pid 4242 on host node-1) died during rollout.generate_sequences (...)``. ``with_note``
    adds what the caller knows (where the run can resume from)."""

    def __init__(self, *, role: str, rank: int, method: str | None, remote_traceback: str, reason: str,
                 pid: int | None = None, host: str | None = None, note: str = "") -> None:
        self.reason = reason
        """What happened, as a phrase: "died (...)", "stopped answering: ..."."""
        self.pid = pid
        self.host = host
        self.note = note
        super().__init__(role=role, rank=rank, method=method or "", remote_traceback=remote_traceback)

    @property
    def process(self) -> str:
        """``pid N on host H`` (what is known of it)."""
        parts = [f"pid {self.pid}" if self.pid is not None else "", f"host {self.host}" if self.host else ""]
        return " on ".join(part for part in parts if part) or "process unknown"

    @property
    def summary(self) -> str:
        during = f"during {self.role}.{self.method}" if self.method else "while idle"
        return (f"{self.role} rank {self.rank} ({self.process}) {self.reason} {during}"
                + (f"; {self.note}" if self.note else ""))

    def with_note(self, note: str) -> "WorkerLostError":
        """The same error with ``note`` at the end of its line."""
        return self._replaced(note=note)

    def during(self, method: str) -> "WorkerLostError":
        """The same error naming ``method`` as the call the process was in."""
        return self._replaced(method=method)

    def _replaced(self, **changes) -> "WorkerLostError":
        fields = dict(role=self.role, rank=self.rank, method=self.method, remote_traceback=self.remote_traceback,
                      reason=self.reason, pid=self.pid, host=self.host, note=self.note)
        return WorkerLostError(**{**fields, **changes})

    def __reduce__(self):
        return (_rebuild_lost_error, (self.role, self.rank, self.method, self.remote_traceback, self.reason, self.pid,
                                      self.host, self.note))


def _rebuild_lost_error(role, rank, method, remote_traceback, reason, pid, host, note) -> WorkerLostError:
    return WorkerLostError(role=role, rank=rank, method=method, remote_traceback=remote_traceback, reason=reason,
                           pid=pid, host=host, note=note)


DIED = "died (its process is gone: killed, out of memory or crashed)"
"""The reason of a WorkerLostError for a process that no longer exists."""


def write_trace(directory: str | Path, name: str, text: str) -> Path:
    """Write ``text`` to a new file ``directory/error-<name>-<time>.txt`` (directory created) and return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    path = directory / f"error-{safe_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    path.write_text(text)
    return path


def user_message(error: BaseException, directory: str | Path) -> str:
    """One line for a user: worker errors are summarized with their traceback written under ``directory``."""
    if isinstance(error, WorkerError):
        return error.report(directory)
    return str(error)


def _rebuild_worker_error(role: str, rank: int, method: str, remote_traceback: str) -> WorkerError:
    return WorkerError(role=role, rank=rank, method=method, remote_traceback=remote_traceback)


class WorkerTimeoutError(TimeoutError):
    """A worker method did not finish on some ranks within the group's timeout (``note``: what the caller adds)."""

    def __init__(self, *, role: str, method: str, pending_ranks: list[int], timeout_s: float,
                 pids: list[int] | None = None, note: str = "") -> None:
        self.role = role
        self.method = method
        self.pending_ranks = pending_ranks
        self.timeout_s = timeout_s
        self.pids = pids
        self.note = note
        where = f"ranks {pending_ranks}" + (f" (pids {pids})" if pids else "")
        super().__init__(f"{role}.{method} did not finish within {timeout_s:g} s on {where} "
                         f"(hung collective, deadlock, a frozen process or a dead peer); the group should be shut "
                         f"down. Raise the group's timeout_s if the call is just slow" + (f"; {note}" if note else ""))

    def with_note(self, note: str) -> "WorkerTimeoutError":
        """The same error with ``note`` at the end of its message."""
        return WorkerTimeoutError(role=self.role, method=self.method, pending_ranks=self.pending_ranks,
                                  timeout_s=self.timeout_s, pids=self.pids, note=note)

    def __reduce__(self):
        return (_rebuild_timeout_error, (self.role, self.method, self.pending_ranks, self.timeout_s, self.pids,
                                         self.note))


def _rebuild_timeout_error(role, method, pending_ranks, timeout_s, pids, note="") -> WorkerTimeoutError:
    return WorkerTimeoutError(role=role, method=method, pending_ranks=pending_ranks, timeout_s=timeout_s, pids=pids,
                              note=note)
