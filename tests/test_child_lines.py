"""`first_line` (tests/child_lines.py), which the tests that wait for a child to say it is ready read it with: the
line comes through whatever the child writes to stderr first, and a child that never prints fails at the deadline
with its stderr, instead of blocking the test until pytest's timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_lines import first_line


def start(script: str, stderr: Path) -> subprocess.Popen[bytes]:
    with stderr.open("wb") as err:
        return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)


def test_the_line_comes_after_more_stderr_than_a_pipe_holds(tmp_path: Path) -> None:
    """256 KiB on stderr first: a child whose stderr is an unread pipe would block there and never print."""
    child = start(
        f"{sys.executable} -c \"import sys; sys.stderr.write('x' * 262144)\"; echo READY; sleep 60", tmp_path / "err"
    )
    try:
        assert first_line(child, 120, tmp_path / "err") == "READY"
    finally:
        child.kill()
        child.wait()


def test_a_child_that_never_prints_fails_at_the_deadline_with_its_stderr(tmp_path: Path) -> None:
    err = tmp_path / "err"
    child = start("echo stuck waiting for the model >&2; exec sleep 600", err)
    try:
        while not err.read_text():  # what it says before it hangs is there to be quoted
            time.sleep(0.05)
        began = time.monotonic()
        with pytest.raises(AssertionError, match=r"(?s)no line within 2 s.*stuck waiting for the model"):
            first_line(child, 2, err)
        assert time.monotonic() - began < 30  # the deadline, not the child's 600 s
    finally:
        child.kill()
        child.wait()


def test_a_child_that_exits_first_fails_with_its_exit_code_and_stderr(tmp_path: Path) -> None:
    child = start("printf 'half a line'; echo cannot start >&2; exit 3", tmp_path / "err")
    with pytest.raises(AssertionError, match=r"(?s)exited \(code 3\) before a line.*cannot start"):
        first_line(child, 120, tmp_path / "err")
