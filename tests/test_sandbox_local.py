"""The `local` sandbox backend's own behaviour on the real thing: bubblewrap as the `swe-sandbox` user,
kernel overlayfs (and the fuse-overlayfs and copy fallbacks), cgroups, real git repositories. Needs
root, as the backend does. What every backend promises (exec, files, diff, timeouts, destroy, network
off unless asked, ...) is tests/test_backend_contract.py's, which runs on `local` too.

"Nothing left behind" is checked on the host: no directory, no mount in /proc/self/mountinfo, and no
process whose command line names the sandbox's directory or a test's marker."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from sandbox_helpers import CALC, calc_task, git, host_pids, make_repo, marker, mounted, wait_for_pids
from sandbox_helpers import assert_local_sandbox_gone as assert_gone

from swe_grpo.sandbox.base import Mount, SandboxError
from swe_grpo.sandbox.local import CGROUP_PARENT, Cgroup, CowMethod, LocalBackend, LocalLimits, LocalSandbox
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.tasks import Task

SANDBOX_UID = 999


def tree_digest(root: Path) -> str:
    """Paths, modes and contents of everything under `root` (symlinks not followed)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath, name)
            st = path.lstat()
            h.update(f"{path.relative_to(root)}\0{st.st_mode}\0{st.st_uid}\0".encode())
            h.update(os.readlink(path).encode() if path.is_symlink() else path.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Python project (with a test) with a base commit and a later "fix" the agent must not see."""
    return make_repo(tmp_path_factory.mktemp("origin"), with_tests=True)


@pytest.fixture(scope="module")
def task(repo: Path) -> Task:
    return calc_task(repo)


@pytest.fixture(scope="module")
def backend(local_backend: LocalBackend) -> LocalBackend:
    """This module's tests run on `local` only (conftest's `backend` runs a test on `docker` too)."""
    return local_backend


@pytest.fixture
async def sandbox(backend: LocalBackend, task: Task) -> AsyncIterator[LocalSandbox]:
    sandbox = await backend.create(task)
    try:
        yield sandbox
    finally:
        await sandbox.destroy()
    assert_gone(sandbox)


async def run_ok(
    sandbox: LocalSandbox, command: str | list[str], *, env: dict[str, str] | None = None, cwd: str | None = None
) -> str:
    result = await sandbox.exec(command, timeout_s=30, env=env, cwd=cwd)
    assert result.exit_code == 0, result
    return result.stdout


async def test_detects_kernel_overlay(backend: LocalBackend) -> None:
    assert backend.method == "overlay"  # root on this box may mount overlayfs


async def test_runs_as_sandbox_user_without_host_root(sandbox: LocalSandbox) -> None:
    assert await run_ok(sandbox, "id -u; id -g -n; echo $HOME") == f"{SANDBOX_UID}\nswe-sandbox\n/tmp/home\n"
    result = await sandbox.exec("ls /root; ls /work; ls /home", timeout_s=30)
    assert result.exit_code != 0
    assert result.stdout == ""


async def test_nothing_outlives_its_exec(sandbox: LocalSandbox) -> None:
    """`local` only: on `docker` and `hf` a background child outlives its exec (their sandbox's destroy
    ends it; a timeout or cancellation kills the whole tree on every backend, tests/test_backend_contract.py)."""
    m1, m2 = marker(), marker()
    result = await sandbox.exec(f"setsid sleep {m1} >/dev/null 2>&1 & (sleep {m2} &); echo bye", timeout_s=30)
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "bye\n", False)
    assert result.wall_s < 5
    assert host_pids(f"sleep\0{m1}") == host_pids(f"sleep\0{m2}") == []


async def test_writes_touch_neither_the_cache_nor_the_origin(
    sandbox: LocalSandbox, backend: LocalBackend, repo: Path
) -> None:
    before = tree_digest(backend.cache_dir), tree_digest(repo)
    await run_ok(sandbox, "echo broken > calc.py && rm tests/test_calc.py && echo new > new.txt && git add -A")
    await run_ok(sandbox, "git -c user.name=a -c user.email=a@a commit -qm agent && chmod 600 logo.bin")
    assert await run_ok(sandbox, "cat calc.py new.txt") == "broken\nnew\n"
    assert (tree_digest(backend.cache_dir), tree_digest(repo)) == before


async def test_two_sandboxes_of_a_task_are_isolated(backend: LocalBackend, task: Task) -> None:
    a, b = await asyncio.gather(backend.create(task), backend.create(task))
    try:
        await run_ok(a, "echo a > /testbed/calc.py && echo a > /tmp/only_a")
        assert await run_ok(b, "cat /testbed/calc.py; ls /tmp") == CALC + "home\n"
        m = marker()
        running = asyncio.create_task(a.exec(f"sleep {m}", timeout_s=60))
        await wait_for_pids(f"sleep\0{m}")
        assert m not in await run_ok(b, "ps -eo args")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
    finally:
        await asyncio.gather(a.destroy(), b.destroy())
    assert_gone(a)
    assert_gone(b)


async def test_limits_are_in_place(backend: LocalBackend, task: Task, run_dir: Path) -> None:
    """The limits are in place (what happens at each is tests/test_containment.py's; the output cap is
    tests/test_backend_contract.py's)."""
    limits = LocalLimits(memory_bytes=300 << 20, pids=77, disk_bytes=50 << 20, cpu_s=7, file_size_bytes=1 << 20)
    limited = LocalBackend(limits=limits, cache_dir=backend.cache_dir, run_dir=run_dir, method=backend.method)
    sandbox = await limited.create(task)
    try:
        # The defaults of the limits not set here: 1,024 open files, 2 cores' worth of CPU time.
        assert await run_ok(sandbox, "ulimit -t; ulimit -f; ulimit -n") == "7\n1024\n1024\n"
        layout, name = CgroupLayout.detect(), sandbox.host_dir.name
        memory, pids = layout.memory / CGROUP_PARENT / name, layout.pids / CGROUP_PARENT / name
        assert layout.cpu is not None
        cpu = layout.cpu / CGROUP_PARENT / name
        assert sorted({memory, pids, cpu}) == sandbox.cgroup_dirs
        quota = "cpu.cfs_quota_us" if layout.version == 1 else "cpu.max"
        assert (cpu / quota).read_text().split()[0] == "200000"
        limit = "memory.limit_in_bytes" if layout.version == 1 else "memory.max"
        assert (memory / limit).read_text() == f"{300 << 20}\n"
        assert (pids / "pids.max").read_text() == "77\n"
        inside = await run_ok(sandbox, "cat /proc/self/cgroup")
        for controller in ["memory", "pids"] if layout.version == 1 else [""]:
            assert f":{controller}:/{CGROUP_PARENT}/{name}\n" in inside
        # /tmp and /testbed's upper layer share one 50 MiB tmpfs.
        assert (await run_ok(sandbox, "df -B1M --output=size,fstype /tmp")).split()[-2:] == ["50", "tmpfs"]
        result = await sandbox.exec("head -c 2000000 /dev/zero > /tmp/big", timeout_s=30)
        assert result.exit_code == 128 + 25  # SIGXFSZ
        assert await run_ok(sandbox, "stat -c %s /tmp/big") == f"{1 << 20}\n"
    finally:
        await sandbox.destroy()
    assert_gone(sandbox)


@pytest.mark.parametrize(
    ("repo_spec", "message"),
    [
        ("/nonexistent/swe-grpo/repo", "does not exist"),
        ("swe-grpo-tests/no-such-repo", "github"),
        ("not a repo", "neither"),
    ],
)
async def test_unusable_repo_raises_and_leaves_nothing(
    backend: LocalBackend, task: Task, run_dir: Path, repo_spec: str, message: str
) -> None:
    before = sorted(backend.cache_dir.iterdir())
    with pytest.raises(SandboxError, match=f"(?i){message}"):
        await backend.create(replace(task, repo=repo_spec))
    assert list(run_dir.iterdir()) == []
    assert sorted(p for p in backend.cache_dir.iterdir() if not p.name.endswith(".lock")) == [
        p for p in before if not p.name.endswith(".lock")
    ]


async def test_failed_create_leaves_nothing(backend: LocalBackend, task: Task, run_dir: Path, tmp_path: Path) -> None:
    # tmp_path's parents are private to root: bwrap, running as the sandbox user, could not bind it.
    private = next(p for p in reversed(tmp_path.parents) if not p.stat().st_mode & 0o001)
    with pytest.raises(SandboxError, match=rf"cannot reach {tmp_path}: {private} is mode 700; `chmod o\+x {private}`"):
        await backend.create(task, [Mount(tmp_path, "/opt/agent")])
    with pytest.raises(SandboxError, match="bwrap failed"):  # no mount point can be made in the read-only /usr
        await backend.create(task, [Mount(Path("/usr/bin"), "/usr/swe-grpo-agent")])
    # (An unknown base commit: tests/test_backend_contract.py.)
    assert list(run_dir.iterdir()) == []
    assert not mounted(run_dir)


async def test_concurrent_creates_fill_the_cache_once(task: Task, run_dir: Path, tmp_path: Path) -> None:
    backend = LocalBackend(cache_dir=tmp_path / "cache", run_dir=run_dir)
    sandboxes = await asyncio.gather(*(backend.create(task) for _ in range(4)))
    try:
        for sandbox in sandboxes:
            assert await run_ok(sandbox, "git rev-parse HEAD; git status --porcelain") == f"{task.base_commit}\n"
        entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
        assert len(entries) == 2 and entries[1] == entries[0] + ".lock", entries  # one checkout, no temp dirs
    finally:
        await asyncio.gather(*(s.destroy() for s in sandboxes))
    for sandbox in sandboxes:
        assert_gone(sandbox)


async def test_bundle_repo(backend: LocalBackend, task: Task, repo: Path, tmp_path: Path) -> None:
    bundle = tmp_path / "calc.bundle"
    git(repo, "bundle", "create", str(bundle), "--all")
    sandbox = await backend.create(replace(task, repo=str(bundle)))
    try:
        assert await run_ok(sandbox, "git rev-parse HEAD; git status --porcelain") == f"{task.base_commit}\n"
        # The bundle carried the later commit too; the checkout must not.
        assert (await sandbox.exec(f"git cat-file -e {git(repo, 'rev-parse', 'HEAD')}", timeout_s=30)).exit_code != 0
    finally:
        await sandbox.destroy()
    assert_gone(sandbox)


@pytest.mark.parametrize("method", ["fuse-overlayfs", "copy"])
async def test_fallback_methods(method: CowMethod, backend: LocalBackend, task: Task, run_dir: Path) -> None:
    fallback = LocalBackend(cache_dir=backend.cache_dir, run_dir=run_dir, method=method)
    before = tree_digest(backend.cache_dir)
    sandbox = await fallback.create(task)
    try:
        assert await run_ok(sandbox, "git status --porcelain; id -u") == f"{SANDBOX_UID}\n"
        await run_ok(sandbox, "echo changed > calc.py && echo new > new.py")
        patch = await sandbox.diff(task.base_commit)
        assert "+changed" in patch and "+new" in patch
        assert tree_digest(backend.cache_dir) == before
    finally:
        await sandbox.destroy()
    assert_gone(sandbox)


async def test_start_reaps_leftovers_of_dead_processes_only(backend: LocalBackend, task: Task, run_dir: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = run_dir / f"swe-grpo-{dead.pid}-crashed"
    for sub in ("lower", "upper", "work", "testbed"):
        (leftover / sub).mkdir(parents=True)
    opts = f"lowerdir={leftover}/lower,upperdir={leftover}/upper,workdir={leftover}/work"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(leftover / "testbed")], check=True)
    layout = CgroupLayout.detect()
    crashed_cgroups = [root / CGROUP_PARENT / leftover.name for root in {layout.memory, layout.pids}]
    for cgroup in crashed_cgroups:
        cgroup.mkdir()
    live = await backend.create(task)
    try:
        await backend.start()
        assert not leftover.exists() and not mounted(leftover)
        assert not any(cgroup.exists() for cgroup in crashed_cgroups)
        assert all(d.is_dir() for d in live.cgroup_dirs)
        assert await run_ok(live, "git rev-parse HEAD") == f"{task.base_commit}\n"
    finally:
        await live.destroy()
    assert_gone(live)


async def test_start_refuses_a_run_dir_the_sandbox_user_cannot_reach(backend: LocalBackend, run_dir: Path) -> None:
    private = Path(tempfile.mkdtemp(prefix="private_", dir=run_dir.parent))  # 0700, in a traversable directory
    try:
        (private / "runs").mkdir()
        unreachable = LocalBackend(cache_dir=backend.cache_dir, run_dir=private / "runs", method=backend.method)
        with pytest.raises(SandboxError, match=f"cannot reach {private}/runs: {private} is mode 700"):
            await unreachable.start()
    finally:
        shutil.rmtree(private)


def test_cgroup_v2_files_read_and_written(tmp_path: Path) -> None:
    """cgroup v2 cannot run here with controllers (every one is bound to a v1 hierarchy), so this one test
    uses a FAKE v2 hierarchy, a plain directory: it checks which files the code reads and writes for v2,
    not what the kernel does with them (tests/test_containment.py does that, on v1)."""
    root = tmp_path / "unified"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids\n")
    hybrid = "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    layout = CgroupLayout.parse(hybrid + f"35 31 0:34 / {root} rw - cgroup2 cgroup2 rw,nsdelegate\n")
    assert layout == CgroupLayout(2, root, root, root)
    cgroup = Cgroup(layout, "swe-grpo-1-x")
    (root / CGROUP_PARENT).mkdir()
    cgroup.make(LocalLimits(memory_bytes=300 << 20, pids=77, cpus=1.5))
    assert cgroup.dirs == [root / CGROUP_PARENT / "swe-grpo-1-x"]
    files = {f.name: f.read_text() for f in cgroup.dirs[0].iterdir()}
    # The kernel would have made memory.swap.max; the fake has none, and that file alone may be missing.
    assert files == {"memory.max": str(300 << 20), "pids.max": "77", "cpu.max": "150000 100000"}
    (cgroup.dirs[0] / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 0\noom_kill 0\n")
    (cgroup.dirs[0] / "pids.events").write_text("max 0\n")
    assert cgroup.exhausted() is None
    (cgroup.dirs[0] / "pids.events").write_text("max 2\n")
    assert cgroup.exhausted() == "pids"
    (cgroup.dirs[0] / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert cgroup.exhausted() == "memory"
    with pytest.raises(SandboxError, match="no memory and pids cgroup controllers"):
        CgroupLayout.parse(hybrid)


# Trees an unprivileged agent can leave, run in /testbed (the overlay's upper directory) and /tmp: a chain twice as
# deep as Python's recursion limit (the 5,000 levels failed the same way), a chain of names of the
# filesystem's maximum length (a path far past PATH_MAX), directories of mode 000 (the agent's own, under a mode-000
# /testbed root).
AGENT_TREES = {
    "deep-chain": "import os\nfor _ in range(2000): os.mkdir('d'); os.chdir('d')",
    "long-names": "import os\nfor _ in range(300): os.mkdir('x' * 255); os.chdir('x' * 255)",
    "mode-000": "import os\nos.makedirs('a/b/c')\nopen('a/b/c/f', 'w').close()\n"
    "for d in ('a/b/c', 'a/b', 'a', '.'): os.chmod(d, 0)",
}


@pytest.mark.parametrize("disk", ["tmpfs", "no-tmpfs"])
@pytest.mark.parametrize("tree", AGENT_TREES)
async def test_destroy_removes_any_tree_the_agent_can_make(
    backend: LocalBackend, task: Task, run_dir: Path, tree: str, disk: str
) -> None:
    """Without the disk tmpfs the tree is on the host's filesystem: a deep chain made `destroy()` raise
    RecursionError (shutil.rmtree recursed once per level) and left the directory behind."""
    limits = backend.limits if disk == "tmpfs" else replace(backend.limits, disk_bytes=None)
    own = LocalBackend(limits=limits, cache_dir=backend.cache_dir, run_dir=run_dir)
    sandbox = await own.create(task)
    try:
        script = AGENT_TREES[tree]
        await run_ok(sandbox, ["python3", "-c", script], cwd="/testbed")
        await run_ok(sandbox, ["python3", "-c", script], cwd="/tmp")
    finally:
        await sandbox.destroy()
    assert_gone(sandbox)


async def test_the_reaper_removes_any_tree_and_never_fails_the_next_start(
    backend: LocalBackend, task: Task, run_dir: Path
) -> None:
    """A dead run's sandbox directory holding a deep chain made `start()` raise RecursionError in the reaper. What
    it cannot remove at all (here an immutable file, which only root can make) is logged and counted, and the start
    goes on."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    deep, stuck = run_dir / f"swe-grpo-{dead.pid}-deep", run_dir / f"swe-grpo-{dead.pid}-stuck"
    deep.mkdir()
    subprocess.run(["python3", "-c", AGENT_TREES["deep-chain"]], cwd=deep, check=True)
    (stuck / "sub").mkdir(parents=True)
    (stuck / "sub" / "immutable").touch()
    subprocess.run(["chattr", "+i", str(stuck / "sub" / "immutable")], check=True)
    try:
        await backend.start()
        assert not deep.exists()
        assert stuck.exists() and backend.unreaped == [str(stuck)]
        sandbox = await backend.create(task)  # the backend works on
        await sandbox.destroy()
    finally:
        subprocess.run(["chattr", "-i", str(stuck / "sub" / "immutable")], check=True)
        shutil.rmtree(stuck)
    await backend.start()
    assert backend.unreaped == []
