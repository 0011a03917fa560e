"""The graded runner's out-of-process limits: in a graded run, the test runner may not start a process, exec
a program, reach into another process or re-point the copies pytest keeps of its standard descriptors.
The kernel enforces it (a seccomp filter, `swe_grpo.sandbox.seccomp.runner_program`), so nothing the
patch's code does inside the runner can lift it; a call it refuses ends the runner with SIGSYS, and the
grader reads that from the runner's exit status, outside the runner: `grading_tampered`.

Which process, and how the filter gets there. Only the test command's first Python process, the runner,
is limited: the shell line before it (and a `test_cmd` script) needs fork and exec to start it at all. The
grader cannot point at that process from outside before it exists, so it is the runner itself that
installs the filter, at interpreter start, before any repository code: a piece of the grader's
`sitecustomize.py` (`limit_source`), run by the shims that start every `python`/`python3` of the command
(`swe_grpo.grading.tamper.shim_script`), pops a secret file's path from the environment (so only the first
Python process finds it), reads the filter and deletes the file, imports `ctypes` from the interpreter's
own directory only (never a repository module of that name), sets no_new_privs and installs the filter
with `prctl(PR_SET_SECCOMP)`. Nothing is exec'd after the filter is in place, so execve and execveat are
refused outright: no "allow exactly one exec" rule (an argument value or pointer to match) that the
patch's code could try to reproduce, and no launcher binary to ship into every image (the same code runs
on the `local` and `docker` backends: the interpreter is the image's own). The filter stacks on the
sandbox's own and, like it, is inherited by every thread and cannot be removed. What it writes to its
status file, before any repository code runs, says whether it is in force (`limited`) or why not
(`unlimited ...`: no ctypes in the image's Python, an unsupported machine).

Where the base suite needs them (tests that run a subprocess, a CLI, `git`), the limits are off for the
task: `Task.runner_limits` records it (`swe-grpo tasks calibrate` grades the gold patch with the limits on
and records False when it cannot resolve without lifting them). A task never calibrated is graded with the
limits on, and a run they end is blamed as a timeout is, by control runs: when the run was the task's gold
fix's own, or the tests run without the patch, or with the gold fix (a FAIL_TO_PASS test may spawn only
once fixed), are ended by the limits too, the task's tests need them, the limits are off for the task from
then on (kept with its probe) and the patch is graded again without them; else the patch is
`grading_tampered`. A task with neither a calibration nor a gold patch whose FAIL_TO_PASS tests spawn only
once fixed would see an honest fix ended: calibrate such tasks. Such tasks keep the other layers
only (the capability gate, the canaries, the consistency checks, the boot's tripwires).

What the limits cannot stop: re-pointing a standard descriptor (dup2 onto 0, 1 or 2 is how pytest captures
output, so it stays allowed; pytest restores them from its saved copies before it writes its summary), and
closing one of pytest's saved copies and opening a file that gets the freed number (the lowest free
number is how every open works: no filter can tell that open from an honest one). Writing into the memory
of another process of the sandbox through `/proc/PID/mem` (an open and a write, as far as a filter can
see) is left to the sandbox: its processes run as one user.
"""

from __future__ import annotations

import platform
import signal

from swe_grpo.sandbox.seccomp import runner_program

LIMIT_ENV = "SWE_GRPO_LIMIT"

#: The exit status of a runner the limits ended, as the shell that started it reports it.
KILLED_BY_LIMIT = 128 + signal.SIGSYS

_LIMIT = r"""
def _swe_grpo_limit():
    import os, sys

    secret = os.environ.pop("SWE_GRPO_LIMIT", "")
    if not secret:
        return
    try:
        with open(secret, "rb") as f:
            status, machine, program = f.read().split(b"\n", 2)
        os.unlink(secret)
        fd = os.open(status, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except (OSError, ValueError):
        return
    path, stdlib = sys.path[:], os.path.dirname(os.__file__)
    sys.path[:] = [p for p in path if p.startswith(stdlib)]  # the interpreter's ctypes, never a repository's
    try:
        import ctypes

        class Fprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        if not program or len(program) % 8 or os.uname().machine != machine.decode():
            raise ValueError(f"no filter for {os.uname().machine}")
        libc, ul = ctypes.CDLL(None, use_errno=True), ctypes.c_ulong
        code = ctypes.create_string_buffer(program, len(program))
        fprog = Fprog(len(program) // 8, ctypes.cast(code, ctypes.c_void_p))
        # PR_SET_NO_NEW_PRIVS (38), then PR_SET_SECCOMP (22) with SECCOMP_MODE_FILTER (2).
        if libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) or libc.prctl(22, ul(2), ctypes.byref(fprog), ul(0), ul(0)):
            raise OSError(ctypes.get_errno(), "prctl")
        note = "limited"
    except Exception as exc:
        note = f"unlimited {type(exc).__name__}: {exc}"
    finally:
        sys.path[:] = path
    os.write(fd, f"{note} {os.getpid()}\n".encode())
    os.close(fd)


_swe_grpo_limit()
del _swe_grpo_limit
"""


def limit_source() -> str:
    """The piece of the grader's `sitecustomize.py` that installs the limits in the runner (runs first)."""
    return _LIMIT


def limit_secret(status_path: str) -> bytes:
    """The secret file's content: where to write the status, the machine the filter is for (this host's:
    a sandbox on another refuses it), then the filter (empty where unsupported)."""
    return b"\n".join([status_path.encode(), platform.machine().encode(), runner_program() or b""])


def limited(status: str | None) -> bool:
    """Whether the status file (None: missing) says the limits were in force in the runner."""
    return bool(status) and status.split(" ", 1)[0] == "limited"
