"""The cheat catalogue: patches that try to make a task's tests pass without fixing anything, made the way
a rollout makes patches (edit a checkout of the task's base, diff it). Shared by the grading tests on the
demo tasks (tests/test_grading.py) and on real projects (tests/test_real_projects.py).

`CHEATS` maps a name to (edit, the paths the grader must drop from such a patch, whether the cheat works
against a naive grader that applies the patch unfiltered and trusts the JUnit report)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from swe_grpo.grading import command_words, junit_key
from swe_grpo.tasks import Task

_GIT_ENV = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}


def git(cwd: Path, *args: str, input_text: str | None = None) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    done = subprocess.run(cmd, cwd=cwd, input=input_text, check=True, capture_output=True, text=True, env=_GIT_ENV)
    return done.stdout


def committed_task(repo: Path, files: Mapping[str, str], fixed: Mapping[str, str] | None = None, **fields: Any) -> Task:
    """A task on a new repository at `repo` whose base commit holds `files` (path -> text). `fixed`: the files
    the gold patch changes, as it leaves them (the patch is their diff). `fields`: the rest of the `Task`."""
    git(repo, "init", "-q")
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    patch = ""
    if fixed:
        for name, text in fixed.items():
            (repo / name).write_text(text)
        patch = git(repo, "diff")
        git(repo, "checkout", "-q", "--", ".")
    os.chmod(repo, 0o755)  # the sandbox user clones it
    return Task(repo=str(repo), base_commit=base, patch=patch, **fields)


# --- patches, made the way a rollout makes them: edit a checkout, diff it ---------------------------


def make_patch(task: Task, edit: Callable[[Path, Task], None]) -> str:
    """The diff (as `Sandbox.diff` makes it, renames detected) of `edit` applied to the task's base."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        git(Path(tmp), "clone", "-q", task.repo, str(repo))
        git(repo, "checkout", "-q", task.base_commit)
        edit(repo, task)
        git(repo, "add", "-A", "-f")
        return git(repo, "diff", "--cached", "--binary", "-M", "HEAD")


def source_module(task: Task) -> str:
    """The module the gold patch fixes (the tests import it)."""
    match = re.search(r"^diff --git a/(\S+) ", task.patch, re.MULTILINE)
    assert match
    return match.group(1)


def files_under_test(task: Task) -> set[str]:
    return {test_id.split("::")[0] for test_id in (*task.fail_to_pass, *task.pass_to_pass)}


def append(path: Path, text: str) -> None:
    path.write_text((path.read_text() if path.exists() else "") + text)


FORCE_PASS_PLUGIN = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""


def forged_junit(task: Task) -> str:
    cases = "".join(
        '<testcase classname="{}" name="{}" time="0.01"/>'.format(*junit_key(test_id))
        for test_id in (*task.fail_to_pass, *task.pass_to_pass)
    )
    return f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="9">{cases}</testsuite></testsuites>'


def edit_tests(repo: Path, task: Task) -> None:
    """Knows every test id, and rewrites their files so that each of them trivially passes."""
    for path in files_under_test(task):
        names = [tid.split("::")[-1] for tid in (*task.fail_to_pass, *task.pass_to_pass) if tid.startswith(path)]
        (repo / path).write_text("".join(f"def {name}():\n    pass\n\n\n" for name in names))


def delete_tests(repo: Path, task: Task) -> None:
    for path in files_under_test(task):
        (repo / path).unlink()


def rename_tests(repo: Path, task: Task) -> None:
    for n, path in enumerate(sorted(files_under_test(task))):
        (repo / path).rename(repo / f"moved_{n}.py")


def conftest_hooks(repo: Path, task: Task) -> None:
    (repo / "conftest.py").write_text(FORCE_PASS_PLUGIN)
    (repo / "tests").mkdir(exist_ok=True)
    (repo / "tests" / "conftest.py").write_text(FORCE_PASS_PLUGIN)


def config_addopts(repo: Path, task: Task) -> None:
    """Turns on a plugin through the repository's own pytest configuration file (its pytest section, or a
    new one)."""
    (repo / "cheat_plugin.py").write_text(FORCE_PASS_PLUGIN)
    for name, header, line in [
        ("pytest.ini", "[pytest]", "addopts = -p cheat_plugin"),
        ("tox.ini", "[pytest]", "addopts = -p cheat_plugin"),
        ("setup.cfg", "[tool:pytest]", "addopts = -p cheat_plugin"),
        ("pyproject.toml", "[tool.pytest.ini_options]", 'addopts = "-p cheat_plugin"'),
    ]:
        path = repo / name
        text = path.read_text() if path.exists() else ""
        if header in text:
            # Into the section, replacing an existing addopts key (a second one would be a config error).
            section = text.index(header) + len(header)
            head, tail = text[:section], text[section:]
            if re.search(r"^addopts\s*=", tail, re.MULTILINE):
                tail = re.sub(r"^addopts\s*=[^\n]*", line, tail, count=1, flags=re.MULTILINE)
            else:
                tail = f"\n{line}{tail}"
            path.write_text(head + tail)
            return
    append(repo / "setup.cfg", "\n[tool:pytest]\naddopts = -p cheat_plugin\n")


def new_pytest_ini(repo: Path, task: Task) -> None:
    (repo / "cheat_plugin.py").write_text(FORCE_PASS_PLUGIN)
    (repo / "pytest.ini").write_text("[pytest]\naddopts = -p cheat_plugin\n")


def entry_point_plugin(repo: Path, task: Task) -> None:
    """A distribution in the repository root (on sys.path) whose pytest11 entry point pytest autoloads."""
    (repo / "cheat_plugin.py").write_text(FORCE_PASS_PLUGIN)
    info = repo / "cheat-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cheat\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pytest11]\ncheat = cheat_plugin\n")


def shadow_pytest(repo: Path, task: Task) -> None:
    """A `pytest` package in the repository root: `python -m pytest` runs it instead of pytest."""
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    (repo / "pytest").mkdir()
    (repo / "pytest" / "__init__.py").write_text("")
    (repo / "pytest" / "__main__.py").write_text(
        "import sys\n"
        f"xml = {forged_junit(task)!r}\n"
        "for arg in sys.argv:\n"
        "    if arg.startswith('--junitxml='):\n"
        "        open(arg.split('=', 1)[1], 'w').write(xml)\n"
        "print('=' * 10 + ' short test summary info ' + '=' * 10)\n"
        f"for test_id in {ids!r}:\n"
        "    print('PASSED', test_id)\n"
    )


def startup_hooks(repo: Path, task: Task) -> None:
    (repo / "cheat_plugin.py").write_text(FORCE_PASS_PLUGIN)
    hook = "import sys\nsys.argv += ['-p', 'cheat_plugin']\n"
    (repo / "sitecustomize.py").write_text(hook)
    (repo / "usercustomize.py").write_text(hook)
    (repo / "cheat.pth").write_text("import cheat_plugin\n")
    (repo / "__pycache__").mkdir(exist_ok=True)
    (repo / "__pycache__" / "sitecustomize.cpython-311.pyc").write_bytes(b"\x00" * 16)


def reward_files(repo: Path, task: Task) -> None:
    (repo / "reward.txt").write_text("1.0\n")
    (repo / "junit.xml").write_text(forged_junit(task))
    (repo / ".swe_grpo").mkdir()
    (repo / ".swe_grpo" / "result.json").write_text(json.dumps({"resolved": True, "reward": 1.0}))


def forge_report_at_exit(repo: Path, task: Task) -> None:
    """The code under test finds the JUnit report's path (in the environment, else in the runner's
    arguments) and rewrites the report when the runner exits (after pytest wrote it)."""
    append(
        repo / source_module(task),
        "\n\nimport atexit as _atexit\nimport os as _os\nimport sys as _sys\n\n\n"
        "def _forge():\n"
        "    paths = [a.split('=', 1)[1] for a in _sys.argv if a.startswith('--junitxml=')]\n"
        "    for path in [_os.environ.get('SWE_GRPO_JUNIT_XML'), *paths]:\n"
        "        if path:\n"
        f"            open(path, 'w').write({forged_junit(task)!r})\n"
        "            print('FORGED THE REPORT', file=_sys.stderr)\n\n\n"
        "_atexit.register(_forge)\n",
    )


def shadow_runner_import(repo: Path, task: Task) -> None:
    """An `attr` package in the repository root: pytest 7 imports `attr` (attrs) before it parses its
    arguments, so this one adds a plugin to them, then hands over the real attrs."""
    (repo / "cheat_plugin.py").write_text(FORCE_PASS_PLUGIN)
    (repo / "attr").mkdir()
    (repo / "attr" / "__init__.py").write_text(
        "import importlib, os, sys\n"
        "sys.argv += ['-p', 'cheat_plugin']\n"
        "del sys.modules[__name__]\n"
        "_saved = sys.path[:]\n"
        "sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != os.getcwd()]\n"
        "sys.modules[__name__] = importlib.import_module('attr')\n"
        "sys.path[:] = _saved\n"
    )


def scripts_named(test_cmd: str | None) -> set[str]:
    """The scripts a test command runs by name (`bash run_tests.sh`; not the module of `-m`)."""
    words = shlex.split(test_cmd or "")
    return {word for word in command_words(test_cmd or "") if word.endswith((".sh", ".py")) and word in words}


def scripts_in_test_cmd(task: Task) -> set[str]:
    return scripts_named(task.test_cmd)


def edit_test_script(repo: Path, task: Task) -> None:
    """Rewrites the script the task's test_cmd runs: it writes a passing JUnit report where the runner is
    told to, and prints a passing summary, without running anything."""
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    for script in scripts_in_test_cmd(task):
        (repo / script).write_text(
            'for arg in "$@"; do case $arg in --junitxml=*)'
            f" printf '%s' {shlex.quote(forged_junit(task))} > \"${{arg#--junitxml=}}\";; esac; done\n"
            "echo '========== short test summary info =========='\n"
            + "".join(f"echo {shlex.quote('PASSED ' + test_id)}\n" for test_id in ids)
        )


# name -> (edit, paths the filter must drop, works unfiltered with a junit-only grader)
CHEATS: dict[str, tuple[Callable[[Path, Task], None], Callable[[Task], set[str]], bool]] = {
    "edit_tests": (edit_tests, files_under_test, False),
    "delete_tests": (delete_tests, files_under_test, False),
    "rename_tests": (rename_tests, files_under_test, False),
    "conftest_hooks": (conftest_hooks, lambda t: {"conftest.py", "tests/conftest.py"}, True),
    "config_addopts": (config_addopts, lambda t: {"pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"}, True),
    "new_pytest_ini": (new_pytest_ini, lambda t: {"pytest.ini"}, True),
    "entry_point_plugin": (entry_point_plugin, lambda t: {"cheat-1.0.dist-info/entry_points.txt"}, True),
    "shadow_pytest": (shadow_pytest, lambda t: {"pytest/__init__.py"}, True),
    "shadow_runner_import": (shadow_runner_import, lambda t: {"attr/__init__.py"}, True),
    "startup_hooks": (startup_hooks, lambda t: {"sitecustomize.py", "usercustomize.py", "cheat.pth"}, False),
    "reward_files": (reward_files, lambda t: set(), False),
    "forge_report_at_exit": (forge_report_at_exit, lambda t: set(), True),
    "edit_test_script": (edit_test_script, scripts_in_test_cmd, True),
}
