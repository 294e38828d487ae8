"""A seccomp filter for the code sandbox, compiled to BPF by libseccomp (called through ctypes).

The filter allows everything by default and refuses, with EPERM, the system calls that only
serve to attack the kernel or other processes: tracing, namespaces and mounts, kernel keyrings,
BPF, io_uring, modules, raw handles, new device nodes and extended attributes, and sockets other
than AF_UNIX. It is defence in depth: bubblewrap's namespaces are the boundary (see
hybridflow.rewards.sandbox); the filter shrinks the kernel surface the guest can reach.
System calls of other architectures (e.g. 32-bit ones on x86-64) kill the process (libseccomp's
default for a foreign architecture).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import socket

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_NE = 1
_SCMP_CMP_MASKED_EQ = 7
_TIOCSTI = 0x5412
# Namespace flags of clone(2): a new namespace is how a guest would get capabilities back.
_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "pidfd_open", "pidfd_send_signal",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "open_by_handle_at", "name_to_handle_at",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "quotactl_fd", "personality",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "mknod", "mknodat",
    "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
)
"""System calls the guest may never make (each fails with EPERM)."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


@functools.cache
def _libseccomp():
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                               ctypes.POINTER(_ArgCmp)]
    library.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    return library


def available() -> bool:
    """Whether libseccomp (Debian package libseccomp2) can be loaded here."""
    return _libseccomp() is not None


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter (a BPF program for bubblewrap's --seccomp), built once per process."""
    library = _libseccomp()
    if library is None:
        raise RuntimeError("libseccomp is not installed (Debian: apt-get install libseccomp2)")
    context = library.seccomp_init(_SCMP_ACT_ALLOW)
    if not context:
        raise RuntimeError("seccomp_init failed")
    try:
        def add(name: str, action: int, *comparisons: tuple[int, int, int, int]) -> None:
            number = library.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                return  # not a system call on this architecture / libseccomp version
            array = (_ArgCmp * max(len(comparisons), 1))(*[_ArgCmp(*c) for c in comparisons])
            result = library.seccomp_rule_add_array(context, action, number, len(comparisons), array)
            if result < 0:
                raise RuntimeError(f"seccomp_rule_add({name}) failed: {os.strerror(-result)}")

        for name in DENIED_SYSCALLS:
            add(name, _errno_action(errno.EPERM))
        add("socket", _errno_action(errno.EACCES), (0, _SCMP_CMP_NE, socket.AF_UNIX, 0))
        add("ioctl", _errno_action(errno.EPERM), (1, _SCMP_CMP_MASKED_EQ, 0xFFFFFFFF, _TIOCSTI))
        for flag in _CLONE_NAMESPACE_FLAGS:
            add("clone", _errno_action(errno.EPERM), (0, _SCMP_CMP_MASKED_EQ, flag, flag))
        # clone3 passes its flags in memory a filter cannot read: ENOSYS makes libc fall back to clone.
        add("clone3", _errno_action(errno.ENOSYS))
        read_end, write_end = os.pipe()
        try:
            result = library.seccomp_export_bpf(context, write_end)
            os.close(write_end)
            write_end = -1
            if result < 0:
                raise RuntimeError(f"seccomp_export_bpf failed: {os.strerror(-result)}")
            chunks = []
            while chunk := os.read(read_end, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(read_end)
            if write_end >= 0:
                os.close(write_end)
    finally:
        library.seccomp_release(context)
