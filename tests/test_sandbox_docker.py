"""The `docker` sandbox backend's own behaviour on a real Docker engine with real containers (see
`docker_env`: an engine already running, else a private dockerd started for the session; the offline
base image is built once and cached). Skipped, with the reason, only where no engine can be had at all,
and never under `CI=true` (there a missing engine fails). What every backend promises (exec, files,
diff, timeouts, destroy, network off unless asked, ...) is tests/test_backend_contract.py's, which runs
on `docker` too.

"Nothing left behind" is checked against the engine (no container) and on the host (no process whose
command line holds a test's marker)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import logging
import os
import platform
import random
import socket
import subprocess
import tarfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import docker
import docker.errors
import pytest
from sandbox_helpers import CALC, calc_task, git, make_repo, marker, wait_for_pids
from test_sandbox_local import AGENT_TREES

from swe_grpo.sandbox.base import SandboxError
from swe_grpo.sandbox.docker import (
    DEFAULT_IMAGE,
    OWNER_LABEL,
    SANDBOX_LABEL,
    DockerBackend,
    DockerLimits,
    DockerSandbox,
)
from swe_grpo.sandbox.docker import seccomp as seccomp_module
from swe_grpo.sandbox.docker.engine import reap
from swe_grpo.sandbox.docker.seccomp import MOUNT as SECCOMP_MOUNT
from swe_grpo.sandbox.docker.seccomp import mount_dir
from swe_grpo.sandbox.process import export_repo
from swe_grpo.sandbox.uids import SANDBOX_UIDS
from swe_grpo.tasks import Task, swe_gym_image

UID = 1000  # the sandbox user's: owns the prepared image's /testbed; each sandbox runs as a uid of its own
# io_uring_setup(1, NULL) (x86-64's number): EFAULT from the kernel, EPERM from a filter; prints the errno.
IO_URING_SETUP = "import ctypes; c = ctypes.CDLL(None, use_errno=True); c.syscall(425, 1, 0); print(ctypes.get_errno())"


@pytest.fixture(scope="session")
def engine(docker_url: str) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=docker_url)
    yield client
    client.close()


def assert_gone(engine: docker.DockerClient, sandbox: DockerSandbox) -> None:
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(sandbox.id)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repo(tmp_path_factory.mktemp("origin"))


@pytest.fixture(scope="module")
def task(repo: Path) -> Task:
    return calc_task(repo)


@pytest.fixture
async def backend(docker_url: str) -> AsyncIterator[DockerBackend]:
    backend = DockerBackend(base_url=docker_url)
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture
async def sandbox(backend: DockerBackend, task: Task, engine: docker.DockerClient) -> AsyncIterator[DockerSandbox]:
    sandbox = await backend.create(task)
    try:
        yield sandbox
    finally:
        await sandbox.destroy()
    assert_gone(engine, sandbox)


async def run_ok(sandbox: DockerSandbox, command: str | list[str], **kwargs: object) -> str:
    result = await sandbox.exec(command, timeout_s=30, **kwargs)  # type: ignore[arg-type]
    assert result.exit_code == 0, result
    return result.stdout


def test_export_repo_keeps_nothing_after_the_base(repo: Path, task: Task, tmp_path: Path) -> None:
    bundle = tmp_path / "calc.bundle"
    git(repo, "bundle", "create", str(bundle), "--all")
    for source in (repo, bundle):
        dest = tmp_path / f"export-of-{source.name}"
        export_repo(source, task.base_commit, dest)
        assert git(dest, "rev-parse", "HEAD") == task.base_commit
        assert git(dest, "status", "--porcelain") == ""
        assert git(dest, "for-each-ref", "--format=%(refname)") == "refs/heads/main"
        assert git(dest, "remote") == ""
        fix = git(repo, "rev-parse", "HEAD")
        assert subprocess.run(["git", "-C", str(dest), "cat-file", "-e", fix], capture_output=True).returncode != 0


async def test_the_prepared_testbed_is_the_sandbox_users_and_its_index_fresh(
    sandbox: DockerSandbox, task: Task
) -> None:
    # The prepared image's index already matches its files: git has nothing to refresh, so it does not
    # rewrite the index (otherwise every sandbox's first git command re-reads the whole tree).
    index_before = await run_ok(sandbox, "stat -c %y .git/index")
    out = await run_ok(sandbox, "pwd; id -u; git rev-parse HEAD; git status --porcelain; git log --all --format=%H")
    assert out == f"/testbed\n{sandbox.uid}\n{task.base_commit}\n{task.base_commit}\n"
    assert sandbox.uid in SANDBOX_UIDS  # leased: its copy of /testbed and its home are its own
    assert await run_ok(sandbox, "stat -c %y .git/index") == index_before
    out = await run_ok(sandbox, "cat calc.py; stat -c %u calc.py .git /home/sandbox; echo $HOME")
    assert out == f"{CALC}{sandbox.uid}\n{sandbox.uid}\n{sandbox.uid}\n/home/sandbox\n"
    await run_ok(sandbox, ["python3", "-m", "pytest", "--version"])


async def test_env_is_not_in_the_container_configuration(sandbox: DockerSandbox, engine: docker.DockerClient) -> None:
    """(That it reaches the process and no command line: tests/test_backend_contract.py.)"""
    secret = f"s3cret-{random.random()}"
    m = marker()
    running = asyncio.create_task(sandbox.exec(f"sleep {m}", timeout_s=60, env={"SWE_GRPO_TOKEN": secret}))
    (pid,) = await wait_for_pids(f"sleep\0{m}")
    assert secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    assert secret not in str(engine.containers.get(sandbox.id).attrs)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_file_errors_say_what_is_wrong(sandbox: DockerSandbox) -> None:
    """(Putting and getting files, and a planted symlink: tests/test_backend_contract.py.)"""
    await sandbox.put_file("/testbed/deep/new/blob.bin", b"blob")
    with pytest.raises(SandboxError, match="does not exist"):
        await sandbox.get_file("/testbed/missing.txt")
    with pytest.raises(SandboxError, match="not a regular file"):
        await sandbox.get_file("/testbed/deep")
    with pytest.raises(SandboxError, match="cannot create"):
        await sandbox.put_file("/root/x/y.txt", b"")  # the sandbox user may not create it


async def test_limits_labels_and_hardening(docker_url: str, task: Task, engine: docker.DockerClient) -> None:
    limits = DockerLimits(memory="512m", cpus=1.5, pids=300)
    backend = DockerBackend(base_url=docker_url, limits=limits)
    await backend.start()
    try:
        sandbox = await backend.create(task, network=True)  # the backend's network: `host`
        attrs = engine.containers.get(sandbox.id).attrs
        host = attrs["HostConfig"]
        assert (host["Memory"], host["MemorySwap"]) == (512 << 20, 512 << 20)
        assert (host["NanoCpus"], host["PidsLimit"]) == (1_500_000_000, 300)
        assert (host["Init"], host["NetworkMode"], host["CapDrop"]) == (True, "host", ["ALL"])
        assert host["SecurityOpt"] == ["no-new-privileges"]
        # The disk limit: a read-only root, and the writable paths tmpfs volumes of `disk` (2 GiB) each.
        assert host["ReadonlyRootfs"] is True
        writable = ["/home/sandbox", "/testbed", "/tmp", "/var/tmp"]
        mounts = {m["Destination"]: m["RW"] for m in attrs["Mounts"]}
        assert mounts == {SECCOMP_MOUNT: False} | dict.fromkeys(writable, True)
        sizes = await run_ok(sandbox, ["stat", "-f", "-c", "%T %b %S", *writable])
        assert sizes.splitlines() == [f"tmpfs {(2 << 30) // 4096} 4096"] * 4
        result = await sandbox.exec("touch /etc/x /usr/x; echo > /testbed/ok", timeout_s=30)
        assert result.stderr.count("Read-only file system") == 2 and result.exit_code == 0, result
        assert attrs["Config"]["User"] == f"{sandbox.uid}:{sandbox.uid}" and sandbox.uid in SANDBOX_UIDS
        labels = attrs["Config"]["Labels"]
        assert labels[SANDBOX_LABEL] == "1" and labels["swe_grpo.task"] == task.instance_id
        assert labels[OWNER_LABEL].startswith(f"{socket.gethostname()}/{os.getpid()}/")
        # ... and the kernel enforces them (cgroup v1 or v2 paths, whichever this host has).
        out = await run_ok(
            sandbox, "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null; true"
        )
        assert str(512 << 20) in out
        out = await run_ok(sandbox, "cat /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/pids.max 2>/dev/null; true")
        assert "300" in out
    finally:
        await backend.close()


async def test_every_exec_runs_under_our_filter_on_top_of_the_engines_profile(
    docker_url: str, sandbox: DockerSandbox, task: Task, engine: docker.DockerClient
) -> None:
    """Our seccomp filter is added to the engine's default profile, never instead of it: every exec has two
    filters (what the engine's profile refuses stays refused: tests/test_sandbox_limits.py). A command that
    cannot run says why on stderr with the shell's exit status. A sandbox running as root cannot replace the
    wrapper or its filter (a read-only mount), and is filtered as well."""
    assert "seccomp" not in str(engine.containers.get(sandbox.id).attrs["HostConfig"]["SecurityOpt"])
    status = await run_ok(sandbox, "grep -E '^(NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status")
    assert status.split() == ["NoNewPrivs:", "1", "Seccomp:", "2", "Seccomp_filters:", "2"]
    missing = await sandbox.exec(["no-such-command", "x"], timeout_s=30)
    assert (missing.exit_code, missing.stderr) == (
        127,
        "seccomp-exec: cannot run no-such-command: No such file or directory\n",
    )
    refused = await sandbox.exec(["/etc/passwd"], timeout_s=30)
    assert (refused.exit_code, refused.stderr) == (126, "seccomp-exec: cannot run /etc/passwd: Permission denied\n")

    root = DockerBackend(base_url=docker_url, uid=None)
    await root.start()
    try:
        async with await root.create(task) as sandbox_as_root:
            assert await run_ok(sandbox_as_root, "id -u") == "0\n"
            for path in (f"{SECCOMP_MOUNT}/seccomp-exec", f"{SECCOMP_MOUNT}/filter"):
                written = await sandbox_as_root.exec(f"echo > {path}", timeout_s=30)
                assert written.exit_code != 0 and "Read-only file system" in written.stderr, written
            if platform.machine() == "x86_64":
                assert await run_ok(sandbox_as_root, ["python3", "-c", IO_URING_SETUP]) == f"{errno.EPERM}\n"
    finally:
        await root.close()


def test_the_wrappers_source_compiles_cleanly(tmp_path: Path) -> None:
    """The wrapper's source builds with every common warning on (users' newer compilers build it without
    -Werror, so a warning there cannot break their docker sandboxes)."""
    source = Path(seccomp_module.__file__).with_name("seccomp_exec.c")
    build = ["cc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o", str(tmp_path / "w"), str(source)]
    subprocess.run(build, check=True, capture_output=True)


async def test_without_a_compiler_start_says_what_to_install(
    docker_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SWE_GRPO_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    backend = DockerBackend(base_url=docker_url)
    try:
        with pytest.raises(SandboxError, match=r"seccomp wrapper: .*libc6-dev"):
            await backend.start()
    finally:
        await backend.close()


def test_an_engine_of_another_architecture_gets_no_wrapper(caplog: pytest.LogCaptureFixture) -> None:
    """The wrapper is built here, for this host: an engine on another architecture (a remote one) keeps its
    own profile only, and that is said."""
    other = "aarch64" if platform.machine() == "x86_64" else "x86_64"
    with caplog.at_level(logging.WARNING):
        assert mount_dir(other) is None
        assert mount_dir("riscv64") is None
    assert f"no seccomp filter of ours for a Docker engine on {other}" in caplog.text
    assert "on riscv64" in caplog.text


async def test_a_repository_too_big_for_the_disk_limit_is_refused(
    docker_url: str, task: Task, engine: docker.DockerClient
) -> None:
    backend = DockerBackend(base_url=docker_url, limits=DockerLimits(disk="16k"))
    await backend.start()
    volumes = {v.id for v in engine.volumes.list()}
    try:
        with pytest.raises(SandboxError, match=r"does not fit the sandbox.s disk limit \(16k\)"):
            await backend.create(task)
    finally:
        await backend.close()
    assert {v.id for v in engine.volumes.list()} == volumes  # its tmpfs volumes went with it


async def test_network_none_cuts_the_host_off(docker_url: str, task: Task, engine: docker.DockerClient) -> None:
    """A backend whose network is `none` cuts it even from a sandbox that asks for it."""
    backend = DockerBackend(base_url=docker_url, network="none")
    await backend.start()
    try:
        sandbox = await backend.create(task, network=True)
        assert engine.containers.get(sandbox.id).attrs["HostConfig"]["NetworkMode"] == "none"
        result = await sandbox.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1", timeout_s=30)
        assert result.stdout.split() == ["lo"]
    finally:
        await backend.close()


@pytest.mark.parametrize("disk", ["tmpfs", "no-tmpfs"])
async def test_destroy_removes_any_tree_the_agent_can_make(
    docker_url: str, task: Task, engine: docker.DockerClient, disk: str
) -> None:
    """The trees of tests/test_sandbox_local.py (a chain past Python's recursion limit, names of the maximum
    length, mode 000), in the tmpfs volumes or, without them, the container's writable layer: the engine removes
    them with the container."""
    backend = DockerBackend(base_url=docker_url, limits=DockerLimits() if disk == "tmpfs" else DockerLimits(disk=None))
    await backend.start()
    try:
        sandbox = await backend.create(task)
        try:
            for tree, script in AGENT_TREES.items():
                for where in (f"/testbed/{tree}", f"/tmp/{tree}"):
                    await run_ok(sandbox, ["mkdir", where])
                    await run_ok(sandbox, ["python3", "-c", script], cwd=where)
        finally:
            await sandbox.destroy()
        assert_gone(engine, sandbox)
    finally:
        await backend.close()


class FailingContainer:
    """A FAKE container the engine fails to remove (a real engine cannot be made to on demand)."""

    name, id, labels = "stuck", "stuck", {OWNER_LABEL: f"{socket.gethostname()}/4194999/1"}  # a dead owner here

    def remove(self, **_: object) -> None:
        raise docker.errors.APIError("driver failed to remove the container's layer")


def test_a_leftover_the_engine_cannot_remove_never_fails_the_reaper(
    docker_url: str, engine: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper goes on past a container the engine fails to remove (it was raised out of `start()`), and
    removes the next one (a real dead owner's container on the real engine)."""
    dead_owner = f"{socket.gethostname()}/4194999/1"
    leftover = engine.containers.create(
        DEFAULT_IMAGE, entrypoint=["true"], labels={SANDBOX_LABEL: "1", OWNER_LABEL: dead_owner}
    )
    listed = [FailingContainer(), leftover]
    client = docker.DockerClient(base_url=docker_url)
    monkeypatch.setattr(client.containers, "list", lambda **_: listed)
    try:
        assert reap(client) == [leftover.name]
    finally:
        client.close()
        with contextlib.suppress(docker.errors.NotFound):
            leftover.remove(force=True)


async def test_start_reaps_leftovers_of_dead_processes_only(
    docker_url: str, backend: DockerBackend, task: Task, engine: docker.DockerClient
) -> None:
    live = await backend.create(task)  # a live owner (this process) in another backend
    dead_owner = f"{socket.gethostname()}/4194999/1"  # above any pid_max: that process cannot exist
    leftover = engine.containers.run(
        DEFAULT_IMAGE,
        entrypoint=["sleep", "infinity"],
        detach=True,
        labels={SANDBOX_LABEL: "1", OWNER_LABEL: dead_owner},
    )
    other_host = engine.containers.run(
        DEFAULT_IMAGE,
        entrypoint=["sleep", "infinity"],
        detach=True,
        labels={SANDBOX_LABEL: "1", OWNER_LABEL: "another-machine/1/1"},
    )
    unlabelled = engine.containers.run(DEFAULT_IMAGE, entrypoint=["sleep", "infinity"], detach=True)
    try:
        second = DockerBackend(base_url=docker_url)
        await second.start()
        await second.close()
        with pytest.raises(docker.errors.NotFound):
            leftover.reload()
        for kept in (other_host, unlabelled):
            kept.reload()
            assert kept.status == "running"
        assert await run_ok(live, "echo alive") == "alive\n"
    finally:
        for container in (leftover, other_host, unlabelled):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)


@pytest.fixture(scope="module")
def nogit_image(engine: docker.DockerClient) -> Iterator[str]:
    """The base image without git, to check that an unusable image is refused."""
    name = "swe-grpo-base-nogit:test"
    container = engine.containers.create(DEFAULT_IMAGE, entrypoint=["rm", "-f", "/usr/bin/git"], user="0")
    container.start()
    container.wait()
    container.commit(*name.split(":"))
    container.remove()
    yield name
    engine.images.remove(name, force=True)


async def test_failures_raise_and_leave_nothing(
    backend: DockerBackend, task: Task, engine: docker.DockerClient, nogit_image: str
) -> None:
    before = {c.id for c in engine.containers.list(all=True)}
    images = {i.id for i in engine.images.list()}
    with pytest.raises(SandboxError, match="swe-grpo-missing:nope is not on this engine"):
        await backend.create(replace(task, image="swe-grpo-missing:nope"))
    with pytest.raises(SandboxError, match="not a local repository"):
        await backend.create(replace(task, repo="swe-grpo-tests/no-such-repo"))
    # (An unknown base commit: tests/test_backend_contract.py.)
    with pytest.raises(SandboxError, match="the image has no git"):
        await backend.create(replace(task, image=nogit_image))
    assert {c.id for c in engine.containers.list(all=True)} == before
    assert {i.id for i in engine.images.list()} == images


async def test_swe_gym_image_is_used_as_is(
    backend: DockerBackend, task: Task, repo: Path, engine: docker.DockerClient, tmp_path: Path
) -> None:
    """A SWE-bench-style image (root-owned /testbed with full history, named after the task) is found by
    the SWE-Gym naming rule and used instead of copying the repository."""
    gym_task = replace(task, instance_id="demo__gym-1", repo="demo/gym")
    name = swe_gym_image(gym_task.instance_id)
    assert name == "xingyaoww/sweb.eval.x86_64.demo_s_gym-1"
    if not engine.images.list(name=name):
        clone = tmp_path / "testbed"
        git(tmp_path, "clone", "-q", str(repo), "testbed")
        git(clone, "checkout", "-q", task.base_commit)
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(clone, arcname="testbed")
        container = engine.containers.create(DEFAULT_IMAGE, entrypoint=["true"])
        container.put_archive("/", archive.getvalue())
        container.commit(name)
        container.remove()
    sandbox = await backend.create(gym_task)
    try:
        out = await run_ok(sandbox, "git rev-parse HEAD; git status --porcelain; id -u; stat -c %u calc.py")
        assert out == f"{task.base_commit}\n{sandbox.uid}\n{sandbox.uid}\n"
    finally:
        await sandbox.destroy()
    with pytest.raises(SandboxError, match="not at the base commit"):
        await backend.create(replace(gym_task, base_commit=git(repo, "rev-parse", "HEAD")))


async def test_unreachable_engine_is_a_clear_error() -> None:
    backend = DockerBackend(base_url="unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxError, match=r"no Docker engine reachable at unix:///nonexistent/docker\.sock"):
        await backend.start()
    await backend.close()
