"""An import-only stand-in for ray on the device tool's GPU machine (the real wheel is over its 64 MiB carry
limit): hybridflow imports and local mode runs; any real Ray call raises. Never on PYTHONPATH elsewhere."""


def _unavailable(*args, **kwargs):
    raise RuntimeError("ray stand-in (scripts/device): Ray is not installed on this machine; use local mode")


class _Anything:
    """Whatever attribute a caller reads: constructible, and raising when called."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        _unavailable()

    def __getattr__(self, name):
        return _Anything


class ObjectRef:
    pass


class exceptions:  # noqa: N801 (ray.exceptions is a module; the names hybridflow catches)
    class RayError(Exception):
        pass

    class RayActorError(RayError):
        pass

    class RayTaskError(RayError):
        pass

    class GetTimeoutError(RayError):
        pass

    class ActorUnavailableError(RayError):
        pass


def is_initialized() -> bool:
    return False


init = get = wait = put = kill = shutdown = nodes = cluster_resources = available_resources = _unavailable
get_runtime_context = _unavailable


def remote(*args, **kwargs):
    """``@ray.remote`` and ``@ray.remote(...)``: the class or function unchanged."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda target: target


def method(*args, **kwargs):
    return lambda target: target


def __getattr__(name):
    return _Anything
