"""Containment on real sandboxes (`local` and `docker`): a sandbox that exhausts its own memory, process or
disk limit harms no other sandbox, is reported by `exhausted()` with the right cause, and leaves nothing
behind; a grading sandbox (`network=False`, the default) has no network at all.

Every attack here is bounded even if the limit it tests failed (this box is shared): the fork bomb starts
at most 2,000 sleeping processes, the memory hog holds at most 1 GiB, the disk filler writes at most
960 MiB, and all die with their exec. The network is checked by interfaces and routes, never by sending
traffic.
"""

from __future__ import annotations

import asyncio
import errno
import json
import platform
import socket
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

import pytest
from cheats import append, git, make_patch, source_module
from conftest import SERVED_NAME
from sandbox_helpers import assert_nothing_left, calc_task, make_repo
from test_pi_integration import RecordingClient
from test_rollout import STRUTIL, rollout

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import DEFAULT_TEST_CMD, grade
from swe_grpo.sandbox.base import ExecResult, Sandbox, SandboxBackend
from swe_grpo.sandbox.docker import DockerLimits
from swe_grpo.sandbox.door import Door
from swe_grpo.sandbox.local import LocalBackend, LocalLimits
from swe_grpo.tasks import Task

STRUTIL_TASK = next(t for t in demo_tasks() if t.instance_id == STRUTIL)
MEMORY = 256 << 20
PIDS = 128
DISK = 128 << 20

# At most 2,000 sleeping children (posix_spawn fails with EAGAIN at the pids limit), then hold them.
BOMB = """
import os, time
spawned = 0
for _ in range(2000):
    try:
        os.posix_spawn("/bin/sleep", ["sleep", "300"], {})
    except OSError:
        break
    spawned += 1
print(spawned, flush=True)
time.sleep(300)
"""
# 64 MiB at a time, every byte written (so the pages are real), at most 1 GiB; prints what it holds.
HOG = """
held = []
for _ in range(16):
    held.append(b"x" * (64 << 20))
    print(len(held) * 64, flush=True)
"""
# 16 MiB at a time into /tmp, at most 960 MiB; prints what it wrote.
FILLER = """
import os
written = 0
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(60):
            f.write(b"x" * (16 << 20))
            f.flush()
            os.fsync(f.fileno())
            written += 16 << 20
except OSError as e:
    print("stopped:", e.strerror)
print(written >> 20)
"""
# What an agent or grading does: compute, spawn processes and threads, write files, ask git.
WORKLOAD = r"""
set -e
python3 -c 'print(sum(i * i for i in range(300000)))'
python3 -c '
import threading
threads = [threading.Thread(target=sum, args=([1] * 10000,)) for _ in range(32)]
for t in threads: t.start()
for t in threads: t.join()
print("threads", len(threads))'
mkdir -p /testbed/out
for i in $(seq 30); do echo "$i" > "/testbed/out/$i"; done
seq 8 | xargs -P 8 -I{} sh -c 'echo {}' | sort -n | tr '\n' ' '
head -c 8M /dev/urandom > /tmp/blob && wc -c < /tmp/blob
cat /testbed/out/* | wc -l
git status --porcelain
"""

# Raw calls (x86-64 numbers) with arguments no kernel accepts: unfiltered, each fails with the kernel's own
# complaint (EFAULT, EINVAL, EBADF; ENOSYS for the x32 `getpid` where the kernel has no x32), never EPERM.
# `userfaultfd` asks for user-mode faults only, which no sysctl refuses, plus a flag that is invalid.
# Made by the process itself, a thread of it, and a child of it in a session of its own (an agent's
# background job); prints {"where": {"call": errno}}.
KERNEL_CALLS = r"""
import ctypes, json, os, subprocess, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
calls = {
    "io_uring_setup": (425, 1, 0), "io_uring_enter": (426, -1, 0, 0, 0, 0, 0), "io_uring_register": (427, -1, 0, 0, 0),
    "add_key": (248, 0, 0, 0, 0, 0), "request_key": (249, 0, 0, 0, 0), "keyctl": (250, -1, 0),
    "bpf": (321, 0, 0, 0), "perf_event_open": (298, 0, 0, -1, -1, 0), "userfaultfd": (323, 3),
    "x32 getpid": (0x40000000 + 39,),
}
def errnos():
    seen = {}
    for name, (nr, *args) in calls.items():
        ctypes.set_errno(0)
        libc.syscall(nr, *args)
        seen[name] = ctypes.get_errno()
    return seen
if sys.argv[1:] == ["child"]:
    print(json.dumps(errnos()))
    sys.exit()
seen = {"process": errnos()}
thread = threading.Thread(target=lambda: seen.update(thread=errnos()))
thread.start()
thread.join()
child = subprocess.run(["setsid", sys.executable, sys.argv[0], "child"], capture_output=True, text=True, check=True)
seen["detached child"] = json.loads(child.stdout)
print(json.dumps(seen))
"""


async def wait_for(check: Callable[[], Awaitable[object]], what: str, timeout_s: float = 60) -> None:
    for _ in range(int(timeout_s / 0.1)):
        if await check():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def outcome(result: ExecResult) -> tuple[int | None, str, str, bool]:
    return result.exit_code, result.stdout, result.stderr, result.timed_out


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return calc_task(make_repo(tmp_path_factory.mktemp("origin")))


@pytest.fixture(scope="module")
def sandbox_limits() -> tuple[LocalLimits, DockerLimits]:
    """Small limits, so that the attacks below reach them quickly."""
    local = LocalLimits(memory_bytes=MEMORY, pids=PIDS, disk_bytes=DISK)
    return local, DockerLimits(memory=f"{MEMORY >> 20}m", pids=PIDS, disk=f"{DISK >> 20}m")


async def test_exhaustion_stays_in_its_sandbox(backend: SandboxBackend, task: Task, run_dir: Path) -> None:
    """A fork bomb, a memory hog and a disk filler, each in its own sandbox, while an agent's and a grading
    sandbox run a normal workload: the workload ends exactly as it does alone, and each guilty sandbox
    says what it exhausted."""
    sandboxes: list[Sandbox] = []

    async def create(network: bool = True) -> Sandbox:
        sandboxes.append(await backend.create(task, network=network))
        return sandboxes[-1]

    try:
        agent, grader = await create(), await create(network=False)
        bomber, hog, filler = await create(), await create(), await create()
        alone = [outcome(await s.exec(WORKLOAD, timeout_s=120)) for s in (agent, grader)]
        assert alone[0] == alone[1] and alone[0][0] == 0, alone

        bombing = asyncio.create_task(bomber.exec(["python3", "-c", BOMB], timeout_s=120))
        await wait_for(lambda: bomber.exhausted(), "the fork bomb reaches the pids limit")
        hogging = asyncio.create_task(hog.exec(["python3", "-c", HOG], timeout_s=120))
        filling = asyncio.create_task(filler.exec(["python3", "-c", FILLER], timeout_s=120))
        during = await asyncio.gather(*(s.exec(WORKLOAD, timeout_s=120) for s in (agent, grader)))
        assert [outcome(r) for r in during] == alone

        hogged, filled = await hogging, await filling
        assert hogged.exit_code == 128 + 9, hogged  # OOM-killed
        assert int(hogged.stdout.split()[-1]) < MEMORY >> 20, hogged
        assert filled.exit_code == 0 and "stopped: No space left on device" in filled.stdout, filled
        assert int(filled.stdout.split()[-1]) <= DISK >> 20
        assert not bombing.done()
        bombing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await bombing
        causes = [await s.exhausted() for s in (agent, grader, bomber, hog, filler)]
        assert causes == [None, None, "pids", "memory", "disk"]
        # Sticky: the bomb is dead, the filler's files are gone, the cause stays.
        assert (await filler.exec("rm -f /tmp/fill", timeout_s=30)).exit_code == 0
        assert [await s.exhausted() for s in (bomber, filler)] == ["pids", "disk"]
    finally:
        await asyncio.gather(*(s.destroy() for s in sandboxes))
    assert_nothing_left(backend, run_dir)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the raw calls use x86-64 numbers")
async def test_kernel_interfaces_an_agent_never_needs_are_refused_in_every_process(
    backend: SandboxBackend, task: Task, run_dir: Path
) -> None:
    """io_uring, the keyrings, bpf, perf events, userfaultfd and x32 calls fail with EPERM in every process of
    a sandbox, on every engine: a command's own process, its threads, a detached child, and the agent's tree
    behind the door's forwarder; while the ordinary work of an agent and of grading (Python, threads,
    processes, files, bytecode, git) runs as before."""
    door = Door.make("seccomp")  # unserved: the probe makes no request through it
    try:
        async with await backend.create(task, mounts=[door.mount()], network=False) as sandbox:
            await sandbox.put_file("/tmp/calls.py", KERNEL_CALLS.encode())
            places = {
                "command": await sandbox.exec(["python3", "/tmp/calls.py"], timeout_s=60),
                "agent": await sandbox.exec(door.wrap(["python3", "/tmp/calls.py"]), timeout_s=60),
            }
            work = await sandbox.exec(WORKLOAD, timeout_s=120)
            compiled = await sandbox.exec("python3 -m compileall -q . && ls __pycache__", timeout_s=60)
    finally:
        door.remove()
    for place, result in places.items():
        assert result.exit_code == 0, (place, result)
        seen = json.loads(result.stdout)
        assert list(seen) == ["process", "thread", "detached child"]
        for where, errnos in seen.items():
            assert errnos == dict.fromkeys(errnos, errno.EPERM), (place, where, errnos)
    assert work.exit_code == 0 and "threads 32" in work.stdout, work
    assert compiled.exit_code == 0, compiled
    assert [(name.split(".")[0], name.split(".")[-1]) for name in compiled.stdout.split()] == [("calc", "pyc")]
    assert_nothing_left(backend, run_dir)


# Appended to the demo task's module after its gold fix: it runs when the tests import the module, then
# lets them run (they would all pass).
ON_IMPORT = {
    "pids": "import os\nfor _ in range(2000):\n    try:\n        os.posix_spawn('/bin/sleep', ['sleep', '300'], {})\n"
    "    except OSError:\n        break\n",
    "memory": HOG,  # in the test runner's own process: the OOM killer takes it
    "disk": FILLER,
}


async def test_a_patch_that_exhausts_the_grading_sandbox(backend: SandboxBackend, run_dir: Path) -> None:
    """The tests import the patch's code: a patch with the right fix whose module fork-bombs, hogs memory
    or fills the disk on import ends `resource_exhausted` (reward 0, "grading" and the limit in its error:
    the tests stay within the limits without it), while the gold patch graded beside them resolves as it
    does alone; nothing is left."""
    attacks = ["pids", "memory", "disk"]

    def fix_and(attack: str) -> Callable[[Path, Task], None]:
        def edit(repo: Path, task: Task) -> None:
            git(repo, "apply", "-", input_text=task.patch)
            append(repo / source_module(task), "\n\n" + ON_IMPORT[attack])

        return edit

    # The capability gate and the runner's own limits off: they would refuse the fork bomb, or end it at its
    # first spawn (grading_tampered, see tests/test_graded_run_limits.py); here the sandbox's limits are tested.
    task = replace(STRUTIL_TASK, runner_limits=False, tamper_allow=("process-control",))
    patches = [task.patch, *(make_patch(task, fix_and(attack)) for attack in attacks)]
    gold, *guilty = await asyncio.gather(*(grade(task, patch, backend, timeout_s=120) for patch in patches))
    assert (gold.outcome, gold.reward) == ("resolved", 1.0), (gold.error, gold.log_tail)
    for attack, result in zip(attacks, guilty, strict=True):
        assert (result.outcome, result.reward) == ("resource_exhausted", 0.0), (attack, result.error, result.log_tail)
        assert result.error is not None and result.error.startswith("grading:") and attack in result.error
    assert_nothing_left(backend, run_dir)


async def test_tests_that_exhaust_the_grading_sandbox_alone_are_an_infra_error(
    local_backend: LocalBackend, run_dir: Path
) -> None:
    """When the tests run the sandbox out of a limit without the patch too, the limits are too small for
    the task: no reward, never a 0 for the patch."""
    task = replace(STRUTIL_TASK, test_cmd=f"python3 -c \"b = b'x' * (1 << 30)\"; {DEFAULT_TEST_CMD}")
    result = await grade(task, task.patch, local_backend, timeout_s=120)
    assert (result.outcome, result.reward) == ("infra_error", None), (result.error, result.log_tail)
    assert "memory" in (result.error or "") and "without the patch" in (result.error or "")
    assert_nothing_left(local_backend, run_dir)


IFACES = "import json, socket; print(json.dumps([name for _, name in socket.if_nameindex()]))"


@pytest.mark.parametrize("asked", [{}, {"network": False}], ids=["by-default", "network-false"])
async def test_grading_sandbox_has_no_network(
    backend: SandboxBackend, task: Task, run_dir: Path, asked: dict[str, bool]
) -> None:
    """`network=False`, which is also what `create()` gives when not asked (so a caller's own loop is
    contained unless it asks): a loopback of its own and nothing else: no other interface, no route (IPv4
    or IPv6) anywhere."""
    offline = await backend.create(task, **asked)
    try:
        result = await offline.exec(["python3", "-c", IFACES], timeout_s=30)
        assert json.loads(result.stdout) == ["lo"], result
        routes = await offline.exec("tail -n +2 /proc/net/route; cat /proc/net/ipv6_route", timeout_s=30)
        assert routes.exit_code == 0
        # IPv6: at most loopback's own routes (the kernel adds them to `lo` once it is up).
        assert all(line.split()[-1] == "lo" for line in routes.stdout.splitlines()), routes.stdout
        inet6 = await offline.exec("cat /proc/net/if_inet6 2>/dev/null; true", timeout_s=30)
        assert all(line.split()[-1] == "lo" for line in inet6.stdout.splitlines()), inet6.stdout
        assert await offline.exhausted() is None
    finally:
        await offline.destroy()
    assert_nothing_left(backend, run_dir)


async def test_a_sandbox_asked_for_the_network_shares_the_hosts(
    backend: SandboxBackend, task: Task, run_dir: Path
) -> None:
    """`create(network=True)` gives the backend's network (the host's here): what an agent gets only when its
    door is turned off (`RolloutConfig.door=False`); rollouts default to the door."""
    online = await backend.create(task, network=True)
    try:
        result = await online.exec(["python3", "-c", IFACES], timeout_s=30)
        assert json.loads(result.stdout) == [name for _, name in socket.if_nameindex()]
    finally:
        await online.destroy()
    assert_nothing_left(backend, run_dir)


@pytest.mark.integration
async def test_rollout_whose_agent_exhausts_its_sandbox(vllm_server, tokenizer, pi_bundle, run_dir, tmp_path) -> None:
    """The agent's first turn (guided) runs a memory hog (at most 1 GiB against 512 MiB): the rollout ends
    `resource_exhausted`, reward 0, ungraded, naming the limit; nothing is left."""
    hog = {"name": "bash", "arguments": {"command": "python3 -c \"b = [b'x' * (64 << 20) for _ in range(16)]\""}}
    client = RecordingClient(
        vllm_server.url,
        SERVED_NAME,
        stop_token_ids=[tokenizer.eos_token_id],
        guided=[f"<tool_call>\n{json.dumps(hog)}\n</tool_call>"],
    )
    backend = LocalBackend(
        limits=LocalLimits(memory_bytes=512 << 20), cache_dir=tmp_path / "checkouts", run_dir=run_dir
    )
    async with client:
        trajectory, server = await rollout(client, tokenizer, backend, STRUTIL_TASK, pi_bundle)
    assert (trajectory.outcome, trajectory.reward, trajectory.grade) == ("resource_exhausted", 0.0, None)
    assert "memory" in trajectory.error and trajectory.turns
    # Its processes, Pi's included, were in its cgroup, which could be removed only once empty.
    assert_nothing_left(backend, run_dir)
    assert server.open_rollouts == 0
