"""Grading: does a patch resolve a task? Run the task's tests where the patch's author cannot reach them.

`grade(task, patch, backend)` works in a FRESH sandbox (`backend.create(task, network=False)`: the
repository at `base_commit`, no network) and always destroys it:

1. A probe, before the patch and in a sandbox of its own (nothing it writes reaches the graded run): the
   test command runs on one PASS_TO_PASS test (else the first FAIL_TO_PASS one) with a usercustomize.py
   (in a HOME of its own) that records, for every Python process, `sys.path` and where each top-level
   module came from (`RunnerImports`; kept per task base, test command, plugin setting and backend, so
   a task's later grades reuse it).
2. The patch is applied to a scratch git index holding `base_commit` (`git apply --cached`), so git's
   own parser decides what it touches (renames count as delete + add). Every touched path that is
   protected (see `is_protected`) is reset to `base_commit` in that index, and so is a source module
   whose doctests the task runs when the patch changes its doctest examples; the rest is diffed into
   a filtered patch, which is checked to contain no dropped path and applied to the working tree.
   A patch that git cannot apply is `patch_apply_failed` (a model failure; so is a filtered patch that
   does not apply to the working tree, which only a sandbox whose tree differs from `base_commit` or
   a patch playing with symlinks can cause).
3. The task's `test_patch` is applied (it must apply: if not, the task is broken: `infra_error`).
4. All FAIL_TO_PASS and PASS_TO_PASS tests run in ONE test-runner call: `task.test_cmd` or
   `python3 -m pytest -rA -p no:cacheprovider --junitxml="$SWE_GRPO_JUNIT_XML"`, with the test ids
   appended. `SWE_GRPO_JUNIT_XML` is a shell variable of that command line, NOT exported: the code
   under test does not inherit it. Pytest plugins installed in the sandbox load
   (`PYTEST_DISABLE_PLUGIN_AUTOLOAD=1` only when plugin autoload is off: `task.plugin_autoload`, else
   the worker's setting, on by default).
5. Per-test statuses come from the JUnit XML and the `-rA` summary on stdout together (see
   `report_statuses`). SWE-bench semantics: resolved iff every F2P and P2P test passed (PASSED, XFAIL
   or a non-strict XPASS, which pytest itself reports as passed); a test no report names counts as
   failed. A task without FAIL_TO_PASS tests cannot be resolved (`infra_error`). When the tests need
   a fixture no loaded plugin provides ("fixture 'mocker' not found") or async tests were skipped for
   want of a plugin, the grade's `error` says so.

Why protected paths, not just "the files the test patch touches" (what SWE-bench reverts): a patch could
otherwise make tests pass without fixing anything, by editing or deleting tests, adding a conftest.py
whose hooks rewrite reports, turning on a plugin through pytest.ini/tox.ini/setup.cfg/pyproject.toml
`addopts` or through an entry point in a `*.dist-info` directory (found because the repository is on
sys.path), shadowing a module the runner imports (pytest, or `attr`, which pytest 7 imports, or a
plugin's imports) with a module of the same name in a directory on the runner's sys.path, adding
sitecustomize.py / usercustomize.py / `*.pth` / bytecode, or rewriting the script `test_cmd` runs
(`bash run_tests.sh`). All of these are protected, so they keep their `base_commit` contents (test-patch
contents for the test files). Nothing the patch writes is read by the grader: the report files live
outside the repository under a random name, and a report written by anyone else cannot vouch for a test
the other report says failed.

Plugin autoload is on by default because SWE-bench's harness runs with the image's installed plugins
(repositories whose tests use pytest-mock's `mocker` cannot resolve without them), and a patch cannot
add a plugin either way: plugin metadata (`*.dist-info`, `*.egg-info`, `.pth`), configuration and
start-up hooks are protected. tests/test_real_projects.py grades the whole cheat catalogue with
autoload on.

Outcomes and rewards (a `None` reward means "no reward: never train on this as 0"):
    resolved 1.0 | unresolved 0.0 | patch_apply_failed 0.0 |
    timeout: 0.0 when the tests finish in time without the patch (so the patch made them hang), else None
    resource_exhausted 0.0: the test run hit a limit of the grading sandbox (memory, processes or disk:
        `Sandbox.exhausted()`, named in `error`, which starts with "grading:") that it stays within
        without the patch; with the patch's help it stays within none: `infra_error`
    infra_error None (sandbox failures, broken tasks; the cause is in `error`)
A test run that yields no report at all, or hits a limit, is re-run once without the patch (a control
run) to find out whose fault it is: when the control run does report, the patch broke the runner:
`unresolved`; when it stays within the limits, the patch's code exhausted the sandbox.

Why `resource_exhausted` with reward 0.0, whatever the tests said: the tests import the patch's code, so
a fork bomb, a memory hog or a disk filler in it runs in the grading sandbox, and that is the policy's
doing, as in its own sandbox (`swe_grpo.rollout`): trained on as 0, so the policy learns not to. The
sandbox's limits kept it from harming any other grade or rollout, and a verdict reached in a sandbox at
its limits is not trusted (a refused fork or an OOM kill can change what a test sees). The control run
keeps a task whose own tests need more than the limits from being blamed on the patch.

What this cannot stop: the code under test runs inside the test runner's process, as the same user, so
a patch whose module monkeypatches pytest when it is imported, or finds the JUnit report (its path is
in the runner's arguments, `sys.argv` and /proc/self/cmdline, and the scratch directory can be listed
in the sandbox's /tmp) and rewrites it while printing a fake summary, can forge results (SWE-bench,
which trusts the log, has the same limit); a fake report alone is outvoted by the real summary. What a
`test_cmd` script runs in turn (another script it calls) is protected only when it is test code or
configuration by name. The probe sees the modules imported on the way to one test; a module that only
other tests' runs import lazily is covered when it is in the standard library or named pytest*.
"""

from __future__ import annotations

import ast
import asyncio
import doctest
import itertools
import json
import logging
import re
import shlex
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from swe_grpo.sandbox._common import Exhaustion
from swe_grpo.sandbox.base import ExecResult, Sandbox, SandboxBackend, SandboxError
from swe_grpo.tasks import Task

log = logging.getLogger(__name__)
_T = TypeVar("_T")

Outcome = Literal["resolved", "unresolved", "patch_apply_failed", "timeout", "resource_exhausted", "infra_error"]

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
# Only when the probe reports nothing (a runner that is not Python, user site-packages disabled): pytest
# and some of what it imports besides the standard library (pytest 7 also imports `attr`, for one).
_FALLBACK_RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging"})


@dataclass(frozen=True)
class RunnerImports:
    """Where a patch could shadow what the test runner imports: `search_dirs` are the repository
    directories on the runner's `sys.path` ("" = the root), `names` the top-level modules it loads from
    OUTSIDE the repository. Measured per grade by a probe run (see `grade`); the standard library and
    names starting with "pytest" are always in, whatever the probe saw (they are imported lazily)."""

    search_dirs: frozenset[str] = frozenset({""})
    names: frozenset[str] = _FALLBACK_RUNNER_MODULES

    def shadows(self, path: str) -> bool:
        """Whether `path` would be a top-level module (`name.py`, `name.so`, `name/__init__.*`) in a
        search directory, named like a module the runner loads from outside the repository."""
        for directory in self.search_dirs:
            if directory and not path.startswith(directory + "/"):
                continue
            parts = (path[len(directory) + 1 :] if directory else path).lower().split("/")
            if len(parts) == 1 and parts[0].endswith((".py", ".so")):
                module = parts[0].split(".")[0]
            elif len(parts) == 2 and parts[1].split(".")[0] == "__init__":
                module = parts[0]
            else:
                continue
            if module in self.names or module in sys.stdlib_module_names or module.startswith("pytest"):
                return True
        return False


def is_protected(path: str, explicit: Collection[str] = (), runner: RunnerImports = RunnerImports()) -> bool:
    """Whether a patch may not add, change or delete `path` (relative to the repository root, "/"-separated).

    Protected: (1) `explicit` paths (the files the test patch touches, the test files and non-Python
    doctest files the test ids name, the scripts `test_cmd` names), their parent directories and anything
    under them; (2) test code by name: a directory component starting with "test" (tests/, testing/,
    test-data/...) or equal to "e2e", a file named test_*, *_test.py, *_tests.py or tests.py; (3)
    test-runner configuration and interpreter start-up hooks at any depth: conftest.py, pytest.ini,
    .pytest.ini, pytest.toml, .pytest.toml, tox.ini, setup.cfg, pyproject.toml, sitecustomize.py,
    usercustomize.py, .gitattributes, *.pth; (4) bytecode and package metadata: *.pyc, *.pyo,
    __pycache__/, *.dist-info/, *.egg-info/, *.egg-link; (5) a module that would shadow one the runner
    imports (`runner.shadows`)."""
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
    return runner.shadows(path)


def _test_file(test_id: str) -> str:
    return test_id.split("::", 1)[0]


def doctest_examples(source: str) -> list[tuple[str, str]]:
    """The (source, expected output) of every doctest example in the docstrings of a Python module's
    text (the module's, its classes' and functions'), in order; a module that does not parse gives its
    whole text, so any change to it counts as a change."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return [(source, "")]
    parser = doctest.DocTestParser()
    examples = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            try:
                examples += [(e.source, e.want) for e in parser.get_examples(docstring or "")]
            except ValueError:  # malformed examples: the docstring itself is what must not change
                examples.append((docstring or "", ""))
    return examples


def command_words(test_cmd: str) -> list[str]:
    """The words of `test_cmd` that could name a file in the repository (not options, assignments or
    variables), as repository-relative paths; `-m pkg.mod` gives pkg/mod.py."""
    try:
        words = shlex.split(test_cmd)
    except ValueError:
        words = test_cmd.split()
    paths = []
    for before, word in itertools.pairwise(["", *words]):
        if before == "-m":
            paths.append(word.replace(".", "/") + ".py")
        elif not word.startswith(("-", "/")) and "=" not in word and "$" not in word:
            paths.append(word.removeprefix("./"))
    return paths


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
    exhausted: Exhaustion | None = None  # the limit the sandbox hit, seen once the tests ran


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


_PROBE = """\
# swe_grpo's grading probe (usercustomize.py in a probe-only HOME): at exit, record where this process
# looked for modules and where each top-level module it imported came from.
import atexit, json, os, sys


def _swe_grpo_probe():
    modules = {}
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(module, "__file__", None)
        if origin is None and getattr(module, "__path__", None):
            origin = next(iter(module.__path__), None)
        modules[name] = origin if isinstance(origin, str) else "built-in"
    out = os.path.join(os.environ["SWE_GRPO_PROBE_OUT"], f"{os.getpid()}.json")
    with open(out, "w") as f:
        json.dump({"path": [os.path.abspath(p or os.curdir) for p in sys.path], "modules": modules}, f)
        f.write("\\n")


atexit.register(_swe_grpo_probe)
"""


_PROBED: dict[tuple[str | None, ...], RunnerImports] = {}
_PROBED_MAX = 4096


def _runner_imports(probe_output: str, workdir: str) -> RunnerImports:
    """Parse the probe's JSON lines (one per Python process); the fallback when there are none."""
    records = []
    for line in probe_output.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not records:
        return RunnerImports()

    def inside(path: str) -> str | None:
        return "" if path == workdir else path[len(workdir) + 1 :] if path.startswith(workdir + "/") else None

    dirs = {inside(path) for record in records for path in record.get("path", [])} - {None}
    names = {
        name for record in records for name, origin in record.get("modules", {}).items() if inside(str(origin)) is None
    }
    return RunnerImports(search_dirs=frozenset({"", *dirs}), names=frozenset(names))  # type: ignore[arg-type]


async def _probe_runner(backend: SandboxBackend, task: Task, env: dict[str, str], timeout_s: float) -> RunnerImports:
    """Run the test command on one PASS_TO_PASS test (it passes, so it does not hang, without the patch;
    else the first FAIL_TO_PASS test) in a sandbox of its own, with a usercustomize.py (in a HOME of its
    own) that records what every Python process imported. What it finds depends only on the task's base
    and environment: it is kept for the task's next grades."""
    key = (backend.name, task.repo, task.base_commit, task.image, task.test_cmd, str(env))
    if key in _PROBED:
        return _PROBED[key]
    test_id = (task.pass_to_pass or task.fail_to_pass)[0]
    q = shlex.quote

    async def probe(sandbox: Sandbox) -> RunnerImports:
        made = await _step(sandbox, "mktemp -d -t swe_grpo-probe.XXXXXXXXXX", "preparing the probe")
        scratch = made.stdout.strip()
        if made.exit_code != 0 or not scratch.startswith("/"):
            raise _BrokenTask(_failure("no scratch directory for the probe", made))
        await sandbox.put_file(f"{scratch}/probe.py", _PROBE.encode())
        out = f"{scratch}/out"
        script = (
            f"export HOME={q(scratch)}/home SWE_GRPO_PROBE_OUT={q(out)} && mkdir -p {q(out)}"
            " && site=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p \"$site\""
            f' && cp {q(scratch)}/probe.py "$site/usercustomize.py" && SWE_GRPO_JUNIT_XML={q(scratch)}/junit.xml'
            f" && {{ {task.test_cmd or DEFAULT_TEST_CMD} {q(test_id)} >/dev/null 2>&1; }}"
            f"; cat {q(out)}/*.json 2>/dev/null"
        )
        probed = await sandbox.exec(script, timeout_s=timeout_s, env=env, cwd=sandbox.workdir)
        return _runner_imports("" if probed.timed_out else probed.stdout, sandbox.workdir)

    imports = await _in_sandbox(backend, task, probe)
    if len(_PROBED) >= _PROBED_MAX:
        _PROBED.clear()
    _PROBED[key] = imports
    return imports


async def _doctests_changed(sandbox: Sandbox, base: str, index: str, paths: Iterable[str]) -> list[str]:
    """Those of `paths` (source modules whose doctests the task runs) whose doctest examples differ
    between `base` and the index `index`."""
    changed = []
    q = shlex.quote
    for path in paths:
        shown = await _step(
            sandbox,
            f"git show {q(base)}:{q(path)}; printf '\\0'; GIT_INDEX_FILE={q(index)} git show :{q(path)}",
            "reading a doctest module",
        )
        before, _, after = shown.stdout.partition("\0")
        if doctest_examples(before) != doctest_examples(after):
            changed.append(path)
    return changed


async def _graded_run(
    sandbox: Sandbox,
    task: Task,
    patch: str,
    *,
    timeout_s: float,
    env: dict[str, str],
    runner: RunnerImports,
    timings: dict[str, float],
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

    # A test id's file is protected, except a source module whose doctests are tests: the fix may have to
    # change it, so only its doctest examples are (checked below).
    named = {_test_file(test_id) for test_id in test_ids}
    doctest_modules = {path for path in named if path.endswith(".py") and not is_protected(path)}
    explicit = named - doctest_modules
    words = command_words(task.test_cmd or "")
    if words:  # the scripts test_cmd runs, where they are files of the repository
        listed = await _step(sandbox, f"git ls-tree -z {q(base)} -- {' '.join(map(q, words))}", "git ls-tree")
        explicit.update(entry.split("\t", 1)[1] for entry in _nul_list(listed.stdout) if " blob " in entry)
    if task.test_patch:
        await sandbox.put_file(f"{scratch}/test.patch", task.test_patch.encode())
        touched = await _touched(sandbox, base, f"{scratch}/test.patch", f"{scratch}/test.index")
        if touched.exit_code != 0:
            raise _BrokenTask(_failure("the task's test_patch does not apply to base_commit", touched))
        explicit.update(_paths(touched.stdout))

    run = _Run()
    if patch.strip():
        index = f"{scratch}/agent.index"
        await sandbox.put_file(f"{scratch}/agent.patch", (patch if patch.endswith("\n") else patch + "\n").encode())
        touched = await _touched(sandbox, base, f"{scratch}/agent.patch", index)
        if touched.exit_code != 0:
            run.apply_error = _failure("git apply", touched)
            return run
        paths = _paths(touched.stdout)
        protected = [path for path in paths if is_protected(path, explicit, runner)]
        run.dropped = (*protected, *await _doctests_changed(sandbox, base, index, doctest_modules & set(paths)))
        reset = ""
        if run.dropped:
            await sandbox.put_file(f"{scratch}/dropped", "".join(f"{path}\0" for path in run.dropped).encode())
            reset = f"xargs -0 -a {q(scratch)}/dropped git --literal-pathspecs reset -q {q(base)} -- && "
        filtered = await _step(
            sandbox,
            f"export GIT_INDEX_FILE={q(index)} && {reset}"
            f"git diff --cached --binary --no-renames --no-color --no-ext-diff --src-prefix=a/ --dst-prefix=b/"
            f" {q(base)} > {q(scratch)}/filtered.patch && git diff --cached --name-status -z --no-renames {q(base)}",
            "filtering the patch",
        )
        if filtered.exit_code != 0:
            raise _BrokenTask(_failure("filtering the patch", filtered))
        kept = _paths(filtered.stdout)
        if set(kept) & set(run.dropped) or any(is_protected(path, explicit, runner) for path in kept):
            raise _BrokenTask(f"filtering the patch left protected paths in it: {kept}")  # never grade that
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

    # The report path is a shell variable of the command line, not exported: the code under test does
    # not inherit it (see the module docstring for what it can still find). The ids travel in a file:
    # thousands of them would not fit in one command-line argument.
    junit_path = f"{scratch}/junit.xml"
    command = (
        f"mapfile -t ids < {q(scratch)}/test_ids && SWE_GRPO_JUNIT_XML={q(junit_path)}"
        f' && {task.test_cmd or DEFAULT_TEST_CMD} "${{ids[@]}}"'
    )
    run.tests = await sandbox.exec(command, timeout_s=timeout_s, env=env, cwd=sandbox.workdir)
    timings["tests_s"] = run.tests.wall_s
    run.exhausted = await sandbox.exhausted()
    if not run.tests.timed_out:
        try:
            junit_xml: str | None = (await sandbox.get_file(junit_path)).decode("utf-8", "replace")
        except SandboxError:
            junit_xml = None  # not written (or unreadable): the summary may still tell
        run.statuses = report_statuses(test_ids, junit_xml, run.tests.stdout)
    return run


async def _in_sandbox(
    backend: SandboxBackend,
    task: Task,
    work: Callable[[Sandbox], Awaitable[_T]],
    timings: dict[str, float] | None = None,
) -> _T:
    """`work` in a fresh network-less sandbox (tests need no network, and get none), destroyed after."""
    started = time.monotonic()
    sandbox = await backend.create(task, network=False)
    if timings is not None:
        timings["sandbox_s"] = time.monotonic() - started
    # The clean-up is shielded (a second cancellation must not interrupt it), and when something is
    # already going wrong, a failing clean-up must not replace that exception (a cancellation above all).
    try:
        result = await work(sandbox)
    except BaseException:
        try:
            await asyncio.shield(sandbox.destroy())
        except SandboxError as exc:
            log.warning("could not destroy the grading sandbox of %s: %s", task.instance_id, exc)
        raise
    await asyncio.shield(sandbox.destroy())
    return result


async def _run(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    *,
    timeout_s: float,
    plugin_autoload: bool,
    timings: dict[str, float],
) -> _Run:
    env = {} if plugin_autoload else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    started = time.monotonic()
    runner = await _probe_runner(backend, task, env, min(timeout_s, _STEP_TIMEOUT_S))
    timings["probe_s"] = time.monotonic() - started

    async def graded(sandbox: Sandbox) -> _Run:
        return await _graded_run(sandbox, task, patch, timeout_s=timeout_s, env=env, runner=runner, timings=timings)

    return await _in_sandbox(backend, task, graded, timings)


_MISSING_FIXTURE = re.compile(r"fixture '(\w+)' not found")
_ASYNC_SKIPPED = "async def functions are not natively supported"


def _plugin_hint(output: str, plugin_autoload: bool) -> str | None:
    """What the run's output says about a pytest plugin its tests need and did not have."""
    missing = sorted(set(_MISSING_FIXTURE.findall(output)))
    needs = [f"fixture(s) {', '.join(map(repr, missing))}"] if missing else []
    if _ASYNC_SKIPPED in output:
        needs.append("an async test plugin (pytest-asyncio, anyio): async tests were skipped")
    if not needs:
        return None
    why = "plugin autoload is off for this grade" if not plugin_autoload else "no installed plugin provides them"
    return f"the tests need {' and '.join(needs)}, which no loaded pytest plugin provides ({why})"


def _join(*parts: str | None) -> str | None:
    return "; ".join(part for part in parts if part) or None


def _finished(run: _Run) -> bool:
    return run.tests is not None and not run.tests.timed_out and run.statuses is not None


async def grade(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugin_autoload: bool = True,
) -> GradeResult:
    """Grade `patch` (a `git apply`-able diff against `task.base_commit`; "" for none) in a fresh sandbox;
    see the module docstring for the rules. `timeout_s` bounds the test run. `plugin_autoload` (the
    worker's setting; `task.plugin_autoload`, when set, wins) lets pytest load the plugins installed in
    the sandbox, as SWE-bench's harness does (repositories whose tests use pytest-mock's `mocker` need
    it); a patch cannot bring a plugin in either way. Never raises for a sandbox failure
    (`infra_error`); cancellation propagates, after the sandboxes are destroyed."""
    if task.plugin_autoload is not None:
        plugin_autoload = task.plugin_autoload
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
            error=error if outcome == "resolved" else _join(error, _plugin_hint(output, plugin_autoload)),
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
        if run.exhausted is not None or not _finished(run):
            # No verdict, or none to trust. Whose fault? Run the tests once more without the patch.
            control_started = time.monotonic()
            control = await attempt("", {})
            timings["control_s"] = time.monotonic() - control_started
            if run.exhausted is not None:
                if control.exhausted is not None:
                    error = f"the tests run the grading sandbox out of {control.exhausted} without the patch too"
                    return result("infra_error", None, f"grading: {error} (its {control.exhausted} limit)")
                error = f"the patch's code ran the grading sandbox out of {run.exhausted} when the tests ran"
                return result("resource_exhausted", 0.0, f"grading: {error} (its {run.exhausted} limit)")
            control_ok = _finished(control)
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
    plugin_autoload: bool = True,
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
