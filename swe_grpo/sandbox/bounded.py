"""Host-side work on what a sandbox gave back (an agent's patch, the files it touched, a test report), bounded
in time and memory and off the event loop that serves every rollout: `run_bounded(fn, *args, timeout_s=...,
memory_bytes=...)` returns `fn(*args)` or raises `BoundExceeded` naming the bound. What comes back is bounded
too (`result_bytes`, pickled): a parse within its own bounds can still build a result that is large in the
serving process (a report naming a million distinct tests is a dict of hundreds of MiB there).

Why a process, not a thread: such work is mostly parsing, and a parser written in C (`ast.parse`, `re`,
ElementTree) holds the GIL for its whole input, so a thread stalls the serving loop as surely as running it
inline, and a thread's memory cannot be bounded. Each call forks a child of this process (copy-on-write: no
import, no start-up; a forkserver or a spawned process would re-run the main script's top level, as
multiprocessing prepares its children, and pay for the imports). The child touches nothing of the parent's
but `fn` and its arguments, caps its own address space at what it was forked with plus `memory_bytes`
(RLIMIT_AS), and is killed at `timeout_s`, or when the caller is cancelled. `fn`'s result must pickle.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import resource
import select
import signal
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

T = TypeVar("T")

#: The default cap on a result, pickled (real reports of the largest suites pickle to a few MiB).
RESULT_BYTES = 16 << 20


class BoundExceeded(Exception):
    """`fn` did not return within its bounds: `bound` is "time", "memory", or "error" (it raised, or its
    process died); the message says which and how."""

    def __init__(self, bound: Literal["time", "memory", "error"], message: str) -> None:
        super().__init__(message)
        self.bound = bound


async def run_bounded(
    fn: Callable[..., T], *args: Any, timeout_s: float, memory_bytes: int, result_bytes: int = RESULT_BYTES
) -> T:
    """`fn(*args)` in a child process of its own, within `timeout_s` seconds and `memory_bytes` more address
    space than the child starts with, its result within `result_bytes` pickled (over it: a "memory" bound,
    read no further). Raises `BoundExceeded`; a cancelled caller's child is killed."""
    started: list[int] = []
    try:
        return await asyncio.to_thread(_run, fn, args, timeout_s, memory_bytes, result_bytes, started)
    except asyncio.CancelledError:
        for pid in started:  # the thread then sees EOF at once and reaps it
            _kill(pid)
        raise


def _run(
    fn: Callable[..., T], args: tuple[Any, ...], timeout_s: float, memory_bytes: int, result_bytes: int, started: list
) -> T:
    # A bare fork, not multiprocessing's: a rollout host is a daemonic multiprocessing child, and
    # multiprocessing refuses a daemon children of its own.
    receive, send = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns, never runs the parent's exit handlers
        os.close(receive)
        try:
            _child(send, memory_bytes, fn, args)
        finally:
            os._exit(0)
    started.append(pid)
    os.close(send)
    try:
        data = _read_until_eof(receive, time.monotonic() + timeout_s, result_bytes)
        if data is None:
            raise BoundExceeded("time", f"{fn.__name__} took longer than {timeout_s:g}s")
        if len(data) > result_bytes:
            raise BoundExceeded("memory", f"{fn.__name__}: its result is over {result_bytes} bytes")
    finally:
        os.close(receive)
        _kill(pid)
    if not data:
        raise BoundExceeded("error", f"{fn.__name__}'s process died without an answer")
    status, value = pickle.loads(data)
    if status == "ok":
        return value
    raise BoundExceeded(status, f"{fn.__name__}: {value}")


def _read_until_eof(fd: int, deadline: float, most: int) -> bytes | None:
    """All the child wrote, once it closed its end, or the first bytes past `most` of it (no more is read);
    None when `deadline` passed first."""
    data = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0]:
            if not (chunk := os.read(fd, 1 << 20)):
                return bytes(data)
            data += chunk
            if len(data) > most:
                return bytes(data)
    return None


def _kill(pid: int) -> None:
    """End and reap the child, whatever state it is in (a second call finds it gone)."""
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


def _child(send: int, memory_bytes: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    with open("/proc/self/status") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, size + memory_bytes))
    try:
        result: tuple[str, Any] = ("ok", fn(*args))
    except MemoryError:
        result = ("memory", f"over its memory bound of {memory_bytes} bytes")
    except Exception as e:
        result = ("error", f"{type(e).__name__}: {e}")
    try:
        data = pickle.dumps(result)
    except MemoryError:
        data = pickle.dumps(("memory", f"over its memory bound of {memory_bytes} bytes"))
    with os.fdopen(send, "wb") as out:
        out.write(data)
