"""Sandbox steps shared by the probe and the graded run: a bounded shell step, a fresh sandbox that is
always destroyed, and the error of a step that failed."""

from __future__ import annotations

import asyncio
import logging
import shlex
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


async def grade_setup(sandbox: Sandbox, task: Task, env: dict[str, str]) -> None:
    """Run the task's `grade_setup_cmd` in the repository, within `task.setup_timeout_s`; it must exit 0
    and leave every tracked file as `base_commit` has it (else the patch would be applied to another
    tree). Its failure is the task's: `BrokenTask`."""
    assert task.grade_setup_cmd
    done = await sandbox.exec(task.grade_setup_cmd, timeout_s=task.setup_timeout_s, env=env, cwd=sandbox.workdir)
    if done.timed_out:
        raise BrokenTask(f"grade_setup_cmd timed out after {task.setup_timeout_s:g}s")
    if done.exit_code != 0:
        tail = (done.stdout + done.stderr).strip()[-1000:]
        raise BrokenTask(f"grade_setup_cmd failed (exit {done.exit_code}): {tail}")
    changed = await step(sandbox, f"git diff --name-only {shlex.quote(task.base_commit)} --", "after grade_setup_cmd")
    if changed.exit_code != 0 or changed.stdout.strip():
        raise BrokenTask(f"grade_setup_cmd changed tracked files: {changed.stdout.split()[:5]} {changed.stderr[-300:]}")


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
