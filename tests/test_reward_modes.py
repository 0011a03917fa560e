"""Reward modes (issue 25, section 4): `binary` (SWE-bench's, the default) and `fraction` (the share of
FAIL_TO_PASS tests passing, 0.0 when a PASS_TO_PASS test does not pass), per run and per task. Graded on
the real `local` backend with the real grader and the bundled demo tasks; the attacker's tests are patches
a policy would write to earn a partial reward under `fraction` without earning it: deleting the tests it
still fails, keeping the PASS_TO_PASS tests from running, forging a pass for one test only."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from cheats import append, committed_task, make_patch, source_module
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse here; `local_backend` is conftest's)
from tampers import NO_CALL_PHASE

from swe_grpo.cli import parse_args, rollout_config
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import SCAN_RULES, GradeResult, grade
from swe_grpo.rollout import RolloutConfig
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task, TaskFormatError, task_from_row
from swe_grpo.worker.config import WorkerConfig

INTERVALS = next(task for task in demo_tasks() if "intervals" in task.instance_id)  # 3 F2P, 4 P2P in one file
INIPARSE = next(task for task in demo_tasks() if "iniparse" in task.instance_id)  # 2 F2P
CORE = "intervals/core.py"
# Fixes only `total_length` (one of the three FAIL_TO_PASS tests); `merge` keeps its bug.
PARTIAL = (
    "    return sum(len(interval) for interval in merge(intervals))",
    "    return sum(map(len, merge(sorted(intervals))))",
)
GOLD = ("    for interval in intervals:", "    for interval in sorted(intervals):")
# Breaks a PASS_TO_PASS test (test_interval_rejects_reversed_bounds), nothing else.
BREAK_P2P = ("        if self.end < self.start:", "        if False:")


def edited(task: Task, path: str, *replacements: tuple[str, str]) -> str:
    def edit(repo: Path, task: Task) -> None:
        text = (repo / path).read_text()
        for old, new in replacements:
            assert old in text, old
            text = text.replace(old, new)
        (repo / path).write_text(text)

    return make_patch(task, edit)


def combined(task: Task, *edits: tuple[str, tuple[str, str]]) -> str:
    def edit(repo: Path, task: Task) -> None:
        for path, (old, new) in edits:
            text = (repo / path).read_text()
            assert old in text, old
            (repo / path).write_text(text.replace(old, new))

    return make_patch(task, edit)


async def graded(backend: LocalBackend, task: Task, patch: str, mode: str) -> GradeResult:
    return await grade(task, patch, backend, timeout_s=60, reward_mode=mode)  # type: ignore[arg-type]


# --- the modes on a real task -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["binary", "fraction"])
async def test_the_gold_patch_earns_one_in_both_modes(local_backend: LocalBackend, mode: str) -> None:
    result = await graded(local_backend, INTERVALS, INTERVALS.patch, mode)
    assert (result.outcome, result.reward, result.reward_mode, result.error) == ("resolved", 1.0, mode, None)


@pytest.mark.parametrize(("mode", "reward"), [("binary", 0.0), ("fraction", 1 / 3)])
async def test_a_partial_fix_earns_the_share_only_under_fraction(
    local_backend: LocalBackend, mode: str, reward: float
) -> None:
    result = await graded(local_backend, INTERVALS, edited(INTERVALS, CORE, PARTIAL), mode)
    assert (result.outcome, result.reward, result.reward_mode) == ("unresolved", reward, mode), result.log_tail
    assert (result.f2p_passed, result.f2p_total, result.p2p_passed) == (1, 3, 4)


async def test_the_tasks_own_mode_wins(local_backend: LocalBackend) -> None:
    patch = edited(INTERVALS, CORE, PARTIAL)
    fraction = await graded(local_backend, replace(INTERVALS, reward_mode="fraction"), patch, "binary")
    assert (fraction.reward, fraction.reward_mode) == (1 / 3, "fraction")
    binary = await graded(local_backend, replace(INTERVALS, reward_mode="binary"), patch, "fraction")
    assert (binary.reward, binary.reward_mode) == (0.0, "binary")


@pytest.mark.parametrize("mode", ["binary", "fraction"])
async def test_breaking_a_pass_to_pass_test_earns_nothing(local_backend: LocalBackend, mode: str) -> None:
    patch = edited(INTERVALS, CORE, GOLD, BREAK_P2P)
    result = await graded(local_backend, INTERVALS, patch, mode)
    assert (result.outcome, result.reward) == ("unresolved", 0.0), result.log_tail
    assert (result.f2p_passed, result.p2p_passed) == (3, 3)


async def test_a_run_that_times_out_stays_timeout_under_fraction(local_backend: LocalBackend) -> None:
    """The partial fix, with `merge` hanging on the input of one FAIL_TO_PASS test."""
    hang = (
        "    merged: list[Interval] = []",
        "    merged: list[Interval] = []\n    while any(i.end == 12 for i in intervals):\n        pass",
    )
    patch = edited(INTERVALS, CORE, PARTIAL, hang)
    result = await grade(INTERVALS, patch, local_backend, timeout_s=8, reward_mode="fraction")
    assert (result.outcome, result.reward, result.reward_mode) == ("timeout", 0.0, "fraction"), result.error


# --- the attacker under fraction ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_files_task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    """A task whose FAIL_TO_PASS tests (tests/test_fix.py) and PASS_TO_PASS tests (tests/test_keep.py)
    live in different files, each importing its own function from the package `calc`."""
    ops = (
        "def add(a, b):\n    return a - b\n\n\ndef double(a):\n    return a - a\n\n\ndef sub(a, b):\n    return a - b\n"
    )
    files = {
        "calc/__init__.py": "from calc.ops import add, double, sub\n",
        "calc/ops.py": ops,
        "tests/test_fix.py": "from calc import add, double\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_double():\n    assert double(2) == 4\n",
        "tests/test_keep.py": "from calc import sub\n\n\ndef test_sub():\n    assert sub(2, 3) == -1\n\n\n"
        "def test_sub_zero():\n    assert sub(2, 0) == 2\n",
    }
    return committed_task(
        tmp_path_factory.mktemp("twofiles"),
        files,
        instance_id="local__twofiles-1",
        problem_statement="add and double subtract",
        fail_to_pass=("tests/test_fix.py::test_add", "tests/test_fix.py::test_double"),
        pass_to_pass=("tests/test_keep.py::test_sub", "tests/test_keep.py::test_sub_zero"),
    )


ADD_FIX = ("calc/ops.py", ("def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b"))


async def test_deleting_the_tests_it_fails_does_not_raise_the_share(
    local_backend: LocalBackend, two_files_task: Task
) -> None:
    """Under `fraction`, the patch would like the FAIL_TO_PASS test it does not fix to vanish from the
    count: it fixes `add` and deletes `test_double`. The test file is protected (the deletion is dropped),
    and a FAIL_TO_PASS test no report names would count as failed anyway: the share stays 1/2."""

    def edit(repo: Path, task: Task) -> None:
        ops = repo / "calc" / "ops.py"
        ops.write_text(ops.read_text().replace(*ADD_FIX[1]))
        tests = repo / "tests" / "test_fix.py"
        tests.write_text(tests.read_text().split("\n\n\ndef test_double")[0] + "\n")
        assert "test_double" not in tests.read_text()

    result = await graded(local_backend, two_files_task, make_patch(two_files_task, edit), "fraction")
    assert (result.outcome, result.reward) == ("unresolved", 0.5), (result.error, result.log_tail)
    assert result.dropped_paths == ("tests/test_fix.py",)


# Two ways to keep the PASS_TO_PASS tests (which use `sub`) from running, with no pytest name and nothing
# the scan or the audit knows: `unittest.SkipTest` when their file imports `sub` (a collection-time skip of
# the whole file), or when a test calls it (each test skipped).
SKIP_AT_IMPORT = """from calc.ops import add, double


def __getattr__(name):
    if name == "sub":
        import unittest

        raise unittest.SkipTest("not today")
    raise AttributeError(name)
"""
SKIP_WHEN_CALLED = """from calc.ops import add, double


def sub(a, b):
    import unittest

    raise unittest.SkipTest("not today")
"""


@pytest.mark.parametrize(("init", "f2p_passed"), [(SKIP_AT_IMPORT, 0), (SKIP_WHEN_CALLED, 1)], ids=["import", "call"])
async def test_keeping_the_pass_to_pass_tests_from_running_earns_nothing(
    local_backend: LocalBackend, two_files_task: Task, init: str, f2p_passed: int
) -> None:
    """The patch fixes one of two FAIL_TO_PASS tests and keeps the PASS_TO_PASS tests from running: none
    of them FAILS, which a grader that counted only the PASS_TO_PASS tests it saw fail would pay half
    for. A test that did not pass is not passed. (Skipped at collection, the file's explicit test ids
    are not found and pytest runs nothing at all.)"""
    sanity = await graded(local_backend, two_files_task, combined(two_files_task, ADD_FIX), "fraction")
    assert (sanity.outcome, sanity.reward) == ("unresolved", 0.5), sanity.log_tail  # the honest partial fix

    def edit(repo: Path, task: Task) -> None:
        ops = repo / "calc" / "ops.py"
        ops.write_text(ops.read_text().replace(*ADD_FIX[1]))
        (repo / "calc" / "__init__.py").write_text(init)

    # The capability gate refuses `import unittest` first: allowed here, so that the reward's arithmetic behind
    # it is what is tested.
    task = replace(two_files_task, tamper_allow=("test-machinery",))
    result = await graded(local_backend, task, make_patch(task, edit), "fraction")
    assert (result.outcome, result.reward) == ("unresolved", 0.0), (result.error, result.log_tail)
    assert (result.f2p_passed, result.p2p_passed) == (f2p_passed, 0), (result.tests, result.log_tail)
    assert {result.tests[t] for t in two_files_task.pass_to_pass} <= {"missing", "skipped"}, result.tests


async def test_a_forged_pass_of_one_test_earns_no_share(local_backend: LocalBackend) -> None:
    """Under `binary` a forged pass only pays when every test passes; under `fraction` forging ONE of
    the two FAIL_TO_PASS tests would pay half. The forgery (a runtest protocol that skips the call phase
    of that test) is allowed past the static scan and the audit boot for this task, so only the checks
    of a complete, consistent run are left to catch it: they must hold for a partial reward too."""
    first = INIPARSE.fail_to_pass[0].split("::")[-1]

    def edit(repo: Path, task: Task) -> None:
        append(repo / source_module(task), "\n" + NO_CALL_PHASE.format(f2p=[first]))

    task = replace(INIPARSE, tamper_allow=(*SCAN_RULES, "os.exec", "sys.settrace", "object.__setattr__", "foreign"))
    result = await graded(local_backend, task, make_patch(INIPARSE, edit), "fraction")
    assert (result.outcome, result.reward) == ("grading_tampered", 0.0), (result.error, result.log_tail)
    assert (result.error or "").startswith("the JUnit report and the summary disagree"), result.error


# --- where the mode is set ---------------------------------------------------------------------------------


def test_the_mode_is_validated_everywhere() -> None:
    row = {
        "instance_id": "a__b-1",
        "repo": "a/b",
        "base_commit": "0" * 40,
        "problem_statement": "x",
        "FAIL_TO_PASS": ["t.py::t"],
    }
    assert task_from_row(row, source="s", where="line 1").reward_mode is None
    assert task_from_row({**row, "reward_mode": None}, source="s", where="line 1").reward_mode is None
    assert task_from_row({**row, "reward_mode": "fraction"}, source="s", where="line 1").reward_mode == "fraction"
    for bad in ("partial", 1, ["binary"]):
        with pytest.raises(TaskFormatError, match=r"s: line 3: field 'reward_mode': expected binary, fraction"):
            task_from_row({**row, "reward_mode": bad}, source="s", where="line 3")
    with pytest.raises(ValueError, match="unknown reward_mode 'partial'"):
        RolloutConfig(agent=None, reward_mode="partial")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown reward_mode 'partial'"):
        WorkerConfig(reward_mode="partial")  # type: ignore[arg-type]
    assert WorkerConfig(reward_mode="fraction").reward_mode == "fraction"


def test_the_cli_takes_the_mode_for_rollout_and_grade() -> None:
    rollout = ["rollout", "--tasks", "demo", "--vllm-url", "http://x", "--model", "m"]
    grade_ = ["grade", "--tasks", "demo", "--predictions", "p.jsonl", "--output", "o.jsonl"]
    for argv in (rollout, grade_):
        assert parse_args(argv).reward_mode == "binary"
        assert parse_args([*argv, "--reward-mode", "fraction"]).reward_mode == "fraction"
        if argv is rollout:
            assert rollout_config(parse_args([*argv, "--reward-mode", "fraction"]), 4096).reward_mode == "fraction"
        with pytest.raises(SystemExit):
            parse_args([*argv, "--reward-mode", "partial"])
