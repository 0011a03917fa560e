"""Grading: does a patch resolve a task? Run the task's tests where the patch's author cannot reach them.

`grade(task, patch, backend)` works in a FRESH sandbox (`backend.create(task)`: the repository at
`base_commit`) and always destroys it:

1. The patch is applied to a scratch git index holding `base_commit` (`git apply --cached`), so git's
   own parser decides what it touches (renames count as delete + add). Every touched path that is
   protected (see `is_protected`) is reset to `base_commit` in that index; the rest is diffed into a
   filtered patch, which is checked to contain no protected path and applied to the working tree.
   A patch that git cannot apply is `patch_apply_failed` (a model failure; so is a filtered patch that
   does not apply to the working tree, which only a sandbox whose tree differs from `base_commit` or
   a patch playing with symlinks can cause).
2. The task's `test_patch` is applied (it must apply: if not, the task is broken: `infra_error`).
3. All FAIL_TO_PASS and PASS_TO_PASS tests run in ONE test-runner call: `task.test_cmd` or
   `python3 -m pytest -rA -p no:cacheprovider --junitxml=<scratch file outside the repo>`, with the
   test ids appended, and `PYTEST_DISABLE_PLUGIN_AUTOLOAD=1` unless `plugin_autoload=True`.
4. Per-test statuses come from the JUnit XML and the `-rA` summary on stdout together (see
   `report_statuses`). SWE-bench semantics: resolved iff every F2P and P2P test passed (PASSED, XFAIL
   or a non-strict XPASS, which pytest itself reports as passed); a test no report names counts as
   failed. A task without FAIL_TO_PASS tests cannot be resolved (`infra_error`).

Why protected paths, not just "the files the test patch touches" (what SWE-bench reverts): a patch could
otherwise make tests pass without fixing anything, by editing or deleting tests, adding a conftest.py
whose hooks rewrite reports, turning on a plugin through pytest.ini/tox.ini/setup.cfg/pyproject.toml
`addopts` or through an entry point in a `*.dist-info` directory (found because the repository is on
sys.path), shadowing `pytest` (or a module it imports) with a top-level module of the same name, or
adding sitecustomize.py / usercustomize.py / `*.pth` / bytecode. All of these are in the protected set,
so they keep their `base_commit` contents (test-patch contents for the test files). Nothing the patch
writes is read by the grader: the report files live outside the repository under a random name, and a
report written by anyone else cannot vouch for a test the other report says failed.

Outcomes and rewards (a `None` reward means "no reward: never train on this as 0"):
    resolved 1.0 | unresolved 0.0 | patch_apply_failed 0.0 |
    timeout: 0.0 when the tests finish in time without the patch (so the patch made them hang), else None
    infra_error None (sandbox failures, broken tasks; the cause is in `error`)
A test run that yields no report at all is re-run once without the patch (a control run) to find out
whose fault it is: when the control run does report, the patch broke the runner: `unresolved`.

What this cannot stop: the code under test runs inside the test runner's process, so a patch whose
module monkeypatches pytest when it is imported, or deletes the JUnit report and prints a fake summary
to the runner's stdout, can forge results (SWE-bench, which trusts the log, has the same limit).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shlex
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from swe_grpo.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxError
from swe_grpo.tasks import Task

log = logging.getLogger(__name__)

Outcome = Literal["resolved", "unresolved", "patch_apply_failed", "timeout", "infra_error"]

#: SWE-bench's per-instance limit for the test run.
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_TEST_CMD = 'python3 -m pytest -rA -p no:cacheprovider --junitxml="$SWE_GRPO_JUNIT_XML"'
_STEP_TIMEOUT_S = 120.0  # each git step
_LOG_TAIL_CHARS = 4000

PASS_STATUSES = frozenset({"passed", "xfail", "xpass"})
# Worst first: when reports disagree about a test, the worst status wins.
_SEVERITY = ("error", "failed", "missing", "skipped", "xpass", "xfail", "passed")


@dataclass(frozen=True)
class GradeResult:
    """The grade of one patch for one task. `reward` is 1.0 only for `resolved`, 0.0 for model failures
    and None when there is no reward (infrastructure failures: never train on them as 0). `tests` maps
    every F2P/P2P test id to passed|xfail|xpass|failed|error|skipped|missing (empty when no report was
    obtained); `dropped_paths` are the paths removed from the patch as protected; `timings` in seconds."""

    instance_id: str
    outcome: Outcome
    reward: float | None
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    tests: dict[str, str] = field(default_factory=dict)
    dropped_paths: tuple[str, ...] = ()
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""


# --- which paths a patch may not change --------------------------------------------------------------

_RUNNER_CONFIG = frozenset(
    {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg"}
    | {"pyproject.toml", "sitecustomize.py", "usercustomize.py", ".gitattributes"}
)
# Top-level modules that would shadow the test runner or what it imports (the repository root is first
# on sys.path under `python -m pytest`).
_SHADOWED = frozenset(sys.stdlib_module_names) | {"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging"}


def is_protected(path: str, explicit: Collection[str] = ()) -> bool:
    """Whether a patch may not add, change or delete `path` (relative to the repository root, "/"-separated).

    Protected: (1) `explicit` paths (the files the test patch touches and the files the test ids name),
    their parent directories and anything under them; (2) test code by name: a directory component
    starting with "test" (tests/, testing/, test-data/...) or equal to "e2e", a file named test_*,
    *_test.py, *_tests.py or tests.py; (3) test-runner configuration and interpreter start-up hooks at
    any depth: conftest.py, pytest.ini, .pytest.ini, pytest.toml, .pytest.toml, tox.ini, setup.cfg,
    pyproject.toml, sitecustomize.py, usercustomize.py, .gitattributes, *.pth; (4) bytecode and package
    metadata: *.pyc, *.pyo, __pycache__/, *.dist-info/, *.egg-info/, *.egg-link; (5) a top-level module
    or package (`name.py`, `name.so`, `name/__init__.*`) named like a standard-library module, pytest,
    _pytest, pluggy, py, iniconfig, packaging, or anything starting with "pytest"."""
    for protected in explicit:
        if path == protected or path.startswith(protected + "/") or protected.startswith(path + "/"):
            return True
    parts = path.lower().split("/")
    *dirs, name = parts
    if any(part.startswith("test") or part == "e2e" for part in dirs):
        return True
    if name.startswith("test_") or name.endswith(("_test.py", "_tests.py")) or name == "tests.py":
        return True
    if name in _RUNNER_CONFIG or name.endswith((".pth", ".pyc", ".pyo", ".egg-link")):
        return True
    if any(part == "__pycache__" or part.endswith((".dist-info", ".egg-info")) for part in dirs):
        return True
    if len(parts) == 1 and name.endswith((".py", ".so")):
        module = name.split(".")[0]
    elif len(parts) == 2 and name.split(".")[0] == "__init__":
        module = parts[0]
    else:
        return False
    return module in _SHADOWED or module.startswith("pytest")


def _test_file(test_id: str) -> str | None:
    path = test_id.split("::", 1)[0]
    return path if path.endswith(".py") else None


# --- test reports -----------------------------------------------------------------------------------

_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$", re.MULTILINE)
_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+)$")


def junit_key(test_id: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit XML gives the test with this node id."""
    path, sep, tail = test_id.partition("::")
    names_part, bracket, params = tail.partition("[")
    names = [re.sub(r"\.py$", "", path.replace("/", ".")), *(names_part.split("::") if sep else [])]
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def _junit_statuses(xml_text: str) -> dict[tuple[str, str], list[str]] | None:
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return None
    if root.tag not in ("testsuites", "testsuite"):
        return None
    statuses: dict[tuple[str, str], list[str]] = {}
    for case in root.iter("testcase"):
        children = {child.tag: child for child in case}
        if "error" in children:
            status = "error"
        elif "failure" in children:
            status = "failed"
        elif "skipped" in children:
            status = "xfail" if children["skipped"].get("type") == "pytest.xfail" else "skipped"
        else:
            status = "passed"
        statuses.setdefault((case.get("classname", ""), case.get("name", "")), []).append(status)
    return statuses


def _summary_statuses(output: str, test_ids: Collection[str]) -> dict[str, list[str]] | None:
    # From the first summary header on: anything printed before it is captured test output (a test could
    # print fake lines), and a real status line after it always counts, so a fake one cannot hide it.
    header = _SUMMARY_HEADER.search(output)
    if header is None:
        return None
    statuses: dict[str, list[str]] = {}
    for line in output[header.end() :].splitlines():
        match = _SUMMARY_LINE.match(line)
        if match:
            word, rest = match.groups()
            test_id = rest if rest in test_ids else rest.split(" - ", 1)[0]
            statuses.setdefault(test_id, []).append(word.lower())
    return statuses


def report_statuses(test_ids: Sequence[str], junit_xml: str | None, output: str) -> dict[str, str] | None:
    """Each test's status from a pytest JUnit XML report and/or the `-rA` short summary in `output`;
    None when neither is usable (missing, garbled). With a JUnit report, a test must be in it (else
    "missing") and a summary line can only make it worse; without one, the summary decides. When a
    test is reported more than once, the worst status wins."""
    junit = _junit_statuses(junit_xml) if junit_xml is not None else None
    summary = _summary_statuses(output, set(test_ids))
    if junit is None and summary is None:
        return None
    result: dict[str, str] = {}
    for test_id in test_ids:
        seen = (junit.get(junit_key(test_id)) or ["missing"]) if junit is not None else []
        reported = summary.get(test_id, []) if summary is not None else []
        seen = [*seen, *reported] or ["missing"]
        result[test_id] = min(seen, key=_SEVERITY.index)
    return result


# --- one graded run in one fresh sandbox ------------------------------------------------------------


class _BrokenTask(Exception):
    """The task or the grading machinery failed (not the patch): an infra_error."""


@dataclass
class _Run:
    dropped: tuple[str, ...] = ()
    apply_error: str | None = None  # the patch did not apply: the patch's fault
    tests: ExecResult | None = None
    statuses: dict[str, str] | None = None


def _nul_list(data: str) -> list[str]:
    return [item for item in data.split("\0") if item]


async def _step(sandbox: Sandbox, script: str, what: str) -> ExecResult:
    result = await sandbox.exec(script, timeout_s=_STEP_TIMEOUT_S, cwd=sandbox.workdir)
    if result.timed_out:
        raise _BrokenTask(f"{what}: timed out after {_STEP_TIMEOUT_S:.0f}s")
    return result


def _failure(what: str, result: ExecResult) -> str:
    return f"{what} (exit {result.exit_code}): {result.stderr.strip()[-1000:]}"


async def _touched(sandbox: Sandbox, base: str, patch_file: str, index: str) -> ExecResult:
    """Apply a patch to a scratch index holding `base`; stdout: `git diff --name-status -z` of it."""
    q = shlex.quote
    script = (
        f"export GIT_INDEX_FILE={q(index)} && git read-tree {q(base)} && git apply --cached {q(patch_file)}"
        f" && git diff --cached --name-status -z --no-renames {q(base)}"
    )
    return await _step(sandbox, script, "git apply --cached")


def _paths(name_status: str) -> list[str]:
    items = _nul_list(name_status)
    return items[1::2]  # (status, path) pairs


async def _graded_run(
    sandbox: Sandbox, task: Task, patch: str, *, timeout_s: float, plugin_autoload: bool, timings: dict[str, float]
) -> _Run:
    q = shlex.quote
    base = task.base_commit
    started = time.monotonic()
    # Without the base commit every apply below would fail, and be blamed on the patch.
    prepare = f"git cat-file -e {q(base)}^{{commit}} && mktemp -d -t swe_grpo-grade.XXXXXXXXXX"
    made = await _step(sandbox, prepare, "preparing")
    scratch = made.stdout.strip()
    if made.exit_code != 0 or not scratch.startswith("/"):
        raise _BrokenTask(_failure("no base_commit in the sandbox's repository, or no scratch directory", made))
    test_ids = [*task.fail_to_pass, *task.pass_to_pass]
    await sandbox.put_file(f"{scratch}/test_ids", "".join(f"{test_id}\n" for test_id in test_ids).encode())

    explicit = {path for path in map(_test_file, test_ids) if path}
    if task.test_patch:
        await sandbox.put_file(f"{scratch}/test.patch", task.test_patch.encode())
        touched = await _touched(sandbox, base, f"{scratch}/test.patch", f"{scratch}/test.index")
        if touched.exit_code != 0:
            raise _BrokenTask(_failure("the task's test_patch does not apply to base_commit", touched))
        explicit.update(_paths(touched.stdout))

    run = _Run()
    if patch.strip():
        await sandbox.put_file(f"{scratch}/agent.patch", (patch if patch.endswith("\n") else patch + "\n").encode())
        touched = await _touched(sandbox, base, f"{scratch}/agent.patch", f"{scratch}/agent.index")
        if touched.exit_code != 0:
            run.apply_error = _failure("git apply", touched)
            return run
        run.dropped = tuple(path for path in _paths(touched.stdout) if is_protected(path, explicit))
        reset = ""
        if run.dropped:
            await sandbox.put_file(f"{scratch}/dropped", "".join(f"{path}\0" for path in run.dropped).encode())
            reset = f"xargs -0 -a {q(scratch)}/dropped git --literal-pathspecs reset -q {q(base)} -- && "
        filtered = await _step(
            sandbox,
            f"export GIT_INDEX_FILE={q(scratch)}/agent.index && {reset}"
            f"git diff --cached --binary --no-renames --no-color --no-ext-diff --src-prefix=a/ --dst-prefix=b/"
            f" {q(base)} > {q(scratch)}/filtered.patch && git diff --cached --name-status -z --no-renames {q(base)}",
            "filtering the patch",
        )
        if filtered.exit_code != 0:
            raise _BrokenTask(_failure("filtering the patch", filtered))
        kept = _paths(filtered.stdout)
        if any(is_protected(path, explicit) for path in kept):  # the reset did not take: never grade that
            raise _BrokenTask(f"filtering the patch left protected paths in it: {kept}")
        if kept:
            applied = await _step(sandbox, f"git apply {q(scratch)}/filtered.patch", "git apply")
            if applied.exit_code != 0:
                run.apply_error = _failure("git apply (protected paths removed)", applied)
                return run
    if task.test_patch:
        applied = await _step(sandbox, f"git apply {q(scratch)}/test.patch", "applying the test patch")
        if applied.exit_code != 0:
            raise _BrokenTask(_failure("the task's test_patch does not apply after the patch", applied))
    timings["apply_s"] = time.monotonic() - started

    junit_path = f"{scratch}/junit.xml"
    env = {"SWE_GRPO_JUNIT_XML": junit_path}
    if not plugin_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # The ids travel in a file: thousands of them would not fit in one command-line argument.
    command = f'mapfile -t ids < {q(scratch)}/test_ids && {task.test_cmd or DEFAULT_TEST_CMD} "${{ids[@]}}"'
    run.tests = await sandbox.exec(command, timeout_s=timeout_s, env=env, cwd=sandbox.workdir)
    timings["tests_s"] = run.tests.wall_s
    if not run.tests.timed_out:
        try:
            junit_xml: str | None = (await sandbox.get_file(junit_path)).decode("utf-8", "replace")
        except SandboxError:
            junit_xml = None  # not written (or unreadable): the summary may still tell
        run.statuses = report_statuses(test_ids, junit_xml, run.tests.stdout)
    return run


async def _run(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    *,
    timeout_s: float,
    plugin_autoload: bool,
    timings: dict[str, float],
) -> _Run:
    started = time.monotonic()
    sandbox = await backend.create(task, network=False)  # tests need no network, and get none
    timings["sandbox_s"] = time.monotonic() - started
    # The clean-up is shielded (a second cancellation must not interrupt it), and when something is
    # already going wrong, a failing clean-up must not replace that exception (a cancellation above all).
    try:
        run = await _graded_run(
            sandbox, task, patch, timeout_s=timeout_s, plugin_autoload=plugin_autoload, timings=timings
        )
    except BaseException:
        try:
            await asyncio.shield(sandbox.destroy())
        except SandboxError as exc:
            log.warning("could not destroy the grading sandbox of %s: %s", task.instance_id, exc)
        raise
    await asyncio.shield(sandbox.destroy())
    return run


def _finished(run: _Run) -> bool:
    return run.tests is not None and not run.tests.timed_out and run.statuses is not None


async def grade(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugin_autoload: bool = False,
) -> GradeResult:
    """Grade `patch` (a `git apply`-able diff against `task.base_commit`; "" for none) in a fresh sandbox;
    see the module docstring for the rules. `timeout_s` bounds the test run. `plugin_autoload=True`
    lets pytest load the plugins installed in the sandbox (needed by repositories whose tests use, e.g.,
    pytest-mock's `mocker`); it is safe because a patch can never add plugin metadata. Never raises for
    a sandbox failure (`infra_error`); cancellation propagates, after the sandboxes are destroyed."""
    started = time.monotonic()
    timings: dict[str, float] = {}
    run = _Run()

    def result(outcome: Outcome, reward: float | None, error: str | None = None) -> GradeResult:
        statuses = run.statuses or {}
        f2p, p2p = task.fail_to_pass, task.pass_to_pass
        output = run.tests.stdout + run.tests.stderr if run.tests is not None else ""
        return GradeResult(
            instance_id=task.instance_id,
            outcome=outcome,
            reward=reward,
            f2p_passed=sum(statuses.get(test_id) in PASS_STATUSES for test_id in f2p),
            f2p_total=len(f2p),
            p2p_passed=sum(statuses.get(test_id) in PASS_STATUSES for test_id in p2p),
            p2p_total=len(p2p),
            tests=statuses,
            dropped_paths=run.dropped,
            error=error,
            timings={**timings, "total_s": time.monotonic() - started},
            log_tail=output[-_LOG_TAIL_CHARS:],
        )

    async def attempt(patch: str, timings: dict[str, float]) -> _Run:
        return await _run(task, patch, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload, timings=timings)

    if not task.fail_to_pass:  # nothing could show that the patch fixes anything
        return result("infra_error", None, "the task names no FAIL_TO_PASS test")
    try:
        run = await attempt(patch, timings)
        if run.apply_error is not None:
            return result("patch_apply_failed", 0.0, run.apply_error)
        assert run.tests is not None  # the patch applied, so the tests ran
        if not _finished(run):
            # No verdict. Whose fault? Run the tests once more without the patch.
            control_started = time.monotonic()
            control_ok = _finished(await attempt("", {}))
            timings["control_s"] = time.monotonic() - control_started
            exit_code = run.tests.exit_code
            if run.tests.timed_out:
                cause = "they finish without it" if control_ok else "they do not finish without it either"
                error = f"the tests did not finish in {timeout_s:g}s with the patch; {cause}"
                return result("timeout", 0.0 if control_ok else None, error)
            if control_ok:
                return result("unresolved", 0.0, f"the patch broke the test runner: no report (exit {exit_code})")
            return result("infra_error", None, f"the test command yields no report (exit {exit_code}), patch or not")
        statuses = run.statuses or {}
        if all(statuses.get(test_id) in PASS_STATUSES for test_id in (*task.fail_to_pass, *task.pass_to_pass)):
            return result("resolved", 1.0)
        return result("unresolved", 0.0)
    except _BrokenTask as exc:
        return result("infra_error", None, str(exc))
    except SandboxError as exc:
        return result("infra_error", None, f"sandbox: {exc}")


# --- SWE-bench-style predictions --------------------------------------------------------------------


def load_predictions(path: str | Path) -> list[dict[str, Any]]:
    """Predictions from a SWE-bench predictions file: a JSON list, or JSONL (one object per line)."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def grade_predictions(
    tasks: Iterable[Task],
    predictions: Iterable[Mapping[str, Any]],
    backend: SandboxBackend,
    *,
    concurrency: int = 4,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugin_autoload: bool = False,
) -> list[GradeResult]:
    """Grade SWE-bench-style predictions (`instance_id`, `model_patch`; a null patch is an empty one),
    at most `concurrency` at a time; results in the order of `predictions`. Every prediction is checked
    before anything runs: an unknown `instance_id` raises `KeyError`, a non-string patch `ValueError`."""
    by_id = {task.instance_id: task for task in tasks}
    jobs: list[tuple[Task, str]] = []
    for number, prediction in enumerate(predictions):
        instance_id, patch = prediction.get("instance_id"), prediction.get("model_patch") or ""
        if instance_id not in by_id:
            raise KeyError(f"prediction {number}: no task with instance_id {instance_id!r}")
        if not isinstance(patch, str):
            raise ValueError(f"prediction {number} ({instance_id}): model_patch is not a string")
        jobs.append((by_id[instance_id], patch))
    semaphore = asyncio.Semaphore(concurrency)

    async def one(task: Task, patch: str) -> GradeResult:
        async with semaphore:
            return await grade(task, patch, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload)

    async with asyncio.TaskGroup() as group:
        running = [group.create_task(one(task, patch)) for task, patch in jobs]
    return [job.result() for job in running]
