"""Tasks: what a rollout works on (`Task`) and how tasks are read (`load_tasks` and friends)."""

from typing import Any

from swe_grpo._compat import moved_name
from swe_grpo.tasks.task import (
    Task,
    TaskFormatError,
    load_jsonl,
    load_tasks,
    swe_gym_image,
    task_from_row,
    tasks_from_dataset,
    tasks_from_rows,
)

__all__ = [
    "Task",
    "TaskFormatError",
    "load_jsonl",
    "load_tasks",
    "swe_gym_image",
    "task_from_row",
    "tasks_from_dataset",
    "tasks_from_rows",
]


def __getattr__(name: str) -> Any:
    return moved_name(__name__, name)
