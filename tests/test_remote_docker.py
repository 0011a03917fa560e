"""The `docker` backend against a remote engine: a second dockerd made from nothing for this module
(`docker_env.tcp_engine`), reached over tcp on 127.0.0.1, so the backend treats it as another machine's
(no shared path, no door, exhaustion read through the engine). It runs on this machine only because no
other can be had here; nothing in the backend relies on that.

Checked: a rollout's sandbox work (a mount copied to the engine once, commands, files, the diff, the
limits, destroy) with nothing left on the engine but its caches; the reaper removing a dead owner's
containers there and no other; plain tcp off the loopback refused before any connection."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import docker
import docker.errors
import pytest
from docker_env import DockerUnavailable, tcp_engine
from sandbox_helpers import calc_task, make_repo
from test_containment import FILLER, HOG

from swe_grpo.sandbox.base import Mount, SandboxError
from swe_grpo.sandbox.docker import DEFAULT_IMAGE, MOUNT_LABEL, OWNER_LABEL, SANDBOX_LABEL, DockerBackend, DockerLimits
from swe_grpo.tasks import Task

# Sleepers of 2 s until a spawn fails at the pids limit (at most 2,000), then it exits: through a remote
# engine the counters are read from inside, by an exec that needs the limit not to be held any more.
BRIEF_BOMB = """
import os
spawned = 0
for _ in range(2000):
    try:
        os.posix_spawn("/bin/sleep", ["sleep", "2"], {})
    except OSError:
        break
    spawned += 1
print(spawned)
"""


@pytest.fixture(scope="module")
def remote_url(docker_url: str) -> Iterator[str]:
    try:
        with tcp_engine(docker_url) as url:
            yield url
    except DockerUnavailable as e:
        pytest.skip(f"no second Docker engine: {e}")


@pytest.fixture(scope="module")
def remote(remote_url: str) -> Iterator[docker.DockerClient]:
    client = docker.DockerClient(base_url=remote_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return calc_task(make_repo(tmp_path_factory.mktemp("origin")))


def our_containers(engine: docker.DockerClient) -> list[str]:
    return [c.name or "" for c in engine.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"})]


def volumes(engine: docker.DockerClient) -> list[tuple[str, dict[str, str]]]:
    return [(v.name or "", v.attrs.get("Labels") or {}) for v in engine.volumes.list()]


async def test_a_rollouts_sandbox_work_on_a_remote_engine(
    remote_url: str, remote: docker.DockerClient, task: Task
) -> None:
    """What a rollout does with its sandboxes, on the remote engine: the repository (a host path) reaches
    the prepared image; a host directory mounted as the Pi bundle is copied to one volume once and is
    read-only; commands, files and the diff work; the limits hold and are told (memory, disk) through the
    engine; destroy leaves no container and no volume but the mount's copy."""
    bundle = Path(os.environ.get("TMPDIR", "/tmp")) / f"swe-grpo-bundle-{os.getpid()}"
    (bundle / "bin").mkdir(parents=True, exist_ok=True)
    (bundle / "bin" / "agent.sh").write_text("echo agent ran\n")
    limits = DockerLimits(memory="256m", pids=128, disk="128m")
    backend = DockerBackend(base_url=remote_url, limits=limits)
    assert backend.remote and not backend.live_mounts
    await backend.start()
    try:
        mounts = [Mount(bundle, "/opt/agent")]
        agent, bomber, hog, filler = await asyncio.gather(*(backend.create(task, mounts) for _ in range(4)))
        result = await agent.exec("bash /opt/agent/bin/agent.sh && touch /opt/agent/x", timeout_s=60)
        assert result.stdout == "agent ran\n" and "Read-only file system" in result.stderr, result
        copies = [name for name, labels in volumes(remote) if labels.get(MOUNT_LABEL) == "1"]
        assert len(copies) == 2, copies  # the bundle's and the seccomp wrapper's
        filters = await agent.exec(["grep", "Seccomp_filters", "/proc/self/status"], timeout_s=60)
        assert filters.stdout == "Seccomp_filters:\t2\n", filters  # the engine's profile and ours

        await agent.exec("printf 'def add(a, b):\\n    return b + a\\n' > calc.py", timeout_s=60)
        await agent.put_file("/testbed/notes/new.txt", b"hello\n")
        assert await agent.get_file("/testbed/notes/new.txt") == b"hello\n"
        patch = await agent.diff(task.base_commit)
        assert "+    return b + a" in patch and "notes/new.txt" in patch

        bombed, hogged, filled = await asyncio.gather(
            bomber.exec(["python3", "-c", BRIEF_BOMB], timeout_s=60),
            hog.exec(["python3", "-c", HOG], timeout_s=120),
            filler.exec(["python3", "-c", FILLER], timeout_s=120),
        )
        assert bombed.exit_code == 0 and int(bombed.stdout) < 128, bombed
        assert hogged.exit_code == 128 + 9, hogged
        assert "stopped: No space left on device" in filled.stdout, filled
        sandboxes = (agent, bomber, hog, filler)
        assert [await s.exhausted() for s in sandboxes] == [None, "pids", "memory", "disk"]
        await asyncio.gather(*(s.destroy() for s in sandboxes))
    finally:
        await backend.close()
        for path in sorted(bundle.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        bundle.rmdir()
    assert our_containers(remote) == []
    assert [name for name, labels in volumes(remote) if labels.get(MOUNT_LABEL) != "1"] == []


async def test_writable_mount_is_refused_remotely(remote_url: str, remote: docker.DockerClient, task: Task) -> None:
    backend = DockerBackend(base_url=remote_url)
    await backend.start()
    try:
        with pytest.raises(SandboxError, match=r"cannot mount .* writable"):
            await backend.create(task, [Mount(Path("/tmp"), "/opt/out", writable=True)])
    finally:
        await backend.close()
    assert our_containers(remote) == []


async def test_reaper_on_a_remote_engine(remote_url: str, remote: docker.DockerClient, task: Task) -> None:
    """`start()` removes the containers a dead process of this machine left on the remote engine, and
    keeps a live process's and another machine's."""
    live_backend = DockerBackend(base_url=remote_url)
    await live_backend.start()
    live = await live_backend.create(task)
    dead_owner = f"{socket.gethostname()}/4194999/1"  # above any pid_max: that process cannot exist
    made = []
    try:
        for owner in (dead_owner, "another-machine/1/1"):
            labels = {SANDBOX_LABEL: "1", OWNER_LABEL: owner}
            made.append(remote.containers.run(DEFAULT_IMAGE, ["sleep", "infinity"], detach=True, labels=labels))
        leftover, other_machine = made
        second = DockerBackend(base_url=remote_url)
        await second.start()
        await second.close()
        with pytest.raises(docker.errors.NotFound):
            leftover.reload()
        other_machine.reload()
        assert other_machine.status == "running"
        assert (await live.exec("echo alive", timeout_s=30)).stdout == "alive\n"
    finally:
        for container in made:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        await live_backend.close()
    assert our_containers(remote) == []


async def test_plain_tcp_off_the_loopback_is_refused() -> None:
    """Refused before any connection is made (192.0.2.1 is a documentation address: nothing is sent)."""
    backend = DockerBackend(base_url="tcp://192.0.2.1:2375")
    with pytest.raises(SandboxError, match=r"refusing the Docker engine at tcp://192\.0\.2\.1:2375: plain tcp"):
        await backend.start()
    await backend.close()
