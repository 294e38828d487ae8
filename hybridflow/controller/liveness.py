"""LivenessMonitor: the driver notices within seconds that a worker process it watches was lost (killed, crashed) or
that its calls stopped finishing for longer than the timeout (a frozen process), whatever call the driver waits on."""

from __future__ import annotations

import time
from typing import Iterable

import ray

from hybridflow.controller.errors import DIED, WorkerLostError
from hybridflow.controller.future import host_of, watching
from hybridflow.controller.worker_group import WorkerGroup

LIVENESS_INTERVAL_S = 1.0
"""How often (at most) a monitor looks at its processes while the driver waits."""


class LivenessMonitor:
    """Watches every rank of one or more worker groups from the driver. Inside ``with monitor:`` every wait of the
    driver on any worker call runs ``check`` at each poll (``future.watching``); outside, nothing runs.

    A check (at most every ``interval_s``) looks at the groups' calls in flight without fetching them:
    - a call that failed because its process died raises ``WorkerLostError`` (role, rank, pid, host, the call);
    - a rank whose calls made no progress for ``timeout_s`` raises ``WorkerLostError`` ("stopped answering").
      A rank runs its calls in order, so its oldest unfinished call has been running since the previous call
      finished, or since the rank was seen busy after being idle: progress is a call of the rank finishing;
    - a rank with nothing to do gets a ping (a no-op call, queued like any other), so a process that dies while
      idle is noticed too, and one frozen while idle once its ping is older than ``timeout_s``.
    A call that raised in the worker is left to whoever collects its future. Groups colocated in the same processes
    are watched together, and every role those processes host must be given (the monitor sees the calls of the
    groups it is given only). After a report the monitor is spent: it reports once.
    """

    def __init__(self, groups: WorkerGroup | Iterable[WorkerGroup], *, timeout_s: float,
                 interval_s: float = LIVENESS_INTERVAL_S) -> None:
        groups = [groups] if isinstance(groups, WorkerGroup) else list(groups)
        if not groups:
            raise ValueError("LivenessMonitor: groups got none; allowed: one worker group or more")
        for name, value in (("timeout_s", timeout_s), ("interval_s", interval_s)):
            if not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"LivenessMonitor: {name} must be a finite number of seconds > 0, got {value!r}")
        by_processes: dict[tuple, list[WorkerGroup]] = {}
        for group in groups:
            if group.is_local:
                raise ValueError(f"LivenessMonitor: group {group.role!r} runs inside the driver's process "
                                 f"(single-process mode): there is no process of its own to watch")
            by_processes.setdefault(tuple(zip(group.nodes, group.pids)), []).append(group)
        self.processes = [_Processes(views, timeout_s=float(timeout_s)) for views in by_processes.values()]
        self.timeout_s = float(timeout_s)
        self.interval_s = float(interval_s)
        self.spent = False
        """True once it reported a lost process (or its groups were shut down): it checks nothing more."""
        self._next_check = 0.0
        self._watch = None

    def __enter__(self) -> "LivenessMonitor":
        assert self._watch is None, "a LivenessMonitor's block is not re-entrant"
        self._watch = watching(self.check)
        self._watch.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        watch, self._watch = self._watch, None
        watch.__exit__(*exc_info)

    def check(self, *, force: bool = False) -> None:
        """Look at the processes now if ``interval_s`` passed since the last look (or ``force``); raise
        ``WorkerLostError`` for a rank that is lost."""
        now = time.monotonic()
        if self.spent or (now < self._next_check and not force):
            return
        self._next_check = now + self.interval_s
        if not all(processes.running for processes in self.processes):  # shut down on purpose
            self.spent = True
            return
        try:
            for processes in self.processes:
                processes.look(now)
        except WorkerLostError:
            self.spent = True
            raise


class _Processes:
    """The processes behind one or more colocated worker groups (views), and what the monitor saw of them."""

    def __init__(self, views: list[WorkerGroup], *, timeout_s: float) -> None:
        given = [view.role for view in views]
        missing = [role for role in views[0].process_roles if role not in given]
        if missing:
            raise ValueError(f"LivenessMonitor: the processes of group {given[0]!r} also host {missing}, whose calls "
                             f"the monitor would not see; allowed: every group colocated in them")
        self.views = views
        self.timeout_s = timeout_s
        self.world_size = views[0].world_size
        self.label = "+".join(views[0].process_roles)
        self._pings: dict[int, ray.ObjectRef] = {}
        self._busy_since: dict[int, float] = {}
        """rank -> since when its oldest unfinished call has been running (absent: idle)."""
        self._finished: set[ray.ObjectRef] = set()
        """Calls seen finished (and checked) at the last look."""
        self._running: dict[ray.ObjectRef, int] = {}
        """Calls (and pings) unfinished at the last look -> rank."""

    @property
    def running(self) -> bool:
        return all(view.is_running for view in self.views)

    def look(self, now: float) -> None:
        calls = {ref: (view.role, rank, method) for view in self.views
                 for ref, (rank, method) in view.calls_in_flight().items()}
        calls.update({ref: (self.label, rank, None) for rank, ref in self._pings.items()})
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
        self._running = {ref: rank for ref, (_, rank, _) in unfinished.items()}
        for rank in range(self.world_size):
            rank_calls = [(role, method) for role, call_rank, method in unfinished.values() if call_rank == rank]
            if not rank_calls:  # idle: ask it to answer, and time that like any call
                self._pings[rank] = ping = self.views[0].ping(rank)
                self._running[ping] = rank
                self._busy_since[rank] = now
            elif rank in progressed or rank not in self._busy_since:
                self._busy_since[rank] = now
            elif now - self._busy_since[rank] > self.timeout_s:
                role, method = next(((role, method) for role, method in rank_calls if method is not None),
                                    (self.label, None))
                raise self._lost(role, rank, method, reason=(
                    f"stopped answering: no call finished for {now - self._busy_since[rank]:.0f} s, past the timeout "
                    f"of {self.timeout_s:g} s (a frozen process, a deadlock or a hung collective)"),
                    detail="no call of this rank finished within the timeout")

    def _raise_if_died(self, ref: ray.ObjectRef, role: str, rank: int, method: str | None) -> None:
        try:
            ray.get(ref, timeout=0)  # an info tuple or a ping's answer: small
        except ray.exceptions.ActorUnavailableError:
            return  # reachable again soon, or reported dead later
        except ray.exceptions.RayActorError as error:
            lost = self._lost(role, rank, method, reason=DIED,
                              detail=f"the worker process died or is unreachable: {error}")
            view = next((view for view in self.views if view.role == role), None)
            raise (view.died_in(lost) if view is not None else lost) from None
        except ray.exceptions.RayError:
            return  # the method raised: its future reports it

    def _lost(self, role: str, rank: int, method: str | None, *, reason: str, detail: str) -> WorkerLostError:
        pids, nodes = self.views[0].pids, self.views[0].nodes
        return WorkerLostError(role=role, rank=rank, method=method, reason=reason,
                               pid=pids[rank] if rank < len(pids) else None,
                               host=host_of(nodes[rank]) if rank < len(nodes) else None, remote_traceback=detail)
