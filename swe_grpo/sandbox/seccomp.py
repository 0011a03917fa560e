"""The sandboxes' seccomp filter: the kernel interfaces a coding agent never needs and that are the usual way
from an unprivileged process to a kernel exploit fail with EPERM. `local` sandboxes get it from bwrap
(`filter_fd`); `docker` sandboxes from a wrapper that starts every exec (`swe_grpo.sandbox.docker.seccomp`),
on top of the engine's default profile (which refuses io_uring only from Docker 25 on).

Refused: io_uring (`io_uring_setup`, `_enter`, `_register`), Linux AIO contexts (`io_setup`: their slots
are one host-wide pool, `fs.aio-max-nr`, that one sandbox could take whole; without a context the other AIO
calls do nothing), the kernel keyrings (`add_key`, `request_key`, `keyctl`), `bpf`, `perf_event_open` and
`userfaultfd`; on x86-64 also every call of the x32 ABI (another
syscall table the filter would otherwise have to list twice). Runtimes that try io_uring fall back to
threads on EPERM (libuv, in Node, does). Everything else is allowed: the sandbox's other walls (its own
unprivileged user, its user namespace in which no other can be made, no capabilities) hold the rest.

The filter is a classic BPF program (`struct sock_filter` records), which bwrap installs with `--seccomp FD`
(the docker wrapper with `prctl(PR_SET_SECCOMP)`) just before it runs the command; children inherit it and
cannot remove it. Only for x86-64 and aarch64, whose syscall numbers are below; elsewhere `program()` is
None and the caller warns.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import platform
import struct

log = logging.getLogger(__name__)

# Classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h).
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS: load a 32-bit word of `struct seccomp_data`
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # of `nr` and `arch` in `struct seccomp_data`


def _arg_low(i: int) -> int:
    """The offset of the low 32 bits of syscall argument `i` in `struct seccomp_data` (little-endian)."""
    return 16 + 8 * i


_X32_SYSCALL_BIT = 0x40000000
_CLONE_THREAD = 0x00010000
_F_DUPFD, _F_DUPFD_CLOEXEC = 0, 1030

# AUDIT_ARCH_* of the machine, and the numbers of the calls the filters name on it (aarch64 has no fork,
# vfork or dup2: its libc makes them of clone and dup3).
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "io_setup": 206,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "perf_event_open": 298,
            "bpf": 321,
            "userfaultfd": 323,
            "clone": 56,
            "fork": 57,
            "vfork": 58,
            "execve": 59,
            "execveat": 322,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "dup2": 33,
            "dup3": 292,
            "fcntl": 72,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "io_setup": 0,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "perf_event_open": 241,
            "bpf": 280,
            "userfaultfd": 282,
            "clone": 220,
            "execve": 221,
            "execveat": 281,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "dup3": 24,
            "fcntl": 25,
        },
    ),
}
# One table on every architecture since 5.1.
_EVERY_ARCH = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "clone3": 435}
_EVERY_ARCH |= {"pidfd_getfd": 438}

_REFUSED = ("io_uring_setup", "io_uring_enter", "io_uring_register", "add_key", "request_key", "keyctl")
_REFUSED += ("bpf", "perf_event_open", "userfaultfd", "io_setup")
# The graded runner's limits (`runner_program`): a call that starts a process, replaces the program, or
# reaches into another process of the sandbox ends the runner at once (SIGSYS, which its exit status
# shows the grader); `clone3` fails with ENOSYS, as on a kernel that lacks it, because its flags are in
# memory a filter cannot read: libc then falls back to `clone`, whose flags it can.
_RUNNER_KILLED = ("fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev")
_RUNNER_KILLED += ("pidfd_getfd",)


class _Assembler:
    """A classic BPF program with forward jumps to named labels (jump offsets are counted for you)."""

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, str | int, str | int]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self.ops.append((code, k, jt, jf))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.ops)

    def bytes(self) -> bytes:
        def offset(at: int, target: str | int) -> int:
            if isinstance(target, int):
                return target
            jump = self.labels[target] - at - 1
            assert 0 <= jump <= 255, (target, jump)  # classic BPF jumps forward, by at most 255
            return jump

        return b"".join(
            struct.pack("=HBBI", code, offset(i, jt), offset(i, jf), k) for i, (code, k, jt, jf) in enumerate(self.ops)
        )


def _build(machine: str, runner: bool) -> bytes | None:
    if machine not in _ARCHES:
        return None
    arch, numbers = _ARCHES[machine]
    numbers = {**numbers, **_EVERY_ARCH}
    a = _Assembler()
    # A call made under another architecture's numbering (a 32-bit binary) is not what the table means: kill.
    a.op(_LD_W_ABS, _ARCH_OFFSET)
    a.op(_JEQ_K, arch, jf="kill")
    a.op(_LD_W_ABS, _NR_OFFSET)
    if machine == "x86_64":  # x32 calls
        a.op(_JGE_K, _X32_SYSCALL_BIT, jt="deny")
    for nr in sorted({numbers[name] for name in _REFUSED}):
        a.op(_JEQ_K, nr, jt="deny")
    if runner:
        for nr in sorted({numbers[name] for name in _RUNNER_KILLED if name in numbers}):
            a.op(_JEQ_K, nr, jt="kill")
        a.op(_JEQ_K, numbers["clone3"], jt="enosys")
        a.op(_JEQ_K, numbers["clone"], jt="clone")
        for name in ("dup2", "dup3"):
            if name in numbers:
                a.op(_JEQ_K, numbers[name], jt="dup")
        a.op(_JEQ_K, numbers["fcntl"], jt="fcntl")
        a.op(_RET_K, _RET_ALLOW)
        # A thread shares its process's memory and descriptors: allowed; any other clone is a new process.
        a.label("clone")
        a.op(_LD_W_ABS, _arg_low(0))
        a.op(_JSET_K, _CLONE_THREAD, jt="allow", jf="kill")
        # dup2/dup3 onto 0, 1 or 2 is how pytest captures output (and restores it from the copies it
        # saved); onto any other descriptor it would re-point one of those saved copies.
        a.label("dup")
        a.op(_LD_W_ABS, _arg_low(1))
        a.op(_JGE_K, 3, jt="kill", jf="allow")
        # F_DUPFD(_CLOEXEC) with a floor of 3 or more is the same re-pointing by the lowest free number
        # (os.dup asks for a floor of 0).
        a.label("fcntl")
        a.op(_LD_W_ABS, _arg_low(1))
        a.op(_JEQ_K, _F_DUPFD, jt="dupfd")
        a.op(_JEQ_K, _F_DUPFD_CLOEXEC, jt="dupfd", jf="allow")
        a.label("dupfd")
        a.op(_LD_W_ABS, _arg_low(2))
        a.op(_JGE_K, 3, jt="kill")
    a.label("allow")
    a.op(_RET_K, _RET_ALLOW)
    a.label("deny")
    a.op(_RET_K, _RET_ERRNO | errno.EPERM)
    a.label("kill")
    a.op(_RET_K, _RET_KILL_PROCESS)
    if runner:
        a.label("enosys")
        a.op(_RET_K, _RET_ERRNO | errno.ENOSYS)
    return a.bytes()


@functools.cache
def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one; `uname -m`'s name) as bwrap's `--seccomp` and the docker
    wrapper read it; None where unsupported."""
    return _build(machine or platform.machine(), runner=False)


@functools.cache
def runner_program(machine: str | None = None) -> bytes | None:
    """`program` plus the graded runner's limits, installed by the runner itself on top of the sandbox's
    filter before any repository code runs (`swe_grpo.grading.limits`): no new process (fork, vfork,
    clone without CLONE_THREAD, clone3 is ENOSYS so libc falls back to clone, hence posix_spawn and
    subprocess too), no exec (execve, execveat), no reaching into another process (ptrace,
    process_vm_readv/writev, pidfd_getfd), no dup2/dup3 onto a descriptor above 2 and no F_DUPFD with a
    floor above 2 (re-pointing pytest's saved copies of its standard descriptors); each ends the process
    with SIGSYS. Threads keep working. None where unsupported."""
    return _build(machine or platform.machine(), runner=True)


def filter_fd() -> int | None:
    """A new file descriptor holding this machine's filter, at offset 0, for one bwrap's `--seccomp` (which
    reads it to the end); the caller closes it. None (and a warning, once) where there is no filter."""
    data = program()
    if data is None:
        _warn_unsupported()
        return None
    fd = os.memfd_create("swe-grpo-seccomp", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def _warn_unsupported() -> None:
    log.warning("no seccomp filter for %s: local sandboxes can use io_uring, keyrings and bpf", platform.machine())
