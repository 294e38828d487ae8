"""Errors a worker group raises on the driver: a failing rank, a dead process, a call past its timeout."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker method raised (or its process died) on one rank; carries the remote traceback."""

    def __init__(self, *, role: str, rank: int, method: str, remote_traceback: str) -> None:
        self.role = role
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        super().__init__(f"{role}.{method} failed on rank {rank}:\n{remote_traceback}")

    def __reduce__(self):
        # keyword-only constructor: pickle through a helper so the error crosses Ray intact
        return (_rebuild_worker_error, (self.role, self.rank, self.method, self.remote_traceback))


def _rebuild_worker_error(role: str, rank: int, method: str, remote_traceback: str) -> WorkerError:
    return WorkerError(role=role, rank=rank, method=method, remote_traceback=remote_traceback)


class WorkerTimeoutError(TimeoutError):
    """A worker method did not finish on some ranks within the group's timeout."""

    def __init__(self, *, role: str, method: str, pending_ranks: list[int], timeout_s: float,
                 pids: list[int] | None = None) -> None:
        self.role = role
        self.method = method
        self.pending_ranks = pending_ranks
        self.timeout_s = timeout_s
        self.pids = pids
        where = f"ranks {pending_ranks}" + (f" (pids {pids})" if pids else "")
        super().__init__(f"{role}.{method} did not finish within {timeout_s:g} s on {where} "
                         f"(hung collective, deadlock, a frozen process or a dead peer); the group should be shut "
                         f"down. Raise the group's timeout_s if the call is just slow")

    def __reduce__(self):
        return (_rebuild_timeout_error, (self.role, self.method, self.pending_ranks, self.timeout_s, self.pids))


def _rebuild_timeout_error(role, method, pending_ranks, timeout_s, pids) -> WorkerTimeoutError:
    return WorkerTimeoutError(role=role, method=method, pending_ranks=pending_ranks, timeout_s=timeout_s, pids=pids)
