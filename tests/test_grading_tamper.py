"""A patch whose code runs inside the test runner cannot fake a pass (issue 23, section 1): every tampering
patch in tests/tampers.py, graded on the real `local` backend with the real grader, is never `resolved`,
and the ones that reach into the runner are named `grading_tampered` (reward 0.0). Each tamper that
works against a grader without these defences says so in `TAMPERS`; `test_the_tampers_work_naively`
shows they do, by running them with plain pytest and trusting its JUnit report. Most are refused by the
capability gate before any test runs; `test_each_witness_on_its_own` allows every capability to show the
in-process witnesses still name them. The forging catalogue written against the whole defence
(tests/forgeries.py, issue 32) is graded here for its armed few."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from cheats import committed_task, git, make_patch
from forgeries import FORGERIES, forgery_patch
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse here; `local_backend` is conftest's)
from tampers import PLAIN_FAILURES, TAMPERS, UNITTEST_TAMPERS, tamper_patch

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import (
    DEFAULT_TEST_CMD,
    SCAN_RULES,
    WITNESSES,
    AuditReport,
    GradeResult,
    RunReports,
    grade,
    report_statuses,
)
from swe_grpo.grading.probe import probe_runner
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task, TaskFormatError, task_from_row

INIPARSE = next(task for task in demo_tasks() if "iniparse" in task.instance_id)


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
    return committed_task(
        tmp_path_factory.mktemp("calc"),
        {"calc.py": CALC, "tests/test_calc.py": CALC_TESTS},
        fixed={"calc.py": CALC.replace("return a - b", "return a + b", 1)},
        instance_id="local__calc-1",
        problem_statement="add subtracts",
        fail_to_pass=("tests/test_calc.py::CalcTest::test_add",),
        pass_to_pass=("tests/test_calc.py::CalcTest::test_sub",),
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
    local_backend: LocalBackend, name: str, which: str, unittest_task: Task
) -> None:
    task, patch = _task_and_patch(name, which, unittest_task)
    result = await grade(task, patch, local_backend, timeout_s=60)
    assert result.outcome != "resolved" and result.reward == 0.0, (result.outcome, result.error, result.log_tail)
    expected = "unresolved" if name in PLAIN_FAILURES else "grading_tampered"
    assert result.outcome == expected, (result.error, result.log_tail)
    assert result.f2p_passed == 0 or result.outcome == "grading_tampered"


@pytest.mark.parametrize("which", ["iniparse", "unittest"])
async def test_the_gold_patch_still_resolves(local_backend: LocalBackend, which: str, unittest_task: Task) -> None:
    task = INIPARSE if which == "iniparse" else unittest_task
    result: GradeResult = await grade(task, task.patch, local_backend, timeout_s=60)
    assert (result.outcome, result.reward, result.error) == ("resolved", 1.0, None), result.log_tail


EVENTS = ("os.exec", "sys.settrace", "object.__setattr__", "foreign")


@pytest.mark.parametrize(
    ("name", "allow", "because"),
    [
        # The scan allowed: the audit boot names them.
        ("code_swap", (), "audit: the audit hook saw object.__setattr__ __code__ from /"),
        ("settrace", (), "audit: the audit hook saw sys.settrace from /"),
        ("reexec_runner", (), "audit: the audit hook saw os.exec "),
        ("patch_report_class", (), "audit: the audit hook saw foreign _pytest.reports.TestReport.__init__ from /"),
        ("targeted_hook", (), "audit: the audit hook saw foreign hook pytest_runtest_makereport from /"),
        ("patch_runtest", (), "audit: the audit hook saw foreign _pytest.python.Function.runtest from /"),
        ("filter_output", (), "audit: the audit hook saw foreign TerminalReporter._tw._file from /"),
        ("os_exit_at_exit", (), "audit: the runner never reached its interpreter's exit"),
        ("delete_audit_report", (), "audit: the audit hook never started"),
        # Also every audit event: the exec'd runner has no boot of its own, so no exit record.
        ("user_site", EVENTS, "audit: the runner never reached its interpreter's exit"),
        # ...the canaries, and the two reports against each other.
        (
            "plugin_at_import",
            EVENTS,
            "the grader's canary tests (one must pass, one must fail) came out passed and passed",
        ),
        ("no_call_phase", EVENTS, "the JUnit report and the summary disagree: tests/test_iniparse.py::test_value_"),
        ("rewrite_junit_at_exit", EVENTS, "the run printed no test summary, which this runner prints"),
    ],
)
async def test_each_witness_on_its_own(
    local_backend: LocalBackend, name: str, allow: tuple[str, ...], because: str
) -> None:
    """With the layers before it allowed for the task (every capability of the gate, then the audit's events),
    the next one still names the tamper. The runner's limits are off: they would end the runs that exec
    before these in-process witnesses see them (tests/test_graded_run_limits.py)."""
    task = replace(INIPARSE, tamper_allow=(*SCAN_RULES, *allow), runner_limits=False)
    result = await grade(task, tamper_patch(INIPARSE, TAMPERS[name][0]), local_backend, timeout_s=60)
    assert (result.outcome, result.reward) == ("grading_tampered", 0.0), (result.error, result.log_tail)
    assert (result.error or "").startswith(because), result.error


async def test_an_expected_xfail_recorded_for_the_task_passes(local_backend: LocalBackend) -> None:
    """A FAIL_TO_PASS test whose gold run is an XFAIL, recorded in the task, may pass as one; nothing else
    changes (the P2P tests, the canaries, the reports still count)."""
    patch = tamper_patch(INIPARSE, TAMPERS["xfail_on_buggy_path"][0])
    strict = await grade(replace(INIPARSE, tamper_allow=tuple(SCAN_RULES)), patch, local_backend, timeout_s=60)
    assert (strict.outcome, strict.reward) == ("unresolved", 0.0)
    assert (strict.error or "").startswith("a FAIL_TO_PASS test passes only as PASSED: tests/test_iniparse.py::")
    recorded = replace(
        INIPARSE, tamper_allow=tuple(SCAN_RULES), expected_statuses=dict.fromkeys(INIPARSE.fail_to_pass, "xfail")
    )
    result = await grade(recorded, patch, local_backend, timeout_s=60)
    assert (result.outcome, result.error) == ("resolved", None), result.log_tail


# --- the rules, without sandboxes -----------------------------------------------------------------------

IDS = ["t/test_a.py::test_ok", "t/test_a.py::test_bad"]
JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="t.test_a" name="test_ok"/>
<testcase classname="t.test_a" name="test_bad"><failure message="no"/></testcase>
<testcase classname="t.test_a" name="test_skip"><skipped type="pytest.skip" message="later"/></testcase>
</testsuite></testsuites>"""
SUMMARY = """\
=========================== short test summary info ============================
PASSED t/test_a.py::test_ok
SKIPPED [1] t/test_a.py:9: later
FAILED t/test_a.py::test_bad - AssertionError: no
==================== 1 failed, 1 passed, 1 skipped in 0.1s =====================
"""


def test_reports_that_agree_and_count_right() -> None:
    reports = RunReports.parse(IDS, JUNIT, SUMMARY)
    assert reports.disagreements([*IDS, "t/test_a.py::test_skip"]) == []
    assert reports.count_mismatch() is None
    assert RunReports.parse(IDS, JUNIT, SUMMARY.replace("=" * 20 + " 1 failed", "1 failed")).count_mismatch() is None


XPASS_IDS = ["t/test_a.py::test_x", "t/test_a.py::test_x[a b]", "t/test_a.py::test_y"]
XPASS_JUNIT = """<?xml version="1.0"?><testsuites><testsuite>
<testcase classname="t.test_a" name="test_x"/><testcase classname="t.test_a" name="test_x[a b]"/>
<testcase classname="t.test_a" name="test_y"/></testsuite></testsuites>"""


@pytest.mark.parametrize(
    "lines",
    [
        # pytest < 8 writes an XPASS's reason after a space, pytest 8 after " - ".
        [
            "XPASS t/test_a.py::test_x later - maybe",
            "XPASS t/test_a.py::test_x[a b] later",
            "XPASS t/test_a.py::test_y",
        ],
        [
            "XPASS t/test_a.py::test_x - later - maybe",
            "XPASS t/test_a.py::test_x[a b] - later",
            "XPASS t/test_a.py::test_y",
        ],
    ],
)
def test_a_non_strict_xpass_is_a_pass_in_junit_and_an_xpass_in_the_summary(lines: list[str]) -> None:
    """JUnit has no word for a non-strict XPASS (a testcase without children, as a pass): the two reports agree,
    and the test's status is the summary's, whichever way pytest wrote its reason."""
    summary = "=== short test summary info ===\n" + "\n".join(lines) + "\n=== 3 xpassed in 0.1s ===\n"
    reports = RunReports.parse(XPASS_IDS, XPASS_JUNIT, summary)
    assert (reports.disagreements(XPASS_IDS), reports.count_mismatch()) == ([], None)
    assert report_statuses(XPASS_IDS, XPASS_JUNIT, summary) == dict.fromkeys(XPASS_IDS, "xpass")


@pytest.mark.parametrize(
    ("junit", "summary", "disagree", "mismatch"),
    [
        # A forged JUnit report: the summary still says FAILED.
        (JUNIT.replace('<failure message="no"/>', ""), SUMMARY, ["t/test_a.py::test_bad (passed in"], "the JUnit"),
        # A test that never ran its call phase: in the JUnit report, absent from the summary.
        (JUNIT, SUMMARY.replace("PASSED t/test_a.py::test_ok\n", ""), ["t/test_a.py::test_ok (passed in"], "the"),
        # A fake summary printed after the real one: a second closing line.
        (
            JUNIT,
            SUMMARY + "PASSED t/test_a.py::test_bad\n===== 2 passed in 0.1s =====\n",
            [],
            "the summary has 2",
        ),
        # A closing line that does not count its own lines.
        (JUNIT, SUMMARY.replace("1 failed, 1 passed", "2 passed"), [], "the summary counts 2 passed but lists 1"),
    ],
)
def test_reports_that_do_not(junit: str, summary: str, disagree: list[str], mismatch: str) -> None:
    reports = RunReports.parse(IDS, junit, summary)
    found = reports.disagreements(IDS)
    assert len(found) == len(disagree) and all(f.startswith(d) for f, d in zip(found, disagree, strict=True)), found
    assert (reports.count_mismatch() or "").startswith(mismatch)


def test_the_audit_report_needs_the_nonce_a_start_and_an_exit() -> None:
    clean = "n1 7 start \nn1 9 event ignored? no: counted\nn1 7 end pytest\n"
    assert AuditReport.parse("n1 7 start \nn1 7 end pytest\n", "n1").tampering() is None
    assert AuditReport.parse("n1 7 start \nn1 7 end pytest\n", "n1").pytest
    assert AuditReport.parse(clean, "n1").tampering() == "the audit hook saw ignored? no: counted"
    assert "written by someone else" in (AuditReport.parse("x 7 start \nn1 7 start \n", "n1").tampering() or "")
    assert "never started" in (AuditReport.parse("", "n1").tampering() or "")
    assert "never reached" in (AuditReport.parse("n1 7 start \nn1 8 end pytest\n", "n1").tampering() or "")


async def test_the_probe_sees_which_witnesses_a_runner_supports(local_backend: LocalBackend) -> None:
    """A witness is used only where it works without the patch: a runner started by absolute path gets no
    boot, and so no canaries (the grader's sitecustomize hands the selection to pytest off its command line;
    without it the ids would be on the command line, where the patch's code reads them); the reports still
    count. A command that is no test runner gets none."""
    witnesses = await probe_runner(local_backend, INIPARSE, {}, 60)
    assert (witnesses.canaries, witnesses.summary, witnesses.audit, witnesses.audit_allow) == (True, True, True, ())
    absolute = replace(INIPARSE, test_cmd=DEFAULT_TEST_CMD.replace("python3", "/usr/bin/python3"))
    witnesses = await probe_runner(local_backend, absolute, {}, 60)
    assert (witnesses.canaries, witnesses.summary, witnesses.audit) == (False, True, False)
    witnesses = await probe_runner(local_backend, replace(INIPARSE, test_cmd="true"), {}, 60)
    assert (witnesses.canaries, witnesses.summary, witnesses.audit) == (False, False, False)


async def test_a_grade_names_the_witnesses_that_were_active(local_backend: LocalBackend) -> None:
    """`GradeResult.witnesses` says which layers vouched for a grade, as the probe decided them: all six for
    a task run by `python3 -m pytest`; no boot, no runner limits and no canaries for a runner started by
    absolute path (the PATH shim never runs, nor the grader's sitecustomize, which also hands the canaries'
    ids to pytest); no scan where the task allows all its rules.
    The field travels wherever a grade is written."""
    every = ("scan", "pinned_env", "boot", "canaries", "consistency", "limits")
    assert every == WITNESSES
    full = await grade(INIPARSE, INIPARSE.patch, local_backend, timeout_s=60)
    assert (full.outcome, full.witnesses) == ("resolved", every), (full.error, full.log_tail)
    absolute = replace(INIPARSE, test_cmd=DEFAULT_TEST_CMD.replace("python3", "/usr/bin/python3"))
    no_boot = await grade(absolute, INIPARSE.patch, local_backend, timeout_s=60)
    unbooted = tuple(w for w in every if w not in ("boot", "limits", "canaries"))
    assert (no_boot.outcome, no_boot.witnesses) == ("resolved", unbooted)
    unscanned = await grade(replace(INIPARSE, tamper_allow=tuple(SCAN_RULES)), "", local_backend, timeout_s=60)
    assert (unscanned.outcome, unscanned.witnesses) == ("unresolved", every[1:])
    assert json.loads(json.dumps(asdict(no_boot)))["witnesses"] == list(unbooted)


ROW = {
    "instance_id": "a__b-1",
    "repo": "a/b",
    "base_commit": "0" * 40,
    "problem_statement": "x",
    "FAIL_TO_PASS": ["t.py::test_x"],
}


def test_a_task_row_records_expected_statuses_and_allowed_checks() -> None:
    row = {**ROW, "expected_statuses": {"t.py::test_x": "xfail"}, "tamper_allow": ["pytest-hooks", "foreign"]}
    task = task_from_row(row, source="t.jsonl", where="line 1")
    assert (task.expected_statuses, task.tamper_allow) == ({"t.py::test_x": "xfail"}, ("pytest-hooks", "foreign"))
    plain = task_from_row(ROW, source="t.jsonl", where="line 1")
    assert (plain.expected_statuses, plain.tamper_allow, plain.metadata) == ({}, (), {})
    with pytest.raises(TaskFormatError, match="expected_statuses"):
        task_from_row({**ROW, "expected_statuses": {"t.py::test_x": "failed"}}, source="t.jsonl", where="line 1")
    with pytest.raises(TaskFormatError, match="tamper_allow"):
        task_from_row({**ROW, "tamper_allow": "pytest-hooks"}, source="t.jsonl", where="line 1")


# --- the forging catalogue (tests/forgeries.py) against real grades: the gate is what holds -----------------


@pytest.mark.parametrize("name", [name for name, forgery in FORGERIES.items() if forgery.armed])
async def test_an_armed_forgery_resolves_without_the_gate_and_is_refused_with_it(
    local_backend: LocalBackend, name: str
) -> None:
    """Every case of the catalogue is refused by the gate alone (tests/test_capability_gate.py); these few,
    graded for real with every capability allowed (the gate off), forge a pass past every other layer, so
    the catalogue is armed and the gate, not the boot, stops them."""
    patch = forgery_patch(INIPARSE, FORGERIES[name])
    naked = await grade(replace(INIPARSE, tamper_allow=SCAN_RULES), patch, local_backend, timeout_s=60)
    assert (naked.outcome, naked.reward, naked.error) == ("resolved", 1.0, None), naked.log_tail
    assert "scan" not in naked.witnesses and "boot" in naked.witnesses and "canaries" in naked.witnesses
    gated = await grade(INIPARSE, patch, local_backend, timeout_s=60)
    assert (gated.outcome, gated.reward) == ("grading_tampered", 0.0), gated.error
    assert (gated.error or "").startswith("static scan: "), gated.error
    assert f"{FORGERIES[name].capability} in iniparse.py: " in (gated.error or ""), gated.error


async def test_a_file_the_gate_cannot_parse_earns_nothing(local_backend: LocalBackend) -> None:
    """The gold fix plus a Python file the grader's Python cannot parse (which no test imports): the tests
    pass, but code the gate never read earns no reward."""

    def edit(repo: Path, task: Task) -> None:
        git(repo, "apply", "-", input_text=task.patch)
        (repo / "helpers.py").write_text("def later(:\n    pass\n")

    result = await grade(INIPARSE, make_patch(INIPARSE, edit), local_backend, timeout_s=180)
    assert (result.outcome, result.reward) == ("grading_tampered", 0.0), (result.error, result.log_tail)
    assert result.error == "static scan: the grader's Python cannot parse helpers.py, and the run would earn a reward"


async def test_a_module_turned_into_a_symbolic_link_is_refused(local_backend: LocalBackend) -> None:
    """A link named like code runs what it points at: here the module under test points at a text file that
    holds the fix and a forgery; the gate, which reads files and not what links point at, refuses it."""

    def edit(repo: Path, task: Task) -> None:
        git(repo, "apply", "-", input_text=task.patch)
        fixed = (repo / "iniparse.py").read_text()
        (repo / "iniparse.txt").write_text(fixed + "\nimport gc as _gc\n\n_gc.freeze()\n")
        (repo / "iniparse.py").unlink()
        (repo / "iniparse.py").symlink_to("iniparse.txt")

    result = await grade(INIPARSE, make_patch(INIPARSE, edit), local_backend, timeout_s=180)
    assert (result.outcome, result.reward) == ("grading_tampered", 0.0), (result.error, result.log_tail)
    assert (result.error or "").startswith("static scan: binary in iniparse.py: a symbolic link"), result.error
