"""Helpers shared by the sandbox tests: a small repository with a base commit and a later fix, and host-side
process checks (the contract kit's, `swe_grpo.testing.sandbox_checks`, re-exported), checks for leftovers,
the `local` and `docker` backend fixtures (conftest.py makes them every module's: `backend` runs a test on
both; a module sets their limits by overriding `sandbox_limits`), `FakeHubSandbox` (a FAKE of
`huggingface_hub.Sandbox`) with the `hf_backend` fixture over it, and `no_sandbox_left_in_run_dir` (a module
that imports it checks, after each of its tests, that no `local` sandbox is left in `run_dir`).
tests/test_backend_contract.py runs the contract every backend shares on all three."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import psutil
import pytest
from huggingface_hub import SandboxCommandResult
from huggingface_hub.errors import SandboxCommandError
from huggingface_hub.errors import SandboxError as HubSandboxError
from parallel import the_run_alone

from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.sandbox.docker import OWNER_LABEL, SANDBOX_LABEL, DockerBackend, DockerLimits
from swe_grpo.sandbox.hf import HFBackend
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend, LocalLimits, LocalSandbox
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.testing.backend_contract import Target
from swe_grpo.testing.sandbox_checks import (  # noqa: F401  (the contract kit's, re-exported for the tests)
    CALC,
    GIT_ENV,
    calc_task,
    git,
    host_pids,
    make_repo,
    marker,
    wait_for_pids,
)

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


def mounted(path: Path) -> bool:
    return str(path) in Path("/proc/self/mountinfo").read_text()


def assert_local_sandbox_gone(sandbox: LocalSandbox) -> None:
    """Nothing left of one `local` sandbox: no cgroup, no directory, no mount, no process naming it."""
    assert sandbox.cgroup_dirs and not any(d.exists() for d in sandbox.cgroup_dirs)
    assert not sandbox.host_dir.exists()
    assert not mounted(sandbox.host_dir)
    assert host_pids(str(sandbox.host_dir)) == []


def local_target(backend: LocalBackend, run_dir: Path) -> Target:
    """The contract's `Target` for a started `local` backend (or a subclass of it) whose sandboxes live in
    `run_dir`: its facts, and "nothing left" read from directories, mounts, cgroups and its cache."""

    def leftovers() -> Any:
        cache = sorted(p.name for p in backend.cache_dir.iterdir() if not p.name.endswith(".lock"))
        return sorted(run_dir.iterdir()), mounted(run_dir), sandbox_cgroups(), cache

    def new_backend(output_bytes: int | None) -> SandboxBackend:
        limits = LocalLimits() if output_bytes is None else LocalLimits(output_bytes=output_bytes)
        return type(backend)(limits=limits, cache_dir=backend.cache_dir, run_dir=run_dir, method=backend.method)

    return Target(
        name=backend.name,
        backend=backend,
        uid=999,  # swe-sandbox
        host_uids=backend.uids.uids,
        put_through_symlink_refused=True,
        has_curl=True,
        exec_may_raise_on_destroy=False,  # it is killed: a result
        gone=assert_local_sandbox_gone,  # type: ignore[arg-type]
        alive=lambda sandbox: mounted(sandbox.host_dir),  # type: ignore[attr-defined]
        leftovers=leftovers,
        new_backend=new_backend,
        close_destroys_live=False,  # it holds nothing to close: its sandboxes are their owners' to destroy
    )


def own_pids(needle: str, root: int | None = None) -> list[int]:
    """The descendants of `root` (default: this process) whose command line contains `needle`: this test's own
    agents, not those of other test runs on the host."""
    try:
        children = psutil.Process(root or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    pids = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            if needle in " ".join(child.cmdline()):
                pids.append(child.pid)
    return pids


def assert_no_agent_or_sandbox_left(run_dir: Path) -> None:
    """No Pi process on the host (checked while no other xdist worker is inside a test), and nothing left of the
    `local` sandboxes."""
    with the_run_alone():
        assert host_pids(PI_PROCESS) == []
    assert_no_local_sandbox_left(run_dir)


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


def our_containers(client: Any) -> set[str]:
    """The ids of this process's `docker` sandbox containers (by the owner label every backend of this
    process sets: another session's sandboxes on a shared engine are not ours)."""
    mine = f"{socket.gethostname()}/{os.getpid()}/"
    containers = client.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"})
    return {c.id for c in containers if c.labels.get(OWNER_LABEL, "").startswith(mine)}


@pytest.fixture(autouse=True)
def no_sandbox_left_in_run_dir(run_dir: Path) -> Iterator[None]:
    """After each test of a module that imports it (autouse there, and only there: conftest.py does not
    import it): no `local` sandbox is left in the module's `run_dir`."""
    yield
    assert list(run_dir.iterdir()) == [], "a sandbox was left behind"


# --- hf: a FAKE of huggingface_hub.Sandbox ---------------------------------------------------------------

_FAKE_VAR = "FAKE_HF_SANDBOX"


def _procs_with_env(entry: str) -> list[int]:
    pids = []
    for proc in os.scandir("/proc"):
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if entry.encode() in Path(proc.path, "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
    return pids


class FakeHubFiles:
    """The fake's `files`: only `read` and `write`, on the fake's writable directories."""

    def __init__(self, box: FakeHubSandbox) -> None:
        self._box = box

    def read(self, path: str) -> bytes:
        host = self._box.host_path(path)
        if not host.is_file():
            raise HubSandboxError(f"Sandbox API error (404): {path} not found", status_code=404)
        return host.read_bytes()

    def write(self, path: str, data: bytes, mode: str | None = None) -> None:
        host = self._box.host_path(path)
        host.parent.mkdir(parents=True, exist_ok=True)
        host.write_bytes(data)


class FakeHubSandbox:
    """A FAKE of a dedicated `huggingface_hub.Sandbox`, for tests only. Commands run on this machine under
    bubblewrap, with the host's /usr read-only and private /etc, /tmp, /root, /opt, /home and /testbed
    (the image name is only recorded). It imitates what huggingface_hub documents: `run` takes `cmd` as
    an argv (`shell=False`) or a string (`sh -c`), adds `env`, kills the command's PROCESS GROUP on
    `timeout` (so a `setsid` child survives, as on HF), returns a real `SandboxCommandResult`, raises
    `SandboxCommandError` under `check=True`; `files.read` raises `SandboxError(status_code=404)` for a
    missing file; the file API refuses symlinks; `kill()` is idempotent and stops everything. Output
    reaches the callbacks when the command ends (HF streams it). It shares the host's network (HF gives
    its sandboxes a network of their own, which no option turns off)."""

    created: ClassVar[list[FakeHubSandbox]] = []
    WRITABLE = ("etc", "tmp", "root", "opt", "home", "testbed")

    def __init__(self, image: str, **options: Any) -> None:
        self.image, self.options = image, options
        self.id = f"fake-{uuid.uuid4().hex[:12]}"
        self.kills = 0
        self.keepalives = 0
        self.root = Path(tempfile.mkdtemp(prefix="fake-hf-sandbox-"))
        for name in self.WRITABLE:
            (self.root / name).mkdir()
        subprocess.run(["cp", "-a", "/etc/.", str(self.root / "etc")], check=True)
        self.files = FakeHubFiles(self)

    @classmethod
    def create(cls, image: str, **options: Any) -> FakeHubSandbox:
        box = cls(image, **options)
        cls.created.append(box)
        return box

    @classmethod
    def by_id(cls, box_id: str) -> FakeHubSandbox:
        (box,) = (box for box in cls.created if box.id == box_id)
        return box

    def host_path(self, path: str) -> Path:
        parts = PurePosixPath(path).parts
        if len(parts) < 3 or parts[1] not in self.WRITABLE:
            raise HubSandboxError(f"fake: {path} is outside the fake's writable directories", status_code=400)
        host = self.root
        for part in parts[1:]:
            host = host / part
            if host.is_symlink():
                raise HubSandboxError(f"Sandbox API error (400): symlink in {path}", status_code=400)
        return host

    def run(
        self,
        cmd: str | list[str],
        *,
        shell: bool | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        check: bool = True,
        on_stdout: Callable[[str], None] | None = None,
        on_stderr: Callable[[str], None] | None = None,
        capture_output: bool = True,
    ) -> SandboxCommandResult:
        assert not self.kills, "run on a killed sandbox"
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else cmd
        binds = [arg for name in self.WRITABLE for arg in ("--bind", str(self.root / name), f"/{name}")]
        usr = [
            "--ro-bind",
            "/usr",
            "/usr",
            *(a for d in ("bin", "sbin", "lib", "lib64") for a in ("--symlink", f"usr/{d}", f"/{d}")),
        ]
        bwrap = ["bwrap", *usr, *binds, "--proc", "/proc", "--dev", "/dev", "--chdir", cwd or "/", "--", *argv]
        base_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
        started = time.monotonic()
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            # Files, not pipes: a child that outlives the command must not hold its output open.
            proc = subprocess.Popen(
                bwrap,
                stdout=out,
                stderr=err,
                env={**base_env, **(env or {}), _FAKE_VAR: self.id},
                start_new_session=True,
            )
            try:
                exit_code: int | None = proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                exit_code, timed_out = None, True
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        for callback, text in ((on_stdout, stdout), (on_stderr, stderr)):
            if callback is not None and text:
                callback(text)
        result = SandboxCommandResult(
            exit_code=exit_code,
            stdout=stdout if capture_output else "",
            stderr=stderr if capture_output else "",
            signal=signal.SIGKILL if timed_out else None,
            timed_out=timed_out,
            duration_ms=int((time.monotonic() - started) * 1000),
        )
        if check and (exit_code != 0 or timed_out):
            raise SandboxCommandError(cmd=cmd, result=result)
        return result

    def processes(self) -> list[Any]:
        """Background processes: the fake runs none; counted, as the backend calls it to keep alive."""
        self.keepalives += 1
        return []

    def kill(self) -> None:
        self.kills += 1
        for pid in _procs_with_env(f"{_FAKE_VAR}={self.id}"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


def assert_fake_hub_sandbox_gone(box: FakeHubSandbox) -> None:
    """Nothing left of a fake HF sandbox: killed, its directory and its processes gone."""
    assert box.kills >= 1
    assert not box.root.exists()
    assert _procs_with_env(f"{_FAKE_VAR}={box.id}") == []


@pytest.fixture(scope="module")
async def hf_backend() -> AsyncIterator[HFBackend]:
    """The `hf` backend over `FakeHubSandbox` (nothing talks to Hugging Face), accepting that sandboxes asked
    for no network keep HF's (`accept_network`): the tests create them as grading does."""
    backend = HFBackend(
        create_sandbox=FakeHubSandbox.create, flavor="cpu-upgrade", idle_timeout="5m", accept_network=True
    )
    await backend.start()
    yield backend
    await backend.close()
