"""How the suite shares a box with itself when pytest-xdist runs it on several workers (`make test`: `-n 2`). Most slow
tests wait (stall timeouts, heartbeats, agents starting), so two workers keep the cores busy. What must not be split
or overlapped is said here, and nothing changes in a run without xdist:

- Every test is in a group that one worker takes whole (`GroupScheduling`): its module's by default (a module's
  fixtures are set up once), "docker" for every test that uses Docker (a private dockerd is one per cache directory:
  a second worker would wait for the first one's whole session), and the groups in `SHARED` for modules that share
  a session fixture. The longest groups (`FIRST`) are handed out first, so that none of them starts last. (xdist's
  own `loadgroup` does not group under pytest 9.2: it renames `item._nodeid`, which pytest no longer reads.)
- `with the_run_alone():` around a check of the whole host (no Pi process left anywhere on it): while it runs, no
  other worker is inside a test, as in a serial run. A test marked `alone` runs entirely so (it reaps what other
  processes left on the host). Every other test holds the run's lock shared, except those marked `lockfree` (they
  start no agent and open no door: test_real_projects, whose grades take minutes); a turnstile keeps one that waits
  for the lock alone from being starved by the others' next tests.

The controller makes a directory for the run (`SWE_GRPO_XDIST_DIR`, inherited by the workers): the workers write the
groups there when they collect, the scheduler reads them, and the locks live there."""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

_DIR_VARIABLE = "SWE_GRPO_XDIST_DIR"
# Modules that share a session fixture, so one worker sets it up: the 16k-context vLLM server (`long_vllm`).
SHARED = {"tests/test_opencode.py": "long_vllm", "tests/test_codex_claude.py": "long_vllm"}
# The groups that take longest (a fresh-clone run's durations), first: longest-first keeps the workers' ends close.
FIRST = [
    "tests/test_real_projects.py",
    "docker",
    "tests/test_demo.py",
    "tests/test_chaos.py",
    "tests/test_worker.py",
    "tests/test_family_rollouts.py",
]


def _run_dir() -> Path | None:
    """The xdist run's directory, in a worker; None in the controller and without xdist."""
    path = os.environ.get(_DIR_VARIABLE)
    return Path(path) if path and os.environ.get("PYTEST_XDIST_WORKER") else None


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput"):
        os.environ[_DIR_VARIABLE] = tempfile.mkdtemp(prefix="swe_grpo-xdist-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput") and (path := os.environ.pop(_DIR_VARIABLE, None)):
        shutil.rmtree(path, ignore_errors=True)


def uses_docker(item: pytest.Item) -> bool:
    """Whether the test may use Docker: a docker fixture, a parameter naming it, or its own code naming it (a
    fixture fetched by name). `docker_url` fails a worker that uses Docker outside this group (`claim_docker`)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if {"docker_url", "docker_backend"} & set(getattr(item, "fixturenames", ())) or "docker" in params.values():
        return True
    function = getattr(item, "function", None)
    with contextlib.suppress(OSError, TypeError):
        return function is not None and "docker" in inspect.getsource(function).lower()
    return False


def group_of(item: pytest.Item) -> str:
    module = item.nodeid.split("::")[0]
    return "docker" if uses_docker(item) else SHARED.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: order the tests longest group first (each module's tests stay together and in their order) and
    write each test's group for the scheduler (every worker writes the same)."""
    if (run := _run_dir()) is None:
        return
    groups = {item.nodeid: group_of(item) for item in items}
    rank = {name: i for i, name in enumerate(FIRST)}
    first_seen = {name: i for i, name in reversed(list(enumerate(groups.values())))}
    items.sort(key=lambda it: (rank.get(groups[it.nodeid], len(rank)), first_seen[groups[it.nodeid]]))
    staging = run / f"groups.{os.environ['PYTEST_XDIST_WORKER']}"
    staging.write_text(json.dumps(groups))
    staging.replace(run / "groups.json")


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (a worker takes a whole scope; a new one when it has two tests left), with the
    groups above as the scopes, in the order the workers collected them."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        super().__init__(config, log)  # type: ignore[arg-type]
        config.option.loadscopereorder = False  # the order is the plan: longest first, not most tests first
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # written by the workers before they report their collection
            self._groups = json.loads((Path(os.environ[_DIR_VARIABLE]) / "groups.json").read_text())
        return self._groups.get(nodeid) or nodeid.split("::")[0]


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own choice; none without xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> GroupScheduling:
    return GroupScheduling(config, log)


class _RunLock:
    """The run's readers-writer lock: flock on a file in the run's directory, with a turnstile."""

    def __init__(self, run: Path) -> None:
        self.main = os.open(run / "tests.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.turnstile = os.open(run / "turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)

    def take(self, mode: int) -> None:
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.main, mode)
        finally:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def drop(self) -> None:
        fcntl.flock(self.main, fcntl.LOCK_UN)


_lock: _RunLock | None = None


def _run_lock() -> _RunLock | None:
    global _lock
    if _lock is None and (run := _run_dir()) is not None:
        _lock = _RunLock(run)
    return _lock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Each test (its setup, call and teardown: module fixtures too) holds the run's lock: shared, alone if marked
    so, not at all if marked `lockfree`."""
    lock = _run_lock()
    if lock is None or item.get_closest_marker("lockfree"):
        yield
        return
    lock.take(fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
    try:
        yield
    finally:
        lock.drop()


@contextlib.contextmanager
def the_run_alone() -> Iterator[None]:
    """While the block runs, no other worker of the run is inside a test (a no-op without xdist). The shared hold
    is dropped before waiting, so two workers that both wait cannot block each other."""
    lock = _run_lock()
    if lock is None:
        yield
        return
    lock.drop()
    lock.take(fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock.main, fcntl.LOCK_SH)  # back to the test's shared hold (others wait at most for this block)


def claim_docker() -> None:
    """Fail a worker that uses Docker when another worker of the run already does (the test is missing from the
    "docker" group: `uses_docker`), rather than wait for the other's dockerd until its session ends."""
    if (run := _run_dir()) is None:
        return
    worker = os.environ["PYTEST_XDIST_WORKER"]
    with contextlib.suppress(FileExistsError):
        fd = os.open(run / "docker", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, worker.encode())
        os.close(fd)
    if (holder := (run / "docker").read_text()) != worker:
        pytest.fail(f"Docker is in use on xdist worker {holder}: this test belongs in the 'docker' group (parallel.py)")
