"""Calibrating tasks from their gold runs: `Task.expected_statuses` filled from what the gold patch does.

The grader counts a FAIL_TO_PASS test as passed only as PASSED: an XFAIL or XPASS is what a patch makes of a
test it cannot fix (`pytest.xfail()` on the buggy path), so it is no fix. Yet a project's own test may end
XFAIL or XPASS with the reference fix too (an `xfail(raises=...)` marker the fix keeps, a known limitation
left for later); its task would then never resolve. `gold_statuses` grades the gold patch for real, strictly,
and returns those tests' gold statuses, verified by a second grade that resolves with them recorded;
`calibrate_file` does it for every row of a task file (`swe-grpo tasks calibrate`), and records with them
whether the gold's graded run keeps within the runner's limits (`Task.runner_limits`,
`swe_grpo.grading.limits`): the gold is graded as a never-calibrated task is, so where its tests need
what the limits refuse, it resolves with them lifted and the row says False.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swe_grpo.grading.run import GradeResult, grade
from swe_grpo.grading.steps import DEFAULT_TIMEOUT_S
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.tasks import Task
from swe_grpo.tasks.task import jsonl_rows, tasks_from_rows

#: The statuses a gold run may record for a FAIL_TO_PASS test besides PASSED.
RECORDABLE = ("xfail", "xpass")


class GoldUnresolved(Exception):
    """The task's gold patch does not resolve it, even with the statuses its gold run showed recorded (or the
    task has no gold patch). `grade`: the gold's last grade, None when there was none."""

    def __init__(self, task: Task, message: str, grade: GradeResult | None = None) -> None:
        self.instance_id, self.grade = task.instance_id, grade
        super().__init__(message)


async def gold_statuses(
    task: Task, backend: SandboxBackend, *, timeout_s: float = DEFAULT_TIMEOUT_S, plugin_autoload: bool = True
) -> dict[str, str]:
    """Each FAIL_TO_PASS test whose status under the task's gold patch (`task.patch`) is XFAIL or XPASS ->
    that status: the `Task.expected_statuses` this task should carry ({} when the gold passes them all, so
    strict stays strict). The gold is graded as any patch is, with the task's own recorded statuses and
    runner limits set aside; when it leaves such tests, it is graded again with them recorded and must then
    resolve. Raises `GoldUnresolved` when it does not (a gold that fails a test, a P2P test broken, a grade
    that is not to be trusted, an infra error) or when the task has no gold patch."""
    return (await _gold(task, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload))[0]


async def _gold(
    task: Task, backend: SandboxBackend, *, timeout_s: float, plugin_autoload: bool
) -> tuple[dict[str, str], GradeResult]:
    """`gold_statuses`, and the gold's resolving grade."""
    if not task.patch.strip():
        raise GoldUnresolved(task, "the task has no gold patch")

    async def graded(expected: dict[str, str]) -> GradeResult:
        calibrated = replace(task, expected_statuses=expected, runner_limits=None)
        return await grade(calibrated, task.patch, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload)

    strict = await graded({})
    if strict.outcome == "resolved":
        return {}, strict
    found = {t: strict.tests[t] for t in task.fail_to_pass if strict.tests.get(t) in RECORDABLE}
    if strict.outcome != "unresolved" or not found:
        raise GoldUnresolved(task, _why(strict), strict)
    recorded = await graded(found)
    if recorded.outcome != "resolved":
        raise GoldUnresolved(task, f"with {found} recorded, {_why(recorded)}", recorded)
    return found, recorded


def runner_limits(gold: GradeResult) -> bool:
    """The `Task.runner_limits` a resolving gold grade shows: whether the runner's limits were in force."""
    return "limits" in gold.witnesses


def _why(result: GradeResult) -> str:
    failing = sorted(f"{t} ({status})" for t, status in result.tests.items() if status not in ("passed", *RECORDABLE))
    detail = f"; not passing: {', '.join(failing[:5])}" if failing else ""
    return f"the gold patch grades {result.outcome}: {result.error or 'no error given'}{detail}"


@dataclass(frozen=True)
class Calibration:
    """One row's calibration: `expected_statuses` and `runner_limits` written to its row, or `error` (why it
    was refused)."""

    instance_id: str
    expected_statuses: dict[str, str] | None = None
    error: str | None = None
    runner_limits: bool | None = None


async def calibrate_file(
    source: Path,
    out: Path,
    backend: SandboxBackend,
    *,
    jobs: int = 4,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugin_autoload: bool = True,
    on_done: Callable[[Calibration], None] | None = None,
) -> list[Calibration]:
    """Calibrate every row of the JSONL task file `source` (`jobs` at once) and write to `out`, in order,
    the rows whose gold resolves, each with `expected_statuses` set to its `gold_statuses` (replacing
    whatever the row had; {} for none) and `runner_limits` to whether the gold's run kept within them, and
    nothing else changed but a local `repo` path, rewritten relative to `out`'s directory. A row whose gold
    does not resolve is left out of `out` and returned with its `error`. `out` is replaced whole, once every
    row is done. Malformed rows raise `TaskFormatError` first."""
    pairs = list(jsonl_rows(source))
    rows: list[dict[str, Any]] = [row for _, row in pairs]
    tasks = tasks_from_rows(pairs, source=str(source), base_dir=source.parent.resolve())
    semaphore = asyncio.Semaphore(jobs)

    async def one(task: Task) -> Calibration:
        async with semaphore:
            try:
                statuses, gold = await _gold(task, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload)
                done = Calibration(task.instance_id, expected_statuses=statuses, runner_limits=runner_limits(gold))
            except GoldUnresolved as exc:
                done = Calibration(task.instance_id, error=str(exc))
        if on_done is not None:
            on_done(done)
        return done

    async with asyncio.TaskGroup() as group:  # anything but a refused gold cancels the rest
        running = [group.create_task(one(task)) for task in tasks]
    done = [job.result() for job in running]
    moved = out.parent.resolve() != source.parent.resolve()
    written = []
    for row, task, calibration in zip(rows, tasks, done, strict=True):
        if calibration.expected_statuses is None:
            continue
        row = {**row, "expected_statuses": calibration.expected_statuses, "runner_limits": calibration.runner_limits}
        if moved and task.repo != row["repo"]:  # a local path, relative to the task file
            row["repo"] = os.path.relpath(task.repo, out.parent.resolve())
        written.append(json.dumps(row) + "\n")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(written), encoding="utf-8")
    tmp.replace(out)
    return done
