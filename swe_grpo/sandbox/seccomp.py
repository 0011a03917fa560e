"""The sandboxes' seccomp filter: the kernel interfaces a coding agent never needs and that are the usual way
from an unprivileged process to a kernel exploit fail with EPERM. `local` sandboxes get it from bwrap
(`filter_fd`); `docker` sandboxes from a wrapper that starts every exec (`swe_grpo.sandbox.docker.seccomp`),
on top of the engine's default profile (which refuses io_uring only from Docker 25 on).

Refused: io_uring (`io_uring_setup`, `_enter`, `_register`), the kernel keyrings (`add_key`, `request_key`,
`keyctl`), `bpf`, `perf_event_open` and `userfaultfd`; on x86-64 also every call of the x32 ABI (another
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
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # of `nr` and `arch` in `struct seccomp_data`
_X32_SYSCALL_BIT = 0x40000000

# AUDIT_ARCH_* of the machine, and the numbers of the refused calls on it.
_ARCHES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {"add_key": 248, "request_key": 249, "keyctl": 250, "perf_event_open": 298, "bpf": 321, "userfaultfd": 323},
    ),
    "aarch64": (
        0xC00000B7,
        {"add_key": 217, "request_key": 218, "keyctl": 219, "perf_event_open": 241, "bpf": 280, "userfaultfd": 282},
    ),
}
_EVERY_ARCH = {"io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427}  # one table since 5.1


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


@functools.cache
def program(machine: str | None = None) -> bytes | None:
    """The filter for `machine` (default: this one; `uname -m`'s name) as bwrap's `--seccomp` and the docker
    wrapper read it; None where unsupported."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        return None
    arch, numbers = _ARCHES[machine]
    refused = sorted({*numbers.values(), *_EVERY_ARCH.values()})
    deny = _op(_RET_K, _RET_ERRNO | errno.EPERM)
    # A call made under another architecture's numbering (a 32-bit binary) is not what the table means: kill.
    ops = [_op(_LD_W_ABS, _ARCH_OFFSET), _op(_JEQ_K, arch, jt=1), _op(_RET_K, _RET_KILL_PROCESS)]
    ops.append(_op(_LD_W_ABS, _NR_OFFSET))
    if machine == "x86_64":  # x32 calls: to the final deny (past the list and the allow)
        ops.append(_op(_JGE_K, _X32_SYSCALL_BIT, jt=len(refused) + 1))
    # Each match jumps over the rest of the list and the allow, onto the deny.
    ops += [_op(_JEQ_K, nr, jt=len(refused) - i) for i, nr in enumerate(refused)]
    return b"".join([*ops, _op(_RET_K, _RET_ALLOW), deny])


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
