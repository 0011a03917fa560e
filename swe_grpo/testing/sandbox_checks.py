"""What the sandbox backend contract (`swe_grpo.testing.backend_contract`) works with: a small repository with a
base commit and a later fix the sandbox must not show (`make_repo`, `calc_task`), and host-side process checks
(`marker`, `host_pids`, `wait_for_pids`) that find a sandbox's processes by their command line. The project's
own tests use them too (tests/sandbox_helpers.py)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
from pathlib import Path

from swe_grpo.tasks import Task

CALC = "def add(a, b):\n    return a + b\n"
TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
# Fixed dates make the commits, and so the prepared images keyed by them, the same on every run.
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
}


def git(repo: Path, *args: str) -> str:
    """`git -C repo args...` with a fixed identity and dates; its stdout, stripped. Raises on failure."""
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **GIT_ENV}).stdout.strip()


def make_repo(parent: Path, *, with_tests: bool = False) -> Path:
    """A small project with a base commit and a later "fix" commit the agent must not see; the same
    commit ids on every run. `with_tests`: the base commit also holds `tests/test_calc.py` (one test,
    which passes)."""
    root = parent / "calc"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
    if with_tests:
        (root / "tests").mkdir()
        (root / "tests" / "test_calc.py").write_text(TEST_CALC)
    (root / "logo.bin").write_bytes(bytes(range(256)) * 4)
    (root / "old.txt").write_text("old\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    (root / "calc.py").write_text(CALC + "\n\ndef sub(a, b):\n    return a - b\n")
    git(root, "commit", "-qam", "the fix")
    git(root, "tag", "v1")
    return root


def calc_task(repo: Path) -> Task:
    """The task of `make_repo`'s repository, at its base commit."""
    return Task(
        instance_id="demo__calc-1", repo=str(repo), base_commit=git(repo, "rev-parse", "HEAD~1"), problem_statement=""
    )


def marker() -> str:
    """A unique `sleep` duration: the process that sleeps it is findable on the host by its argv."""
    return f"{random.randint(1000, 9999)}.{random.randint(10**8, 10**9)}"


def host_pids(needle: str) -> list[int]:
    """Host processes (other than this one) whose command line contains `needle`."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle.encode() in Path(entry.path, "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # exited meanwhile
                pass
    return pids


async def wait_for_pids(needle: str) -> list[int]:
    """The host processes whose command line holds `needle`, once there is one (within ~10 s, else
    `AssertionError`)."""
    for _ in range(1000):
        if pids := host_pids(needle):
            return pids
        await asyncio.sleep(0.01)
    raise AssertionError(f"no process with {needle!r} appeared")
