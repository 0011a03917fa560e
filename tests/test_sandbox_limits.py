"""Per-sandbox CPU and open-file limits, no nested user namespaces and no kernel interfaces an agent never
needs, on the real `local` (bubblewrap, cgroups, seccomp) and `docker` (private dockerd) backends, checked
from inside as an attacker would: a process that opens files until it cannot, busy loops that try to take
every core, `unshare -U`, raw io_uring / keyring / bpf / perf calls."""

from __future__ import annotations

import errno
import platform

import pytest
from sandbox_helpers import calc_task, make_repo

from swe_grpo.sandbox.base import FileTooLarge, Sandbox, SandboxBackend
from swe_grpo.sandbox.docker import DockerLimits
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalLimits, LocalSandbox
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.tasks import Task

OPEN_FILES = 256
CPUS = 0.2
BUSY_S = 3.0
# Two processes that each try to use a whole core for BUSY_S seconds; prints the CPU seconds they got.
BUSY = f"""
import os, time
children = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + {BUSY_S}
        while time.monotonic() < end:
            pass
        os._exit(0)
    children.append(pid)
for pid in children:
    os.waitpid(pid, 0)
times = os.times()
print(times.children_user + times.children_system)
"""
# Opens /dev/null until refused (at most 100,000 times); prints how many it held and why it stopped.
OPENER = """
import os
held = []
try:
    for _ in range(100_000):
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError as e:
    print(len(held), e.strerror)
"""
# Raw calls (x86-64 numbers) with arguments no kernel accepts: without a filter each fails with the kernel's
# own complaint (EFAULT, EINVAL), never EPERM; prints "name errno" per call.
RAW_CALLS = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
calls = {"io_uring_setup": (425, 1, 0), "keyctl": (250, 0, 0), "add_key": (248, 0, 0), "bpf": (321, 0, 0, 0),
         "perf_event_open": (298, 0, 0, -1, -1, 0)}
for name, (nr, *args) in calls.items():
    libc.syscall(nr, *args)
    print(name, ctypes.get_errno())
"""
# The container's CFS quota and period as its cgroup shows them from inside (cgroup v1 or v2).
QUOTA = "cat {0}/cpu.max 2>/dev/null || echo $(cat {0}/cpu/cpu.cfs_quota_us {0}/cpu/cpu.cfs_period_us)"


@pytest.fixture(scope="module")
def sandbox_limits() -> tuple[LocalLimits, DockerLimits]:
    return LocalLimits(cpus=CPUS, open_files=OPEN_FILES), DockerLimits(cpus=CPUS, open_files=OPEN_FILES)


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return calc_task(make_repo(tmp_path_factory.mktemp("origin")))


async def run_ok(sandbox: Sandbox, command: str) -> str:
    result = await sandbox.exec(command, timeout_s=60)
    assert result.exit_code == 0, result.stderr
    return result.stdout


async def test_open_files_are_capped(backend: SandboxBackend, task: Task) -> None:
    async with await backend.create(task) as sandbox:
        assert (await run_ok(sandbox, "ulimit -Sn; ulimit -Hn")).split() == [str(OPEN_FILES)] * 2
        held, *why = (await run_ok(sandbox, f"python3 -c '{OPENER}'")).split(maxsplit=1)
        assert OPEN_FILES - 10 < int(held) < OPEN_FILES and why == ["Too many open files\n"]
        raised = await sandbox.exec("ulimit -n 100000", timeout_s=60)
        assert raised.exit_code != 0


async def test_cpu_is_capped_at_the_quota(backend: SandboxBackend, task: Task) -> None:
    async with await backend.create(task) as sandbox:
        if isinstance(sandbox, LocalSandbox):  # no /sys inside: its cgroup, as the host sees it
            layout = CgroupLayout.detect()
            assert layout.cpu is not None
            cpu = layout.cpu / CGROUP_PARENT / sandbox.host_dir.name
            v1 = [cpu / "cpu.cfs_quota_us", cpu / "cpu.cfs_period_us"]
            shown = (cpu / "cpu.max").read_text() if layout.version == 2 else " ".join(f.read_text() for f in v1)
        else:
            shown = await run_ok(sandbox, QUOTA.format("/sys/fs/cgroup"))
        quota, period = shown.split()
        assert int(quota) / int(period) == pytest.approx(CPUS)
        used = float(await run_ok(sandbox, f"python3 -c '{BUSY}'"))
    # Unlimited, the two loops would take up to 2 x BUSY_S; the quota allows CPUS x BUSY_S (+ one period).
    assert used <= CPUS * BUSY_S + 0.3, used


async def test_no_user_namespace_can_be_made_inside(backend: SandboxBackend, task: Task) -> None:
    async with await backend.create(task) as sandbox:
        nested = await sandbox.exec("unshare -U true", timeout_s=60)
        mapped = await sandbox.exec("unshare -r id -u", timeout_s=60)
    assert nested.exit_code != 0 and "unshare failed" in nested.stderr
    assert mapped.exit_code != 0 and mapped.stdout == ""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the raw calls use x86-64 numbers")
async def test_kernel_interfaces_an_agent_never_needs_are_refused(backend: SandboxBackend, task: Task) -> None:
    async with await backend.create(task) as sandbox:
        refused = dict(line.split() for line in (await run_ok(sandbox, f"python3 -c '{RAW_CALLS}'")).splitlines())
        assert await run_ok(sandbox, "git status --porcelain; echo ok") == "ok\n"  # and the rest works
    eperm = {name: code for name, code in refused.items() if code == str(errno.EPERM)}
    assert eperm == refused, refused  # on docker our filter, stacked on the engine's profile (any engine version)


async def test_a_file_read_back_is_capped(backend: SandboxBackend, task: Task) -> None:
    """What the host reads from a sandbox (a patch, a test report) stops at the caller's cap: a file the
    sandbox made larger raises FileTooLarge instead of filling the host's memory."""
    async with await backend.create(task) as sandbox:
        await run_ok(sandbox, "head -c 300000 /dev/zero > /tmp/big")
        assert len(await sandbox.get_file("/tmp/big", max_bytes=300_000)) == 300_000
        with pytest.raises(FileTooLarge, match="larger than 299999 bytes"):
            await sandbox.get_file("/tmp/big", max_bytes=299_999)
