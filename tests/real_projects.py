"""Grading tasks on real projects: released PyPI sdists, a bug injected into each (SWE-smith style), and
FAIL_TO_PASS / PASS_TO_PASS taken by running the project's own test suite in the grader's own sandbox.

`real_project_tasks(backend)` returns the tasks, building them on first use into
`cache_root()/real_projects/<hash of this file>/` (sdists, git repositories, `tasks.jsonl`); a second call
(or run) only reads that file. Building, for each project:

1. `pip download --no-deps --no-binary :all: NAME==VERSION` into `cache_root()/real_projects/sdists`, and
   the archive's sha256 checked against the pinned one (`SdistError` when it differs); the
   download, extraction and root commits are `swe_grpo.synth.source`'s, which `swe-grpo tasks synth` uses.
2. The sdist's tree, plus `Project.adapt` (config edits that make the released tree run with what this box
   has, e.g. dropping pytest-cov options) and `Project.extra_files`, is the clean tree. Each `Bug` makes a
   buggy tree from it by replacing one snippet in one function. The buggy tree is a ROOT commit (no
   parent, fixed dates), so a sandbox, which fetches only the base commit's history, shows no trace of
   the clean code; the gold patch is `git diff buggy clean`.
3. The whole suite runs in a `LocalBackend` sandbox (the task's `test_cmd`, or the grader's default, with
   the environment's plugins loaded) at the buggy commit and with the gold patch applied: F2P = the tests
   that PASS with the gold patch and not without it; P2P = the tests that pass in both. Then those tests
   run again as the grader runs them (only them, F2P first), with and without the gold patch, and a test
   whose result changes (semver's .rst doctests need a fixture that only runs if tests/ ran first) is
   dropped. A bug that then fails no test is a `BuildError`.

The problem statements describe the symptom, not the fix, as an issue would.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from swe_grpo.grading import DEFAULT_TEST_CMD
from swe_grpo.paths import cache_root
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.synth.source import SynthError, commit_tree, download_sdist, extract_sdist, git
from swe_grpo.tasks import Task, load_jsonl

_SUITE_TIMEOUT_S = 300.0


SdistError = SynthError  # an sdist could not be downloaded, or is not the pinned one


class BuildError(RuntimeError):
    """A task cannot be built as specified (a snippet not found, a bug that fails no test, ...)."""


@dataclass(frozen=True)
class Bug:
    """A small mutation of one function: `old` (found exactly once in `path`) becomes `new`."""

    name: str
    path: str
    old: str
    new: str
    problem_statement: str


@dataclass(frozen=True)
class Project:
    """A released sdist and the bugs injected into it. `style` says which test style it brings."""

    name: str
    version: str
    sha256: str
    style: str
    bugs: tuple[Bug, ...]
    test_cmd: str | None = None
    adapt: tuple[tuple[str, str, str], ...] = ()  # (path, old, new): make the released tree run here
    extra_files: dict[str, str] = field(default_factory=dict)

    @property
    def dist(self) -> str:
        return f"{self.name}-{self.version}"


_RUN_TESTS_SH = """\
#!/bin/sh
# Runs the test suite from a source checkout (the package lives in src/).
PYTHONPATH=src exec python3 -m pytest -rA -p no:cacheprovider "$@"
"""

PROJECTS: tuple[Project, ...] = (
    Project(
        "more-itertools",
        "10.5.0",
        "5482bfef7849c25dc3c6dd53a6173ae4795da2a41a80faea6700d9f5846c5da6",
        "unittest classes, flat layout",
        bugs=(
            Bug(
                "split_at_maxsplit",
                "more_itertools/more.py",
                "            if maxsplit == 1:\n                yield list(it)",
                "            if maxsplit == 2:\n                yield list(it)",
                "`split_at(iterable, pred, maxsplit=N)` does not stop after N splits: with maxsplit=1 the whole "
                "iterable is split, and other values give one split too few.",
            ),
            Bug(
                "padded_next_multiple",
                "more_itertools/more.py",
                "                yield islice(iterable_with_repeat, n - 1)",
                "                yield islice(iterable_with_repeat, n)",
                "`padded(iterable, n=3, next_multiple=True)` emits groups of the wrong size: "
                "`list(padded([1, 2, 3, 4], n=3, next_multiple=True))` is not `[1, 2, 3, 4, None, None]`.",
            ),
        ),
    ),
    Project(
        "toolz",
        "1.0.0",
        "2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02",
        "pytest functions inside the package (toolz/tests)",
        bugs=(
            Bug(
                "interpose_leading",
                "toolz/itertoolz.py",
                "    inposed = concat(zip(itertools.repeat(el), seq))\n    next(inposed)\n",
                "    inposed = concat(zip(itertools.repeat(el), seq))\n",
                "`interpose('a', [1, 2, 3])` starts with the separator: it should be [1, 'a', 2, 'a', 3].",
            ),
            Bug(
                "partition_all_tail",
                "toolz/itertoolz.py",
                "            yield prev[:len(seq) % n]",
                "            yield prev[:len(seq) // n]",
                "`partition_all(2, [1, 2, 3, 4, 5])` gets its last, shorter tuple wrong for sequences.",
            ),
        ),
    ),
    Project(
        "boltons",
        "24.0.0",
        "7153feccaea1ff2e1472f68d4b57fadb796a2ee49d29f638f1c9cd8fb5ebd916",
        "pytest functions, conftest.py, pytest.ini, doctests (--doctest-modules)",
        test_cmd=DEFAULT_TEST_CMD + " --doctest-modules",
        bugs=(
            Bug(
                "ordinalize_teens",
                "boltons/strutils.py",
                "            if numstr[-2] == '1':",
                "            if numstr[-1] == '1':",
                "`strutils.ordinalize` gives wrong suffixes: `ordinalize(1)` should be '1st', `ordinalize(11)` '11th'.",
            ),
            Bug(
                "parse_int_list_range",
                "boltons/strutils.py",
                "            output += list(range(min(range_limits), max(range_limits)+1))",
                "            output += list(range(min(range_limits), max(range_limits)))",
                "`parse_int_list('1,3,5-8')` drops the upper end of a range: 8 is missing.",
            ),
        ),
    ),
    Project(
        "semver",
        "3.0.2",
        "6253adb39c70f6e51afed2fa7152bcd414c411286088fb4b9effb133885ab4cc",
        "src/ layout (pythonpath ini), conftest.py fixtures, doctests in modules and .rst",
        # pytest-cov is not installed here: its options would be a usage error.
        adapt=(("setup.cfg", "\t--no-cov-on-fail\n\t--cov=semver\n\t--cov-report=term-missing\n", ""),),
        bugs=(
            Bug(
                "prerelease_numeric_precedence",
                "src/semver/version.py",
                "            elif isinstance(a, int):\n                return -1",
                "            elif isinstance(a, int):\n                return 1",
                "Pre-release precedence is wrong: `Version.parse('1.0.0-alpha.1') < Version.parse('1.0.0-alpha.beta')`"
                " should be True (numeric identifiers have lower precedence than alphanumeric ones).",
            ),
            Bug(
                "increment_string_width",
                "src/semver/version.py",
                "            next_ = str(int(match.group(1)) + 1)",
                "            next_ = str(int(match.group(1)) + 2)",
                "`Version.parse('1.2.3-rc.1').bump_prerelease()` skips a number: it should be 1.2.3-rc.2.",
            ),
        ),
    ),
    Project(
        "platformdirs",
        "4.2.2",
        "38b7b51f512eed9e84a22788b4bce1de17c0adb134d6becb09836e37d8654cd3",
        "src/ layout (PYTHONPATH in test_cmd), conftest.py fixtures, pytest-mock's `mocker`",
        test_cmd="PYTHONPATH=src " + DEFAULT_TEST_CMD,
        bugs=(
            Bug(
                "site_data_dirs_order",
                "src/platformdirs/unix.py",
                '            path = f"/usr/local/share{os.pathsep}/usr/share"',
                '            path = f"/usr/share{os.pathsep}/usr/local/share"',
                "On Unix, without XDG_DATA_DIRS, `site_data_dir` is /usr/share/... but the XDG spec's default "
                "order puts /usr/local/share first.",
            ),
            Bug(
                "bsd_runtime_fallback",
                "src/platformdirs/unix.py",
                'path = f"/var/run/user/{getuid()}"\n                if not Path(path).exists():',
                'path = f"/var/run/user/{getuid()}"\n                if Path(path).exists():',
                "On FreeBSD/OpenBSD/NetBSD, `user_runtime_dir` is /tmp/runtime-<uid> even when /var/run/user/<uid>"
                " exists, and a /var/run/user path that does not exist is returned otherwise.",
            ),
        ),
    ),
    Project(
        "cachetools",
        "5.5.0",
        "2cc24fb4cbe39633fb7badd9db9ca6295d766d9c2995f245725a46715d050f2a",
        "src/ layout, unittest classes, run by a script named in test_cmd",
        test_cmd='bash run_tests.sh --junitxml="$SWE_GRPO_JUNIT_XML"',
        extra_files={"run_tests.sh": _RUN_TESTS_SH},
        bugs=(
            Bug(
                "lru_popitem",
                "src/cachetools/__init__.py",
                '        """Remove and return the `(key, value)` pair least recently used."""\n'
                "        try:\n            key = next(iter(self.__order))",
                '        """Remove and return the `(key, value)` pair least recently used."""\n'
                "        try:\n            key = next(reversed(self.__order))",
                "LRUCache evicts the most recently used item instead of the least recently used one.",
            ),
            Bug(
                "ttl_expiry_boundary",
                "src/cachetools/__init__.py",
                "        while curr is not root and not (time < curr.expires):",
                "        while curr is not root and not (time <= curr.expires):",
                "TTLCache.expire() keeps items whose time-to-live has just run out (at exactly their expiry time).",
            ),
        ),
    ),
)


def sdist(project: Project, cache: Path) -> Path:
    """The project's sdist, downloaded once with pip and checked against its pinned sha256."""
    return download_sdist(f"{project.name}=={project.version}", cache / "sdists", project.sha256)


def _clean_tree(project: Project, archive: Path, dest: Path) -> None:
    extract_sdist(archive, dest)
    for path, old, new in project.adapt:
        _replace(dest / path, old, new)
    for path, text in project.extra_files.items():
        (dest / path).write_text(text)


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise BuildError(f"{path}: expected the snippet once, found it {text.count(old)} times: {old!r}")
    path.write_text(text.replace(old, new))


@dataclass
class _Built:
    project: Project
    bug: Bug
    base_commit: str
    patch: str


def _build_repo(project: Project, archive: Path, repo: Path) -> list[_Built]:
    """A bare repository holding one root commit per bug (and a branch named after it)."""
    git(repo.parent, "init", "-q", "--bare", str(repo))
    built = []
    with tempfile.TemporaryDirectory() as tmp:
        clean = Path(tmp) / "clean"
        _clean_tree(project, archive, clean)
        clean_commit = commit_tree(repo, clean, f"{project.dist}")
        for bug in project.bugs:
            buggy = Path(tmp) / bug.name
            shutil.copytree(clean, buggy, symlinks=True)
            _replace(buggy / bug.path, bug.old, bug.new)
            base = commit_tree(repo, buggy, f"{project.dist}")
            git(repo, "branch", bug.name, base)
            patch = git(repo, "diff", "--binary", base, clean_commit)
            built.append(_Built(project, bug, base, patch))
    return built


_PASSED = re.compile(r"^PASSED (\S.*)$", re.MULTILINE)


async def _passing(backend: SandboxBackend, task: Task, patch: str, ids: list[str] | None = None) -> set[str]:
    """The ids of the tests that pass at `task.base_commit` + `patch`: of the whole suite, or of `ids`
    run as the grader runs them (in one call, in that order)."""
    sandbox = await backend.create(task, network=False)  # as the grader's
    try:
        if patch:
            await sandbox.put_file("/tmp/gold.patch", patch.encode())
            applied = await sandbox.exec("git apply /tmp/gold.patch", timeout_s=60)
            if applied.exit_code != 0:
                raise BuildError(f"{task.instance_id}: the gold patch does not apply: {applied.stderr}")
        await sandbox.put_file("/tmp/ids", "".join(f"{test_id}\n" for test_id in ids or []).encode())
        selection = '"${ids[@]}"' if ids else "--continue-on-collection-errors"
        command = (
            f"mapfile -t ids < /tmp/ids && SWE_GRPO_JUNIT_XML=/tmp/junit.xml && {task.test_cmd or DEFAULT_TEST_CMD}"
        )
        run = await sandbox.exec(f"{command} {selection}", timeout_s=_SUITE_TIMEOUT_S)
    finally:
        await sandbox.destroy()
    if run.timed_out:
        raise BuildError(f"{task.instance_id}: the suite did not finish in {_SUITE_TIMEOUT_S:g}s")
    summary = run.stdout.rpartition("short test summary info")[2]
    return set(_PASSED.findall(summary))


async def _rows(backend: SandboxBackend, built: list[_Built], repo_of: dict[str, str]) -> list[dict]:
    semaphore = asyncio.Semaphore(2)

    async def row(item: _Built) -> dict:
        project, bug = item.project, item.bug
        task = Task(
            instance_id=f"{project.dist}__{bug.name}",
            repo=repo_of[project.dist],
            base_commit=item.base_commit,
            problem_statement=bug.problem_statement,
            test_cmd=project.test_cmd,
        )
        async with semaphore:
            broken, fixed = await asyncio.gather(_passing(backend, task, ""), _passing(backend, task, item.patch))
            # Run as the grader will (only these ids, F2P first): a test that then behaves otherwise (it
            # depends on the order, or on tests not selected) is no F2P/P2P test.
            ids = [*sorted(fixed - broken), *sorted(fixed & broken)]
            selected_broken, selected_fixed = await asyncio.gather(
                _passing(backend, task, "", ids), _passing(backend, task, item.patch, ids)
            )
        fixed &= selected_fixed
        broken &= selected_broken
        f2p, p2p = sorted(fixed - broken - selected_broken), sorted(fixed & broken)
        if not f2p:
            raise BuildError(
                f"{task.instance_id}: the bug fails no test that the gold patch passes"
                f" ({len(fixed)} pass with it, {len(broken)} without)"
            )
        return {
            "instance_id": task.instance_id,
            "repo": os.path.relpath(task.repo, repo_of["__root__"]),
            "base_commit": item.base_commit,
            "problem_statement": bug.problem_statement,
            "patch": item.patch,
            "test_patch": "",
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            "test_cmd": project.test_cmd,
            "project_style": project.style,
        }

    results = await asyncio.gather(*(row(item) for item in built), return_exceptions=True)
    errors = [str(result) for result in results if isinstance(result, BaseException)]
    if errors:
        raise BuildError("\n".join(errors))
    return [result for result in results if not isinstance(result, BaseException)]


def tasks_dir(cache: Path | None = None) -> Path:
    """Where this version of the task set lives: keyed by this file's contents, so any change rebuilds."""
    root = cache or cache_root() / "real_projects"
    return root / hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


async def real_project_tasks(backend: SandboxBackend, cache: Path | None = None) -> list[Task]:
    """The task set, built on first use (see the module docstring; one builder at a time, across
    processes); later calls read `tasks.jsonl`."""
    root = cache or cache_root() / "real_projects"
    done = tasks_dir(cache)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
        if not (done / "tasks.jsonl").is_file():
            await _build(backend, root, done)
    return load_jsonl(done / "tasks.jsonl")


async def _build(backend: SandboxBackend, root: Path, done: Path) -> None:
    building = Path(tempfile.mkdtemp(prefix=f".{done.name}-", dir=root))
    try:
        repo_of = {"__root__": str(done)}
        built: list[_Built] = []
        for project in PROJECTS:
            repo = building / "repos" / f"{project.dist}.git"
            repo.parent.mkdir(exist_ok=True)
            built += _build_repo(project, sdist(project, root), repo)
            repo_of[project.dist] = str(done / "repos" / repo.name)
        # The sandboxes read the repositories where they will stay: move them there first.
        shutil.rmtree(done, ignore_errors=True)
        building.rename(done)
        rows = await _rows(backend, built, repo_of)
        (done / "tasks.jsonl.tmp").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (done / "tasks.jsonl.tmp").rename(done / "tasks.jsonl")
    finally:
        shutil.rmtree(building, ignore_errors=True)
