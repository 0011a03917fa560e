"""Calibrating a task from its gold run (issue 23 §1: "strict statuses, unless the gold run says otherwise"):
a FAIL_TO_PASS test that the project's own xfail marker keeps XFAIL or XPASS under the reference fix makes
the strict grader refuse the gold; `gold_statuses` / `swe-grpo tasks calibrate` record those statuses from a
real gold grade, after which the gold resolves and a patch that does not fix still does not. Everything on
the real `local` backend with the real grader."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from cheats import committed_task
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse here; `local_backend` is conftest's)

from swe_grpo import cli
from swe_grpo.grading import GoldUnresolved, gold_statuses, grade
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task, load_tasks

SCALE = "def scale(x, factor):\n    return x\n"  # the bug: the factor is ignored
# The reference fix: integers scale; floats are a known limitation, left for later (NotImplementedError).
FIXED = """\
def scale(x, factor):
    if isinstance(factor, float):
        raise NotImplementedError("float factors")
    return x * factor
"""
TESTS = """\
import pytest

from scale import scale


def test_int():
    assert scale(2, 3) == 6


def test_one():
    assert scale(5, 1) == 5


@pytest.mark.xfail(raises=NotImplementedError, strict=False, reason="float factors come later")
def test_float():
    assert scale(2, 1.5) == 3.0


@pytest.mark.xfail(raises=NotImplementedError, strict=False, reason="negative factors may come later")
def test_negative():
    assert scale(2, -1) == -2
"""
T = "tests/test_scale.py::"
# At base, test_float and test_negative fail (an AssertionError is not the NotImplementedError the marker
# expects); with the fix, test_float is XFAIL and test_negative XPASS.
EXPECTED = {f"{T}test_float": "xfail", f"{T}test_negative": "xpass"}


def scale_task(repo: Path, instance_id: str, fail_to_pass: tuple[str, ...], fixed: str = FIXED) -> Task:
    repo.mkdir(exist_ok=True)
    return committed_task(
        repo,
        {"scale.py": SCALE, "tests/test_scale.py": TESTS},
        fixed={"scale.py": fixed},
        instance_id=instance_id,
        problem_statement="scale ignores its factor",
        fail_to_pass=fail_to_pass,
        pass_to_pass=(f"{T}test_one",),
    )


@pytest.fixture(scope="module")
def xfail_task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return scale_task(tmp_path_factory.mktemp("xfail"), "local__scale-xfail", (f"{T}test_int", *EXPECTED))


async def test_an_xfail_gold_resolves_once_calibrated(local_backend: LocalBackend, xfail_task: Task) -> None:
    strict = await grade(xfail_task, xfail_task.patch, local_backend, timeout_s=60)
    assert (strict.outcome, strict.reward) == ("unresolved", 0.0), (strict.error, strict.log_tail)
    assert (strict.error or "").startswith("a FAIL_TO_PASS test passes only as PASSED"), strict.error
    found = await gold_statuses(xfail_task, local_backend, timeout_s=60)
    assert found == EXPECTED
    calibrated = replace(xfail_task, expected_statuses=found)
    gold = await grade(calibrated, calibrated.patch, local_backend, timeout_s=60)
    assert (gold.outcome, gold.reward, gold.error) == ("resolved", 1.0, None), gold.log_tail
    # Recording what the gold does opens nothing: without a fix, those tests fail, as XFAIL or not.
    empty = await grade(calibrated, "", local_backend, timeout_s=60)
    assert (empty.outcome, empty.reward) == ("unresolved", 0.0)
    assert {t: empty.tests[t] for t in EXPECTED} == dict.fromkeys(EXPECTED, "failed")


async def test_a_passed_gold_records_nothing(local_backend: LocalBackend, tmp_path: Path) -> None:
    task = scale_task(tmp_path, "local__scale-int", (f"{T}test_int",))
    stale = replace(task, expected_statuses={f"{T}test_int": "xfail"})  # recomputed, not kept
    assert await gold_statuses(stale, local_backend, timeout_s=60) == {}


async def test_a_gold_that_fails_is_refused(local_backend: LocalBackend, tmp_path: Path) -> None:
    task = scale_task(tmp_path, "local__scale-wrong", (f"{T}test_int", *EXPECTED), fixed=SCALE + "\n\n# later\n")
    with pytest.raises(GoldUnresolved, match=r"the gold patch grades unresolved.*test_int \(failed\)") as refused:
        await gold_statuses(task, local_backend, timeout_s=60)
    assert refused.value.grade is not None and refused.value.grade.outcome == "unresolved"
    with pytest.raises(GoldUnresolved, match="no gold patch"):
        await gold_statuses(replace(task, patch=""), local_backend, timeout_s=60)


def row(task: Task, repo: str) -> dict:
    return {
        "instance_id": task.instance_id,
        "repo": repo,
        "base_commit": task.base_commit,
        "problem_statement": task.problem_statement,
        "patch": task.patch,
        "FAIL_TO_PASS": list(task.fail_to_pass),
        "PASS_TO_PASS": list(task.pass_to_pass),
        "source": "kept as it is",
    }


def test_the_command_line_calibrates_a_task_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`swe-grpo tasks calibrate`: rows whose gold resolves are written with `expected_statuses` (a local repo
    path still leading to the repository from the new file's directory); a row whose gold fails is named on
    stderr, left out, and the exit status says so."""
    tasks_dir, out_dir = tmp_path / "tasks", tmp_path / "out"
    tasks_dir.mkdir()
    out_dir.mkdir()
    xfail = scale_task(tasks_dir / "xfail", "local__scale-xfail", (f"{T}test_int", *EXPECTED))
    passed = scale_task(tasks_dir / "int", "local__scale-int", (f"{T}test_int",))
    wrong = scale_task(tasks_dir / "wrong", "local__scale-wrong", (f"{T}test_int",), fixed=SCALE + "\n# later\n")
    rows = [row(xfail, "xfail"), row(passed, str(tasks_dir / "int")), row(wrong, "./wrong")]
    (tasks_dir / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = out_dir / "calibrated.jsonl"
    argv = ["tasks", "calibrate", str(tasks_dir / "tasks.jsonl"), "-o", str(out), "--timeout", "60"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "local__scale-wrong" in err and "the gold patch grades unresolved" in err, err
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["instance_id"] for r in written] == ["local__scale-xfail", "local__scale-int"]
    assert [r["expected_statuses"] for r in written] == [EXPECTED, {}]
    assert written[0]["repo"] == "../tasks/xfail" and written[1]["repo"] == str(tasks_dir / "int")
    assert all(r["source"] == "kept as it is" for r in written)
    loaded = load_tasks(out)
    assert [(t.repo, t.expected_statuses) for t in loaded] == [(xfail.repo, EXPECTED), (passed.repo, {})]
