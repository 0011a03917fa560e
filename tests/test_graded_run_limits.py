"""The graded runner's out-of-process limits (issue 32 §2, `swe_grpo.grading.limits`): the kernel ends a runner
that starts a process, execs, reaches into another process or re-points pytest's saved descriptors, and
the grader names it from the runner's exit status.

First the filter itself, installed the way the grader installs it (the grader's sitecustomize piece in a
real Python process on this host's kernel), against each way around it an attacker has; then whole grades
on the real `local` and `docker` backends: the issue's three escapes (a child forked at import that
reports and leaves by `os._exit`, a second runner spawned at exit, pytest's saved stdout pointed at a spool
file) and a runner that forges its own status of the limits before it forks each grade `grading_tampered`
(the grader reads the kill from the exit status the sandbox's exec reports, not from the runner), while
the gold (with a thread of its own) resolves with the limits in force; a base suite that runs a subprocess
itself still grades, with the limits lifted and recorded.

The attack patches carry `tamper_allow` for the process and descriptor capabilities, so that the
capability gate lets them through to the run: this file tests the limits, not the gate."""

from __future__ import annotations

import asyncio
import json
import platform
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from cheats import append, committed_task, git, make_patch, source_module

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import DEFAULT_TEST_CMD, grade
from swe_grpo.grading.gold import calibrate_file
from swe_grpo.grading.limits import LIMIT_ENV, limit_secret, limit_source
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task, load_tasks

STRUTIL = next(task for task in demo_tasks() if "strutil" in task.instance_id)
# The scan's and the gate's names for what the attacks use: let them reach the run.
ALLOW = ("process-control", "exit", "reports")

# Each runs in a Python process under the limits; x86-64 numbers for the raw calls (pytestmark below).
PRELUDE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
"""
ESCAPES = {
    "fork": "os.fork()",
    "clone without CLONE_THREAD": "libc.syscall(56, 17, 0, 0, 0, 0)",  # SIGCHLD: what fork() asks
    "vfork": "libc.syscall(58)",
    "posix_spawn": "os.posix_spawn('/bin/true', ['true'], {})",
    "subprocess": "import subprocess; subprocess.run(['true'])",
    "execve": "os.execv('/bin/true', ['true'])",
    "execveat": "libc.syscall(322, -100, b'/bin/true', None, None, 0)",
    "dup2 onto a saved copy": "os.dup2(r, w)",
    "dup3 onto a saved copy": "os.dup2(r, w, inheritable=False)",
    "F_DUPFD with a floor": "import fcntl; fcntl.fcntl(r, fcntl.F_DUPFD, 7)",
    "ptrace the parent": "libc.syscall(101, 16, os.getppid(), 0, 0)",
    "process_vm_writev": "libc.syscall(311, os.getppid(), 0, 0, 0, 0, 0)",
    "pidfd_getfd": "libc.syscall(438, 0, 1, 0)",
}
# What stays allowed: threads (clone3 fails with ENOSYS, so libc falls back to clone with CLONE_THREAD),
# pytest's capture (dup2 onto 0, 1, 2), os.dup, opening and closing files.
ALLOWED = """
import threading
done = []
thread = threading.Thread(target=lambda: done.append(1))
thread.start()
thread.join()
assert done
assert libc.syscall(435, 0, 0) == -1 and ctypes.get_errno() == 38  # clone3: ENOSYS
saved = os.dup(1)
os.dup2(w, 1)
os.dup2(saved, 1)
os.close(saved)
with open(os.devnull) as f:
    f.read()
print("ok")
"""

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="raw calls by x86-64 number")


def limited_python(tmp_path: Path, code: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run `code` in a Python process that installs the limits as a graded runner does; its result and
    what the installer wrote to its status file."""
    site, secret, status = tmp_path / "site", tmp_path / "secret", tmp_path / "status"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(limit_source())
    status.write_text("")
    secret.write_bytes(limit_secret(str(status)))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), LIMIT_ENV: str(secret)}
    done = subprocess.run([sys.executable, "-c", PRELUDE + code], env=env, capture_output=True, text=True, timeout=60)
    assert not secret.exists()  # read once, by the first process
    return done, status.read_text()


@pytest.mark.parametrize("escape", ESCAPES)
def test_every_way_out_ends_the_runner(tmp_path: Path, escape: str) -> None:
    done, status = limited_python(tmp_path, ESCAPES[escape] + "\nprint('escaped')")
    assert status.startswith("limited"), status
    assert done.returncode == -signal.SIGSYS and "escaped" not in done.stdout, (done.returncode, done.stderr)


def test_threads_capture_and_files_keep_working(tmp_path: Path) -> None:
    done, status = limited_python(tmp_path, ALLOWED)
    assert status.startswith("limited"), status
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


# Appended to the demo task's module, whose bug they leave in place: the escapes.
FORK_AND_REPORT = """
import os as _os
import sys as _sys

if _os.fork() == 0:  # the child reports every test passed, then leaves without a trace
    _sys.stdout.write("".join(f"PASSED {_id}\\n" for _id in _sys.argv if "::" in _id))
    _sys.stdout.flush()
    _os._exit(0)
"""
RUNNER_AT_EXIT = """
import atexit as _atexit
import subprocess as _subprocess
import sys as _sys

_atexit.register(lambda: _subprocess.run([_sys.executable, "-c", "print('a second runner')"]))
"""
SPOOLED_STDOUT = """
import os as _os
import stat as _stat
import tempfile as _tempfile

_spool = _tempfile.TemporaryFile()
for _fd in range(3, 64):  # pytest's saved copy of the runner's stdout: a pipe above 2
    try:
        if _stat.S_ISFIFO(_os.fstat(_fd).st_mode):
            _os.dup2(_spool.fileno(), _fd)
    except OSError:
        pass
"""
# A runner that forges its own report of the limits (the status the grader's piece wrote before any repository
# code: "unlimited"), then forks: the grader reads the kill from the exit status, not from that report.
FORGED_STATUS = """
import glob as _glob
import os as _os

for _status in _glob.glob("/tmp/swe_grpo-grade.*/limited-*"):
    with open(_status, "w") as _f:
        _f.write("unlimited ImportError: forged by the patch\\n")
if _os.fork() == 0:
    _os._exit(0)
"""
# The gold fix, with a thread of its own at import: threads stay allowed.
THREADED = """
import threading as _threading

_worker = _threading.Thread(target=lambda: None)
_worker.start()
_worker.join()
"""


def appended(code: str, *, fixed: bool = False) -> Callable[[Path, Task], None]:
    def edit(repo: Path, task: Task) -> None:
        if fixed:
            git(repo, "apply", "-", input_text=task.patch)
        append(repo / source_module(task), "\n\n" + code)

    return edit


async def test_escapes_grade_tampered_and_the_gold_resolves(backend: SandboxBackend) -> None:
    task = replace(STRUTIL, tamper_allow=ALLOW)
    patches = {
        "gold": make_patch(task, appended(THREADED, fixed=True)),
        "fork": make_patch(task, appended(FORK_AND_REPORT)),
        "runner at exit": make_patch(task, appended(RUNNER_AT_EXIT)),
        "spooled stdout": make_patch(task, appended(SPOOLED_STDOUT)),
        "forged status": make_patch(task, appended(FORGED_STATUS)),
    }
    graded = await asyncio.gather(*(grade(task, patch, backend, timeout_s=120) for patch in patches.values()))
    results = dict(zip(patches, graded, strict=True))
    gold = results.pop("gold")
    assert (gold.outcome, gold.reward) == ("resolved", 1.0), (gold.error, gold.log_tail)
    assert "limits" in gold.witnesses
    for name, result in results.items():
        assert (result.outcome, result.reward) == ("grading_tampered", 0.0), (name, result.error, result.log_tail)
        assert result.error is not None and result.error.startswith("limits: "), (name, result.error)


CLI = "def greet(name):\n    return 'hello ' + name\n"
# A base suite that runs the project's code in a subprocess: it needs what the limits refuse.
CLI_TESTS = """\
import subprocess
import sys

from cli import greet


def test_greet():
    assert greet("x") == "hello x!"


def test_greet_in_a_subprocess():
    done = subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, text=True, check=True)
    assert done.stdout == "1\\n"
"""


@pytest.fixture(scope="module")
def spawning_task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return committed_task(
        tmp_path_factory.mktemp("cli"),
        {"cli.py": CLI, "tests/test_cli.py": CLI_TESTS},
        fixed={"cli.py": CLI.replace("+ name", "+ name + '!'")},
        instance_id="local__cli-1",
        problem_statement="greet forgets the exclamation mark",
        fail_to_pass=("tests/test_cli.py::test_greet",),
        pass_to_pass=("tests/test_cli.py::test_greet_in_a_subprocess",),
    )


# Another honest fix than the gold's.
OTHER_FIX = "def greet(name):\n    return f'hello {name}!'\n"


def other_fix(repo: Path, task: Task) -> None:
    (repo / "cli.py").write_text(OTHER_FIX)


async def test_a_suite_that_spawns_grades_with_the_limits_lifted(backend: SandboxBackend, spawning_task: Task) -> None:
    """Never calibrated: an honest fix's run is ended by the limits, so is the run without the patch: the
    limits are lifted for the task and the fix resolves without them (the grade's witnesses say so); the gold
    too, and an empty patch is still unresolved. Calibrated with the limits off, a grade does not try them."""
    fixed = await grade(spawning_task, make_patch(spawning_task, other_fix), backend, timeout_s=120)
    assert (fixed.outcome, fixed.reward) == ("resolved", 1.0), (fixed.error, fixed.log_tail)
    assert "limits" not in fixed.witnesses and "control_s" in fixed.timings
    gold = await grade(spawning_task, spawning_task.patch, backend, timeout_s=120)
    assert (gold.outcome, "limits" in gold.witnesses) == ("resolved", False), (gold.error, gold.log_tail)
    # The same command spelled out: a task of its own to the probe's memory, which has not lifted its limits.
    calibrated = replace(spawning_task, runner_limits=False, test_cmd=DEFAULT_TEST_CMD)
    empty, again = await asyncio.gather(
        grade(spawning_task, "", backend, timeout_s=120), grade(calibrated, calibrated.patch, backend, timeout_s=120)
    )
    assert (empty.outcome, empty.reward) == ("unresolved", 0.0), (empty.error, empty.log_tail)
    assert again.outcome == "resolved" and "limits" not in again.witnesses and "control_s" not in again.timings


# A FAIL_TO_PASS test that spawns only once its assertion holds: the run without the patch is not ended.
LATE_SPAWN_TESTS = """\
import subprocess
import sys

from cli import greet


def test_greet():
    assert greet("x") == "hello x!"
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_greet_type():
    assert isinstance(greet("x"), str)
"""


async def test_a_test_that_spawns_once_fixed_is_found_by_the_gold(
    local_backend: LocalBackend, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The control run without the patch cannot show that the tests spawn (they fail before); the one with
    the task's gold fix does: an honest fix resolves with the limits lifted."""
    task = committed_task(
        tmp_path_factory.mktemp("late"),
        {"cli.py": CLI, "tests/test_cli.py": LATE_SPAWN_TESTS},
        fixed={"cli.py": CLI.replace("+ name", "+ name + '!'")},
        instance_id="local__late-1",
        problem_statement="greet forgets the exclamation mark",
        fail_to_pass=("tests/test_cli.py::test_greet",),
        pass_to_pass=("tests/test_cli.py::test_greet_type",),
    )
    fixed = await grade(task, make_patch(task, other_fix), local_backend, timeout_s=120)
    assert (fixed.outcome, fixed.reward) == ("resolved", 1.0), (fixed.error, fixed.log_tail)
    assert "limits" not in fixed.witnesses


async def test_calibration_records_the_limits(local_backend: LocalBackend, spawning_task: Task, tmp_path: Path) -> None:
    """`swe-grpo tasks calibrate` writes `runner_limits`: True where the gold's run keeps within them, False
    where the task's tests spawn; a recorded True is trusted (no run without the patch to blame)."""
    rows = []
    for task in (STRUTIL, spawning_task):
        rows.append(
            {
                "instance_id": task.instance_id,
                "repo": task.repo,
                "base_commit": task.base_commit,
                "problem_statement": task.problem_statement,
                "patch": task.patch,
                "test_patch": task.test_patch,
                "FAIL_TO_PASS": list(task.fail_to_pass),
                "PASS_TO_PASS": list(task.pass_to_pass),
                **({"test_cmd": task.test_cmd} if task.test_cmd else {}),
            }
        )
    source, out = tmp_path / "tasks.jsonl", tmp_path / "calibrated.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    done = await calibrate_file(source, out, local_backend, timeout_s=120)
    assert [(c.error, c.runner_limits) for c in done] == [(None, True), (None, False)]
    assert [json.loads(line)["runner_limits"] for line in out.read_text().splitlines()] == [True, False]
    strutil = replace(load_tasks(out)[0], tamper_allow=ALLOW)
    assert strutil.runner_limits is True
    forked = await grade(strutil, make_patch(strutil, appended(FORK_AND_REPORT)), local_backend, timeout_s=120)
    assert forked.outcome == "grading_tampered" and "control_s" not in forked.timings, forked.error
