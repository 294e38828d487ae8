"""Futures of worker-group calls, the lazy arguments that let workers fetch them, and driver fetch accounting.

A non-blocking call returns a ``Future``: the per-rank Ray object references of its outputs plus how
to collect them. ``Future.get()`` materializes the collected value on the driver. Passed to another
group's method, a future is not materialized: the destination protocol turns it into lazy
arguments (``RowSlice``, ``WholeValue``) that each destination rank resolves itself, fetching only
the source outputs holding its rows straight from the object store.

Every source output comes with a small info tuple ``(out_rows, in_rows, layout_version)`` (a second
Ray return value), so a destination rank learns the row counts of the source chunks without
fetching them and the padding added by the source split is removed exactly, even when a method
returns a fixed multiple of its input rows (n samples per prompt).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import ray
import torch

from hybridflow.controller.batch import concat_rows, slice_rows
from hybridflow.controller.errors import DIED, WorkerError, WorkerLostError, WorkerTimeoutError

if TYPE_CHECKING:
    from hybridflow.controller.protocols import GroupMesh, Protocol

OutputInfo = tuple  # (out_rows: int | None, in_rows: int | None, layout_version: int)
FAIL_FAST_POLL_S = 0.5
WATCHDOG_INTERVAL_S = 120.0
"""How often a driver waiting on a worker call logs which ranks it still waits for."""
logger = logging.getLogger("hybridflow.controller")
DRIVER_ACTIVITY: contextvars.ContextVar = contextvars.ContextVar("hybridflow_driver_activity", default=None)
"""A callable returning what the driver is doing (a trainer's current phase, or None): the watchdog names it."""
_DRIVER_CHECKS: contextvars.ContextVar = contextvars.ContextVar("hybridflow_driver_checks", default=())
"""The checks the driver runs at every poll while it waits on any worker call (``watching``): a ``LivenessMonitor``
raises from its check when a process it watches is lost, so the driver learns it within seconds whatever call it
waits on."""


@contextlib.contextmanager
def watching(check: Callable[..., None]) -> Iterator[None]:
    """Within this block, every wait of the driver on a worker call runs ``check()`` at each poll (and
    ``check(force=True)`` before it reports a call that failed, so a lost process is named as the cause)."""
    token = _DRIVER_CHECKS.set((*_DRIVER_CHECKS.get(), check))
    try:
        yield
    finally:
        _DRIVER_CHECKS.reset(token)


def run_driver_checks(*, force: bool = False) -> None:
    """Run the checks of the ``watching`` blocks the driver is in (``force``: whatever their own interval)."""
    for check in _DRIVER_CHECKS.get():
        check(force=force)


# ---------------------------------------------------------------- driver fetch accounting

@dataclass
class DriverFetchStats:
    """What the driver process has materialized from worker outputs since the last reset."""

    objects: int = 0
    """Worker outputs fetched into the driver."""
    bytes: int = 0
    """Payload bytes of those outputs (tensor storage and DataProto.nbytes; other objects count 0)."""


_stats = DriverFetchStats()
_lazy_stats = DriverFetchStats()
_stats_lock = threading.Lock()


def driver_fetch_stats() -> DriverFetchStats:
    """A snapshot of the driver's fetch counters."""
    with _stats_lock:
        return DriverFetchStats(objects=_stats.objects, bytes=_stats.bytes)


def reset_driver_fetch_stats() -> None:
    with _stats_lock:
        _stats.objects = 0
        _stats.bytes = 0


def lazy_fetch_stats() -> DriverFetchStats:
    """What this process fetched to resolve future arguments (on a worker: the sources it read)."""
    with _stats_lock:
        return DriverFetchStats(objects=_lazy_stats.objects, bytes=_lazy_stats.bytes)


def payload_nbytes(value: Any) -> int:
    """Bytes of tensor data in ``value`` (recursing into lists, tuples and dicts)."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(item) for item in value)
    if isinstance(value, dict):
        return sum(payload_nbytes(item) for item in value.values())
    return 0


def _count_fetched(values: list[Any], stats: DriverFetchStats = _stats) -> None:
    with _stats_lock:
        stats.objects += len(values)
        stats.bytes += sum(payload_nbytes(value) for value in values)


# ---------------------------------------------------------------- fetching with rank-level errors

def gather(refs: dict[int, ray.ObjectRef], *, role: str, method: str, timeout_s: float | None,
           count: bool, watchdog_s: float | None = WATCHDOG_INTERVAL_S, pids: list[int] | None = None,
           nodes: list[str] | None = None) -> dict[int, Any]:
    """``ray.get`` of per-rank refs that fails fast with the first failing rank and honours a deadline.

    Every ``watchdog_s`` seconds of waiting, a warning names the role, method, the ranks (and
    pids) not yet done and how long the driver has waited, so a frozen worker never goes unnoticed.
    Every poll runs the driver's checks (``watching``: a lost process of another group is raised from there).
    ``pids`` and ``nodes`` (Ray node ids), per rank, name a dead rank's process.
    """
    rank_of = {ref: rank for rank, ref in refs.items()}
    values: dict[int, Any] = {}

    def fetch(ready: list[ray.ObjectRef]) -> None:
        for ref in ready:
            rank = rank_of[ref]
            try:
                values[rank] = fetch_one(ref, role=role, rank=rank, method=method, pid=_item(pids, rank),
                                         node=_item(nodes, rank))
            except WorkerLostError:
                raise
            except WorkerError as error:  # it may have failed because a process it needed died: name that one
                _raise_lost_cause(error)
                raise

    def report(pending: list[ray.ObjectRef], waited_s: float, left_s: float | None) -> None:
        describe = DRIVER_ACTIVITY.get()
        activity = describe() if describe is not None else None
        logger.warning("%s.%s: still waiting for %s after %.0f s (%s)%s", role, method,
                       _describe_ranks(sorted(rank_of[ref] for ref in pending), pids), waited_s,
                       "no timeout" if left_s is None else f"timeout in {left_s:.0f} s",
                       f"; the driver is at: {activity}" if activity else "")

    pending = wait_all(list(refs.values()), timeout_s, on_ready=fetch, watchdog_s=watchdog_s, on_watchdog=report)
    if pending:
        pending_ranks = sorted(rank_of[ref] for ref in pending)
        raise WorkerTimeoutError(role=role, method=method, timeout_s=timeout_s, pending_ranks=pending_ranks,
                                 pids=_pids_of(pending_ranks, pids))
    if count:
        _count_fetched(list(values.values()))
    return values


def wait_all(refs: list[ray.ObjectRef], timeout_s: float | None, *,
             on_ready: Callable[[list[ray.ObjectRef]], None] = lambda ready: None, watchdog_s: float | None = None,
             on_watchdog: Callable[[list[ray.ObjectRef], float, float | None], None] | None = None,
             ) -> list[ray.ObjectRef]:
    """Wait until every reference is ready or ``timeout_s`` passed; returns the references not ready.

    The driver's one poll loop: it looks at what finished every ``FAIL_FAST_POLL_S`` (``on_ready(ready)``, so a
    caller reports a failed rank at once even when its peers now hang in a collective waiting for it), runs the
    driver's checks (``watching``) and every ``watchdog_s`` calls ``on_watchdog(pending, waited_s, left_s)``.
    Fetches nothing itself: a failed call is left to whoever collects it."""
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    next_report = None if watchdog_s is None or on_watchdog is None else start + watchdog_s
    pending = list(refs)
    while pending:
        poll = min([FAIL_FAST_POLL_S] + [moment - time.monotonic() for moment in (deadline, next_report)
                                         if moment is not None])
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=max(poll, 0.0))
        on_ready(ready)
        if not pending:
            break
        run_driver_checks()
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            break
        if next_report is not None and now >= next_report:
            on_watchdog(pending, now - start, None if deadline is None else deadline - now)
            next_report += watchdog_s
    return pending


LOST_CAUSE_GRACE_S = 5.0
"""How long a call that failed reaching a dead process waits for the driver's checks to name that process."""


def _raise_lost_cause(error: WorkerError) -> None:
    """Raise the ``WorkerLostError`` of a watched process that died, when ``error`` may be its consequence: a worker
    that could not fetch an argument from it (the weights of a sync, a batch passed as a future) fails with Ray's
    actor error in its traceback; the driver may learn of the death a moment later than that worker did."""
    if not _DRIVER_CHECKS.get():
        return
    consequence = any(name in error.remote_traceback for name in ("RayActorError", "ActorDiedError",
                                                                 "ActorUnavailableError", "OwnerDiedError"))
    deadline = time.monotonic() + (LOST_CAUSE_GRACE_S if consequence else 0.0)
    while True:
        run_driver_checks(force=True)
        if time.monotonic() >= deadline:
            return
        time.sleep(FAIL_FAST_POLL_S / 5)


def _item(values: list | None, index: int) -> Any:
    return values[index] if values is not None and index < len(values) else None


def _pids_of(ranks: list[int], pids: list[int] | None) -> list[int] | None:
    return None if pids is None else [pids[rank] for rank in ranks if rank < len(pids)]


def _describe_ranks(ranks: list[int], pids: list[int] | None) -> str:
    if pids is None:
        return f"rank(s) {ranks}"
    return ", ".join(f"rank {rank} (pid {pids[rank]})" if rank < len(pids) else f"rank {rank}" for rank in ranks)


def fetch_one(ref: ray.ObjectRef, *, role: str, rank: int, method: str, pid: int | None = None,
              node: str | None = None) -> Any:
    """``ray.get`` that turns Ray's task and actor failures into a ``WorkerError`` naming the rank (a
    ``WorkerLostError`` naming its process, ``pid`` on the host of Ray node ``node``, when the process died)."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as error:
        cause = getattr(error, "cause", None)
        if isinstance(cause, WorkerError):
            raise cause from None
        raise WorkerError(role=role, rank=rank, method=method, remote_traceback=str(error)) from None
    except ray.exceptions.RayActorError as error:
        raise WorkerLostError(role=role, rank=rank, method=method, reason=DIED, pid=pid, host=host_of(node),
                              remote_traceback=f"the worker process died or is unreachable: {error}") from None


def host_of(node: str | None) -> str | None:
    """The host name of Ray node ``node`` (its address when Ray does not know the name; None when unknown)."""
    if node is None or not ray.is_initialized():
        return None
    try:
        found = next((entry for entry in ray.nodes() if entry.get("NodeID") == node), None)
    except Exception:  # the cluster's table is unreachable: the error is raised without the host
        return None
    return None if found is None else (found.get("NodeManagerHostname") or found.get("NodeManagerAddress"))


# ---------------------------------------------------------------- padding bookkeeping

def output_pad(in_pad: int, infos: list[OutputInfo]) -> int:
    """Pad rows in the concatenated outputs, given ``in_pad`` pad rows at the end of the split input.

    A method may return a fixed multiple k of its input rows (k samples per prompt, in input order);
    then the last ``k * in_pad`` output rows come from padding.
    """
    if in_pad == 0:
        return 0
    ratios = set()
    for out_rows, in_rows, _ in infos:
        if out_rows is None or not in_rows or out_rows % in_rows:
            raise ValueError(f"cannot drop {in_pad} padding rows: a rank returned {out_rows} rows for {in_rows} "
                             f"input rows; methods under split protocols must return k rows per input row "
                             f"in input order (or make the batch a multiple of the data-parallel size)")
        ratios.add(out_rows // in_rows)
    if len(ratios) != 1:
        raise ValueError(f"ranks returned different multiples {sorted(ratios)} of their input rows; "
                         f"the padding rows cannot be located")
    return in_pad * ratios.pop()


@dataclass(frozen=True)
class DerivedPad:
    """Pad rows of a split whose input is a future: known only once the source's row counts are."""

    source: "RowSource"
    """The future whose rows were split."""
    num_chunks: int
    """Into how many equal chunks they were split."""

    def resolve(self) -> int:
        counts, pad = self.source.row_layout()
        real_rows = sum(counts) - pad
        return -real_rows % self.num_chunks


def resolve_pad(pad: int | DerivedPad) -> int:
    return pad if isinstance(pad, int) else pad.resolve()


# ---------------------------------------------------------------- the value of a call, as references

@dataclass(frozen=True)
class FutureValue:
    """Everything needed to compute a call's collected value anywhere (driver or worker)."""

    refs: dict[int, ray.ObjectRef]
    """Output reference of every rank that ran the method."""
    infos: dict[int, ray.ObjectRef]
    """Info reference (out_rows, in_rows, layout_version) of every rank that ran the method."""
    mesh: "GroupMesh"
    protocol: "Protocol"
    in_pad: int | DerivedPad
    """Pad rows the distribute step appended to the split input."""

    def source_ranks(self) -> list[int]:
        if self.protocol.source_ranks is None:
            return sorted(self.refs)
        return self.protocol.source_ranks(self.mesh)

    def rows(self) -> "RowSource | None":
        """The row view of this value when the protocol concatenates rank outputs, else None."""
        if not self.protocol.concatenates:
            return None
        ranks = self.source_ranks()
        return RowSource(parts=[self.refs[r] for r in ranks], infos=[self.infos[r] for r in ranks],
                         in_pad=self.in_pad)

    def compute(self, outputs: dict[int, Any], infos: dict[int, OutputInfo] | None = None) -> Any:
        """Collect fetched ``outputs`` (rank -> value, the source ranks at least) into the call's value."""
        ranks = self.source_ranks()
        if self.protocol.concatenates:
            if infos is None:
                infos = dict(zip(ranks, ray.get([self.infos[r] for r in ranks])))
            pad = output_pad(resolve_pad(self.in_pad), [infos[r] for r in ranks])
        else:
            pad = resolve_pad(self.in_pad)
        by_rank = [outputs.get(rank) for rank in range(self.mesh.world_size)]
        return self.protocol.collect(self.mesh, by_rank, pad)


@dataclass(frozen=True)
class RowSource:
    """The rows of a concatenating future: its source ranks' outputs in order, the last ``pad`` rows padding."""

    parts: list[ray.ObjectRef]
    infos: list[ray.ObjectRef]
    in_pad: int | DerivedPad

    def row_layout(self) -> tuple[list[int], int]:
        """(rows of each part, padding rows at the end), from the small info objects only."""
        infos = ray.get(self.infos)
        counts = [info[0] for info in infos]
        if any(count is None for count in counts):
            raise ValueError("a future passed as a batch must come from a method returning DataProto, "
                             "tensors or lists")
        return counts, output_pad(resolve_pad(self.in_pad), infos)


# ---------------------------------------------------------------- lazy arguments resolved on workers

class LazyArgument:
    """An argument a worker resolves itself (Ray resolves only top-level references)."""

    def resolve(self) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class RowSlice(LazyArgument):
    """Chunk ``index`` of ``num_chunks`` of a future's rows, padded like ``DataProto.chunk`` would."""

    source: RowSource
    num_chunks: int
    index: int

    def row_ranges(self, counts: list[int], pad: int) -> list[tuple[int, int]]:
        """Source row ranges making up this chunk; rows past the source's end wrap to its first real rows."""
        total_rows = sum(counts)
        real_rows = total_rows - pad
        if real_rows <= 0:
            raise ValueError("cannot split an empty batch across ranks: the source future holds no real rows")
        chunk_rows = -(-real_rows // self.num_chunks)
        start, stop = self.index * chunk_rows, (self.index + 1) * chunk_rows
        ranges = []
        if start < total_rows:
            ranges.append((start, min(stop, total_rows)))
        position = max(start, total_rows)
        while position < stop:
            wrapped = (position - total_rows) % real_rows
            take = min(stop - position, real_rows - wrapped)
            ranges.append((wrapped, wrapped + take))
            position += take
        return ranges

    def resolve(self) -> Any:
        counts, pad = self.source.row_layout()
        offsets = [0]
        for count in counts:
            offsets.append(offsets[-1] + count)
        fetched: dict[int, Any] = {}
        pieces = []
        for start, stop in self.row_ranges(counts, pad):
            for part, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                if hi <= start or lo >= stop or lo == hi:
                    continue
                if part not in fetched:
                    fetched[part] = ray.get(self.source.parts[part])
                    _count_fetched([fetched[part]], _lazy_stats)
                pieces.append(slice_rows(fetched[part], max(start, lo) - lo, min(stop, hi) - lo))
        return pieces[0] if len(pieces) == 1 else concat_rows(pieces)


@dataclass(frozen=True)
class WholeValue(LazyArgument):
    """A future's whole collected value, computed on the worker that needs it."""

    value: FutureValue

    def resolve(self) -> Any:
        ranks = self.value.source_ranks()
        outputs = dict(zip(ranks, ray.get([self.value.refs[r] for r in ranks])))
        _count_fetched(list(outputs.values()), _lazy_stats)
        return self.value.compute(outputs)


def _resolve(value: Any) -> Any:
    if isinstance(value, LazyArgument):
        return value.resolve()
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    return value


def resolve_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replace top-level lazy arguments and object references by their values (runs on the worker)."""
    return tuple(_resolve(arg) for arg in args), {key: _resolve(value) for key, value in kwargs.items()}


# ---------------------------------------------------------------- the driver-side future

class Future:
    """The pending result of a non-blocking worker-group call."""

    def __init__(self, *, value: FutureValue | None, role: str, method: str, timeout_s: float | None,
                 local_result: Any = None, on_infos: Callable[[dict[int, OutputInfo]], None] | None = None,
                 watchdog_s: float | None = WATCHDOG_INTERVAL_S, pids: list[int] | None = None,
                 nodes: list[str] | None = None,
                 on_lost: Callable[[WorkerLostError], WorkerLostError] | None = None) -> None:
        """``on_infos(infos)``: runs once every rank's info is fetched; ``on_lost(error)``: the error to raise when a
        rank's process died (its group names the call that process died in, which may be an earlier one)."""
        self._value = value
        self._on_lost = on_lost
        self._nodes = nodes
        self._watchdog_s = watchdog_s
        self._pids = pids
        self._on_infos = on_infos
        self._role = role
        self._method = method
        self._timeout_s = timeout_s
        self._local_result = local_result

    @property
    def is_local(self) -> bool:
        """True for a call that already ran in the driver's process (single-process mode)."""
        return self._value is None

    @property
    def value_refs(self) -> FutureValue:
        assert self._value is not None, "a local future has no references"
        return self._value

    def done(self) -> bool:
        """Whether every rank has finished (successfully or not)."""
        if self._value is None:
            return True
        pending = list(self._value.infos.values())
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        return len(ready) == len(pending)

    def get(self, timeout_s: float | None = None, *, watchdog_s: float | None = None) -> Any:
        """Wait for every rank, fetch the outputs the protocol collects, and return the collected value.

        ``timeout_s`` and ``watchdog_s`` default to the group's."""
        if self._value is None:
            return self._local_result
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        watchdog_s = self._watchdog_s if watchdog_s is None else watchdog_s
        try:
            # wait on the tiny info objects of every rank first: a failing rank that the protocol does
            # not collect from must still surface as an error
            infos = gather(self._value.infos, role=self._role, method=self._method, timeout_s=timeout_s, count=False,
                           watchdog_s=watchdog_s, pids=self._pids, nodes=self._nodes)
            if self._on_infos is not None:
                self._on_infos(infos)
            ranks = self._value.source_ranks()
            outputs = gather({r: self._value.refs[r] for r in ranks}, role=self._role, method=self._method,
                             timeout_s=timeout_s, count=True, watchdog_s=watchdog_s, pids=self._pids,
                             nodes=self._nodes)
        except WorkerLostError as error:
            if self._on_lost is None or error.role != self._role:  # another group's process: named by it already
                raise
            raise self._on_lost(error) from None
        return self._value.compute(outputs, infos)

    def __repr__(self) -> str:
        return f"Future({self._role}.{self._method}, done={self.done()})"
