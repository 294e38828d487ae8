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


def register(protocol: str = "ONE_TO_ALL", *, blocking: bool = True) -> Callable:
    """Expose a ``Worker`` method on the driver's ``WorkerGroup`` under the given transfer protocol."""
    from hybridflow.controller.protocols import get_protocol

    get_protocol(protocol)  # unknown names fail where the method is declared, not at the first call
    if not isinstance(blocking, bool):
        raise ValueError(f"blocking must be True or False, got {blocking!r}")

    def decorate(method: Callable) -> Callable:
        setattr(method, REGISTRATION_ATTR, Registration(protocol=protocol, blocking=blocking))
        return method

    return decorate


def registered_methods(worker_cls: type) -> dict[str, Registration]:
    """Every method of ``worker_cls`` (and its bases) carrying a ``@register`` declaration."""
    methods: dict[str, Registration] = {}
    for name in dir(worker_cls):
        registration = getattr(getattr(worker_cls, name, None), REGISTRATION_ATTR, None)
        if registration is not None:
            methods[name] = registration
    return methods
