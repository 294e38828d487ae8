"""LivenessMonitor: the driver notices within seconds that a worker group lost a process (killed, crashed) or that
its calls stopped finishing for longer than the timeout (a frozen process), whatever call the driver waits on."""

from __future__ import annotations

import time

import ray

from hybridflow.controller.errors import DIED, WorkerLostError
from hybridflow.controller.future import DRIVER_CHECKS, host_of
from hybridflow.controller.worker_group import WorkerGroup

LIVENESS_INTERVAL_S = 1.0
"""How often (at most) a monitor looks at its group while the driver waits."""


class LivenessMonitor:
    """Watches every rank of one worker group from the driver; ``start()`` adds its ``check`` to the checks the
    driver runs at every poll while it waits on any worker call (``future.DRIVER_CHECKS``), ``close()`` removes it.

    A check (at most every ``interval_s``) looks at the group's calls in flight without fetching them:
    - a call that failed because its process died raises ``WorkerLostError`` (role, rank, pid, host, the call);
    - a rank whose calls made no progress for ``timeout_s`` raises ``WorkerLostError`` ("stopped answering").
      A rank runs its calls in order, so its oldest unfinished call has been running since the previous call
      finished, or since the rank was seen busy after being idle: progress is a call of the rank finishing;
    - a rank with nothing to do gets a ping (a no-op call, queued like any other), so a process that dies while
      idle is noticed too, and one frozen while idle once its ping is older than ``timeout_s``.
    A call that raised in the worker is left to whoever collects its future. The monitor sees only this group's
    calls, so its processes must host no other role (``WorkerGroup.hosts_one_role``).
    """

    def __init__(self, group: WorkerGroup, *, timeout_s: float, interval_s: float = LIVENESS_INTERVAL_S) -> None:
        if group.is_local:
            raise ValueError(f"LivenessMonitor: group {group.role!r} runs inside the driver's process (single-process "
                             f"mode): there is no process of its own to watch")
        if not group.hosts_one_role:
            raise ValueError(f"LivenessMonitor: the processes of group {group.role!r} host other roles too, whose "
                             f"calls the monitor cannot see; allowed: a group on a pool of its own")
        for name, value in (("timeout_s", timeout_s), ("interval_s", interval_s)):
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"LivenessMonitor: {name} must be a finite number of seconds > 0, got {value!r}")
        self.group = group
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s)
        self._pings: dict[int, ray.ObjectRef] = {}
        self._busy_since: dict[int, float] = {}
        """rank -> since when its oldest unfinished call has been running (absent: idle)."""
        self._finished: set[ray.ObjectRef] = set()
        """Calls seen finished (and checked) at the last look."""
        self._running: dict[ray.ObjectRef, int] = {}
        """Calls (and pings) unfinished at the last look -> rank."""
        self._next_check = 0.0

    def start(self) -> "LivenessMonitor":
        if self.check not in DRIVER_CHECKS:
            DRIVER_CHECKS.append(self.check)
        return self

    def close(self) -> None:
        """Stop watching (before the group is shut down on purpose); idempotent."""
        while self.check in DRIVER_CHECKS:
            DRIVER_CHECKS.remove(self.check)

    def check(self) -> None:
        """Look at the group now if ``interval_s`` passed since the last look; raise ``WorkerLostError`` for a
        rank that is lost (the monitor closes itself first: the error is reported once)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.interval_s
        if not self.group.is_running:  # shut down on purpose
            self.close()
            return
        try:
            self._look(now)
        except WorkerLostError:
            self.close()
            raise

    def _look(self, now: float) -> None:
        calls = self.group.calls_in_flight()
        calls.update({ref: (rank, None) for rank, ref in self._pings.items()})
        refs = list(calls)
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) if refs else set()
        for ref in refs:
            if ref in ready and ref not in self._finished:
                self._raise_if_died(ref, *calls[ref])
        self._finished = ready
        self._pings = {rank: ref for rank, ref in self._pings.items() if ref not in ready}
        unfinished = {ref: calls[ref] for ref in refs if ref not in ready}
        # a call running at the last look that is done now (or was collected since, so no longer listed) is progress
        progressed = {rank for ref, rank in self._running.items() if ref not in unfinished}
        self._running = {ref: rank for ref, (rank, _) in unfinished.items()}
        for rank in range(self.group.world_size):
            methods = [method for call_rank, method in unfinished.values() if call_rank == rank]
            if not methods:  # idle: ask it to answer, and time that like any call
                self._pings[rank] = ping = self.group.ping(rank)
                self._running[ping] = rank
                self._busy_since[rank] = now
            elif rank in progressed or rank not in self._busy_since:
                self._busy_since[rank] = now
            elif now - self._busy_since[rank] > self.timeout_s:
                method = next((name for name in methods if name is not None), None)
                raise self._lost(rank, method, reason=(
                    f"stopped answering: no call finished for {now - self._busy_since[rank]:.0f} s, past the timeout "
                    f"of {self.timeout_s:g} s (a frozen process, a deadlock or a hung collective)"),
                    detail="no call of this rank finished within the timeout")

    def _raise_if_died(self, ref: ray.ObjectRef, rank: int, method: str | None) -> None:
        try:
            ray.get(ref, timeout=0)  # an info tuple or a ping's answer: small
        except ray.exceptions.ActorUnavailableError:
            return  # reachable again soon, or reported dead later
        except ray.exceptions.RayActorError as error:
            raise self._lost(rank, method, reason=DIED,
                             detail=f"the worker process died or is unreachable: {error}") from None
        except ray.exceptions.RayError:
            return  # the method raised: its future reports it

    def _lost(self, rank: int, method: str | None, *, reason: str, detail: str) -> WorkerLostError:
        pids, nodes = self.group.pids, self.group.nodes
        return WorkerLostError(role=self.group.role, rank=rank, method=method, reason=reason,
                               pid=pids[rank] if rank < len(pids) else None,
                               host=host_of(nodes[rank]) if rank < len(nodes) else None, remote_traceback=detail)
