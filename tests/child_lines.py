"""A child process's first line of output, read with a deadline. A test that starts a child and waits for it to say
it is ready must not block on the read: a child that hangs before it prints (or that blocks writing a full stderr
pipe nobody reads) would hold the test, and the suite, until pytest's own timeout, with nothing said about why.
Here the child's stderr goes to a file, and a child that has not printed its line by the deadline fails the test
with its exit status and the tail of that file."""

from __future__ import annotations

import os
import selectors
import subprocess
import time
from pathlib import Path


def first_line(child: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float, stderr: Path) -> str:
    """The first line `child` writes to its stdout (a pipe), without its newline. Fails (AssertionError) when the
    child exits before a whole line or writes none within `timeout_s`, naming which and quoting `stderr` (the
    file its stderr was sent to). The rest of stdout is left unread; read it from `child.stdout.fileno()`."""
    assert child.stdout is not None
    fd = child.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    got = b""
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in got:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                raise AssertionError(f"the child printed no line within {timeout_s:.0f} s{_said(child, stderr)}")
            chunk = os.read(fd, 4096)  # raw reads: the pipe's buffered reader would block for a whole line
            if not chunk:
                child.wait()
                raise AssertionError(f"the child exited (code {child.returncode}) before a line{_said(child, stderr)}")
            got += chunk
    return got.split(b"\n", 1)[0].decode()


def _said(child: subprocess.Popen[bytes] | subprocess.Popen[str], stderr: Path) -> str:
    tail = stderr.read_text(errors="replace")[-4000:] if stderr.exists() else ""
    return f" (pid {child.pid}); its stderr ends:\n{tail}"
