"""What a sandboxed subprocess runs: impose limits, drop privileges, install guards, then run the untrusted code.

It is executed as a script by a fresh interpreter (`python -I sandbox_child.py SETTINGS.json`),
never imported by hybridflow, and uses the standard library only.
"""

import json
import os
import resource
import sys
import traceback

# Audit events (PEP 578) that untrusted code may never trigger: network, new processes, signals
# to other processes, native code, and heap introspection (which could reach the hook's state).
_FORBIDDEN_PREFIXES = ("socket.", "subprocess.", "ctypes.", "gc.", "os.exec", "os.spawn", "os.posix_spawn", "pty.")
_FORBIDDEN_EVENTS = {
    "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill",
    "_posixsubprocess.fork_exec", "sys.remote_exec", "winreg", "mmap.__new__",
}
# Audit events that take paths: event -> (positions of path arguments, which must lie inside the
# sandbox directory; positions of dir_fd arguments, which must be unset since a path relative to
# an arbitrary directory descriptor cannot be checked).
_PATH_EVENTS = {
    "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)),
    "os.link": ((0, 1), (2, 3)), "os.symlink": ((0, 1), (2,)), "os.chmod": ((0,), (2,)),
    "os.chown": ((0,), (3,)), "os.mkdir": ((0,), (2,)), "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()),
    "os.chflags": ((0,), ()), "shutil.rmtree": ((0,), (1,)), "shutil.copyfile": ((1,), ()),
    "shutil.move": ((0, 1), ()),
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _set_limits(settings: dict) -> None:
    for name, value in (
        ("RLIMIT_AS", settings["memory_bytes"]),
        ("RLIMIT_CPU", settings["cpu_seconds"]),
        ("RLIMIT_FSIZE", settings["max_file_bytes"]),
        ("RLIMIT_NPROC", settings["max_processes"]),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _install_guard(workdir: str) -> None:
    root = os.path.realpath(workdir)

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an already-open file descriptor
        try:
            resolved = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return resolved == root or resolved.startswith(root + os.sep)

    def guard(event: str, args: tuple) -> None:
        if event in _FORBIDDEN_EVENTS or event.startswith(_FORBIDDEN_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
            if writes and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
        elif event in _PATH_EVENTS:
            path_positions, dir_fd_positions = _PATH_EVENTS[event]
            for position in path_positions:
                if position < len(args) and not inside(args[position]):
                    raise PermissionError(f"sandbox: {event} on {args[position]!r} is not allowed")
            for position in dir_fd_positions:
                if position < len(args) and args[position] not in (None, -1):
                    raise PermissionError(f"sandbox: {event} relative to a directory descriptor is not allowed")

    sys.addaudithook(guard)
    # The "open" audit event does not report dir_fd, so a relative path opened against a directory
    # descriptor could not be checked: refuse dir_fd at the function instead.
    import posix

    unguarded_open = posix.open

    def guarded_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            raise PermissionError("sandbox: os.open relative to a directory descriptor is not allowed")
        return unguarded_open(path, flags, mode)

    posix.open = os.open = guarded_open


def main() -> None:
    with open(sys.argv[1]) as handle:
        settings = json.load(handle)
    with open(settings["code_path"]) as handle:
        source = handle.read()
    os.chdir(settings["workdir"])
    _set_limits(settings)
    if settings["drop_to_uid"] is not None:
        _drop_privileges(settings["drop_to_uid"])
    sys.path[:] = [path for path in sys.path if path]  # nothing importable from the working directory
    _install_guard(settings["workdir"])
    del settings
    code = compile(source, "<solution>", "exec")
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
