"""Tasks: what a rollout works on (`Task`) and how tasks are read (`load_tasks` and friends)."""

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

# The names that moved out (`demo_tasks`, `demo_tasks_path`) are given back, with a warning, by `swe_grpo._compat`:
# the data path imports nothing by a string (tests/test_layers.py).
