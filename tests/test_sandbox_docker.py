"""The `docker` sandbox backend on a real Docker engine with real containers (see `docker_env`: an
engine already running, else a private dockerd started for the session; the offline base image is
built once and cached). Skipped, with the reason, only where no engine can be had at all.

"Nothing left behind" is checked against the engine (no container) and on the host (no process whose
command line holds a test's marker)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import socket
import subprocess
import tarfile
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import docker
import docker.errors
import pytest
from sandbox_helpers import CALC, calc_task, git, host_pids, make_repo, marker, wait_for_pids

from swe_grpo.sandbox.base import Mount, SandboxError
from swe_grpo.sandbox.docker import (
    DEFAULT_IMAGE,
    OWNER_LABEL,
    SANDBOX_LABEL,
    DockerBackend,
    DockerLimits,
    DockerSandbox,
)
from swe_grpo.sandbox.process import export_repo
from swe_grpo.tasks import Task, swe_gym_image

UID = 1000


@pytest.fixture(scope="session")
def engine(docker_url: str) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=docker_url)
    yield client
    client.close()


def assert_gone(engine: docker.DockerClient, sandbox: DockerSandbox) -> None:
    with pytest.raises(docker.errors.NotFound):
        engine.containers.get(sandbox.id)


def our_containers(engine: docker.DockerClient) -> set[str]:
    return {c.id for c in engine.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"})}


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


async def test_repo_at_base_commit_clean_without_the_future(sandbox: DockerSandbox, task: Task) -> None:
    # The prepared image's index already matches its files: git has nothing to refresh, so it does not
    # rewrite the index (otherwise every sandbox's first git command re-reads the whole tree).
    index_before = await run_ok(sandbox, "stat -c %y .git/index")
    out = await run_ok(sandbox, "pwd; id -u; git rev-parse HEAD; git status --porcelain; git log --all --format=%H")
    assert out == f"/testbed\n{UID}\n{task.base_commit}\n{task.base_commit}\n"
    assert await run_ok(sandbox, "stat -c %y .git/index") == index_before
    out = await run_ok(sandbox, "cat calc.py; stat -c %u calc.py .git; echo $HOME")
    assert out == f"{CALC}{UID}\n{UID}\n/home/sandbox\n"
    await run_ok(sandbox, ["python3", "-m", "pytest", "--version"])


async def test_exec_output_exit_codes_argv_and_cwd(sandbox: DockerSandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=30)
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    argv = ["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME", "'"]
    assert await run_ok(sandbox, argv) == "['a b', '$HOME', \"'\"]\n"
    assert await run_ok(sandbox, "pwd", cwd="/tmp") == "/tmp\n"
    assert (await sandbox.exec("no-such-command", timeout_s=30)).exit_code == 127
    result = await sandbox.exec(["no-such-binary"], timeout_s=30)
    assert result.exit_code not in (0, None)


async def test_output_cap_keeps_the_end(docker_url: str, task: Task) -> None:
    backend = DockerBackend(base_url=docker_url, limits=DockerLimits(output_bytes=1000))
    await backend.start()
    try:
        sandbox = await backend.create(task)
        result = await sandbox.exec("head -c 5000000 /dev/zero | tr '\\0' a; echo -n END", timeout_s=60)
        assert result.stdout == "[... 4999003 bytes dropped ...]\n" + "a" * 997 + "END"
    finally:
        await backend.close()


async def test_env_reaches_the_process_but_no_argv(sandbox: DockerSandbox, engine: docker.DockerClient) -> None:
    secret = f"s3cret-{random.random()}"
    env = {"SWE_GRPO_TOKEN": secret}
    assert await run_ok(sandbox, "echo $SWE_GRPO_TOKEN", env=env) == f"{secret}\n"
    assert secret not in await run_ok(sandbox, "cat /proc/*/cmdline", env=env)
    m = marker()
    running = asyncio.create_task(sandbox.exec(f"sleep {m}", timeout_s=60, env=env))
    (pid,) = await wait_for_pids(f"sleep\0{m}")
    # On the host: no command line has it, the process that has it runs as the sandbox user, and the
    # container's own configuration does not hold it.
    assert host_pids(secret) == []
    assert secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    assert f"Uid:\t{UID}\t{UID}" in Path(f"/proc/{pid}/status").read_text()
    assert secret not in str(engine.containers.get(sandbox.id).attrs)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_timeout_kills_the_whole_tree(sandbox: DockerSandbox) -> None:
    m1, m2, m3 = marker(), marker(), marker()
    command = f"echo started; setsid sleep {m1} & (setsid sleep {m2} &); sleep {m3}"
    result = await sandbox.exec(command, timeout_s=1)
    assert (result.exit_code, result.timed_out, result.stdout) == (None, True, "started\n")
    assert 1 <= result.wall_s < 5
    for m in (m1, m2, m3):
        assert host_pids(f"sleep\0{m}") == []  # already gone when exec returns: no waiting here
    assert m1 not in await run_ok(sandbox, ["ps", "-eo", "args"])


async def test_cancellation_kills_the_whole_tree(sandbox: DockerSandbox) -> None:
    m1, m2 = marker(), marker()
    running = asyncio.create_task(sandbox.exec(f"(setsid sleep {m1} &); sleep {m2}", timeout_s=60))
    await wait_for_pids(f"sleep\0{m1}")
    await wait_for_pids(f"sleep\0{m2}")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert host_pids(f"sleep\0{m1}") == host_pids(f"sleep\0{m2}") == []
    assert m1 not in await run_ok(sandbox, ["ps", "-eo", "args"])


async def test_reaches_a_server_on_host_loopback(sandbox: DockerSandbox) -> None:
    class Pong(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"pong")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Pong)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/ping"
        py = f"import urllib.request; print(urllib.request.urlopen('{url}').read().decode())"
        assert await run_ok(sandbox, ["python3", "-c", py]) == "pong\n"
    finally:
        server.shutdown()
        server.server_close()


async def test_put_and_get_files(sandbox: DockerSandbox) -> None:
    blob = bytes(range(256)) * 1000
    await sandbox.put_file("/testbed/deep/new/blob.bin", blob, mode=0o755)
    await sandbox.put_file("/tmp/note.txt", b"hello\n")
    assert await sandbox.get_file("/testbed/deep/new/blob.bin") == blob
    assert await sandbox.get_file("/tmp/note.txt") == b"hello\n"
    stat = await run_ok(sandbox, "stat -c '%u %a' /testbed/deep /testbed/deep/new/blob.bin /tmp/note.txt")
    assert stat == f"{UID} 755\n{UID} 755\n{UID} 644\n"
    await sandbox.put_file("/testbed/calc.py", b"x = 1\n")  # overwrite a tracked file
    assert await run_ok(sandbox, "cat calc.py") == "x = 1\n"
    with pytest.raises(SandboxError, match="does not exist"):
        await sandbox.get_file("/testbed/missing.txt")
    with pytest.raises(SandboxError, match="not a regular file"):
        await sandbox.get_file("/testbed/deep")
    with pytest.raises(SandboxError, match="cannot create"):
        await sandbox.put_file("/root/x/y.txt", b"")  # the sandbox user may not create it
    with pytest.raises(ValueError):
        await sandbox.put_file("relative.txt", b"")
    # A symlink the agent planted resolves inside the container, never to the host's file.
    await run_ok(sandbox, "ln -s /etc/hostname /testbed/evil")
    hostname = Path("/etc/hostname").read_bytes()
    await sandbox.put_file("/testbed/evil", b"pwned")
    assert Path("/etc/hostname").read_bytes() == hostname


async def test_diff_applies_to_a_fresh_checkout(sandbox: DockerSandbox, task: Task, repo: Path, tmp_path: Path) -> None:
    assert await sandbox.diff(task.base_commit) == ""
    await run_ok(sandbox, "printf 'def add(a, b):\\n    return b + a\\n' > calc.py && rm old.txt")
    await sandbox.put_file("/testbed/pkg/new module.py", b"VALUE = 42\n")
    await sandbox.put_file("/testbed/logo.bin", bytes(reversed(range(256))))
    patch = await sandbox.diff(task.base_commit)
    assert "calc.py" in patch and "pkg/new module.py" in patch and "GIT binary patch" in patch

    fresh = tmp_path / "fresh"
    git(tmp_path, "clone", "-q", str(repo), "fresh")
    git(fresh, "checkout", "-q", task.base_commit)
    (tmp_path / "agent.patch").write_text(patch)
    git(fresh, "apply", str(tmp_path / "agent.patch"))
    for path in ("calc.py", "pkg/new module.py", "logo.bin"):
        assert (fresh / path).read_bytes() == await sandbox.get_file(f"/testbed/{path}")
    assert not (fresh / "old.txt").exists()


async def test_limits_labels_and_hardening(docker_url: str, task: Task, engine: docker.DockerClient) -> None:
    limits = DockerLimits(memory="512m", cpus=1.5, pids=300)
    backend = DockerBackend(base_url=docker_url, limits=limits)
    await backend.start()
    try:
        sandbox = await backend.create(task)
        attrs = engine.containers.get(sandbox.id).attrs
        host = attrs["HostConfig"]
        assert (host["Memory"], host["MemorySwap"]) == (512 << 20, 512 << 20)
        assert (host["NanoCpus"], host["PidsLimit"]) == (1_500_000_000, 300)
        assert (host["Init"], host["NetworkMode"], host["CapDrop"]) == (True, "host", ["ALL"])
        assert host["SecurityOpt"] == ["no-new-privileges"]
        # The disk limit: a read-only root, and the writable paths tmpfs volumes of `disk` (2 GiB) each.
        assert host["ReadonlyRootfs"] is True
        writable = ["/home/sandbox", "/testbed", "/tmp", "/var/tmp"]
        assert sorted(m["Destination"] for m in attrs["Mounts"]) == writable
        sizes = await run_ok(sandbox, ["stat", "-f", "-c", "%T %b %S", *writable])
        assert sizes.splitlines() == [f"tmpfs {(2 << 30) // 4096} 4096"] * 4
        result = await sandbox.exec("touch /etc/x /usr/x; echo > /testbed/ok", timeout_s=30)
        assert result.stderr.count("Read-only file system") == 2 and result.exit_code == 0, result
        assert attrs["Config"]["User"] == f"{UID}:{UID}"
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
    backend = DockerBackend(base_url=docker_url, network="none")
    await backend.start()
    try:
        sandbox = await backend.create(task)
        assert engine.containers.get(sandbox.id).attrs["HostConfig"]["NetworkMode"] == "none"
        result = await sandbox.exec("cat /proc/net/dev | tail -n +3 | cut -d: -f1", timeout_s=30)
        assert result.stdout.split() == ["lo"]
    finally:
        await backend.close()


async def test_mounts_read_only_and_writable(backend: DockerBackend, task: Task) -> None:
    with tempfile.TemporaryDirectory(prefix="swe_grpo_mounts_") as tmp:
        host = Path(tmp)
        (host / "ro").mkdir()
        (host / "ro" / "agent.js").write_text("console.log(1)\n")
        (host / "rw").mkdir()
        os.chown(host / "rw", UID, UID)
        mounts = [Mount(host / "ro", "/opt/agent"), Mount(host / "rw", "/opt/out", writable=True)]
        sandbox = await backend.create(task, mounts)
        try:
            assert await run_ok(sandbox, "cat /opt/agent/agent.js") == "console.log(1)\n"
            result = await sandbox.exec("touch /opt/agent/x", timeout_s=30)
            assert result.exit_code != 0 and "Read-only file system" in result.stderr
            await run_ok(sandbox, "echo result > /opt/out/r.txt")
            assert (host / "rw" / "r.txt").read_text() == "result\n"
        finally:
            await sandbox.destroy()


async def test_destroy_kills_running_execs_is_idempotent_and_leaves_nothing(
    backend: DockerBackend, task: Task, engine: docker.DockerClient
) -> None:
    sandbox = await backend.create(task)
    m = marker()
    running = asyncio.create_task(sandbox.exec(f"setsid sleep {m} & wait", timeout_s=60))
    await wait_for_pids(f"sleep\0{m}")
    await asyncio.gather(sandbox.destroy(), sandbox.destroy())
    await sandbox.destroy()
    # Its container vanished under it: killed, or (racing the removal) an infrastructure error.
    with contextlib.suppress(SandboxError):
        assert (await running).exit_code != 0
    assert host_pids(f"sleep\0{m}") == []
    assert_gone(engine, sandbox)
    with pytest.raises(SandboxError):
        await sandbox.exec("true", timeout_s=30)


async def test_close_destroys_live_sandboxes(docker_url: str, task: Task, engine: docker.DockerClient) -> None:
    backend = DockerBackend(base_url=docker_url)
    await backend.start()
    sandboxes = await asyncio.gather(backend.create(task), backend.create(task))
    await backend.close()
    for sandbox in sandboxes:
        assert_gone(engine, sandbox)


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
    with pytest.raises(SandboxError, match="no-such-commit"):
        await backend.create(replace(task, base_commit="no-such-commit"))
    with pytest.raises(SandboxError, match="the image has no git"):
        await backend.create(replace(task, image=nogit_image))
    assert {c.id for c in engine.containers.list(all=True)} == before
    assert {i.id for i in engine.images.list()} == images


async def test_cancelled_create_leaves_nothing(backend: DockerBackend, task: Task, engine: docker.DockerClient) -> None:
    await (await backend.create(task)).destroy()  # the prepared image exists: create is quick
    before = our_containers(engine)
    for delay in (0.0, 0.01, 0.05, 0.1, 0.2):
        creating = asyncio.create_task(backend.create(task))
        await asyncio.sleep(delay)
        creating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await (await creating).destroy()  # it won the race: it finished before the cancellation
        assert our_containers(engine) == before


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
        assert out == f"{task.base_commit}\n{UID}\n{UID}\n"
    finally:
        await sandbox.destroy()
    with pytest.raises(SandboxError, match="not at the base commit"):
        await backend.create(replace(gym_task, base_commit=git(repo, "rev-parse", "HEAD")))


async def test_unreachable_engine_is_a_clear_error() -> None:
    backend = DockerBackend(base_url="unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxError, match=r"no Docker engine reachable at unix:///nonexistent/docker\.sock"):
        await backend.start()
    await backend.close()
