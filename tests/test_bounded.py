"""`swe_grpo.sandbox.bounded.run_bounded`: host-side parsing of what an agent wrote runs in a forked child, bounded
in time and memory, while the event loop goes on serving."""

from __future__ import annotations

import ast
import asyncio
import itertools
import multiprocessing
import os
import time

import pytest

from swe_grpo.sandbox.bounded import BoundExceeded, run_bounded


def spin() -> None:
    while True:
        pass


def hog() -> int:
    return len(bytearray(1 << 30))


def fail() -> None:
    raise ValueError("not a patch")


def parse_lines(source: str) -> int:
    return len(ast.parse(source).body)


async def test_the_result_comes_back_and_each_bound_is_named() -> None:
    assert await run_bounded(parse_lines, "a = 1\nb = 2\n", timeout_s=30, memory_bytes=256 << 20) == 2
    started = time.monotonic()
    with pytest.raises(BoundExceeded) as over:
        await run_bounded(spin, timeout_s=1, memory_bytes=256 << 20)
    assert over.value.bound == "time" and time.monotonic() - started < 10
    with pytest.raises(BoundExceeded) as over:
        await run_bounded(hog, timeout_s=30, memory_bytes=256 << 20)  # 1 GiB past a bound of 256 MiB
    assert over.value.bound == "memory"
    with pytest.raises(BoundExceeded, match="ValueError: not a patch") as over:
        await run_bounded(fail, timeout_s=30, memory_bytes=256 << 20)
    assert over.value.bound == "error"


def many_names(count: int) -> dict[str, str]:
    """What a parse of a report naming `count` distinct tests returns (issue 35: a million of them was a dict of
    a few hundred MiB brought back into the serving process)."""
    return {f"tests/test_x.py::test_{i:09d}": "PASSED" for i in range(count)}


async def test_the_result_is_capped_in_size() -> None:
    """A result over `result_bytes` (16 MiB pickled by default) is a "memory" bound, read no further; within
    it, the result comes back whole."""
    assert len(await run_bounded(many_names, 1000, timeout_s=60, memory_bytes=1 << 30)) == 1000
    with pytest.raises(BoundExceeded, match="its result is over 16777216 bytes") as over:
        await run_bounded(many_names, 1_000_000, timeout_s=120, memory_bytes=1 << 30)
    assert over.value.bound == "memory"
    with pytest.raises(BoundExceeded, match="its result is over 1000 bytes"):
        await run_bounded(many_names, 1000, timeout_s=60, memory_bytes=1 << 30, result_bytes=1000)


async def test_a_cancelled_callers_child_is_killed() -> None:
    call = asyncio.ensure_future(run_bounded(spin, timeout_s=600, memory_bytes=256 << 20))
    await asyncio.sleep(1)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):  # the child, reaped by the caller's thread once killed
        if not [p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == os.getpid() and _is_fork(p)]:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the cancelled call's child is still alive")


async def test_the_loop_serves_on_while_a_huge_parse_runs() -> None:
    """`ast.parse` holds the GIL for its whole input: in a thread (`asyncio.to_thread`) the loop stood still for
    the whole parse (0.1-0.4 s for 100,000-300,000 lines here, with 1-2 ticks of 10 ms in it); in `run_bounded`'s
    child the loop ticks on (500-600 ticks, 99 % within 15 ms of time)."""
    source = "x = 1\n" * 100_000
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    ticker = asyncio.ensure_future(tick())
    try:
        assert await run_bounded(parse_lines, source, timeout_s=120, memory_bytes=1 << 30) == 100_000
    finally:
        ticks.append(time.monotonic())
        ticker.cancel()
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(ticks))
    assert len(gaps) > 10 and gaps[len(gaps) * 99 // 100] < 0.1 and gaps[-1] < 1.0, gaps[-5:]


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _is_fork(pid: str) -> bool:
    """A child forked from this process (its command line is this one's; a server the session started is not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as theirs, open("/proc/self/cmdline", "rb") as ours:
            return theirs.read() == ours.read()
    except OSError:
        return False


def _bounded_in_a_daemon(queue: multiprocessing.Queue) -> None:
    queue.put(asyncio.run(run_bounded(parse_lines, "a = 1\n", timeout_s=30, memory_bytes=256 << 20)))


def test_it_runs_inside_a_daemonic_process() -> None:
    """A rollout host is a daemonic multiprocessing child, and grading calls `run_bounded` there: multiprocessing
    refuses a daemon children of its own ("daemonic processes are not allowed to have children"), which made every
    graded rollout in a host `rollout_error`."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    host = context.Process(target=_bounded_in_a_daemon, args=(queue,), daemon=True)
    host.start()
    try:
        assert queue.get(timeout=120) == 1
    finally:
        host.join(30)
        host.kill()
