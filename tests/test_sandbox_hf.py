"""The `hf` backend against `FakeHubSandbox`, a FAKE of `huggingface_hub.Sandbox`: nothing here talks to
Hugging Face. The fake runs commands for real (bubblewrap, root) so that the backend's own shell work
(bundle clone, /testbed checks, tree kill, diff) is exercised; what it does not exercise is listed in
`swe_grpo/sandbox/hf.py`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

import pytest
from huggingface_hub import SandboxCommandResult
from huggingface_hub.errors import SandboxCommandError
from huggingface_hub.errors import SandboxError as HubSandboxError
from sandbox_helpers import CALC, calc_task, git, host_pids, make_repo, marker, wait_for_pids

from swe_grpo.sandbox import hf
from swe_grpo.sandbox.base import Mount, SandboxError
from swe_grpo.sandbox.hf import DEFAULT_IMAGE, LABEL, HFBackend, HFSandbox
from swe_grpo.tasks import Task, swe_gym_image

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
    reaches the callbacks when the command ends (HF streams it)."""

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


def assert_gone(box: FakeHubSandbox) -> None:
    assert box.kills >= 1
    assert not box.root.exists()
    assert _procs_with_env(f"{_FAKE_VAR}={box.id}") == []


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repo(tmp_path_factory.mktemp("origin"))


@pytest.fixture(scope="module")
def task(repo: Path) -> Task:
    return calc_task(repo)


@pytest.fixture
async def backend() -> AsyncIterator[HFBackend]:
    backend = HFBackend(create_sandbox=FakeHubSandbox.create, flavor="cpu-upgrade", idle_timeout="5m")
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture
async def sandbox(backend: HFBackend, task: Task) -> AsyncIterator[HFSandbox]:
    sandbox = await backend.create(task)
    box = FakeHubSandbox.created[-1]
    try:
        yield sandbox
    finally:
        await sandbox.destroy()
    assert_gone(box)


async def run_ok(sandbox: HFSandbox, command: str | list[str], **kwargs: object) -> str:
    result = await sandbox.exec(command, timeout_s=30, **kwargs)  # type: ignore[arg-type]
    assert result.exit_code == 0, result
    return result.stdout


async def test_repo_from_a_bundle_at_base_commit_without_the_future(sandbox: HFSandbox, task: Task) -> None:
    box = FakeHubSandbox.created[-1]
    assert (box.image, box.options["flavor"], box.options["idle_timeout"]) == (DEFAULT_IMAGE, "cpu-upgrade", "5m")
    assert box.options["labels"] == {LABEL: "1"}
    out = await run_ok(
        sandbox, "pwd; git rev-parse HEAD; git status --porcelain; git log --all --format=%H; git remote"
    )
    assert out == f"/testbed\n{task.base_commit}\n{task.base_commit}\n"
    assert await run_ok(sandbox, "cat calc.py; ls /tmp") == CALC  # the uploaded bundle is gone


async def test_exec_output_exit_codes_argv_env_and_cwd(sandbox: HFSandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=30)
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    argv = ["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME", "'"]
    assert await run_ok(sandbox, argv) == "['a b', '$HOME', \"'\"]\n"
    assert await run_ok(sandbox, "pwd", cwd="/tmp") == "/tmp\n"
    secret = f"s3cret-{uuid.uuid4()}"
    assert await run_ok(sandbox, "echo $SWE_GRPO_TOKEN", env={"SWE_GRPO_TOKEN": secret}) == f"{secret}\n"
    assert secret not in await run_ok(sandbox, "cat /proc/*/cmdline", env={"SWE_GRPO_TOKEN": secret})


async def test_a_long_command_keeps_its_sandbox_alive(sandbox: HFSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "KEEPALIVE_S", 0.2)
    await run_ok(sandbox, "sleep 1.1")
    assert FakeHubSandbox.created[-1].keepalives >= 4


async def test_output_cap_keeps_the_end(task: Task) -> None:
    backend = HFBackend(create_sandbox=FakeHubSandbox.create, output_bytes=1000)
    try:
        sandbox = await backend.create(task)
        result = await sandbox.exec("head -c 5000 /dev/zero | tr '\\0' a; echo -n END", timeout_s=30)
        assert result.stdout == "[... 4003 bytes dropped ...]\n" + "a" * 997 + "END"
    finally:
        await backend.close()


async def test_the_fake_like_hf_spares_setsid_children_on_timeout() -> None:
    """The reason for the backend's own tree kill: the server's timeout reaches the process group only."""
    box = FakeHubSandbox.create("any")
    m = marker()
    try:
        result = box.run(f"setsid sleep {m} & sleep 100", timeout=1, check=False)
        assert result.timed_out
        assert host_pids(f"sleep\0{m}") != []
    finally:
        box.kill()
    assert_gone(box)


async def test_timeout_kills_the_whole_tree(sandbox: HFSandbox) -> None:
    m1, m2, m3 = marker(), marker(), marker()
    command = f"echo started; setsid sleep {m1} & (setsid sleep {m2} &); sleep {m3}"
    result = await sandbox.exec(command, timeout_s=1)
    assert (result.exit_code, result.timed_out, result.stdout) == (None, True, "started\n")
    assert 1 <= result.wall_s < 5
    for m in (m1, m2, m3):
        assert host_pids(f"sleep\0{m}") == []


async def test_cancellation_kills_the_whole_tree(sandbox: HFSandbox) -> None:
    m1, m2 = marker(), marker()
    running = asyncio.create_task(sandbox.exec(f"(setsid sleep {m1} &); sleep {m2}", timeout_s=60))
    await wait_for_pids(f"sleep\0{m1}")
    await wait_for_pids(f"sleep\0{m2}")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert host_pids(f"sleep\0{m1}") == host_pids(f"sleep\0{m2}") == []


async def test_put_and_get_files(sandbox: HFSandbox) -> None:
    blob = bytes(range(256)) * 1000
    await sandbox.put_file("/testbed/deep/new/blob.bin", blob, mode=0o755)
    assert await sandbox.get_file("/testbed/deep/new/blob.bin") == blob
    assert await run_ok(sandbox, "stat -c %a /testbed/deep/new/blob.bin") == "755\n"
    with pytest.raises(SandboxError, match="404"):
        await sandbox.get_file("/testbed/missing.txt")
    with pytest.raises(ValueError):
        await sandbox.put_file("relative.txt", b"")


async def test_diff_applies_to_a_fresh_checkout(sandbox: HFSandbox, task: Task, repo: Path, tmp_path: Path) -> None:
    assert await sandbox.diff(task.base_commit) == ""
    await run_ok(sandbox, "printf 'def add(a, b):\\n    return b + a\\n' > calc.py && rm old.txt")
    await sandbox.put_file("/testbed/pkg/new module.py", b"VALUE = 42\n")
    await sandbox.put_file("/testbed/logo.bin", bytes(reversed(range(256))))
    patch = await sandbox.diff(task.base_commit)
    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(repo), "fresh")
    git(fresh, "checkout", "-q", task.base_commit)
    (tmp_path / "agent.patch").write_text(patch)
    git(fresh, "apply", str(tmp_path / "agent.patch"))
    for path in ("calc.py", "pkg/new module.py", "logo.bin"):
        assert (fresh / path).read_bytes() == await sandbox.get_file(f"/testbed/{path}")
    assert not (fresh / "old.txt").exists()


async def test_read_only_mounts_are_uploaded_writable_ones_refused(
    backend: HFBackend, task: Task, tmp_path: Path
) -> None:
    (tmp_path / "agent" / "bin").mkdir(parents=True)
    (tmp_path / "agent" / "bin" / "pi").write_text("#!/bin/sh\necho pi\n")
    (tmp_path / "agent" / "bin" / "pi").chmod(0o755)
    sandbox = await backend.create(task, [Mount(tmp_path / "agent", "/opt/agent")])
    try:
        assert await run_ok(sandbox, "/opt/agent/bin/pi; ls /tmp") == "pi\n"
    finally:
        await sandbox.destroy()
    before = len(FakeHubSandbox.created)
    with pytest.raises(SandboxError, match="writable"):
        await backend.create(task, [Mount(tmp_path, "/opt/out", writable=True)])
    assert len(FakeHubSandbox.created) == before


async def test_destroy_is_idempotent_and_leaves_nothing(backend: HFBackend, task: Task) -> None:
    sandbox = await backend.create(task)
    box = FakeHubSandbox.created[-1]
    m = marker()
    running = asyncio.create_task(sandbox.exec(f"setsid sleep {m} & sleep 1000", timeout_s=60))
    await wait_for_pids(f"sleep\0{m}")
    await asyncio.gather(sandbox.destroy(), sandbox.destroy())
    await sandbox.destroy()
    assert box.kills == 1
    assert_gone(box)
    with contextlib.suppress(SandboxError):  # its sandbox vanished under it
        assert (await running).exit_code != 0
    assert backend.live == set()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_commit": "no-such-commit"}, "no-such-commit"),
        ({"repo": "owner/name"}, "no git repository at /testbed"),  # the (fake) SWE-Gym image is empty
    ],
)
async def test_failed_set_up_raises_and_kills_the_sandbox(
    backend: HFBackend, task: Task, change: dict[str, str], message: str
) -> None:
    before = len(FakeHubSandbox.created)
    with pytest.raises(SandboxError, match=message):
        await backend.create(replace(task, **change))
    for box in FakeHubSandbox.created[before:]:
        assert_gone(box)
    if change.get("repo"):
        assert FakeHubSandbox.created[-1].image == swe_gym_image(task.instance_id)
    assert backend.live == set()


async def test_cancelled_create_kills_what_it_made(backend: HFBackend, task: Task) -> None:
    for delay in (0.0, 0.05, 0.3):
        before = len(FakeHubSandbox.created)
        creating = asyncio.create_task(backend.create(task))
        await asyncio.sleep(delay)
        creating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await (await creating).destroy()  # it won the race
        for box in FakeHubSandbox.created[before:]:
            assert_gone(box)
    assert backend.live == set()
