"""Grading on the real `local` sandbox backend (bubblewrap as `swe-sandbox`; needs root, as it does) with
the bundled demo tasks: gold patches resolve, empty ones do not, and none of the ways a patch could cheat
(edit or delete tests, conftest.py hooks, plugins through ini files or entry points, shadowing pytest,
start-up hooks, reward files, a forged JUnit report) changes a grade. Each cheat is first shown to work
when a patch is applied unfiltered, so the test proves the filter is what stops it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from cheats import CHEATS, append, conftest_hooks, delete_tests, files_under_test, git, make_patch, source_module
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse here; `local_backend` is conftest's)

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import (
    DEFAULT_TEST_CMD,
    GradeResult,
    RunnerImports,
    command_words,
    grade,
    grade_predictions,
    is_protected,
    junit_key,
    load_predictions,
    report_statuses,
)
from swe_grpo.sandbox.base import Mount, Sandbox, SandboxBackend
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task, TaskFormatError, task_from_row

TASKS = demo_tasks()
TASK_IDS = [task.instance_id.split("__")[1] for task in TASKS]
STRUTIL = next(task for task in TASKS if "strutil" in task.instance_id)


def unfiltered_junit_statuses(task: Task, patch: str, tmp_path: Path) -> dict[str, str]:
    """What a naive grader sees: the patch and the test patch applied as they are, pytest run with plugin
    autoload on by the interpreter the local sandbox runs (the host's), and the JUnit report trusted."""
    repo = tmp_path / "naive"
    git(tmp_path, "clone", "-q", task.repo, str(repo))
    git(repo, "checkout", "-q", task.base_commit)
    git(repo, "apply", "-", input_text=patch)
    git(repo, "apply", "-", input_text=task.test_patch)
    junit = tmp_path / "junit.xml"
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    env["SWE_GRPO_JUNIT_XML"] = str(junit)  # as the grader's runner has it
    cmd = ["/usr/bin/python3", "-m", "pytest", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}", *ids]
    subprocess.run(cmd, cwd=repo, env=env, capture_output=True, timeout=120)
    statuses = report_statuses(ids, junit.read_text(), "")
    assert statuses is not None
    return statuses


def assert_model_failure(result: GradeResult, *outcomes: str) -> None:
    assert result.outcome in (outcomes or ("unresolved",)) and result.reward == 0.0, (result.error, result.log_tail)


# --- gold, empty, cheats ------------------------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS, ids=TASK_IDS)
async def test_the_gold_patch_resolves(local_backend: LocalBackend, task: Task) -> None:
    result = await grade(task, task.patch, local_backend, timeout_s=120)
    assert (result.outcome, result.reward, result.error) == ("resolved", 1.0, None), result.log_tail
    assert (result.f2p_passed, result.p2p_passed) == (result.f2p_total, result.p2p_total) != (0, 0)
    assert set(result.tests) == {*task.fail_to_pass, *task.pass_to_pass}
    assert result.dropped_paths == ()
    assert {"sandbox_s", "apply_s", "tests_s", "total_s"} <= result.timings.keys()


@pytest.mark.parametrize("task", TASKS, ids=TASK_IDS)
async def test_an_empty_patch_does_not_resolve(local_backend: LocalBackend, task: Task) -> None:
    result = await grade(task, "", local_backend, timeout_s=120)
    assert_model_failure(result)
    assert (result.f2p_passed, result.p2p_passed) == (0, result.p2p_total)
    assert all(result.tests[test_id] == "failed" for test_id in task.fail_to_pass)


@pytest.mark.parametrize("cheat", [name for name in CHEATS if name != "edit_test_script"])  # needs a script
@pytest.mark.parametrize("task", TASKS, ids=TASK_IDS)
async def test_a_cheating_patch_does_not_resolve(
    local_backend: LocalBackend, task: Task, cheat: str, tmp_path: Path
) -> None:
    edit, must_drop, works_unfiltered = CHEATS[cheat]
    patch = make_patch(task, edit)
    if works_unfiltered:
        statuses = unfiltered_junit_statuses(task, patch, tmp_path)
        assert all(status == "passed" for status in statuses.values()), f"the {cheat} cheat does not even work"
    # With the plugins that are installed allowed to load, so that only the filter stands in the way. What
    # the filter keeps of a cheat (a plugin module without the configuration that would load it) is code
    # that reaches into pytest: the static scan names it.
    result = await grade(task, patch, local_backend, timeout_s=120, plugin_autoload=True)
    assert_model_failure(result, "unresolved", "grading_tampered")
    assert result.outcome == "unresolved" or (result.error or "").startswith("static scan: ")
    assert result.f2p_passed == 0
    present = {path for pair in re.findall(r"^diff --git a/(\S+) b/(\S+)$", patch, re.MULTILINE) for path in pair}
    expected = must_drop(task) & present
    assert expected <= set(result.dropped_paths)
    assert expected or not must_drop(task), "the patch does not contain what the cheat is about"
    assert all(is_protected(path) or path in files_under_test(task) | expected for path in result.dropped_paths)
    if cheat == "forge_report_at_exit":
        assert "reports in " + source_module(task) in (result.error or "")  # its report path search


@pytest.mark.parametrize("task", TASKS, ids=TASK_IDS)
async def test_cheats_next_to_the_fix_do_not_hide_it(local_backend: LocalBackend, task: Task) -> None:
    """The filter drops only the protected paths: the fix in the same patch still counts."""

    def fix_and_cheat(repo: Path, task: Task) -> None:
        git(repo, "apply", "-", input_text=task.patch)
        conftest_hooks(repo, task)
        delete_tests(repo, task)

    result = await grade(task, make_patch(task, fix_and_cheat), local_backend, timeout_s=120)
    assert result.outcome == "resolved", (result.error, result.log_tail)
    assert "conftest.py" in result.dropped_paths


# --- patches that do not apply, hangs, crashes, broken tasks, broken sandboxes ----------------------


LOOK = "atexit.register(lambda: print('REPORT PATH:', os.environ.get('SWE_GRPO_JUNIT_XML'), file=sys.stderr))"


async def test_the_report_path_is_not_in_the_environment_of_the_code_under_test(local_backend: LocalBackend) -> None:
    def look(repo: Path, task: Task) -> None:
        git(repo, "apply", "-", input_text=task.patch)
        append(
            repo / source_module(task),
            f"\n\nimport atexit, os, sys\n\n{LOOK}\n",
        )

    # An exit handler and the report's variable by name are what the capability gate refuses; this task
    # allows them by name.
    patch = make_patch(STRUTIL, look)
    scanned = await grade(STRUTIL, patch, local_backend, timeout_s=120)
    assert (scanned.outcome, scanned.error) == (
        "grading_tampered",
        f"static scan: atexit in strutil.py: import atexit, os, sys; reports in strutil.py: {LOOK}",
    )
    result = await grade(replace(STRUTIL, tamper_allow=("reports", "atexit")), patch, local_backend, timeout_s=120)
    assert result.outcome == "resolved", (result.error, result.log_tail)
    assert "REPORT PATH: None" in result.log_tail


async def test_a_patch_that_does_not_apply(local_backend: LocalBackend) -> None:
    stale = STRUTIL.patch.replace("-    return text[:width] + placeholder", "-    return text[:width] + suffix")
    result = await grade(STRUTIL, stale, local_backend, timeout_s=120)
    assert_model_failure(result, "patch_apply_failed")
    assert "strutil.py" in (result.error or "")
    garbage = await grade(STRUTIL, "I fixed it, trust me.", local_backend, timeout_s=120)
    assert_model_failure(garbage, "patch_apply_failed")


async def test_a_hanging_test_command_is_a_timeout_without_reward(local_backend: LocalBackend) -> None:
    task = replace(STRUTIL, test_cmd="python3 -c 'import time; time.sleep(60)'")
    result = await grade(task, task.patch, local_backend, timeout_s=2)
    assert (result.outcome, result.reward) == ("timeout", None)
    assert "without it either" in (result.error or "")


async def test_a_patch_that_hangs_the_tests_is_a_timeout_with_reward_0(local_backend: LocalBackend) -> None:
    def hang(repo: Path, task: Task) -> None:
        append(repo / source_module(task), "\n\nimport time\n\ntime.sleep(3600)\n")

    result = await grade(STRUTIL, make_patch(STRUTIL, hang), local_backend, timeout_s=3)
    assert_model_failure(result, "timeout")
    assert "they finish without it" in (result.error or "")


def kill_the_runner(repo: Path, task: Task) -> None:
    append(repo / source_module(task), "\n\nimport os\nimport signal\n\nos.kill(os.getpid(), signal.SIGKILL)\n")


async def test_a_patch_that_kills_the_runner_is_tampering(local_backend: LocalBackend) -> None:
    """The boot's exit record is missing: whatever ended the runner, it was not the runner. (The capability gate
    refuses `os.kill` first; allowed here, so that the witness behind it is what is tested.)"""
    task = replace(STRUTIL, tamper_allow=("process-control",))
    result = await grade(task, make_patch(task, kill_the_runner), local_backend, timeout_s=60)
    assert_model_failure(result, "grading_tampered")
    assert "never reached its interpreter's exit" in (result.error or "")


async def test_a_patch_that_kills_a_runner_without_the_boot_does_not_resolve(local_backend: LocalBackend) -> None:
    """A runner started by absolute path gets no boot (the probe sees that): no report, and a control run
    without the patch that has one, is the patch's fault."""
    task = replace(
        STRUTIL,
        test_cmd=DEFAULT_TEST_CMD.replace("python3", "/usr/bin/python3"),
        tamper_allow=("process-control",),  # past the capability gate, to the control run behind it
    )
    result = await grade(task, make_patch(task, kill_the_runner), local_backend, timeout_s=60)
    assert_model_failure(result)
    assert "broke the test runner" in (result.error or "")
    assert "control_s" in result.timings


async def test_a_test_command_without_a_report_is_an_infra_error(local_backend: LocalBackend) -> None:
    result = await grade(replace(STRUTIL, test_cmd="true"), STRUTIL.patch, local_backend, timeout_s=60)
    assert (result.outcome, result.reward) == ("infra_error", None)
    assert "no report" in (result.error or "")


async def test_a_test_patch_that_does_not_apply_is_an_infra_error(local_backend: LocalBackend) -> None:
    broken = replace(STRUTIL, test_patch=STRUTIL.test_patch.replace('truncate("hello", 2)', 'truncate("hello", 3)'))
    result = await grade(broken, STRUTIL.patch, local_backend, timeout_s=60)
    assert (result.outcome, result.reward) == ("infra_error", None)
    assert "test_patch does not apply" in (result.error or "")


async def test_a_task_without_fail_to_pass_tests_is_never_resolved(local_backend: LocalBackend) -> None:
    result = await grade(replace(STRUTIL, fail_to_pass=()), STRUTIL.patch, local_backend, timeout_s=60)
    assert (result.outcome, result.reward) == ("infra_error", None)


async def test_a_sandbox_that_cannot_be_created_is_an_infra_error(local_backend: LocalBackend) -> None:
    result = await grade(replace(STRUTIL, base_commit="f" * 40), STRUTIL.patch, local_backend, timeout_s=60)
    assert (result.outcome, result.reward) == ("infra_error", None)
    assert (result.error or "").startswith("sandbox: ")


class DestroyedOnArrival(SandboxBackend):
    """Hands out real local sandboxes that are already destroyed, so their first use fails for real."""

    name = "destroyed"

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner

    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = False) -> Sandbox:
        sandbox = await self.inner.create(task, mounts, network=network)
        await sandbox.destroy()
        return sandbox


async def test_a_sandbox_failing_mid_grade_is_an_infra_error(local_backend: LocalBackend) -> None:
    result = await grade(STRUTIL, STRUTIL.patch, DestroyedOnArrival(local_backend), timeout_s=60)
    assert (result.outcome, result.reward) == ("infra_error", None)
    assert "destroyed" in (result.error or "")


async def test_cancelling_a_grade_destroys_its_sandbox(local_backend: LocalBackend, run_dir: Path) -> None:
    marker = "time.sleep(61.25)"
    task = replace(STRUTIL, test_cmd=f"python3 -c '{marker}'")
    grading = asyncio.create_task(grade(task, task.patch, local_backend, timeout_s=60))
    for _ in range(500):
        await asyncio.sleep(0.02)
        if running(marker):
            break
    else:
        raise AssertionError("the tests never started")
    grading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await grading
    assert not running(marker)
    assert list(run_dir.iterdir()) == []


def running(needle: str) -> bool:
    """Whether a host process has `needle` in its command line."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle.encode() in (proc / "cmdline").read_bytes():
                return True
        except OSError:  # exited meanwhile
            pass
    return False


# --- predictions --------------------------------------------------------------------------------------


async def test_grade_predictions_keeps_their_order(local_backend: LocalBackend, tmp_path: Path) -> None:
    predictions = [
        *({"instance_id": task.instance_id, "model_patch": task.patch} for task in TASKS),
        {"instance_id": TASKS[0].instance_id, "model_patch": None},
        {"instance_id": TASKS[1].instance_id, "model_patch": ""},
    ]
    path = tmp_path / "preds.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in predictions))
    assert load_predictions(path) == predictions
    path.write_text(json.dumps(predictions))
    assert load_predictions(path) == predictions

    results = await grade_predictions(TASKS, predictions, local_backend, concurrency=3, timeout_s=120)
    assert [r.instance_id for r in results] == [p["instance_id"] for p in predictions]
    assert [r.outcome for r in results] == ["resolved"] * len(TASKS) + ["unresolved", "unresolved"]


async def test_grade_predictions_checks_every_prediction_first(local_backend: LocalBackend) -> None:
    good = {"instance_id": STRUTIL.instance_id, "model_patch": ""}
    with pytest.raises(KeyError, match="nope"):
        await grade_predictions(TASKS, [good, {"instance_id": "nope", "model_patch": ""}], local_backend)
    with pytest.raises(ValueError, match="model_patch is not a string"):
        await grade_predictions(TASKS, [good, {"instance_id": STRUTIL.instance_id, "model_patch": 3}], local_backend)


# --- the rules, without sandboxes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "protected"),
    [
        ("strutil.py", False),
        ("src/pkg/core.py", False),
        ("pkg/__init__.py", False),
        ("docs/testing.md", False),  # a file named testing.md is not test code
        ("attest.py", False),
        ("pytest_helpers/x.md", False),  # a non-module file in a non-package directory
        ("tests/test_a.py", True),
        ("tests/helpers.py", True),
        ("pkg/tests/data/x.json", True),
        ("testing/util.py", True),
        ("test-data/unit/check.test", True),
        ("e2e/run.py", True),
        ("pkg/test_core.py", True),
        ("pkg/core_test.py", True),
        ("pkg/conftest.py", True),
        ("conftest.py", True),
        ("pytest.ini", True),
        ("sub/tox.ini", True),
        ("setup.cfg", True),
        ("pyproject.toml", True),
        (".pytest.ini", True),
        ("sitecustomize.py", True),
        ("lib/usercustomize.py", True),
        ("x.pth", True),
        ("pkg/__pycache__/core.cpython-311.pyc", True),
        ("pkg/core.pyc", True),
        ("cheat-1.0.dist-info/entry_points.txt", True),
        ("pkg.egg-info/entry_points.txt", True),
        (".gitattributes", True),
        ("pytest.py", True),
        ("pytest/__init__.py", True),
        ("_pytest/__init__.py", True),
        ("pluggy.py", True),
        ("json.py", True),
        ("xml/__init__.py", True),
        ("unittest.cpython-311-x86_64-linux-gnu.so", True),
        ("pytest_mock.py", True),
        ("json/data.txt", False),  # not a package without an __init__: cannot shadow the real json
        ("pkg/json.py", False),  # not top-level: `pkg.json`
    ],
)
def test_protected_paths(path: str, protected: bool) -> None:
    assert is_protected(path) is protected


def test_modules_the_runner_imports_are_protected_where_it_looks_for_them() -> None:
    """`attr` (pytest 7 imports it) shadows only when the probe saw the runner import it from outside the
    repository, and only in a directory on the runner's sys.path (here the root and src/)."""
    runner = RunnerImports(search_dirs=frozenset({"", "src"}), names=frozenset({"attr"}))
    assert not is_protected("attr/__init__.py")  # not in the fallback: only the probe knows
    assert is_protected("attr/__init__.py", runner=runner)
    assert is_protected("src/attr.py", runner=runner)
    assert is_protected("src/json.py", runner=runner)  # the standard library, always
    assert not is_protected("src/pkg/attr.py", runner=runner)  # `pkg.attr`
    assert not is_protected("lib/attr.py", runner=runner)  # lib/ is not on the runner's path
    assert not is_protected("src/mypkg/__init__.py", runner=runner)


def test_the_words_of_a_test_command_that_may_name_files() -> None:
    assert command_words('bash run_tests.sh --junitxml="$SWE_GRPO_JUNIT_XML" -k x') == ["bash", "run_tests.sh", "x"]
    assert command_words("PYTHONPATH=src python3 ./runtests.py -m tools.runner") == [
        "python3",
        "runtests.py",
        "tools/runner.py",
    ]


@pytest.mark.parametrize(("value", "expected"), [(True, True), (False, False), (None, None)])
def test_a_task_row_sets_plugin_autoload(value: bool | None, expected: bool | None) -> None:
    row = {**BASE_ROW, "plugin_autoload": value}
    assert task_from_row(row, source="t.jsonl", where="line 1").plugin_autoload is expected
    assert task_from_row(BASE_ROW, source="t.jsonl", where="line 1").plugin_autoload is None


def test_a_task_row_with_a_bad_plugin_autoload_is_refused() -> None:
    with pytest.raises(TaskFormatError, match=r"plugin_autoload.*expected true, false or null"):
        task_from_row({**BASE_ROW, "plugin_autoload": "yes"}, source="t.jsonl", where="line 1")


BASE_ROW = {
    "instance_id": "a__b-1",
    "repo": "a/b",
    "base_commit": "0" * 40,
    "problem_statement": "x",
    "FAIL_TO_PASS": ["t.py::test_x"],
}


def test_explicit_paths_their_parents_and_children_are_protected() -> None:
    explicit = {"checks/regress.py"}
    assert is_protected("checks/regress.py", explicit)
    assert is_protected("checks", explicit)  # a file where the test patch needs a directory
    assert is_protected("checks/regress.py/x", explicit)
    assert not is_protected("checks/other.py", explicit)
    assert not is_protected("checks/regress.pyx", explicit)


def test_junit_keys_follow_pytest() -> None:
    assert junit_key("tests/test_a.py::test_x") == ("tests.test_a", "test_x")
    assert junit_key("tests/test_a.py::TestC::test_y[a::b-1.5]") == ("tests.test_a.TestC", "test_y[a::b-1.5]")
    assert junit_key("test_top.py::test_z") == ("test_top", "test_z")


IDS = ["t/test_a.py::test_ok", "t/test_a.py::test_bad", "t/test_a.py::test_xf", "t/test_a.py::test_skip"]
JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="t.test_a" name="test_ok"/>
<testcase classname="t.test_a" name="test_bad"><failure message="no"/></testcase>
<testcase classname="t.test_a" name="test_xf"><skipped type="pytest.xfail" message="known"/></testcase>
<testcase classname="t.test_a" name="test_skip"><skipped type="pytest.skip" message="later"/></testcase>
</testsuite></testsuites>"""
SUMMARY = """\
some test output
PASSED t/test_a.py::test_bad
==================== short test summary info ====================
PASSED t/test_a.py::test_ok
FAILED t/test_a.py::test_bad - AssertionError: no
XFAIL t/test_a.py::test_xf - known
SKIPPED [1] t/test_a.py:9: later
=========== 1 failed, 1 passed, 1 skipped, 1 xfailed in 0.1s ===========
"""
EXPECTED = {IDS[0]: "passed", IDS[1]: "failed", IDS[2]: "xfail", IDS[3]: "skipped"}


def test_statuses_from_junit_summary_or_both() -> None:
    assert report_statuses(IDS, JUNIT, SUMMARY) == EXPECTED
    assert report_statuses(IDS, JUNIT, "") == EXPECTED
    # Missing or garbled XML: the summary decides (a skipped test has no id on its line: missing).
    summary_only = {**EXPECTED, IDS[3]: "missing"}
    assert report_statuses(IDS, None, SUMMARY) == summary_only
    assert report_statuses(IDS, JUNIT[:40], SUMMARY) == summary_only
    assert report_statuses(IDS, "<html>not a report</html>", SUMMARY) == summary_only
    assert report_statuses(IDS, None, "1 passed") is None
    assert report_statuses(IDS, "garbled", "") is None


def test_a_report_cannot_vouch_for_what_the_other_denies() -> None:
    forged = JUNIT.replace('<failure message="no"/>', "")
    assert report_statuses(IDS, forged, SUMMARY)[IDS[1]] == "failed"  # the real summary still says FAILED
    # A test the JUnit report does not name is missing, whatever a (possibly printed) summary claims.
    extra = "t/test_a.py::test_never_ran"
    claimed = SUMMARY + f"PASSED {extra}\n"
    assert report_statuses([*IDS, extra], JUNIT, claimed)[extra] == "missing"
    # Status lines printed by tests before the real summary header do not count on their own...
    assert report_statuses(IDS, None, SUMMARY)[IDS[1]] == "failed"
    # ...and a duplicated test keeps its worst status.
    twice = JUNIT.replace(
        "</testsuite>", '<testcase classname="t.test_a" name="test_ok"><error/></testcase></testsuite>'
    )
    assert report_statuses(IDS, twice, "")[IDS[0]] == "error"
