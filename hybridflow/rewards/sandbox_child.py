"""What the sandbox runs first: impose limits, drop to the guest uid, then run the untrusted code.

It is executed as a script by a fresh interpreter inside the sandbox
(`python -I -B child.py settings.json`), never imported by hybridflow, and uses the standard
library only. It is not a guard: once the untrusted code runs it can change anything in this
process; the operating system (namespaces, uid, seccomp, limits) is what holds.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38


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
    """From root (no user namespace) to `uid` for good: no capabilities can ever come back."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in range(64):
        libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0)  # EINVAL past the last capability: ignored
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("could not drop to the sandbox uid")


def main() -> None:
    with open(sys.argv[1]) as handle:
        settings = json.load(handle)
    with open(settings["code_path"]) as handle:
        source = handle.read()
    _set_limits(settings)
    if settings["drop_to_uid"] is not None:
        _drop_privileges(settings["drop_to_uid"])
    sys.path[:] = [path for path in sys.path if path]  # nothing importable from the working directory
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
