"""tests/parallel.py, which `make test` runs the suite on two pytest-xdist workers with: run on a small suite of its
own under `-n 2`, the tests of a module stay on one worker, a test marked `alone` and a `the_run_alone()` block
overlap no other test, and the other tests do run side by side (or the checks above would hold trivially)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent

CONFTEST = """
from parallel import (  # noqa: F401
    pytest_collection_modifyitems, pytest_configure, pytest_runtest_protocol, pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
"""
# Each test writes `name worker start end` when it ends.
RECORD = """
import os, time, pytest
from pathlib import Path
from parallel import the_run_alone

def record(name, start, end):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']} {start} {end}\\n")

def shared(name):
    start = time.time(); time.sleep(0.4); record(name, start, time.time())
"""
MODULE_A = RECORD + "".join(f"\ndef test_a{i}():\n    shared('a{i}')\n" for i in range(6))
MODULE_B = RECORD + "".join(f"\ndef test_b{i}():\n    shared('b{i}')\n" for i in range(6))
MODULE_C = RECORD + textwrap.dedent("""
    @pytest.mark.alone
    def test_alone():
        shared("alone")

    def test_block():
        time.sleep(0.2)
        with the_run_alone():
            start = time.time(); time.sleep(0.4); record("block", start, time.time())
        time.sleep(0.2)
    """)


def run_under_two_workers(tmp_path: Path, modules: dict[str, str]) -> dict[str, tuple[str, float, float]]:
    """Run `modules` (file name -> text) with `-n 2` and the suite's hooks: each test's worker, start and end."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: alone\n    lockfree: lockfree\n")
    for name, text in modules.items():
        (tmp_path / name).write_text(text)
    record = tmp_path / "record.txt"
    outer = ("PYTEST_XDIST", "SWE_GRPO_XDIST")  # this run's own, when it runs under xdist itself
    env = {k: v for k, v in os.environ.items() if not k.startswith(outer)} | {
        "PYTHONPATH": str(TESTS),
        "RECORD": str(record),
    }
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split() for line in record.read_text().splitlines()]
    return {name: (worker, float(start), float(end)) for name, worker, start, end in rows}


def overlap(runs: dict[str, tuple[str, float, float]], x: str, y: str) -> bool:
    return runs[x][1] < runs[y][2] and runs[y][1] < runs[x][2]


def test_groups_and_the_alone_lock_under_two_workers(tmp_path: Path) -> None:
    runs = run_under_two_workers(tmp_path, {"test_a.py": MODULE_A, "test_b.py": MODULE_B, "test_c.py": MODULE_C})
    assert len(runs) == 14
    for module in "ab":
        assert len({runs[f"{module}{i}"][0] for i in range(6)}) == 1  # one worker per module
    for lone in ("alone", "block"):
        assert [name for name in runs if name != lone and overlap(runs, lone, name)] == []
    # The premise: the shared tests of the two modules ran at the same time.
    assert any(overlap(runs, f"a{i}", f"b{j}") for i in range(6) for j in range(6))


# A lockfree test (5 s) and an alone test that starts its timed part once the lockfree one has begun: the alone one
# must not wait for it (had it taken the lock, the alone test would run only after it, or wait 60 s for it).
MODULE_FREE = RECORD + textwrap.dedent("""
    @pytest.mark.lockfree
    def test_free():
        start = time.time()
        Path(os.environ["RECORD"] + ".started").touch()
        time.sleep(5)
        record("free", start, time.time())
    """)
MODULE_ALONE = RECORD + textwrap.dedent("""
    @pytest.mark.alone
    def test_alone():
        deadline = time.time() + 60
        while not Path(os.environ["RECORD"] + ".started").exists() and time.time() < deadline:
            time.sleep(0.05)
        shared("alone")
    """)


def test_an_alone_test_does_not_wait_for_a_lockfree_one(tmp_path: Path) -> None:
    runs = run_under_two_workers(tmp_path, {"test_free.py": MODULE_FREE, "test_lone.py": MODULE_ALONE})
    assert runs["free"][0] != runs["alone"][0]  # the premise: one worker each
    assert overlap(runs, "alone", "free")
