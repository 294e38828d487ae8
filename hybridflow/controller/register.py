"""The @register decorator: declares a worker method's transfer protocol and whether calls block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

REGISTRATION_ATTR = "__hybridflow_registration__"


@dataclass(frozen=True, kw_only=True)
class Registration:
    """How the driver calls one worker method."""

    protocol: str
    """Name of the transfer protocol (a built-in such as 'DP_PROTO' or one added by register_protocol)."""
    blocking: bool
    """True: the driver call returns the collected value; False: it returns a Future."""
    declares_layout: bool = False
    """The method may declare a new layout (``set_parallel_layout``). A layout-driven call submitted after it waits
    for it to finish before its data is split; calls of other methods never hold back the next submission."""


def register(protocol: str = "ONE_TO_ALL", *, blocking: bool = True, declares_layout: bool = False) -> Callable:
    """Expose a ``Worker`` method on the driver's ``WorkerGroup`` under the given transfer protocol.

    ``declares_layout=True`` for a method that calls ``set_parallel_layout`` (constructors need nothing): a method
    without it that changes the layout fails, naming itself, instead of letting calls split by a stale layout."""
    from hybridflow.controller.protocols import get_protocol

    get_protocol(protocol)  # unknown names fail where the method is declared, not at the first call
    if not isinstance(blocking, bool):
        raise ValueError(f"blocking must be True or False, got {blocking!r}")
    if not isinstance(declares_layout, bool):
        raise ValueError(f"declares_layout must be True or False, got {declares_layout!r}")

    def decorate(method: Callable) -> Callable:
        setattr(method, REGISTRATION_ATTR, Registration(protocol=protocol, blocking=blocking,
                                                              declares_layout=declares_layout))
        return method

    return decorate


def declares_layout(worker_cls: type, method: str) -> bool:
    """Whether ``worker_cls.method`` is registered as one that may declare a new layout."""
    registration = getattr(getattr(worker_cls, method, None), REGISTRATION_ATTR, None)
    return registration is not None and registration.declares_layout


def registered_methods(worker_cls: type) -> dict[str, Registration]:
    """Every method of ``worker_cls`` (and its bases) carrying a ``@register`` declaration."""
    methods: dict[str, Registration] = {}
    for name in dir(worker_cls):
        registration = getattr(getattr(worker_cls, name, None), REGISTRATION_ATTR, None)
        if registration is not None:
            methods[name] = registration
    return methods
