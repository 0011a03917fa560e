"""`swe-grpo tasks synth` (swe_grpo/synth) on a small real project written here (pure Python, its tests
pytest functions) and on a released sdist (toolz 1.0.0), in real `local` sandboxes with the real grader:
the synthesised tasks load with `load_tasks`, every gold patch resolves and no empty patch does in a
fresh grading sandbox (also through `swe-grpo grade`), the same seed gives the same tasks, an interrupted
run resumes without redoing what it decided, and each refusal (a source that cannot be fetched, a suite
that does not run, no covered function) says why."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
from pathlib import Path

import docker.errors
import pytest
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse)

from swe_grpo import cli
from swe_grpo.grading import DEFAULT_TEST_CMD, grade
from swe_grpo.paths import cache_root
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.synth import ProjectReport, SynthConfig, SynthError, mutations, synthesize
from swe_grpo.synth.build import _ordered
from swe_grpo.synth.source import GIT_ENV, download_sdist
from swe_grpo.synth.statement import problem_statement
from swe_grpo.tasks import load_tasks

LIMIT = 4

LIBRARY = '''"""A tiny library."""


def clamp(value, low, high):
    if value < low:
        return low
    if value > high:
        return high
    return value


def chunks(items, size):
    if size <= 0:
        raise ValueError("size must be positive")
    return [items[i : i + size] for i in range(0, len(items), size)]


def mean(values):
    if not values:
        raise ValueError("no values")
    return sum(values) / len(values)


def initials(name):
    return "".join(part[0].upper() for part in name.split() if part)


def untested(x):
    return x * 2
'''

TESTS = """import pytest

from tinylib import chunks, clamp, initials, mean


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-1, 0, 10) == 0


def test_clamp_high():
    assert clamp(11, 0, 10) == 10


def test_chunks():
    assert chunks([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_chunks_bad_size():
    with pytest.raises(ValueError):
        chunks([1], 0)


def test_mean():
    assert mean([1, 2, 3, 6]) == 3


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_initials():
    assert initials("ada  lovelace") == "AL"
"""


def write_project(root: Path, tests: str = TESTS) -> Path:
    (root / "tinylib").mkdir(parents=True)
    (root / "tinylib" / "__init__.py").write_text(LIBRARY)
    (root / "tests").mkdir()
    (root / "tests" / "test_tinylib.py").write_text(tests)
    return root


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project as a git repository with a commit (a SOURCE that is a repository: its HEAD is taken)."""
    root = write_project(tmp_path_factory.mktemp("project") / "tinylib-repo")
    (root / "NOT_COMMITTED.txt").write_text("left out: only HEAD's tree counts")
    for args in (["init", "-q"], ["add", "tinylib", "tests"], ["commit", "-q", "-m", "tinylib"]):
        subprocess.run(["git", *args], cwd=root, check=True, env=GIT_ENV, capture_output=True)
    return root


@pytest.fixture(scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> LocalBackend:
    backend = LocalBackend(cache_dir=tmp_path_factory.mktemp("checkouts"), run_dir=run_dir)
    await backend.start()
    return backend


def config(out: Path, **changes) -> SynthConfig:
    return SynthConfig(**{"out": out, "seed": 0, "max_per_project": LIMIT, "jobs": 2, "timeout_s": 120, **changes})


@pytest.fixture(scope="module")
async def synthesised(project: Path, backend: LocalBackend, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    (report,) = await synthesize([str(project)], config(out), backend)
    assert report.error is None, report.error
    assert report.accepted == LIMIT, report
    return out


def test_the_tasks_load_and_hide_the_fix(synthesised: Path) -> None:
    tasks = load_tasks(synthesised / "tasks.jsonl")
    assert len(tasks) == LIMIT
    assert len({task.instance_id for task in tasks}) == LIMIT
    assert not list(synthesised.glob("repos/*/NOT_COMMITTED.txt"))
    for task in tasks:
        assert Path(task.repo) == synthesised / "repos" / Path(task.repo).name
        assert task.fail_to_pass and task.test_patch == "" and task.patch.startswith("diff --git a/tinylib/")
        assert not set(task.fail_to_pass) & set(task.pass_to_pass)
        assert set(task.fail_to_pass) | set(task.pass_to_pass) <= {
            f"tests/test_tinylib.py::{name}" for name in _test_names()
        }
        for test_id in task.fail_to_pass:
            assert f"`{test_id}`" in task.problem_statement
        changed = [line[1:].strip() for line in task.patch.splitlines() if line[:1] in "+-" and line[1:2] not in "+-"]
        assert "@@" not in task.problem_statement and "diff --git" not in task.problem_statement
        for line in changed:
            if len(line) >= 10:  # a whole line of code, not a word like `pass`
                assert line not in task.problem_statement, (line, task.problem_statement)
        assert task.metadata["synth"]["path"] == "tinylib/__init__.py"
        assert task.metadata["synth"]["function"] != "untested"  # no test runs it


def _test_names() -> list[str]:
    return [node.name for node in ast.parse(TESTS).body if isinstance(node, ast.FunctionDef)]


async def test_gold_resolves_and_empty_does_not_in_fresh_grading_sandboxes(
    synthesised: Path, backend: LocalBackend
) -> None:
    tasks = load_tasks(synthesised / "tasks.jsonl")
    gold = await asyncio.gather(*(grade(task, task.patch, backend, timeout_s=120) for task in tasks))
    empty = await asyncio.gather(*(grade(task, "", backend, timeout_s=120) for task in tasks))
    assert [g.outcome for g in gold] == ["resolved"] * len(tasks), [g.error for g in gold]
    assert [g.outcome for g in empty] == ["unresolved"] * len(tasks), [g.error for g in empty]
    for task, result in zip(tasks, empty, strict=True):
        assert result.f2p_passed < result.f2p_total == len(task.fail_to_pass)


async def test_the_same_seed_gives_the_same_tasks(
    synthesised: Path, project: Path, backend: LocalBackend, tmp_path: Path
) -> None:
    (report,) = await synthesize([str(project)], config(tmp_path / "again"), backend)
    assert report.error is None
    assert (tmp_path / "again" / "tasks.jsonl").read_bytes() == (synthesised / "tasks.jsonl").read_bytes()


def test_the_seed_orders_the_candidates() -> None:
    found = mutations("tinylib/__init__.py", LIBRARY.encode())
    assert _ordered(found, 0, "p") == _ordered(found, 0, "p")
    assert _ordered(found, 0, "p") != _ordered(found, 1, "p")
    assert sorted(_ordered(found, 1, "p"), key=lambda m: m.key) == sorted(found, key=lambda m: m.key)
    first = _ordered(found, 0, "p")[:4]
    assert len({m.function for m in first}) == 4  # one mutation of each function before a second of any
    assert len({m.operator for m in first}) == 4  # and operators spread


OPERATORS_SOURCE = """
def f(a, b, flag=True):
    if a < b and b > 0:
        return max(a, b) + 1
    if a is None:
        raise ValueError("a")
    total = 0
    total += a * 2
    seen = False
    return total if flag else seen
"""


def test_every_operator_changes_only_its_own_text() -> None:
    found = mutations("m.py", OPERATORS_SOURCE.encode())
    assert {m.operator for m in found} == {
        "comparison", "arithmetic", "boolean", "off_by_one", "constant", "invert_if", "remove_if",
        "drop_return", "drop_raise", "swap_args",
    }  # fmt: skip
    for mutation in found:
        mutant = mutation.apply(OPERATORS_SOURCE.encode()).decode()
        ast.parse(mutant)
        before, after = OPERATORS_SOURCE.splitlines(), mutant.splitlines()
        changed = [line for line in before if line not in after]
        assert len(changed) == (2 if mutation.operator == "remove_if" else 1), (mutation, changed)
    assert mutations("m.py", OPERATORS_SOURCE.encode(), covered=set()) == []
    assert mutations("m.py", b"def broken(:\n") == []


def test_the_statement_never_quotes_the_mutated_code() -> None:
    found = mutations("m.py", OPERATORS_SOURCE.encode())
    (mutation,) = [m for m in found if m.operator == "drop_return" and m.new == "max(a, b) + 1"]
    messages = {"tests/test_m.py::test_f": "AssertionError: boom\n    max(a, b) + 1\nassert None == 3"}
    text = problem_statement("m", ["tests/test_m.py::test_f"], messages, DEFAULT_TEST_CMD, mutation)
    assert "max(a, b) + 1" not in text and "assert None == 3" in text and "`tests/test_m.py::test_f`" in text
    assert "--junitxml" not in text


async def test_an_interrupted_run_resumes(
    synthesised: Path, project: Path, backend: LocalBackend, tmp_path: Path
) -> None:
    out = tmp_path / "resumed"
    first_decision = asyncio.Event()
    run = asyncio.ensure_future(
        synthesize([str(project)], config(out), backend, decided=lambda n, a, tried: tried and first_decision.set())
    )
    await asyncio.wait_for(first_decision.wait(), 120)
    run.cancel()  # as Ctrl-C does
    with pytest.raises(asyncio.CancelledError):
        await run
    decided = [json.loads(line) for line in (out / ".synth" / "decisions.jsonl").read_text().splitlines()]
    assert decided
    kept = load_tasks(out / "tasks.jsonl")  # what was validated before the interruption is there, loadable
    assert {task.instance_id for task in kept} == {d["instance_id"] for d in decided if d["row"]}

    (report,) = await synthesize([str(project)], config(out), backend)
    assert report.error is None
    again = [json.loads(line) for line in (out / ".synth" / "decisions.jsonl").read_text().splitlines()]
    assert again[: len(decided)] == decided
    ids = [d["instance_id"] for d in again]
    assert len(ids) == len(set(ids)), "a decided candidate was validated again"
    assert (out / "tasks.jsonl").read_bytes() == (synthesised / "tasks.jsonl").read_bytes()


PARITY = """def is_even(n):
    return n % 2 == 0
"""
# unittest, not pytest: `assertTrue` says only "False is not true", whichever way is_even breaks.
PARITY_TESTS = """import unittest

from parity import is_even


class TestParity(unittest.TestCase):
    def test_four_is_even(self):
        self.assertTrue(is_even(4))

    def test_three_is_odd(self):
        self.assertFalse(is_even(3))
"""


@pytest.fixture(scope="module")
async def parity(backend: LocalBackend, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ProjectReport]:
    """A project with a unittest suite whose pytest configuration asks for an option no plugin here has
    (as a project with `--cov` in its addopts does without pytest-cov)."""
    root = tmp_path_factory.mktemp("parity") / "parity"
    (root / "tests").mkdir(parents=True)
    (root / "parity.py").write_text(PARITY)
    (root / "tests" / "test_parity.py").write_text(PARITY_TESTS)
    (root / "setup.cfg").write_text("[tool:pytest]\naddopts = --no-such-plugin-option\n")
    out = tmp_path_factory.mktemp("parity-out")
    (report,) = await synthesize([str(root)], config(out, max_per_project=10), backend)
    return out, report


async def test_a_unittest_suite_whose_addopts_fail_runs_without_them(
    parity: tuple[Path, ProjectReport], backend: LocalBackend
) -> None:
    out, report = parity
    assert report.error is None and report.tests == 2, report
    tasks = load_tasks(out / "tasks.jsonl")
    assert tasks and all(task.test_cmd == DEFAULT_TEST_CMD + " -o addopts=" for task in tasks)
    assert all(test_id.startswith("tests/test_parity.py::TestParity::") for t in tasks for test_id in t.fail_to_pass)
    gold, empty = await asyncio.gather(grade(tasks[0], tasks[0].patch, backend), grade(tasks[0], "", backend))
    assert (gold.outcome, empty.outcome) == ("resolved", "unresolved"), (gold.error, empty.error)


def test_mutants_that_fail_the_same_way_make_one_task(parity: tuple[Path, ProjectReport]) -> None:
    out, report = parity
    tasks = load_tasks(out / "tasks.jsonl")
    statements = [task.problem_statement for task in tasks]
    assert len(statements) == len(set(statements)) >= 2
    # `== 0` -> `!= 0`, `% 2` -> `// 2`, `2` -> `3`, `0` -> `1`: each fails both tests with the same messages.
    assert report.rejected.get("same failure as an earlier task", 0) >= 2, report
    assert report.accepted == len(tasks)


MOCKED_TESTS = """from tinylib import clamp, mean


def test_clamp(mocker):  # pytest-mock's fixture: not in the docker backend's default image
    assert clamp(-1, 0, 10) == 0 and clamp(11, 0, 10) == 10 and clamp(5, 0, 10) == 5


def test_mean(mocker):
    assert mean([1, 2, 3]) == 2
"""


async def test_on_docker_a_project_gets_an_image_with_its_test_requirements(docker_url: str, tmp_path: Path) -> None:
    """`docker`: the project's declared test extra (pytest-mock, from PyPI) is installed into its environment
    image, the rows name that image, and `swe-grpo grade`'s grader resolves the gold patch on docker."""
    from swe_grpo.sandbox.docker import DockerBackend
    from swe_grpo.sandbox.docker.images import ENVIRONMENT_LABEL

    root = write_project(tmp_path / "mocked", tests=MOCKED_TESTS)
    pyproject = '[project]\nname = "tinylib"\nversion = "1"\n[project.optional-dependencies]\ntest = ["pytest-mock"]\n'
    (root / "pyproject.toml").write_text(pyproject)
    backend = DockerBackend(base_url=docker_url)
    await backend.start()
    try:
        (report,) = await synthesize([str(root)], config(tmp_path / "out", max_per_project=1, timeout_s=300), backend)
        assert report.error is None and report.accepted == 1 and report.tests == 2, report
        (task,) = load_tasks(tmp_path / "out" / "tasks.jsonl")
        assert task.image and task.image.startswith("swe-grpo-synth-env:mocked-")
        assert task.metadata["synth"]["requirements"] == ["pytest-mock"]
        image = backend.client.images.get(task.image)
        assert image.labels[ENVIRONMENT_LABEL] == "1"
        check = ["python3", "-c", "import pytest_mock"]
        backend.client.containers.run(task.image, check, remove=True, network_mode="none")
        with pytest.raises(docker.errors.ContainerError):  # the default image has no pytest-mock
            backend.client.containers.run(backend.default_image, check, remove=True, network_mode="none")
        gold, empty = await asyncio.gather(
            grade(task, task.patch, backend, timeout_s=300), grade(task, "", backend, timeout_s=300)
        )
        assert (gold.outcome, empty.outcome) == ("resolved", "unresolved"), (gold.error, empty.error)
    finally:
        await backend.close()


def test_the_requirements_are_the_runtime_ones_and_a_test_extras(tmp_path: Path) -> None:
    from swe_grpo.synth.environment import requirements

    pkg_info = """Metadata-Version: 2.1
Name: p
Version: 1
Requires-Dist: attrs>=22
Requires-Dist: importlib-metadata; python_version < "3.10"
Requires-Dist: pytest-mock; extra == "test"
Requires-Dist: hypothesis; python_version >= "3.9" and extra == 'tests'
Requires-Dist: sphinx; extra == "docs"
"""
    (tmp_path / "PKG-INFO").write_text(pkg_info)
    assert requirements(tmp_path) == [
        "attrs>=22",
        'importlib-metadata; python_version < "3.10"',
        "pytest-mock",
        'hypothesis; python_version >= "3.9" and "a" == "a"',
    ]


async def test_on_docker_requirements_that_cannot_be_installed_are_a_refusal(docker_url: str, tmp_path: Path) -> None:
    from swe_grpo.sandbox.docker import DockerBackend

    root = write_project(tmp_path / "unmet")
    (root / "pyproject.toml").write_text('[project]\nname = "unmet"\nversion = "1"\ndependencies = ["toolz==0.0.0"]\n')
    backend = DockerBackend(base_url=docker_url)
    await backend.start()
    try:
        (report,) = await synthesize([str(root)], config(tmp_path / "out"), backend)
    finally:
        await backend.close()
    assert report.error is not None and "cannot install its test requirements ['toolz==0.0.0']" in report.error
    assert load_tasks(tmp_path / "out" / "tasks.jsonl") == []


def test_the_command_line_makes_tasks_that_swe_grpo_grade_takes(project: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    synth = ["tasks", "synth", str(project), "--out", str(out), "--max-per-project", "2", "--timeout", "120"]
    assert cli.main(synth) == 0
    tasks = load_tasks(out / "tasks.jsonl")
    assert len(tasks) == 2
    predictions = [{"instance_id": t.instance_id, "model_patch": t.patch} for t in tasks]
    predictions.append({"instance_id": tasks[0].instance_id, "model_patch": ""})
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    graded = ["grade", "--tasks", str(out / "tasks.jsonl"), "--predictions", str(tmp_path / "predictions.jsonl")]
    assert cli.main([*graded, "--output", str(tmp_path / "results.jsonl"), "--timeout", "120"]) == 0
    results = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["outcome"] for r in results] == ["resolved", "resolved", "unresolved"], [r["error"] for r in results]


async def test_a_released_sdist_from_pypi(backend: LocalBackend, tmp_path: Path) -> None:
    """toolz 1.0.0 (its tests inside the package, toolz/tests): the sdist as tests/real_projects.py has it
    cached (else pip downloads it), one task, graded again here."""
    sdists = cache_root() / "real_projects" / "sdists"
    (report,) = await synthesize(["toolz==1.0.0"], config(tmp_path, max_per_project=1, sdist_cache=sdists), backend)
    assert report.error is None and report.accepted == 1 and report.tests > 100, report
    (task,) = load_tasks(tmp_path / "tasks.jsonl")
    assert task.instance_id.startswith("toolz-1.0.0__synth-") and task.patch.startswith("diff --git a/toolz/")
    assert all(test_id.startswith("toolz/tests/") for test_id in task.fail_to_pass)
    gold, empty = await asyncio.gather(
        grade(task, task.patch, backend, timeout_s=300), grade(task, "", backend, timeout_s=300)
    )
    assert (gold.outcome, empty.outcome) == ("resolved", "unresolved"), (gold.error, empty.error)


def test_a_source_that_cannot_be_fetched_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-such-project"
    code = cli.main(["tasks", "synth", str(missing), "not a requirement", "--out", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "no such directory, and not a pinned PyPI requirement" in err
    with pytest.raises(SynthError, match=r"cannot fetch toolz==0\.0\.0: pip download"):
        download_sdist("toolz==0.0.0", tmp_path / "sdists")


async def test_a_suite_that_does_not_run_is_refused(backend: LocalBackend, tmp_path: Path) -> None:
    broken = write_project(tmp_path / "broken", tests="import no_such_module\n\n\ndef test_x():\n    pass\n")
    (report,) = await synthesize([str(broken)], config(tmp_path / "out"), backend)
    assert report.error is not None and "the test suite does not run (no test passes" in report.error
    assert "no_such_module" in report.error
    assert report.wall_s > 0  # a refusal's cost is measured too
    (report,) = await synthesize([str(broken)], config(tmp_path / "out2", test_cmd="false"), backend)
    assert report.error is not None and "the test suite does not run (it gives no test report)" in report.error
    assert load_tasks(tmp_path / "out" / "tasks.jsonl") == []


SHIFTING_IDS = """import sys

import pytest

from tinylib import clamp

# The id depends on how pytest was called, as isodate 0.7.2's depend on the run's hash seed: a test passing
# in the whole suite is not found by its id.
SHIFT = "by-id" if any("::" in arg for arg in sys.argv) else "whole"


@pytest.mark.parametrize("value", [5], ids=[SHIFT])
def test_clamp(value):
    assert clamp(value, 0, 10) == 5
"""


async def test_a_suite_whose_test_ids_change_between_runs_is_refused(backend: LocalBackend, tmp_path: Path) -> None:
    shifting = write_project(tmp_path / "shifting", tests=SHIFTING_IDS)
    (report,) = await synthesize([str(shifting)], config(tmp_path / "out"), backend)
    assert report.error is not None, report
    assert "none of the 1 tests that passed twice passes when run by id, as the grader runs them" in report.error


async def test_a_project_whose_tests_run_none_of_its_functions_is_refused(
    backend: LocalBackend, tmp_path: Path
) -> None:
    idle = write_project(tmp_path / "idle", tests="def test_arithmetic():\n    assert 1 + 1 == 2\n")
    (report,) = await synthesize([str(idle)], config(tmp_path / "out"), backend)
    assert report.error is not None and "no covered function" in report.error
