"""A patch whose code runs inside the test runner cannot fake a pass (issue 23, section 1): every tampering
patch in tests/tampers.py, graded on the real `local` backend with the real grader, is never `resolved`,
and the ones that reach into the runner are named `grading_tampered` (reward 0.0). Each tamper that
works against a grader without these defences says so in `TAMPERS`; `test_the_tampers_work_naively`
shows they do, by running them with plain pytest and trusting its JUnit report."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cheats import git
from tampers import TAMPERS, UNITTEST_TAMPERS, tamper_patch

from swe_grpo.grading import GradeResult, grade, report_statuses
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task, demo_tasks

INIPARSE = next(task for task in demo_tasks() if "iniparse" in task.instance_id)
# Tampers whose grade is a model failure, not tampering: they only break the run.
PLAIN_FAILURES = {"skip_on_buggy_path", "sys_exit_at_import", "syntax_error"}


@pytest.fixture(scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> LocalBackend:
    backend = LocalBackend(cache_dir=tmp_path_factory.mktemp("cache"), run_dir=run_dir)
    await backend.start()
    return backend


@pytest.fixture(autouse=True)
def nothing_left_behind(run_dir: Path) -> Iterator[None]:
    yield
    assert list(run_dir.iterdir()) == [], "a sandbox was left behind"


CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
CALC_TESTS = """\
import unittest

from calc import add, sub


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_sub(self):
        self.assertEqual(sub(2, 3), -1)
"""


@pytest.fixture(scope="module")
def unittest_task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    """A task whose tests are unittest classes, run by pytest: `add` subtracts."""
    repo = tmp_path_factory.mktemp("calc")
    git(repo, "init", "-q")
    (repo / "calc.py").write_text(CALC)
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_text(CALC_TESTS)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "calc")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "calc.py").write_text(CALC.replace("return a - b", "return a + b", 1))
    patch = git(repo, "diff")
    git(repo, "checkout", "-q", "--", ".")
    os.chmod(repo, 0o755)  # the sandbox user clones it
    return Task(
        instance_id="local__calc-1",
        repo=str(repo),
        base_commit=base,
        problem_statement="add subtracts",
        fail_to_pass=("tests/test_calc.py::CalcTest::test_add",),
        pass_to_pass=("tests/test_calc.py::CalcTest::test_sub",),
        patch=patch,
    )


def naive_statuses(task: Task, patch: str, tmp_path: Path) -> dict[str, str]:
    """A grader without the tamper defences: the patch applied, plain pytest, the JUnit report and the
    summary trusted as they are (and either one alone when the other is missing)."""
    repo = tmp_path / "naive"
    git(tmp_path, "clone", "-q", task.repo, str(repo))
    git(repo, "checkout", "-q", task.base_commit)
    git(repo, "apply", "-", input_text=patch)
    if task.test_patch:
        git(repo, "apply", "-", input_text=task.test_patch)
    junit = tmp_path / "junit.xml"
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "PYTHON"))}
    env["HOME"] = str(tmp_path / "home")
    cmd = ["/usr/bin/python3", "-m", "pytest", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}", *ids]
    done = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    statuses = report_statuses(ids, junit.read_text() if junit.exists() else None, done.stdout)
    return statuses or {}


CASES = [(name, "iniparse") for name in TAMPERS] + [(name, "unittest") for name in UNITTEST_TAMPERS]


def _task_and_patch(name: str, which: str, unittest_task: Task) -> tuple[Task, str]:
    if which == "iniparse":
        return INIPARSE, tamper_patch(INIPARSE, TAMPERS[name][0])
    return unittest_task, tamper_patch(unittest_task, UNITTEST_TAMPERS[name][0], "calc.py")


@pytest.mark.parametrize(("name", "which"), [case for case in CASES if {**TAMPERS, **UNITTEST_TAMPERS}[case[0]][1]])
def test_the_tampers_work_naively(name: str, which: str, unittest_task: Task, tmp_path: Path) -> None:
    task, patch = _task_and_patch(name, which, unittest_task)
    statuses = naive_statuses(task, patch, tmp_path)
    passing = {"passed", "xfail", "xpass"}
    assert statuses and all(status in passing for status in statuses.values()), statuses


@pytest.mark.parametrize(("name", "which"), CASES)
async def test_a_tampering_patch_is_never_resolved(
    backend: LocalBackend, name: str, which: str, unittest_task: Task
) -> None:
    task, patch = _task_and_patch(name, which, unittest_task)
    result = await grade(task, patch, backend, timeout_s=60)
    assert result.outcome != "resolved" and result.reward == 0.0, (result.outcome, result.error, result.log_tail)
    expected = "unresolved" if name in PLAIN_FAILURES else "grading_tampered"
    assert result.outcome == expected, (result.error, result.log_tail)
    assert result.f2p_passed == 0 or result.outcome == "grading_tampered"


@pytest.mark.parametrize("which", ["iniparse", "unittest"])
async def test_the_gold_patch_still_resolves(backend: LocalBackend, which: str, unittest_task: Task) -> None:
    task = INIPARSE if which == "iniparse" else unittest_task
    result: GradeResult = await grade(task, task.patch, backend, timeout_s=60)
    assert (result.outcome, result.reward, result.error) == ("resolved", 1.0, None), result.log_tail
