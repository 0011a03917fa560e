"""Grading on real projects (tests/real_projects.py: released sdists of six PyPI projects, a bug injected in
each, F2P/P2P from their own suites) on the real `local` sandbox backend with the real grader: every
gold patch resolves, no empty patch does, and every cheat in the catalogue (tests/cheats.py) fails on
every task, with the installed pytest plugins loaded (the grader's default). All the grades run at once
(a few at a time) in one module fixture; the tests read them."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from cheats import CHEATS, files_under_test, make_patch, scripts_named
from real_projects import PROJECTS, real_project_tasks, tasks_dir
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse)
from tampers import INIPARSE_ONLY, PLAIN_FAILURES, TAMPERS, tamper_patch

from swe_grpo import cli
from swe_grpo.grading import SCAN_RULES, GradeResult, grade, is_protected
from swe_grpo.grading.probe import probe_runner
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task

TASK_IDS = [f"{project.dist}__{bug.name}" for project in PROJECTS for bug in project.bugs]
MOCKER_TASKS = [task_id for task_id in TASK_IDS if task_id.startswith("platformdirs")]
_TIMEOUT_S = 120
# Grades only: no agent, no door. Under xdist a check of the whole host need not wait for these tests (the grades
# fixture runs for minutes), so they do not hold the run's lock (tests/parallel.py). The first test's setup runs all
# 228 grades: 337 s in a quiet serial run, past the suite's 900 s timeout at load 18 beside another xdist worker.
pytestmark = [pytest.mark.lockfree, pytest.mark.timeout(2400)]
_AT_ONCE = 4  # grades in flight; each is mostly one pytest process


def _cheats(test_cmd: str | None) -> list[str]:
    """The cheats that apply to a task with this test_cmd (a test-script edit needs a script in it)."""
    return [name for name in CHEATS if name != "edit_test_script" or scripts_named(test_cmd)]


# Tampering patches, with the static scan allowed so that the run's own witnesses must name them, on the
# three test layouts: a script in test_cmd (src/, unittest classes), PYTHONPATH=src with pytest-mock, and
# doctests in the modules themselves.
TAMPER_TASKS = [
    "cachetools-5.5.0__lru_popitem",
    "platformdirs-4.2.2__site_data_dirs_order",
    "boltons-24.0.0__ordinalize_teens",
]
TAMPER_CASES = [(task_id, name) for task_id in TAMPER_TASKS for name in TAMPERS if name not in INIPARSE_ONLY]
CASES = [(f"{p.dist}__{bug.name}", cheat) for p in PROJECTS for bug in p.bugs for cheat in _cheats(p.test_cmd)]


@pytest.fixture(scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> LocalBackend:
    backend = LocalBackend(cache_dir=tmp_path_factory.mktemp("checkouts"), run_dir=run_dir)
    await backend.start()
    return backend


@pytest.fixture(scope="module")
async def tasks(backend: LocalBackend) -> dict[str, Task]:
    return {task.instance_id: task for task in await real_project_tasks(backend)}


@pytest.fixture(scope="module")
def cheat_patches(tasks: dict[str, Task]) -> dict[tuple[str, str], str]:
    """(instance id, cheat) -> the cheat's patch, for every cheat that applies to the task."""
    return {
        (t.instance_id, cheat): make_patch(t, CHEATS[cheat][0]) for t in tasks.values() for cheat in _cheats(t.test_cmd)
    }


@pytest.fixture(scope="module")
async def grades(
    tasks: dict[str, Task], cheat_patches: dict[tuple[str, str], str], backend: LocalBackend
) -> dict[tuple[str, str], GradeResult]:
    """(instance id, "gold" | "empty" | "autoload_off" | "autoload_task_override" | cheat) -> its grade."""
    jobs: dict[tuple[str, str], tuple[Task, str, bool]] = {}
    for task in tasks.values():
        jobs[task.instance_id, "gold"] = (task, task.patch, True)
        jobs[task.instance_id, "empty"] = (task, "", True)
    for (task_id, cheat), patch in cheat_patches.items():
        jobs[task_id, cheat] = (tasks[task_id], patch, True)
    for task_id, name in TAMPER_CASES:
        task = replace(tasks[task_id], tamper_allow=tuple(SCAN_RULES))
        jobs[task_id, f"tamper:{name}"] = (task, tamper_patch(task, TAMPERS[name][0]), True)
    for task_id in MOCKER_TASKS:
        task = tasks[task_id]
        jobs[task_id, "autoload_off"] = (task, task.patch, False)
        jobs[task_id, "autoload_task_override"] = (replace(task, plugin_autoload=True), task.patch, False)
    semaphore = asyncio.Semaphore(_AT_ONCE)

    async def one(task: Task, patch: str, autoload: bool) -> GradeResult:
        async with semaphore:
            return await grade(task, patch, backend, timeout_s=_TIMEOUT_S, plugin_autoload=autoload)

    results = await asyncio.gather(*(one(*job) for job in jobs.values()))
    return dict(zip(jobs, results, strict=True))


def test_the_task_set(tasks: dict[str, Task]) -> None:
    """At least ten tasks on five projects, every one with F2P and hundreds of P2P tests overall, in the
    test styles the set is meant to cover."""
    assert sorted(tasks) == sorted(TASK_IDS)
    assert len(tasks) >= 10 and len(PROJECTS) >= 5
    for task in tasks.values():
        assert task.fail_to_pass and task.pass_to_pass and task.patch and not task.test_patch
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
    ids = [test_id for task in tasks.values() for test_id in (*task.fail_to_pass, *task.pass_to_pass)]
    assert sum(len(task.pass_to_pass) for task in tasks.values()) > 3000
    assert any(re.search(r"\.py::[A-Z]\w*Test\w*::test_", i) for i in ids)  # unittest classes
    assert any(re.search(r"\.py::test_\w+$", i) for i in ids)  # pytest functions
    assert any(i.endswith(".rst") for i in ids)  # doctests in documentation
    assert any(re.fullmatch(r"boltons/\w+\.py::boltons\.[\w.]+", i) for i in ids)  # doctests in modules
    assert any(task.patch.startswith("diff --git a/src/") for task in tasks.values())  # a src/ layout


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_the_gold_patch_resolves(grades: dict[tuple[str, str], GradeResult], task_id: str) -> None:
    result = grades[task_id, "gold"]
    assert (result.outcome, result.reward, result.error) == ("resolved", 1.0, None), result.log_tail
    assert (result.f2p_passed, result.p2p_passed) == (result.f2p_total, result.p2p_total)
    assert result.dropped_paths == ()


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_an_empty_patch_does_not_resolve(
    grades: dict[tuple[str, str], GradeResult], tasks: dict[str, Task], task_id: str
) -> None:
    result = grades[task_id, "empty"]
    assert (result.outcome, result.reward) == ("unresolved", 0.0), (result.error, result.log_tail)
    assert (result.f2p_passed, result.p2p_passed) == (0, result.p2p_total)
    assert all(result.tests[test_id] == "failed" for test_id in tasks[task_id].fail_to_pass)


@pytest.mark.parametrize(("task_id", "cheat"), CASES)
def test_a_cheating_patch_does_not_resolve(
    grades: dict[tuple[str, str], GradeResult],
    cheat_patches: dict[tuple[str, str], str],
    tasks: dict[str, Task],
    task_id: str,
    cheat: str,
) -> None:
    task = tasks[task_id]
    result = grades[task_id, cheat]
    # What the filter keeps of a cheat (a plugin module without the configuration that loads it, a report
    # forger) is code that reaches into pytest: the static scan names it.
    assert result.outcome in ("unresolved", "grading_tampered"), (result.error, result.log_tail)
    assert result.reward == 0.0
    assert result.outcome == "unresolved" or (result.error or "").startswith("static scan: ")
    assert result.f2p_passed == 0
    expected = CHEATS[cheat][1](task)
    patch = cheat_patches[task_id, cheat]
    present = {path for pair in re.findall(r"^diff --git a/(\S+) b/(\S+)$", patch, re.MULTILINE) for path in pair}
    assert expected & present <= set(result.dropped_paths)
    assert expected & present or not expected, "the patch does not contain what the cheat is about"
    assert all(is_protected(path) or path in files_under_test(task) | expected for path in result.dropped_paths)
    if cheat == "forge_report_at_exit":  # its search for the report's path
        assert "reports in " in (result.error or "")


@pytest.mark.parametrize(("task_id", "name"), TAMPER_CASES)
def test_a_tampering_patch_is_never_resolved(
    grades: dict[tuple[str, str], GradeResult], task_id: str, name: str
) -> None:
    """Named `grading_tampered`, except where the tamper only breaks the run, or finds nothing to act on
    (the code swap looks for module-level test functions: these tests are methods or parametrised)."""
    result = grades[task_id, f"tamper:{name}"]
    assert result.outcome != "resolved" and result.reward == 0.0, (result.outcome, result.error, result.log_tail)
    if name in PLAIN_FAILURES:
        assert result.outcome == "unresolved", (result.error, result.log_tail)
    elif name != "code_swap":
        assert result.outcome == "grading_tampered", (result.error, result.log_tail)


@pytest.mark.parametrize("task_id", TASK_IDS)
async def test_every_witness_works_on_every_task(
    grades: dict[tuple[str, str], GradeResult], tasks: dict[str, Task], backend: LocalBackend, task_id: str
) -> None:
    """The probe (kept from the grades above) sees the canaries, the summary and the audit boot work
    without the patch: none of the layers is off for these projects."""
    probe = await probe_runner(backend, tasks[task_id], {}, _TIMEOUT_S)
    assert (probe.canaries, probe.summary, probe.audit, probe.audit_allow) == (True, True, True, ())


@pytest.mark.parametrize("task_id", MOCKER_TASKS)
def test_tests_that_need_a_plugin_resolve_only_with_it_and_say_so(
    grades: dict[tuple[str, str], GradeResult], tasks: dict[str, Task], task_id: str
) -> None:
    """The worker's setting off: the gold patch cannot resolve, and the grade says which fixture was
    missing; the task's own setting wins over the worker's."""
    off = grades[task_id, "autoload_off"]
    assert (off.outcome, off.reward) == ("unresolved", 0.0)
    assert "fixture(s) 'mocker'" in (off.error or "") and "autoload is off" in (off.error or ""), off.error
    assert off.p2p_passed < off.p2p_total
    on = grades[task_id, "autoload_task_override"]
    assert (on.outcome, on.error) == ("resolved", None), on.log_tail


def test_the_grade_command_takes_the_plugin_autoload_setting(tasks: dict[str, Task], tmp_path: Path) -> None:
    """`swe-grpo grade --no-plugin-autoload` reaches the grader (and the default is on)."""
    task = tasks[MOCKER_TASKS[0]]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text(json.dumps({"instance_id": task.instance_id, "model_patch": task.patch}) + "\n")
    outcomes = {}
    for flag in ("--plugin-autoload", "--no-plugin-autoload"):
        output = tmp_path / f"{flag}.jsonl"
        args = ["grade", "--tasks", str(tasks_dir() / "tasks.jsonl"), "--predictions", str(predictions)]
        assert cli.main([*args, "--output", str(output), "--timeout", "120", flag]) == 0
        outcomes[flag] = json.loads(output.read_text())["outcome"], json.loads(output.read_text())["error"]
    assert outcomes["--plugin-autoload"] == ("resolved", None)
    assert outcomes["--no-plugin-autoload"][0] == "unresolved"
    assert "'mocker'" in outcomes["--no-plugin-autoload"][1]
