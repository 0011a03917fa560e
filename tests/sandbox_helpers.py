"""Helpers shared by the sandbox tests: a small repository with a base commit and a later fix, host-side
checks for processes and leftovers, and the `local` and `docker` backend fixtures (conftest.py makes them
every module's: `backend` runs a test on both; a module sets their limits by overriding `sandbox_limits`)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.sandbox.docker import SANDBOX_LABEL, DockerBackend, DockerLimits
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend, LocalLimits
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.tasks import Task

CALC = "def add(a, b):\n    return a + b\n"
# Fixed dates make the commits, and so the prepared images keyed by them, the same on every run.
GIT_ENV = {
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
}


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ, **GIT_ENV}).stdout.strip()


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


PI_PROCESS = "pi-coding-agent/dist/"  # in the command line of every running Pi (its CLI moved within dist/)


def sandbox_cgroups() -> list[Path]:
    """The cgroups of this process's `local` sandboxes that still exist."""
    layout = CgroupLayout.detect()
    mine = f"swe-grpo-{os.getpid()}-*"
    roots = {layout.memory, layout.pids, *([layout.cpu] if layout.cpu is not None else [])}
    return [d for root in roots for d in (root / CGROUP_PARENT).glob(mine)]


def assert_no_local_sandbox_left(run_dir: Path) -> None:
    """Nothing (no directory, no mount, no cgroup) left of the `local` sandboxes in `run_dir`."""
    assert list(run_dir.iterdir()) == []
    assert str(run_dir) not in Path("/proc/self/mountinfo").read_text()
    assert sandbox_cgroups() == []


def assert_no_agent_or_sandbox_left(run_dir: Path) -> None:
    """No Pi process on the host, and nothing left of the `local` sandboxes."""
    assert host_pids(PI_PROCESS) == []
    assert_no_local_sandbox_left(run_dir)


async def wait_for_pids(needle: str) -> list[int]:
    for _ in range(1000):
        if pids := host_pids(needle):
            return pids
        await asyncio.sleep(0.01)
    raise AssertionError(f"no process with {needle!r} appeared")


def make_repo(parent: Path) -> Path:
    """A small project with a base commit and a later "fix" commit the agent must not see; the same
    commit ids on every run."""
    root = parent / "calc"
    root.mkdir()
    (root / "calc.py").write_text(CALC)
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


# --- backends -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox_limits() -> tuple[LocalLimits, DockerLimits]:
    """The limits of the module's `local_backend` and `docker_backend`: the backends' defaults, unless the
    module overrides this fixture."""
    return LocalLimits(), DockerLimits()


@pytest.fixture(scope="module")
async def local_backend(
    tmp_path_factory: pytest.TempPathFactory, run_dir: Path, sandbox_limits: tuple[LocalLimits, DockerLimits]
) -> LocalBackend:
    backend = LocalBackend(limits=sandbox_limits[0], cache_dir=tmp_path_factory.mktemp("cache"), run_dir=run_dir)
    await backend.start()
    return backend


@pytest.fixture(scope="module")
async def docker_backend(
    docker_url: str, sandbox_limits: tuple[LocalLimits, DockerLimits]
) -> AsyncIterator[DockerBackend]:
    backend = DockerBackend(base_url=docker_url, limits=sandbox_limits[1])
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture(params=["local", "docker"])
def backend(request: pytest.FixtureRequest) -> SandboxBackend:
    """The test runs once on each backend."""
    return request.getfixturevalue(f"{request.param}_backend")


def assert_nothing_left(backend: SandboxBackend, run_dir: Path) -> None:
    """Nothing of the backend's sandboxes is left: no directory, mount or cgroup (`local`), no container
    (`docker`)."""
    if isinstance(backend, LocalBackend):
        assert_no_local_sandbox_left(run_dir)
    else:
        assert isinstance(backend, DockerBackend)
        assert backend.client.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"}) == []
