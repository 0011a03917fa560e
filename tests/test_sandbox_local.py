"""The `local` sandbox backend on the real thing: bubblewrap as the `swe-sandbox` user, kernel overlayfs
(and the fuse-overlayfs and copy fallbacks), real git repositories. Needs root, as the backend does.

"Nothing left behind" is checked on the host: no directory, no mount in /proc/self/mountinfo, and no
process whose command line names the sandbox's directory or a test's marker."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiohttp import web
from sandbox_helpers import CALC, git, host_pids, marker, wait_for_pids

from swe_grpo.sandbox.base import WORKDIR, Mount, SandboxError
from swe_grpo.sandbox.local import CGROUP_PARENT, CowMethod, LocalBackend, LocalLimits, LocalSandbox, _Cgroup
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.tasks import Task

SANDBOX_UID = 999

TEST_CALC = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def mounted(path: Path) -> bool:
    return str(path) in Path("/proc/self/mountinfo").read_text()


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


def assert_gone(sandbox: LocalSandbox) -> None:
    assert sandbox.cgroup_dirs and not any(d.exists() for d in sandbox.cgroup_dirs)
    assert not sandbox.host_dir.exists()
    assert not mounted(sandbox.host_dir)
    assert host_pids(str(sandbox.host_dir)) == []


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Python project with a base commit and a later "fix" commit the agent must not see."""
    root = tmp_path_factory.mktemp("origin") / "calc"
    (root / "tests").mkdir(parents=True)
    (root / "calc.py").write_text(CALC)
    (root / "tests" / "test_calc.py").write_text(TEST_CALC)
    (root / "logo.bin").write_bytes(bytes(range(256)) * 4)
    git(root.parent, "init", "-q", "calc")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    (root / "calc.py").write_text(CALC + "\n\ndef sub(a, b):\n    return a - b\n")
    git(root, "commit", "-qam", "the fix")
    return root


@pytest.fixture(scope="module")
def task(repo: Path) -> Task:
    return Task(instance_id="calc", repo=str(repo), base_commit=git(repo, "rev-parse", "HEAD~1"), problem_statement="")


@pytest.fixture(scope="module")
async def backend(tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> LocalBackend:
    backend = LocalBackend(cache_dir=tmp_path_factory.mktemp("cache"), run_dir=run_dir)
    await backend.start()
    return backend


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


async def test_repo_at_base_commit_clean_and_testable(sandbox: LocalSandbox, task: Task, repo: Path) -> None:
    assert await run_ok(sandbox, "pwd") == f"{WORKDIR}\n"
    assert await run_ok(sandbox, "git rev-parse HEAD; git branch --show-current") == f"{task.base_commit}\nmain\n"
    assert await run_ok(sandbox, "git status --porcelain --untracked-files=all") == ""
    # The fix that came after the base commit is not in the sandbox's repository at all.
    future = git(repo, "rev-parse", "HEAD")
    assert (await sandbox.exec(f"git cat-file -e {future}", timeout_s=30)).exit_code != 0
    assert "1 passed" in await run_ok(sandbox, "python3 -m pytest -q -p no:cacheprovider tests")


async def test_runs_as_sandbox_user_without_host_root(sandbox: LocalSandbox) -> None:
    assert await run_ok(sandbox, "id -u; id -g -n; echo $HOME") == f"{SANDBOX_UID}\nswe-sandbox\n/tmp/home\n"
    result = await sandbox.exec("ls /root; ls /work; ls /home", timeout_s=30)
    assert result.exit_code != 0
    assert result.stdout == ""


async def test_exec_output_exit_codes_argv_and_cwd(sandbox: LocalSandbox) -> None:
    result = await sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=30)
    assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
    result = await sandbox.exec(["printf", "%s|", "a b", "$HOME"], timeout_s=30, cwd="/tmp")
    assert (result.exit_code, result.stdout) == (0, "a b|$HOME|")
    assert await run_ok(sandbox, "pwd", cwd="/tmp") == "/tmp\n"
    assert await run_ok(sandbox, r"printf 'ok\377'") == "ok\ufffd"  # undecodable bytes are replaced
    assert (await sandbox.exec("kill -9 $$", timeout_s=30)).exit_code == 128 + 9


async def test_env_reaches_the_process_but_no_argv(sandbox: LocalSandbox) -> None:
    secret = f"s3cret-{random.random()}"
    env = {"SWE_GRPO_TOKEN": secret}
    assert await run_ok(sandbox, "echo $SWE_GRPO_TOKEN", env=env) == f"{secret}\n"
    assert secret not in await run_ok(sandbox, "cat /proc/*/cmdline", env=env)
    # On the host too: no command line has it, and the process that has it in its environment runs as
    # the sandbox user.
    m = marker()
    running = asyncio.create_task(sandbox.exec(f"sleep {m}", timeout_s=60, env=env))
    (pid,) = await wait_for_pids(f"sleep\0{m}")
    assert host_pids(secret) == []
    assert secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()
    assert f"Uid:\t{SANDBOX_UID}\t{SANDBOX_UID}" in Path(f"/proc/{pid}/status").read_text()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_timeout_kills_the_whole_tree(sandbox: LocalSandbox) -> None:
    m1, m2, m3 = marker(), marker(), marker()
    command = f"echo started; setsid sleep {m1} & (setsid sleep {m2} &); sleep {m3}"
    result = await sandbox.exec(command, timeout_s=1)
    assert (result.exit_code, result.timed_out, result.stdout) == (None, True, "started\n")
    assert 1 <= result.wall_s < 5
    for m in (m1, m2, m3):
        assert host_pids(f"sleep\0{m}") == []  # already gone when exec returns: no waiting here


async def test_nothing_outlives_its_exec(sandbox: LocalSandbox) -> None:
    m1, m2 = marker(), marker()
    result = await sandbox.exec(f"setsid sleep {m1} >/dev/null 2>&1 & (sleep {m2} &); echo bye", timeout_s=30)
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "bye\n", False)
    assert result.wall_s < 5
    assert host_pids(f"sleep\0{m1}") == host_pids(f"sleep\0{m2}") == []


async def test_cancellation_kills_the_whole_tree(sandbox: LocalSandbox) -> None:
    m1, m2 = marker(), marker()
    running = asyncio.create_task(sandbox.exec(f"(setsid sleep {m1} &); sleep {m2}", timeout_s=60))
    await wait_for_pids(f"sleep\0{m1}")
    await wait_for_pids(f"sleep\0{m2}")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
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


async def test_reaches_a_server_on_host_loopback(sandbox: LocalSandbox) -> None:
    app = web.Application()

    async def pong(request: web.Request) -> web.Response:
        return web.Response(text="pong")

    app.router.add_get("/ping", pong)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        assert await run_ok(sandbox, f"curl -sS http://127.0.0.1:{port}/ping") == "pong"
        py = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/ping').read().decode())"
        assert await run_ok(sandbox, ["python3", "-c", py]) == "pong\n"
    finally:
        await runner.cleanup()


async def test_put_and_get_files(sandbox: LocalSandbox) -> None:
    blob = bytes(range(256)) * 1000
    await sandbox.put_file("/testbed/deep/new/blob.bin", blob, mode=0o755)
    await sandbox.put_file("/tmp/note.txt", b"hello\n")
    assert await sandbox.get_file("/testbed/deep/new/blob.bin") == blob
    assert await sandbox.get_file("/tmp/note.txt") == b"hello\n"
    stat = await run_ok(sandbox, "stat -c '%u %a' /testbed/deep/new/blob.bin /tmp/note.txt")
    assert stat == f"{SANDBOX_UID} 755\n{SANDBOX_UID} 644\n"
    await sandbox.put_file("/testbed/calc.py", b"x = 1\n")  # overwrite a tracked file
    assert await run_ok(sandbox, "cat calc.py") == "x = 1\n"
    with pytest.raises(SandboxError):
        await sandbox.get_file("/testbed/missing.txt")
    with pytest.raises(ValueError):
        await sandbox.put_file("relative.txt", b"")
    # A symlink the agent planted resolves inside the sandbox, never to the host's file.
    await run_ok(sandbox, "ln -s /etc/hostname /testbed/evil")
    hostname = Path("/etc/hostname").read_bytes()
    with pytest.raises(SandboxError):
        await sandbox.put_file("/testbed/evil", b"pwned")
    assert Path("/etc/hostname").read_bytes() == hostname


async def test_diff_applies_to_a_fresh_checkout(sandbox: LocalSandbox, task: Task, repo: Path, tmp_path: Path) -> None:
    assert await sandbox.diff(task.base_commit) == ""
    await run_ok(sandbox, "printf 'def add(a, b):\\n    return b + a\\n' > calc.py && mkdir -p pkg")
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


async def test_mounts_read_only_and_writable(backend: LocalBackend, task: Task, run_dir: Path) -> None:
    host = Path(tempfile.mkdtemp(prefix="mounts_", dir=run_dir.parent))
    try:
        host.chmod(0o755)
        (host / "ro").mkdir()
        (host / "ro" / "agent.js").write_text("console.log(1)\n")
        (host / "rw").mkdir()
        os.chown(host / "rw", SANDBOX_UID, -1)
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
        assert_gone(sandbox)
        assert sorted(p.name for p in (host / "ro").iterdir()) == ["agent.js"]
    finally:
        subprocess.run(["rm", "-rf", str(host)], check=True)


async def test_limits_and_output_cap(backend: LocalBackend, task: Task, run_dir: Path) -> None:
    """The limits are in place (what happens at each is tests/test_containment.py's)."""
    limits = LocalLimits(
        memory_bytes=300 << 20, pids=77, disk_bytes=50 << 20, cpu_s=7, file_size_bytes=1 << 20, output_bytes=1000
    )
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
        result = await sandbox.exec("head -c 5000 /dev/zero | tr '\\0' a; echo -n END", timeout_s=30)
        assert result.stdout == "[... 4003 bytes dropped ...]\n" + "a" * 997 + "END"
    finally:
        await sandbox.destroy()
    assert_gone(sandbox)


async def test_destroy_kills_running_execs_is_idempotent_and_leaves_nothing(backend: LocalBackend, task: Task) -> None:
    sandbox = await backend.create(task)
    m = marker()
    running = asyncio.create_task(sandbox.exec(f"setsid sleep {m} & wait", timeout_s=60))
    await wait_for_pids(f"sleep\0{m}")
    assert mounted(sandbox.host_dir)
    await asyncio.gather(sandbox.destroy(), sandbox.destroy())
    await sandbox.destroy()
    result = await running
    assert result.exit_code != 0
    assert host_pids(f"sleep\0{m}") == []
    assert_gone(sandbox)
    with pytest.raises(SandboxError):
        await sandbox.exec("true", timeout_s=30)


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
    with pytest.raises(SandboxError, match="no-such-commit"):
        await backend.create(replace(task, base_commit="no-such-commit"))
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
    cgroup = _Cgroup(layout, "swe-grpo-1-x")
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
