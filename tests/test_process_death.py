"""The training process SIGKILLed mid-run (no `finally`, no `stop()`): what its rollouts held on the host
is gone once the next run starts its backend and makes its first door.

The dying process is a real one: a child running two real rollouts (real Pi in `local` or `docker`
sandboxes, behind their doors) whose generation never answers, so that Pi, its door forwarder, the
agents' sandboxes and the doors are all live, plus a bare sandbox running a command (as a grading
sandbox would be), when it is SIGKILLed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import psutil
import pytest
from child_lines import first_line
from sandbox_helpers import marker

from swe_grpo.sandbox.docker import OWNER_LABEL, SANDBOX_LABEL, DockerBackend
from swe_grpo.sandbox.door import remove_orphaned_doors
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend
from swe_grpo.sandbox.process import CgroupLayout

# Alone under xdist: the next start's door reaping, with a 3 s grace, must meet no door another test is opening.
pytestmark = [pytest.mark.integration, pytest.mark.alone]

# Run as `python -c CHILD <backend> <run_dir> <docker_url> <marker>`; prints READY once both agents wait on
# their first generation and the bare sandbox runs `sleep <marker>`.
CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from transformers import AutoTokenizer
    from swe_grpo.agents.base import AgentConfig
    from swe_grpo.agents.pi import PiAgent
    from swe_grpo.serving.interception import InterceptionServer
    from swe_grpo.rollout import RolloutConfig, run_rollout
    from swe_grpo.sandbox.docker import DockerBackend
    from swe_grpo.sandbox.local import LocalBackend
    from swe_grpo.demo.tasks import demo_tasks
    from swe_grpo.extras.tiny_model import build_tiny_model

    kind, run_dir, docker_url, mark = sys.argv[1:]
    waiting = 0

    class NeverAnswers:
        max_model_len = 8192

        async def generate(self, *args, **kwargs):
            global waiting
            waiting += 1
            if waiting == 2:
                print("READY", flush=True)
            await asyncio.Event().wait()

    async def main():
        backend = LocalBackend(run_dir=Path(run_dir)) if kind == "local" else DockerBackend(base_url=docker_url)
        await backend.start()
        task = demo_tasks()[0]
        bare = await backend.create(task, network=False)
        asyncio.create_task(bare.exec(["sleep", mark], timeout_s=3600))
        config = RolloutConfig(agent=AgentConfig(context_window=8192, max_tokens=64, timeout_s=3600))
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
        async with InterceptionServer(NeverAnswers(), tokenizer, model_name="tiny") as server:
            await asyncio.gather(*(run_rollout(task, server, backend, PiAgent(), config) for _ in range(2)))

    asyncio.run(main())
    """
)


def door_dirs(pid: int) -> list[Path]:
    """The door directories whose socket `pid` serves (a door's directory holds no owner's name)."""
    sockets = [c.laddr for c in psutil.Process(pid).net_connections(kind="unix")]
    return sorted({Path(s).parent for s in sockets if Path(s).parent.name.startswith("swe-grpo-door-")})


def existing(paths: list[Path]) -> list[Path]:
    return [p for p in paths if p.exists()]


# The reaper's grace for a door that may be being opened (no listening socket yet): 10 s by default; here
# 3 s, so that the test waits out ~4 s, not 11, for the killed child's doors to be older than it. The
# reaping is the same; no other test opens a door meanwhile (the module runs alone under xdist).
GRACE_S = 3.0


def past_the_grace(doors: list[Path], grace_s: float = GRACE_S) -> None:
    """Wait until `doors` are older than the door reaper's grace (a younger one may be being opened)."""
    newest = max((d.stat().st_mtime for d in existing(doors)), default=0.0)
    time.sleep(max(0.0, newest + grace_s + 1 - time.time()))


def local_leftovers(run_dir: Path, pid: int) -> dict[str, list[str]]:
    """What `pid`'s local sandboxes hold on the host: directories, mounts and cgroups named for it, and
    the processes in those cgroups."""
    layout = CgroupLayout.detect()
    roots = {layout.memory, layout.pids, *([layout.cpu] if layout.cpu is not None else [])}
    cgroups = [d for root in roots for d in (root / CGROUP_PARENT).glob(f"swe-grpo-{pid}-*")]
    return {
        "directories": [str(p) for p in run_dir.glob(f"swe-grpo-{pid}-*")],
        "mounts": [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(run_dir) in line],
        "cgroups": [str(d) for d in cgroups],
        "processes in them": [p for d in cgroups for p in (d / "cgroup.procs").read_text().split()],
    }


def command_line(p: psutil.Process) -> str | None:
    """`p`'s command line; None when it is gone or a zombie (it runs nothing)."""
    try:
        return None if p.status() == psutil.STATUS_ZOMBIE else " ".join(p.cmdline())
    except psutil.Error:
        return None


def alive(pids: list[int]) -> list[str]:
    """The processes of `pids` that still run."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if (line := command_line(psutil.Process(pid))) is not None:
                found.append(f"{pid} {line[:120]}")
    return found


@dataclass
class Killed:
    """The child as it was when SIGKILLed: its pid, its process tree, its doors, its bare sandbox's marker."""

    pid: int
    tree: list[int]
    doors: list[Path]
    mark: str


@contextlib.contextmanager
def killed_mid_run(kind: str, run_dir: Path, stderr: Path, docker_url: str = "") -> Iterator[Killed]:
    """Start the child (its stderr to the file `stderr`), wait until its rollouts are live, SIGKILL it."""
    mark = marker()
    with stderr.open("wb") as err:
        argv = [sys.executable, "-c", CHILD, kind, str(run_dir), docker_url, mark]
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL)
    try:
        assert first_line(child, 300, stderr) == "READY"
        killed = Killed(child.pid, [p.pid for p in psutil.Process(child.pid).children(recursive=True)], [], mark)
        killed.doors = door_dirs(child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        yield killed
    finally:
        child.kill()
        child.wait()


def test_a_sigkilled_run_leaves_local_sandboxes_that_the_next_start_removes(run_dir: Path, tmp_path: Path) -> None:
    with killed_mid_run("local", run_dir, tmp_path / "child.err") as killed:
        time.sleep(1)  # what dies with its parent has died
        left = local_leftovers(run_dir, killed.pid)
        assert left["directories"] and left["mounts"] and left["cgroups"]  # the test's premise
        assert len(existing(killed.doors)) == 2
        # bwrap's --die-with-parent ends each exec's whole pid namespace (Pi, its door forwarder, the
        # command) with the process that started it: nothing runs on for the reaper to find.
        assert alive(killed.tree) == []
        past_the_grace(killed.doors)

        asyncio.run(next_start(LocalBackend(run_dir=run_dir)))

        nothing: dict[str, list[str]] = {"directories": [], "mounts": [], "cgroups": [], "processes in them": []}
        assert local_leftovers(run_dir, killed.pid) == nothing
        assert existing(killed.doors) == []
        assert not any(killed.mark in (command_line(p) or "") for p in psutil.process_iter() if p.pid != os.getpid())


def test_a_sigkilled_run_leaves_docker_sandboxes_that_the_next_start_removes(
    docker_url: str, run_dir: Path, tmp_path: Path
) -> None:
    client = docker.DockerClient(base_url=docker_url)

    def containers(pid: int) -> list[str]:
        found = client.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"})
        return [c.name for c in found if c.labels.get(OWNER_LABEL, "").split("/")[1:2] == [str(pid)]]

    with killed_mid_run("docker", run_dir, tmp_path / "child.err", docker_url) as killed:
        assert len(containers(killed.pid)) == 3  # the test's premise: both agents' and the bare one
        assert len(existing(killed.doors)) == 2
        past_the_grace(killed.doors)

        asyncio.run(next_start(DockerBackend(base_url=docker_url)))

        assert containers(killed.pid) == []
        assert existing(killed.doors) == []
        assert alive(killed.tree) == []
    client.close()


async def next_start(backend: LocalBackend | DockerBackend) -> None:
    """What the next run does first: start its backend, and reap doors as the first door each of its processes
    makes does (`Door.make`; here called directly, since this process made its first door long ago)."""
    await backend.start()
    try:
        await asyncio.to_thread(remove_orphaned_doors, GRACE_S)
    finally:
        await backend.close()
