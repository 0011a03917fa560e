"""The sandbox backend contract, as pytest tests a user runs on their own backend: the same tests the built-in
`local`, `docker` and `hf` backends pass (tests/test_backend_contract.py runs this class on each).

Subclass `BackendContract` in a test module (its name starting with `Test`, so pytest collects it) and give it a
`target` fixture: a started backend and the facts about it the contract needs (`Target`):

    class TestMyBackend(BackendContract):
        @pytest.fixture(scope="class")
        @classmethod
        async def target(cls) -> AsyncIterator[Target]:
            backend = MyBackend()
            await backend.start()
            yield Target(name="mine", backend=backend, uid=1000, ...)
            await backend.close()

What it asserts: the repository at the base commit, clean, without the commits after it; `diff` applies to a
fresh checkout; `exec`'s output, exit codes, argv, cwd and env (never in an argv), its output cap keeping the
end, a timeout or a cancellation killing the whole process tree; files in and out (ownership, modes, a planted
symlink never reaching the host); mounts; the network (none unless asked); and that `destroy`, a failed or
cancelled `create` and `close` leave nothing behind (by the backend's own traces, `Target.leftovers`). A test
that a fact rules out skips and says which fact.

The sandbox's processes are looked for on THIS machine (`/proc`, by a unique argv): a backend whose sandboxes
run elsewhere cannot pass the process checks as they are. Sandbox commands need `sh`, `git`, `python3` with
`pytest`, `ps`, `stat`, `head` and `tr`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from swe_grpo.sandbox.base import Mount, Sandbox, SandboxBackend, SandboxError
from swe_grpo.tasks import Task
from swe_grpo.testing.sandbox_checks import CALC, calc_task, git, host_pids, make_repo, marker, wait_for_pids

__all__ = ["BackendContract", "Target", "run_ok"]


@dataclass
class Target:
    """A started backend under test and the facts about it that the contract needs."""

    name: str
    backend: SandboxBackend
    # Whom commands run as (and who owns the files `put_file` writes), as seen inside; None: a uid of each
    # sandbox's own, its `uid` attribute (in `host_uids`: `docker`, whose containers run as host uids)
    uid: int | None
    put_through_symlink_refused: bool  # `put_file` onto a planted symlink: refused (`SandboxError`), or written inside
    exec_may_raise_on_destroy: bool  # an exec that its sandbox's destroy ends may raise `SandboxError`
    gone: Callable[[Sandbox], None]  # asserts that nothing is left of this (destroyed) sandbox
    alive: Callable[[Sandbox], bool]  # whether the backend's traces of this sandbox are there
    leftovers: Callable[[], Any]  # the backend's traces of its sandboxes now: equal before and after
    new_backend: Callable[[int | None], SandboxBackend]  # a new, unstarted one; its output cap (None: the default)
    has_curl: bool = False  # the sandbox has curl (checked against a server on the host's loopback too)
    # Mounts host directories, read-only ones read-only; False: read-only ones are copies, writable ones refused
    writable_mounts: bool = True
    cuts_network: bool = True  # a sandbox created without `network=True` has no route out
    reaches_host_loopback: bool = True  # with `network=True`, a server on the host's 127.0.0.1 is reachable
    close_destroys_live: bool = True  # `close()` destroys its sandboxes still alive (its set `live` is then empty)
    # The host uids its commands run as, when not `uid`: a uid of its own per sandbox (`local`, `docker`)
    host_uids: range | None = None


async def run_ok(sandbox: Sandbox, command: str | list[str], **kwargs: Any) -> str:
    """`command`'s stdout, asserting that it exited 0."""
    result = await sandbox.exec(command, timeout_s=30, **kwargs)
    assert result.exit_code == 0, result
    return result.stdout


@contextlib.asynccontextmanager
async def _started(backend: SandboxBackend) -> AsyncIterator[SandboxBackend]:
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


def _unless(fact: bool, target: Target, why: str) -> None:
    if not fact:
        pytest.skip(f"{target.name}: {why}")


class BackendContract:
    """The contract's tests (see the module docstring). A subclass gives the `target` fixture."""

    @pytest.fixture(scope="class")
    @classmethod
    def target(cls) -> Target:
        raise NotImplementedError(f"{cls.__name__} gives no `target` fixture: its backend and the facts about it")

    @pytest.fixture(scope="class")
    @classmethod
    def repo(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        return make_repo(tmp_path_factory.mktemp("origin"), with_tests=True)

    @pytest.fixture(scope="class")
    @classmethod
    def task(cls, repo: Path) -> Task:
        return calc_task(repo)

    @pytest.fixture
    async def sandbox(self, target: Target, task: Task) -> AsyncIterator[Sandbox]:
        sandbox = await target.backend.create(task)
        try:
            yield sandbox
        finally:
            await sandbox.destroy()
        target.gone(sandbox)

    # --- the repository ---------------------------------------------------------------------------------

    async def test_repo_at_base_commit_clean_testable_without_the_future(
        self, sandbox: Sandbox, task: Task, repo: Path
    ) -> None:
        assert await run_ok(sandbox, "pwd") == "/testbed\n"
        assert await run_ok(sandbox, "git rev-parse HEAD; git branch --show-current") == f"{task.base_commit}\nmain\n"
        assert await run_ok(sandbox, "git status --porcelain --untracked-files=all; git remote") == ""
        assert await run_ok(sandbox, "cat calc.py") == CALC
        # The fix that came after the base commit is not in the sandbox's repository at all.
        assert await run_ok(sandbox, "git log --all --format=%H") == f"{task.base_commit}\n"
        future = git(repo, "rev-parse", "HEAD")
        assert (await sandbox.exec(f"git cat-file -e {future}", timeout_s=30)).exit_code != 0
        assert "1 passed" in await run_ok(sandbox, "python3 -m pytest -q -p no:cacheprovider tests")

    async def test_diff_applies_to_a_fresh_checkout(
        self, sandbox: Sandbox, task: Task, repo: Path, tmp_path: Path
    ) -> None:
        assert await sandbox.diff(task.base_commit) == ""
        await run_ok(sandbox, "printf 'def add(a, b):\\n    return b + a\\n' > calc.py && rm old.txt && mkdir -p pkg")
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

    # --- exec ---------------------------------------------------------------------------------------------

    async def test_exec_output_exit_codes_argv_and_cwd(self, sandbox: Sandbox) -> None:
        result = await sandbox.exec("echo out; echo err >&2; exit 3", timeout_s=30)
        assert (result.exit_code, result.stdout, result.stderr, result.timed_out) == (3, "out\n", "err\n", False)
        result = await sandbox.exec(["printf", "%s|", "a b", "$HOME"], timeout_s=30, cwd="/tmp")
        assert (result.exit_code, result.stdout) == (0, "a b|$HOME|")
        argv = ["python3", "-c", "import sys; print(sys.argv[1:])", "a b", "$HOME", "'"]
        assert await run_ok(sandbox, argv) == "['a b', '$HOME', \"'\"]\n"
        assert await run_ok(sandbox, "pwd", cwd="/tmp") == "/tmp\n"
        assert await run_ok(sandbox, r"printf 'ok\377'") == "ok\ufffd"  # undecodable bytes are replaced
        assert (await sandbox.exec("kill -9 $$", timeout_s=30)).exit_code == 128 + 9
        assert (await sandbox.exec("no-such-command", timeout_s=30)).exit_code == 127
        result = await sandbox.exec(["no-such-binary"], timeout_s=30)
        assert result.exit_code not in (0, None)

    async def test_env_reaches_the_process_but_no_argv(self, sandbox: Sandbox, target: Target) -> None:
        secret = f"s3cret-{random.random()}"
        env = {"SWE_GRPO_TOKEN": secret}
        assert await run_ok(sandbox, "echo $SWE_GRPO_TOKEN", env=env) == f"{secret}\n"
        assert secret not in await run_ok(sandbox, "cat /proc/*/cmdline", env=env)
        # On the host too: no command line has it, and the process that has it in its environment runs as
        # the sandbox's user.
        m = marker()
        running = asyncio.create_task(sandbox.exec(f"sleep {m}", timeout_s=60, env=env))
        (pid,) = await wait_for_pids(f"sleep\0{m}")
        assert host_pids(secret) == []
        assert secret.encode() in Path(f"/proc/{pid}/environ").read_bytes()
        uids = next(
            line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")
        )
        assert len(set(uids)) == 1 and int(uids[0]) in (target.host_uids or [target.uid]), uids
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running

    async def test_output_cap_keeps_the_end(self, target: Target, task: Task) -> None:
        async with _started(target.new_backend(1000)) as backend:
            sandbox = await backend.create(task)
            try:
                result = await sandbox.exec("head -c 5000000 /dev/zero | tr '\\0' a; echo -n END", timeout_s=60)
                assert result.stdout == "[... 4999003 bytes dropped ...]\n" + "a" * 997 + "END"
            finally:
                await sandbox.destroy()
        target.gone(sandbox)

    async def test_timeout_kills_the_whole_tree(self, sandbox: Sandbox) -> None:
        m1, m2, m3 = marker(), marker(), marker()
        command = f"echo started; setsid sleep {m1} & (setsid sleep {m2} &); sleep {m3}"
        result = await sandbox.exec(command, timeout_s=1)
        assert (result.exit_code, result.timed_out, result.stdout) == (None, True, "started\n")
        assert 1 <= result.wall_s < 5
        for m in (m1, m2, m3):
            assert host_pids(f"sleep\0{m}") == []  # already gone when exec returns: no waiting here
        assert m1 not in await run_ok(sandbox, ["ps", "-eo", "args"])  # and the sandbox still works

    async def test_cancellation_kills_the_whole_tree(self, sandbox: Sandbox) -> None:
        m1, m2 = marker(), marker()
        running = asyncio.create_task(sandbox.exec(f"(setsid sleep {m1} &); sleep {m2}", timeout_s=60))
        await wait_for_pids(f"sleep\0{m1}")
        await wait_for_pids(f"sleep\0{m2}")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert host_pids(f"sleep\0{m1}") == host_pids(f"sleep\0{m2}") == []
        assert m1 not in await run_ok(sandbox, ["ps", "-eo", "args"])

    # --- files --------------------------------------------------------------------------------------------

    async def test_put_and_get_files(self, sandbox: Sandbox, target: Target) -> None:
        blob = bytes(range(256)) * 1000
        await sandbox.put_file("/testbed/deep/new/blob.bin", blob, mode=0o755)
        await sandbox.put_file("/tmp/note.txt", b"hello\n")
        assert await sandbox.get_file("/testbed/deep/new/blob.bin") == blob
        assert await sandbox.get_file("/tmp/note.txt") == b"hello\n"
        stat = await run_ok(sandbox, "stat -c '%u %a' /testbed/deep /testbed/deep/new/blob.bin /tmp/note.txt")
        uid = target.uid if target.uid is not None else sandbox.uid  # type: ignore[attr-defined]
        assert stat == f"{uid} 755\n{uid} 755\n{uid} 644\n"
        await sandbox.put_file("/testbed/calc.py", b"x = 1\n")  # overwrite a tracked file
        assert await run_ok(sandbox, "cat calc.py") == "x = 1\n"
        with pytest.raises(SandboxError):
            await sandbox.get_file("/testbed/missing.txt")
        with pytest.raises(ValueError):
            await sandbox.put_file("relative.txt", b"")
        # A symlink the agent planted resolves inside the sandbox (or is refused), never to the host's file.
        await run_ok(sandbox, "ln -s /etc/hostname /testbed/evil")
        hostname = Path("/etc/hostname").read_bytes()
        try:
            await sandbox.put_file("/testbed/evil", b"pwned")
            refused = False
        except SandboxError:
            refused = True
        assert refused == target.put_through_symlink_refused
        assert Path("/etc/hostname").read_bytes() == hostname

    async def test_mounts_read_only_and_writable(self, target: Target, task: Task) -> None:
        host = Path(tempfile.mkdtemp(prefix="swe_grpo_mounts_"))  # in /tmp: a sandbox user other than root reaches it
        try:
            host.chmod(0o755)
            (host / "ro").mkdir()
            (host / "ro" / "agent.js").write_text("console.log(1)\n")
            (host / "rw").mkdir()
            if target.uid is not None:
                os.chown(host / "rw", target.uid, target.uid)
            else:  # whose it is is known only once created: the uid leased for it
                (host / "rw").chmod(0o777)
            ro, rw = Mount(host / "ro", "/opt/agent"), Mount(host / "rw", "/opt/out", writable=True)
            if not target.writable_mounts:
                before = target.leftovers()
                with pytest.raises(SandboxError, match="writable"):
                    await target.backend.create(task, [rw])
                assert target.leftovers() == before
            sandbox = await target.backend.create(task, [ro, rw] if target.writable_mounts else [ro])
            try:
                assert await run_ok(sandbox, "cat /opt/agent/agent.js") == "console.log(1)\n"
                if target.writable_mounts:  # an uploaded copy may be writable; a mount of the host's never
                    result = await sandbox.exec("touch /opt/agent/x", timeout_s=30)
                    assert result.exit_code != 0 and "Read-only file system" in result.stderr
                    await run_ok(sandbox, "echo result > /opt/out/r.txt")
                    assert (host / "rw" / "r.txt").read_text() == "result\n"
            finally:
                await sandbox.destroy()
            target.gone(sandbox)
            assert sorted(p.name for p in (host / "ro").iterdir()) == ["agent.js"]
        finally:
            shutil.rmtree(host)

    # --- network ------------------------------------------------------------------------------------------

    async def test_reaches_a_server_on_host_loopback_when_asked(self, target: Target, task: Task) -> None:
        _unless(target.reaches_host_loopback, target, "its sandboxes do not share this host's loopback")
        app = web.Application()

        async def pong(request: web.Request) -> web.Response:
            return web.Response(text="pong")

        app.router.add_get("/ping", pong)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        sandbox = await target.backend.create(task, network=True)
        try:
            port = runner.addresses[0][1]
            if target.has_curl:
                assert await run_ok(sandbox, f"curl -sS http://127.0.0.1:{port}/ping") == "pong"
            py = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/ping').read().decode())"
            assert await run_ok(sandbox, ["python3", "-c", py]) == "pong\n"
        finally:
            await sandbox.destroy()
            await runner.cleanup()
        target.gone(sandbox)

    @pytest.mark.parametrize("network", [{}, {"network": False}], ids=["default", "network=False"])
    async def test_no_network_unless_asked(self, target: Target, task: Task, network: dict[str, bool]) -> None:
        """A sandbox created without `network=True` has no route out: only a loopback interface, no IPv4
        route at all (so no default route) and IPv6 routes on the loopback only. Read from /proc inside it;
        nothing is sent anywhere."""
        _unless(target.cuts_network, target, "it cannot cut a sandbox's network (cuts_network=False)")
        sandbox = await target.backend.create(task, **network)
        try:
            interfaces = await run_ok(sandbox, "tail -n +3 /proc/net/dev | cut -d: -f1")
            assert interfaces.split() == ["lo"]
            routes = (await run_ok(sandbox, "cat /proc/net/route")).splitlines()
            assert routes[1:] == [], routes  # the header only
            ipv6 = await run_ok(sandbox, "cat /proc/net/ipv6_route 2>/dev/null; true")
            assert {line.split()[-1] for line in ipv6.splitlines()} <= {"lo"}, ipv6
        finally:
            await sandbox.destroy()
        target.gone(sandbox)

    # --- life cycle ---------------------------------------------------------------------------------------

    async def test_destroy_kills_running_execs_is_idempotent_and_leaves_nothing(
        self, target: Target, task: Task
    ) -> None:
        sandbox = await target.backend.create(task)
        m = marker()
        running = asyncio.create_task(sandbox.exec(f"setsid sleep {m} & wait", timeout_s=60))
        await wait_for_pids(f"sleep\0{m}")
        assert target.alive(sandbox)
        await asyncio.gather(sandbox.destroy(), sandbox.destroy())
        await sandbox.destroy()
        # Its sandbox vanished under it: killed, or (where it may race the removal) an infrastructure error.
        with contextlib.suppress(*([SandboxError] if target.exec_may_raise_on_destroy else [])):
            assert (await running).exit_code != 0
        assert host_pids(f"sleep\0{m}") == []
        target.gone(sandbox)
        with pytest.raises(SandboxError):
            await sandbox.exec("true", timeout_s=30)

    async def test_an_unknown_base_commit_raises_and_leaves_nothing(self, target: Target, task: Task) -> None:
        before = target.leftovers()
        with pytest.raises(SandboxError, match="no-such-commit"):
            await target.backend.create(replace(task, base_commit="no-such-commit"))
        assert target.leftovers() == before

    async def test_a_cancelled_create_leaves_nothing(self, target: Target, task: Task) -> None:
        await (await target.backend.create(task)).destroy()  # what is prepared once exists: create is quick
        before = target.leftovers()
        for delay in (0.0, 0.01, 0.05, 0.1, 0.2, 0.3):
            creating = asyncio.create_task(target.backend.create(task))
            await asyncio.sleep(delay)
            creating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await (await creating).destroy()  # it won the race: it finished before the cancellation
            assert target.leftovers() == before, delay

    async def test_close_returns_once_every_destroy_begun_has_ended(self, target: Target, task: Task) -> None:
        # A rollout cancelled twice (its group's and the stop's) leaves its destroy() midway; the teardown goes
        # on, and `close()` (the last thing a worker awaits before its event loop ends) waits for it.
        async with _started(target.new_backend(None)) as backend:
            sandbox = await backend.create(task)
            destroying = asyncio.create_task(sandbox.destroy())
            await asyncio.sleep(0)  # the teardown has begun
            destroying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await destroying
        target.gone(sandbox)

    async def test_close_destroys_live_sandboxes(self, target: Target, task: Task) -> None:
        _unless(target.close_destroys_live, target, "its sandboxes are their owners' to destroy, not close()'s")
        async with _started(target.new_backend(None)) as backend:
            sandboxes = await asyncio.gather(backend.create(task), backend.create(task))
            assert all(target.alive(sandbox) for sandbox in sandboxes)
        assert backend.live == set()  # type: ignore[attr-defined]
        for sandbox in sandboxes:
            target.gone(sandbox)
