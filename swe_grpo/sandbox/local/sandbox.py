"""`LocalSandbox`: a `local` sandbox, made by `LocalBackend.create` (`backend.py`).

Every `exec` is one bubblewrap run (`bwrap.py`). State survives between execs only in `/testbed`, `/tmp` and
writable mounts; processes never do: when a command ends or is killed, its pid namespace, and with it every
process it started, is gone, before `exec` returns or raises. `exhausted()` tells which limit
(`limits.py`) a sandbox hit: "memory" (an OOM kill in its cgroup), "pids" (a fork refused at its limit),
both from kernel counters that never go down, or "disk" (its tmpfs found full, of blocks or inodes, after an
exec or when asked: a command that fills it and deletes its files before returning goes unseen, and harmed
no other sandbox). `destroy()` leaves nothing: no process, mount, cgroup or host directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from swe_grpo.sandbox.base import WORKDIR, ExecResult, Exhaustion, FileTooLarge, Sandbox, SandboxError
from swe_grpo.sandbox.local.bwrap import REAPER, BwrapRun
from swe_grpo.sandbox.local.host import mounts_under, remove_tree, umount, wait_or_kill
from swe_grpo.sandbox.local.limits import Cgroup, LocalLimits
from swe_grpo.sandbox.process import OutputTail
from swe_grpo.sandbox.seccomp import filter_fd
from swe_grpo.sandbox.uids import UidLease

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HOME = "/tmp/home"


class LocalSandbox(Sandbox):
    """A sandbox made by `LocalBackend`. `host_dir` is where it lives on the host (for diagnostics), and
    `cgroup_dirs` its cgroup; both are gone after `destroy()`. `uid` is the host uid its processes run as,
    its alone until `destroy()` releases it. `fuse` is the fuse-overlayfs daemon serving its /testbed (None
    with the other copy-on-write methods), which `destroy()` waits for."""

    def __init__(
        self,
        host_dir: Path,
        bwrap_argv: list[str],
        limits: LocalLimits,
        cgroup: Cgroup | None,
        lease: UidLease,
        teardowns: set[asyncio.Future[None]],
    ) -> None:
        self.host_dir = host_dir
        self.uid = lease.uid
        self._lease = lease
        self.cgroup_dirs = cgroup.dirs if cgroup is not None else []
        self._argv = bwrap_argv
        self._limits = limits
        self._cgroup = cgroup
        self._exhaustion: Exhaustion | None = None
        self._runs: set[BwrapRun] = set()
        self.fuse: asyncio.subprocess.Process | None = None
        self._teardown: asyncio.Future[None] | None = None
        self._teardowns = teardowns  # the backend's: its close() waits for them

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run `command` (a string runs with `bash -c`: a login shell would reset PATH from
        /etc/profile) as the sandbox user, stdin closed. Returns after the command's whole process
        tree is gone; on timeout (`exit_code` None) or cancellation it is killed first."""
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        code, out, err, timed_out, wall_s = await self._run(
            argv, timeout_s=timeout_s, env=env, cwd=cwd or WORKDIR, cap=self._limits.output_bytes
        )
        return ExecResult(None if timed_out else code, out.text(), err.text(), timed_out, wall_s)

    async def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Written from inside by the sandbox user (so it owns the file, and symlinks resolve inside
        the sandbox, never on the host)."""
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" -- "$1"'
        code, _, err, _, _ = await self._run(
            ["sh", "-c", script, "put_file", _absolute(path), f"{mode:o}"], timeout_s=60, cwd="/", stdin=data
        )
        if code != 0:
            raise SandboxError(f"cannot write {path} in the sandbox: {err.text()[-500:]}")

    async def get_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        bounded = [] if max_bytes is None else ["head", "-c", str(max_bytes + 1)]
        code, out, err, _, _ = await self._run([*(bounded or ["cat"]), "--", _absolute(path)], timeout_s=60, cwd="/")
        if code != 0:
            raise SandboxError(f"cannot read {path} in the sandbox: {err.text()[-500:]}")
        if max_bytes is not None and len(out.data) > max_bytes:
            raise FileTooLarge(path, max_bytes)
        return bytes(out.data)

    async def exhausted(self) -> Exhaustion | None:
        self._observe()
        return self._exhaustion

    def _observe(self) -> None:
        """Record the first limit found hit: the cgroup's counters, then a full tmpfs. (Once destroyed,
        neither exists any more: what was recorded stays.)"""
        with contextlib.suppress(FileNotFoundError):
            if self._exhaustion is None and self._cgroup is not None:
                self._exhaustion = self._cgroup.exhausted()
            if self._exhaustion is None and self._limits.disk_bytes is not None and os.path.ismount(self.host_dir):
                fs = os.statvfs(self.host_dir)
                if fs.f_bavail == 0 or fs.f_favail == 0:
                    self._exhaustion = "disk"

    async def destroy(self) -> None:
        """Kills every running exec, unmounts, removes `host_dir` and the cgroup. Concurrent and repeated calls share
        one teardown, which a cancelled caller does not interrupt (the backend's `close()` waits for it). Raises
        `SandboxError` when something could not be removed."""
        if self._teardown is None:
            self._teardown = asyncio.ensure_future(self._tear_down())
            self._teardowns.add(self._teardown)
            self._teardown.add_done_callback(self._teardowns.discard)
        await asyncio.shield(self._teardown)

    async def _tear_down(self) -> None:
        # Go on when a run could not be ended: the mount and directories must go regardless. The uid is
        # released whatever fails: when a run could not be ended, its next lease kills what is left first.
        ended = await asyncio.gather(*(run.end() for run in list(self._runs)), return_exceptions=True)
        try:
            self._observe()  # the last look: the counters and the tmpfs go below
            testbed = self.host_dir / "testbed"
            if mounts_under(testbed):
                await umount(testbed)
            if self.fuse is not None:  # it exits once its mount is gone
                await wait_or_kill(self.fuse)
            # The idmapped binds (`lower/`, `mounts/<i>`), then the tmpfs; innermost first.
            for point in sorted(mounts_under(self.host_dir), reverse=True):
                await umount(Path(point))
            if mounts_under(self.host_dir):  # never delete through a mount (into the checkout, a mount)
                raise SandboxError(f"{self.host_dir} still has mounts; not removing it")
            if self._cgroup is not None:
                await asyncio.to_thread(self._cgroup.remove)
            if (failure := await asyncio.to_thread(remove_tree, self.host_dir)) is not None:
                raise SandboxError(f"could not remove {self.host_dir}: {failure}")
        finally:
            self._lease.release(ended=not any(isinstance(failure, BaseException) for failure in ended))
        for failure in ended:
            if isinstance(failure, BaseException):
                raise failure

    async def _run(
        self,
        argv: list[str],
        *,
        timeout_s: float,
        cwd: str,
        env: Mapping[str, str] | None = None,
        stdin: bytes | None = None,
        cap: int | None = None,
    ) -> tuple[int | None, OutputTail, OutputTail, bool, float]:
        """Run argv in a fresh bwrap; (exit code, stdout, stderr, timed out, wall seconds)."""
        if self._teardown is not None:
            raise SandboxError("the sandbox has been destroyed")
        # Secrets reach the command only through the environment, which bwrap passes on unchanged.
        full_env = {"PATH": _PATH, "HOME": _HOME, "LANG": "C.UTF-8", "TMPDIR": "/tmp", **(env or {})}
        start = time.monotonic()
        starting = asyncio.ensure_future(self._start([*argv], cwd, full_env, stdin is not None))
        try:
            run = await asyncio.shield(starting)
        except asyncio.CancelledError:
            # A spawn cancelled midway makes asyncio SIGKILL bwrap alone, which orphans a sandbox still
            # being set up (its pid 1 arms --die-with-parent only at the end of setup): let the spawn
            # finish, then kill the proper way.
            with contextlib.suppress(SandboxError):
                await (await starting).end()
            raise
        proc = run.proc
        assert proc.stdout is not None and proc.stderr is not None
        readers = [asyncio.create_task(_read_tail(s, cap)) for s in (proc.stdout, proc.stderr)]
        if stdin is not None:
            readers.append(asyncio.create_task(_feed(proc, stdin)))
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
            await run.end()
            # Every process holding the pipes lived in the now empty pid namespace: EOF is immediate.
            out, err, *_ = await asyncio.gather(*readers)
        except BaseException:
            await run.end()
            for reader in readers:
                reader.cancel()
            raise
        finally:
            self._runs.discard(run)
            self._observe()
        return proc.returncode, out, err, timed_out, time.monotonic() - start

    async def _start(self, argv: list[str], cwd: str, env: dict[str, str], with_stdin: bool) -> BwrapRun:
        info_r, info_w = os.pipe()
        seccomp = filter_fd()
        filtered = ["--seccomp", str(seccomp)] if seccomp is not None else []
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv,
                "--info-fd",
                str(info_w),
                *filtered,
                "--chdir",
                cwd,
                "--",
                *REAPER,
                *argv,
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                pass_fds=(info_w, *([seccomp] if seccomp is not None else [])),
                start_new_session=True,
            )
        except OSError as e:
            os.close(info_r)
            raise SandboxError(f"cannot start bwrap: {e}") from e
        finally:
            os.close(info_w)
            if seccomp is not None:
                os.close(seccomp)
        run = BwrapRun(proc, info_r)
        self._runs.add(run)
        if self._teardown is not None:  # destroy() began while bwrap was starting: it missed this run
            await run.end()
            self._runs.discard(run)
            raise SandboxError("the sandbox has been destroyed")
        return run


async def _read_tail(stream: asyncio.StreamReader, cap: int | None) -> OutputTail:
    """All of `stream` until EOF, or its last `cap` bytes and how many were dropped."""
    out = OutputTail(sys.maxsize if cap is None else cap)
    while chunk := await stream.read(1 << 16):
        out.add(chunk)
    return out


async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):  # the command need not read it all
        pass
    finally:
        proc.stdin.close()


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"sandbox paths are absolute, got {path!r}")
    return path
