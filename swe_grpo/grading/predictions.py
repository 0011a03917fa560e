"""Grading SWE-bench-style predictions files (`instance_id`, `model_patch`) with `grade`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from swe_grpo.grading.run import GradeResult, grade
from swe_grpo.grading.steps import DEFAULT_TIMEOUT_S
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.tasks import Task
from swe_grpo.tasks.task import RewardMode


def load_predictions(path: str | Path) -> list[dict[str, Any]]:
    """Predictions from a SWE-bench predictions file: a JSON list, or JSONL (one object per line)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def grade_predictions(
    tasks: Iterable[Task],
    predictions: Iterable[Mapping[str, Any]],
    backend: SandboxBackend,
    *,
    concurrency: int = 4,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugin_autoload: bool = True,
    reward_mode: RewardMode = "binary",
) -> list[GradeResult]:
    """Grade SWE-bench-style predictions (`instance_id`, `model_patch`; a null patch is an empty one),
    at most `concurrency` at a time, with the run's `reward_mode` (a task's own wins); results in the order
    of `predictions`. Every prediction is checked
    before anything runs: an unknown `instance_id` raises `KeyError`, a non-string patch `ValueError`."""
    by_id = {task.instance_id: task for task in tasks}
    jobs: list[tuple[Task, str]] = []
    for number, prediction in enumerate(predictions):
        instance_id, patch = prediction.get("instance_id"), prediction.get("model_patch") or ""
        if instance_id not in by_id:
            raise KeyError(f"prediction {number}: no task with instance_id {instance_id!r}")
        if not isinstance(patch, str):
            raise ValueError(f"prediction {number} ({instance_id}): model_patch is not a string")
        jobs.append((by_id[instance_id], patch))
    semaphore = asyncio.Semaphore(concurrency)

    async def one(task: Task, patch: str) -> GradeResult:
        async with semaphore:
            return await grade(
                task, patch, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload, reward_mode=reward_mode
            )

    async with asyncio.TaskGroup() as group:
        running = [group.create_task(one(task, patch)) for task, patch in jobs]
    return [job.result() for job in running]
