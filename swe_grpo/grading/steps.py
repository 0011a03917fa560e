"""Sandbox steps shared by the probe and the graded run: a bounded shell step, a fresh sandbox that is
always destroyed, and the error of a step that failed."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from swe_grpo.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxError
from swe_grpo.tasks import Task

log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: SWE-bench's per-instance limit for the test run.
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_TEST_CMD = 'python3 -m pytest -rA -p no:cacheprovider --junitxml="$SWE_GRPO_JUNIT_XML"'
STEP_TIMEOUT_S = 120.0  # each git step


class BrokenTask(Exception):
    """The task or the grading machinery failed (not the patch): an infra_error."""


def nul_list(data: str) -> list[str]:
    return [item for item in data.split("\0") if item]


async def step(sandbox: Sandbox, script: str, what: str) -> ExecResult:
    result = await sandbox.exec(script, timeout_s=STEP_TIMEOUT_S, cwd=sandbox.workdir)
    if result.timed_out:
        raise BrokenTask(f"{what}: timed out after {STEP_TIMEOUT_S:.0f}s")
    return result


def failure(what: str, result: ExecResult) -> str:
    return f"{what} (exit {result.exit_code}): {result.stderr.strip()[-1000:]}"


async def in_sandbox(
    backend: SandboxBackend,
    task: Task,
    work: Callable[[Sandbox], Awaitable[_T]],
    timings: dict[str, float] | None = None,
) -> _T:
    """`work` in a fresh network-less sandbox (tests need no network, and get none), destroyed after."""
    started = time.monotonic()
    sandbox = await backend.create(task, network=False)
    if timings is not None:
        timings["sandbox_s"] = time.monotonic() - started
    # The clean-up is shielded (a second cancellation must not interrupt it), and when something is
    # already going wrong, a failing clean-up must not replace that exception (a cancellation above all).
    try:
        result = await work(sandbox)
    except BaseException:
        try:
            await asyncio.shield(sandbox.destroy())
        except SandboxError as exc:
            log.warning("could not destroy the grading sandbox of %s: %s", task.instance_id, exc)
        raise
    await asyncio.shield(sandbox.destroy())
    return result
