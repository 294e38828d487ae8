"""WorkerGroup: the driver's handle on one role running on every slot of a pool."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hybridflow.controller.errors import WorkerError, WorkerLostError, WorkerTimeoutError
from hybridflow.controller.future import (WATCHDOG_INTERVAL_S, Future, FutureValue, fetch_one, gather, output_pad,
                                         resolve_pad, wait_all)
from hybridflow.controller.host import (RoleSpec, WorkerHost, build_roles, driver_thread_limit, run_method,
                                       threads_per_worker)
from hybridflow.controller.local import call_deadline, init_local_process_group
from hybridflow.controller.protocols import Dispatch, GroupMesh, Protocol, get_protocol
from hybridflow.controller.register import Registration, registered_methods
from hybridflow.controller.resource_pool import ResourcePool
from hybridflow.controller.worker import Worker, WorkerContext, remove_process_role
from hybridflow.parallel.layout import ParallelLayout
from hybridflow.protocol import DataProto

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
DEFAULT_CALL_TIMEOUT_S = 3600.0
"""How long the driver waits for one worker call (or the group's start) before a WorkerTimeoutError."""


class _NodeShares:
    """The driver's count of its worker processes per node, and each one's share of that node's cores.

    A worker's torch threads follow the cores it owns: a node's cores divided among every worker process
    the driver has on it, of all pools (four single-process pools on a 2-core machine get one thread
    each; OpenMP threads beyond the cores spin at every barrier while their peers are descheduled). When
    a group starts or stops, the other processes on its nodes are told their new share.
    """

    def __init__(self) -> None:
        self.groups: list["_Hosts"] = []

    def add(self, hosts: "_Hosts") -> None:
        self.groups.append(hosts)
        self._rebalance(set(hosts.nodes))

    def remove(self, hosts: "_Hosts") -> None:
        if hosts in self.groups:
            self.groups.remove(hosts)
            self._rebalance(set(hosts.nodes))

    def processes_on(self, node: str) -> list:
        return [actor for hosts in self.groups for actor, where in zip(hosts.actors, hosts.nodes) if where == node]

    def _rebalance(self, nodes: set[str]) -> None:
        """Send each process on ``nodes`` its share. Not awaited: a Ray actor runs one caller's calls in
        order, so the share is in force before the driver's next call to it, and a process busy in a long
        call (or hung) does not hold up the group being built."""
        if not ray.is_initialized():  # Ray already shut down: no process left to tell
            return
        limit = driver_thread_limit()
        for node in nodes:
            actors = self.processes_on(node)
            for actor in actors:
                actor.set_num_threads.remote(threads_per_worker(len(actors), limit=limit))


_NODE_SHARES = _NodeShares()


class _Hosts:
    """The processes of one pool that host one or several (colocated) roles."""

    def __init__(self, pool: ResourcePool, roles: dict[str, RoleSpec], *, dist_timeout_s: float,
                 timeout_s: float | None, watchdog_s: float | None = WATCHDOG_INTERVAL_S) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.watchdog_s = watchdog_s
        self.roles = roles
        self.actors: list = []
        self.nodes: list[str] = []  # the Ray node of each actor
        self.local_roles: dict[str, Any] = {}
        pool.claim_processes()
        self._claimed = True
        with _shut_down_on_error(self):  # a rank failed to start: free the slots, kill the ranks that started
            if pool.is_local:
                init_local_process_group()
                context = WorkerContext(rank=0, world_size=1, local_rank=0, node_id="local")
                self.local_roles = build_roles(context, roles)
                self.pids = [os.getpid()]
            else:
                self.pids = self._spawn(dist_timeout_s)

    @property
    def world_size(self) -> int:
        return self.pool.world_size

    @property
    def label(self) -> str:
        return "+".join(self.roles)

    def _spawn(self, dist_timeout_s: float) -> list[int]:
        pool = self.pool
        share = 1.0 / pool.max_processes_per_slot
        actor_cls = ray.remote(WorkerHost)
        thread_limit = driver_thread_limit()
        for rank, (bundle, local_rank) in enumerate(pool.slots()):
            options = dict(
                num_cpus=share, num_gpus=share if pool.use_gpu else 0, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pool.placement_group, placement_group_bundle_index=bundle),
                runtime_env={"env_vars": {**WORKER_ENV, **{k: v for k, v in os.environ.items()
                                                           if k == "HYBRIDFLOW_BACKEND"}}},
            )
            self.actors.append(actor_cls.options(**options).remote(
                rank=rank, world_size=pool.world_size, local_rank=local_rank,
                local_world_size=pool.devices_per_node[bundle], thread_limit=thread_limit))
        master_addr, master_port = gather({0: self.actors[0].address.remote()}, role=self.label, method="address",
                                          timeout_s=self.timeout_s, count=False, watchdog_s=self.watchdog_s)[0]
        setups = {rank: actor.setup.remote(master_addr=master_addr, master_port=master_port,
                                           dist_timeout_s=dist_timeout_s, roles=self.roles)
                  for rank, actor in enumerate(self.actors)}
        pids = gather(setups, role=self.label, method="setup", timeout_s=self.timeout_s, count=False,
                      watchdog_s=self.watchdog_s)
        nodes = gather({rank: actor.node_id.remote() for rank, actor in enumerate(self.actors)}, role=self.label,
                       method="node_id", timeout_s=self.timeout_s, count=False, watchdog_s=self.watchdog_s)
        self.nodes = [nodes[rank] for rank in range(len(self.actors))]
        _NODE_SHARES.add(self)
        return [pids[rank] for rank in range(len(self.actors))]

    def shutdown(self) -> None:
        """Kill the processes (or forget the in-driver roles) and free the pool's slots; idempotent."""
        if not self._claimed:
            return
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        _NODE_SHARES.remove(self)
        for role, worker in self.local_roles.items():
            remove_process_role(role, worker)
        self.actors = []
        self.local_roles = {}
        self._claimed = False
        self.pool.release_processes()


class _BoundMethod:
    """A registered worker method as the driver sees it: call it, or ``.future(...)`` it."""

    def __init__(self, group: "WorkerGroup", name: str, registration: Registration) -> None:
        self._group = group
        self.__name__ = name
        self.registration = registration

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        future = self._group._submit(self.__name__, self.registration, args, kwargs)
        return future.get() if self.registration.blocking else future

    def future(self, *args: Any, **kwargs: Any) -> Future:
        """Run without waiting, whatever the registration says; returns a Future."""
        return self._group._submit(self.__name__, self.registration, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self._group.role}.{self.__name__} protocol={self.registration.protocol}>"


class WorkerGroup:
    """``WorkerGroup(pool, WorkerCls, *args, **kwargs)``: one ``WorkerCls(*args, **kwargs)`` per slot.

    Every method of ``WorkerCls`` decorated with ``@register`` becomes a method of the group with the
    same name: it distributes the arguments by the method's transfer protocol, calls all ranks and
    collects (or returns a ``Future`` for ``blocking=False``). ``name`` names the role in errors;
    ``timeout_s`` bounds every wait of the driver on this group (None: wait forever);
    ``watchdog_s``: while waiting, log the ranks (and pids) not done yet every so many seconds (None: never);
    ``dist_timeout_s`` is the torch.distributed timeout inside the group (a hung collective fails).
    """

    def __init__(self, pool: ResourcePool, worker_cls: type, *args: Any, name: str | None = None,
                 timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S, dist_timeout_s: float = 600.0,
                 watchdog_s: float | None = WATCHDOG_INTERVAL_S, **kwargs: Any) -> None:
        role = name or getattr(worker_cls, "__name__", repr(worker_cls))
        _check_worker_class(role, worker_cls)
        _check_timeouts(timeout_s, dist_timeout_s, watchdog_s)
        hosts = _Hosts(pool, {role: (worker_cls, args, kwargs)}, dist_timeout_s=dist_timeout_s, timeout_s=timeout_s,
                       watchdog_s=watchdog_s)
        with _shut_down_on_error(hosts):
            self._attach(hosts, role, worker_cls)

    @classmethod
    def colocate(cls, pool: ResourcePool, roles: dict[str, tuple], *, timeout_s: float | None = DEFAULT_CALL_TIMEOUT_S,
                 dist_timeout_s: float = 600.0,
                 watchdog_s: float | None = WATCHDOG_INTERVAL_S) -> dict[str, "WorkerGroup"]:
        """Several roles in one process per slot: ``{"actor": (ActorCls, args, kwargs), ...}`` -> group views.

        Each role is still its own object of its own class with its own registered methods; the
        roles of one process can reach each other with ``Worker.colocated_role(name)``.
        """
        if not isinstance(roles, dict) or not roles:
            raise ValueError(f"roles must be a non-empty dict of role name -> (WorkerCls, args, kwargs), got {roles!r}")
        specs: dict[str, RoleSpec] = {}
        for role, spec in roles.items():
            spec = spec if isinstance(spec, tuple) else (spec,)
            if not 1 <= len(spec) <= 3 or not isinstance(spec[0], type):
                raise ValueError(f"role {role!r}: expected (WorkerCls,), (WorkerCls, args) or "
                                 f"(WorkerCls, args, kwargs), got {spec!r}")
            _check_worker_class(role, spec[0])
            specs[role] = (spec[0], tuple(spec[1]) if len(spec) > 1 else (), dict(spec[2]) if len(spec) > 2 else {})
        _check_timeouts(timeout_s, dist_timeout_s, watchdog_s)
        hosts = _Hosts(pool, specs, dist_timeout_s=dist_timeout_s, timeout_s=timeout_s, watchdog_s=watchdog_s)
        views = {}
        with _shut_down_on_error(hosts):
            for role, (worker_cls, _, _) in specs.items():
                view = cls.__new__(cls)
                view._attach(hosts, role, worker_cls)
                views[role] = view
        return views

    def _attach(self, hosts: _Hosts, role: str, worker_cls: type) -> None:
        self._hosts = hosts
        self.role = role
        self.worker_cls = worker_cls
        self._methods = registered_methods(worker_cls)
        for method, registration in self._methods.items():
            setattr(self, method, _BoundMethod(self, method, registration))
        # info reference -> (rank, method), of calls not yet seen done
        self._pending_infos: dict[ray.ObjectRef, tuple[int, str]] = {}
        self._mesh_stale = False
        self._mesh_versions = [0] * hosts.world_size
        self._mesh = GroupMesh(layout=ParallelLayout(dp_size=hosts.world_size))
        self._mesh = self._query_mesh()

    # ------------------------------------------------------------ public

    @property
    def world_size(self) -> int:
        return self._hosts.world_size

    @property
    def pool(self) -> ResourcePool:
        return self._hosts.pool

    @property
    def is_local(self) -> bool:
        return self._hosts.pool.is_local

    @property
    def pids(self) -> list[int]:
        """Process id of every rank (colocated roles report the same ids)."""
        return list(self._hosts.pids)

    @property
    def nodes(self) -> list[str]:
        """The Ray node id of every rank's process (empty in single-process mode)."""
        return list(self._hosts.nodes)

    @property
    def is_running(self) -> bool:
        """False once the group (or a role colocated with it) was shut down."""
        return self._hosts._claimed

    @property
    def process_roles(self) -> tuple[str, ...]:
        """Every role this group's processes host: its own and those colocated with it."""
        return tuple(self._hosts.roles)

    @property
    def hosts_one_role(self) -> bool:
        """Whether this role's processes host no other role (every call they run is this group's)."""
        return len(self._hosts.roles) == 1

    def calls_in_flight(self) -> dict[ray.ObjectRef, tuple[int, str]]:
        """The calls submitted and not yet collected: each one's small info reference -> (rank, method). A
        reference that is ready belongs to a finished call (or one whose process died)."""
        return dict(self._pending_infos)

    def ping(self, rank: int) -> ray.ObjectRef:
        """A no-op call to ``rank``'s process, queued behind its calls: ready once the process answers it."""
        return self._hosts.actors[rank].node_id.remote()

    @property
    def mesh(self) -> GroupMesh:
        """The layout the workers declared (refreshed after calls that may have changed it)."""
        return self._refresh_mesh()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a registered method by name."""
        return getattr(self, self._check_method(method))(*args, **kwargs)

    def shutdown(self) -> None:
        """Kill this group's processes (and those of the roles colocated with it)."""
        self._hosts.shutdown()

    def __repr__(self) -> str:
        return f"WorkerGroup({self.role}, world_size={self.world_size}, pool={self.pool.name!r})"

    # ------------------------------------------------------------ dispatch

    def _check_method(self, method: str) -> str:
        if method not in self._methods:
            raise ValueError(f"{self.worker_cls.__name__}.{method} is not a method registered with @register; "
                             f"registered: {sorted(self._methods)}")
        return method

    def _submit(self, method: str, registration: Registration, args: tuple, kwargs: dict) -> Future:
        protocol = get_protocol(registration.protocol)
        mesh = self._refresh_mesh() if protocol.uses_mesh else self._mesh
        dispatch = protocol.distribute(mesh, args, kwargs)
        if not isinstance(dispatch, Dispatch) or len(dispatch.calls) != self.world_size:
            raise ValueError(f"protocol {protocol.name!r} must return a Dispatch with {self.world_size} calls, "
                             f"got {dispatch!r}")
        if self.is_local:
            return self._run_local(method, protocol, mesh, dispatch)
        refs, infos = {}, {}
        shared = _shared_batches(dispatch.calls)
        for rank, call in enumerate(dispatch.calls):
            if call is None:
                continue
            call_args, call_kwargs = _use_shared(call, shared)
            refs[rank], infos[rank] = self._hosts.actors[rank].execute.remote(self.role, method, call_args, call_kwargs)
        self._pending_infos.update({ref: (rank, method) for rank, ref in infos.items()})
        value = FutureValue(refs=refs, infos=infos, mesh=mesh, protocol=protocol, in_pad=dispatch.pad)
        return Future(value=value, role=self.role, method=method, timeout_s=self._hosts.timeout_s,
                      on_infos=lambda fetched: self._note_versions(infos, fetched),
                      watchdog_s=self._hosts.watchdog_s, pids=self._hosts.pids, nodes=self._hosts.nodes,
                      on_lost=self.died_in)

    def _run_local(self, method: str, protocol: Protocol, mesh: GroupMesh, dispatch: Dispatch) -> Future:
        call_args, call_kwargs = dispatch.calls[0]
        worker = self._hosts.local_roles[self.role]
        with call_deadline(self._hosts.timeout_s, role=self.role, method=method):  # as a remote call's timeout
            output, info = run_method(worker, role=self.role, rank=0, method=method, args=call_args,
                                      kwargs=call_kwargs)
        if info[2] != self._mesh_versions[0]:
            self._mesh = self._query_mesh()
        pad = resolve_pad(dispatch.pad)
        if protocol.concatenates:
            pad = output_pad(pad, [info])
        value = protocol.collect(mesh, [output], pad)
        return Future(value=None, role=self.role, method=method, timeout_s=None, local_result=value)

    # ------------------------------------------------------------ mesh cache

    def _note_versions(self, refs: dict[int, ray.ObjectRef], infos: dict[int, tuple]) -> None:
        """A finished call's layout versions: mark the mesh stale if a worker declared a new layout, and re-read it
        at once while no other call is queued (later, the query would queue behind whatever runs then)."""
        for rank, info in infos.items():
            self._pending_infos.pop(refs[rank], None)
            self._mesh_stale |= info[2] != self._mesh_versions[rank]
        self._forget_finished()
        if self._mesh_stale and not self._pending_infos:
            self._mesh = self._query_mesh()

    def _refresh_mesh(self) -> GroupMesh:
        """Re-read the workers' layouts if a call changed one. Only calls of methods registered with
        ``declares_layout`` are waited for; the others cannot change it (``run_method`` refuses one that does), so a
        layout-driven call is submitted while they run, and those already finished are forgotten here."""
        declaring = [ref for ref, (_, method) in self._pending_infos.items() if self._methods[method].declares_layout]
        if declaring:
            not_ready = wait_all(declaring, self._hosts.timeout_s)
            if not_ready:
                ranks = sorted({self._pending_infos[ref][0] for ref in not_ready})
                raise WorkerTimeoutError(role=self.role, method="(earlier call)", timeout_s=self._hosts.timeout_s,
                                         pending_ranks=ranks, pids=[self._hosts.pids[rank] for rank in ranks])
            try:
                infos = ray.get(declaring)
            except ray.exceptions.RayError:
                self._raise_if_lost(declaring)  # a call whose process died is reported as itself
                infos = []  # a call that raised: its own future reports it; re-read the layout to be safe
                self._mesh_stale = True
            for ref, info in zip(declaring, infos):
                self._mesh_stale |= info[2] != self._mesh_versions[self._pending_infos[ref][0]]
            for ref in declaring:
                del self._pending_infos[ref]
        self._forget_finished()
        if self._mesh_stale:
            self._mesh = self._query_mesh()
        return self._mesh

    def _forget_finished(self) -> None:
        """Drop the finished calls from ``_pending_infos`` (a future never collected would keep its entry for
        ever); one that failed stays, for its own future and the liveness monitor to report."""
        if not self._pending_infos:
            return
        pending = list(self._pending_infos)
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                continue
            del self._pending_infos[ref]

    def died_in(self, error: WorkerLostError) -> WorkerLostError:
        """``error`` (a call of this group whose process died) naming the call that process died in: a rank runs its
        calls in order, so that is the rank's oldest call not finished (the failed call, or one submitted before it
        and not collected yet: a weight sync under the poll queued behind it, say)."""
        for ref, (rank, method) in self._pending_infos.items():  # in the order they were submitted
            if rank == error.rank and not _finished(ref):
                return error if method == error.method else error.during(method)
        return error

    def _raise_if_lost(self, refs: list[ray.ObjectRef]) -> None:
        """The ``WorkerLostError`` of the first of these finished calls whose process died, naming that call."""
        for ref in refs:
            rank, method = self._pending_infos[ref]
            try:
                fetch_one(ref, role=self.role, rank=rank, method=method, pid=self._hosts.pids[rank],
                          node=self._hosts.nodes[rank] if rank < len(self._hosts.nodes) else None)
            except WorkerLostError:
                raise
            except WorkerError:
                continue

    def _query_mesh(self) -> GroupMesh:
        if self.is_local:
            states = [self._hosts.local_roles[self.role].layout_state()]
        else:
            refs = {rank: actor.layout_state.remote(self.role) for rank, actor in enumerate(self._hosts.actors)}
            by_rank = gather(refs, role=self.role, method="layout_state", timeout_s=self._hosts.timeout_s, count=False,
                             watchdog_s=self._hosts.watchdog_s, pids=self._hosts.pids, nodes=self._hosts.nodes)
            states = [by_rank[rank] for rank in range(self.world_size)]
        layout, generation, _ = states[0]
        for rank, (other_layout, other_generation, _) in enumerate(states):
            if (other_layout, other_generation) != (layout, generation):
                raise ValueError(f"{self.role}: rank {rank} declared layout {other_layout} / {other_generation}, "
                                 f"rank 0 declared {layout} / {generation}; every rank must declare the same")
        self._mesh_versions = [state[2] for state in states]
        self._mesh_stale = False
        return GroupMesh(layout=layout, generation=generation)


def _finished(ref: ray.ObjectRef) -> bool:
    """Whether the call behind info reference ``ref`` has run to its end (returned or raised), not lost with its
    process (or still running)."""
    if not ray.wait([ref], timeout=0)[0]:
        return False
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return False
    except ray.exceptions.RayError:
        return True
    return True


@contextlib.contextmanager
def _shut_down_on_error(hosts: _Hosts) -> Iterator[None]:
    """Shut ``hosts`` down if the block fails: a group that never came to be must not hold processes or slots."""
    try:
        yield
    except BaseException:
        hosts.shutdown()
        raise


def _check_worker_class(role: str, worker_cls: Any) -> None:
    """Before any process starts: the role is a Worker subclass whose methods do not shadow the group's."""
    if not isinstance(worker_cls, type) or not issubclass(worker_cls, Worker):
        raise ValueError(f"role {role!r}: the worker class must be a subclass of hybridflow.controller.Worker, "
                         f"got {worker_cls!r}")
    for method in registered_methods(worker_cls):
        if hasattr(WorkerGroup, method):
            raise ValueError(f"{worker_cls.__name__}.{method} clashes with WorkerGroup.{method}; rename the method")


def _check_timeouts(timeout_s: float | None, dist_timeout_s: float, watchdog_s: float | None = None) -> None:
    if timeout_s is not None and (not isinstance(timeout_s, (int, float)) or timeout_s <= 0):
        raise ValueError(f"timeout_s must be a positive number of seconds or None (wait forever), got {timeout_s!r}")
    if watchdog_s is not None and (not isinstance(watchdog_s, (int, float)) or watchdog_s <= 0):
        raise ValueError(f"watchdog_s must be a positive number of seconds or None (no reports), got {watchdog_s!r}")
    if not isinstance(dist_timeout_s, (int, float)) or dist_timeout_s <= 0:
        raise ValueError(f"dist_timeout_s must be a positive number of seconds, got {dist_timeout_s!r}")


def _shared_batches(calls: list) -> dict[int, ray.ObjectRef]:
    """Put each DataProto argument that several ranks receive in the object store once.

    Ranks of one tensor- or pipeline-parallel group get the same chunk object; sending it inline
    would serialize it once per rank. The worker host resolves these references before the method
    runs. A chunk only one rank receives travels inline with the call (cheaper for small batches).
    """
    receivers: dict[int, list] = {}
    for call in calls:
        if call is not None:
            for value in list(call[0]) + list(call[1].values()):
                if isinstance(value, DataProto):
                    receivers.setdefault(id(value), [value, 0])[1] += 1
    return {key: ray.put(value) for key, (value, count) in receivers.items() if count > 1}


def _use_shared(call: tuple, shared: dict[int, ray.ObjectRef]) -> tuple[tuple, dict]:
    args, kwargs = call
    return tuple(shared.get(id(a), a) for a in args), {k: shared.get(id(v), v) for k, v in kwargs.items()}
