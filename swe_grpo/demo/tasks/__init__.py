"""Small demo tasks shipped with swe_grpo: `tasks.jsonl` and one git bundle per repository in `repos/`,
built by `build.py` from the plain source trees in `src/`. Load them with `demo_tasks()`."""

from pathlib import Path

from swe_grpo.tasks import Task, load_jsonl
from swe_grpo.tasks.task import DEMO_TASKS


def demo_tasks_path() -> Path:
    """The bundled demo task file (`swe_grpo/demo/tasks/tasks.jsonl`); its repositories are git bundles
    next to it."""
    return DEMO_TASKS


def demo_tasks() -> list[Task]:
    """The small tasks shipped with the package: tiny stdlib-only Python repositories, each with a real
    bug, a test patch, FAIL_TO_PASS / PASS_TO_PASS tests and the gold patch."""
    return load_jsonl(demo_tasks_path())
