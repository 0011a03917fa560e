"""The `local` sandbox backend: bubblewrap over a copy-on-write view of a cached checkout (Linux, root).

Layout. A task's repository is checked out once per (repo, commit) into a cache directory
(`cache_root()/checkouts`), owned by the unprivileged sandbox user. Each sandbox gets a private host
directory (`run_dir/swe-grpo-<pid>-*`, mode 0711) holding an overlay of that checkout (`testbed/`, with
private `upper/` and `work/`) and the sandbox's `/tmp` (`tmp/`, with `HOME` at `/tmp/home`). The
copy-on-write method is detected once per backend: kernel overlayfs, else `fuse-overlayfs`, else a
plain `cp -a`.

Every `exec` is one bubblewrap run, started as the sandbox user (as root, bwrap's `--uid` would map to
real root), in fresh pid/ipc/uts namespaces. Network: by default the host's network is shared (the agent
reaches the InterceptionServer on the host's 127.0.0.1, and everything else the host reaches); a
sandbox created with `network=False` (grading) gets a network namespace of its own with nothing in it
but its own loopback (`--unshare-net`). Inside: the host's `/usr`, `/bin`, `/lib*`, `/etc`
read-only, a private `/proc` and `/dev`, the overlay at `/testbed`, the sandbox's `/tmp`, and the
requested mounts; nothing else of the host (no `/root`, `/home`, `/work`). State therefore survives
between execs only in `/testbed`, `/tmp` and writable mounts; processes never do: when a command ends
or is killed, its pid namespace, and with it every process it started, is gone.

Limits (`LocalLimits`), per sandbox, whatever runs in it and however many execs at once, so that a
sandbox that exhausts its own cannot make another fail:
- memory, processes and CPU: a cgroup of its own (`swe-grpo/<host_dir name>` under the root of the memory,
  pids and cpu hierarchies, cgroup v1 or v2; see `_common.CgroupLayout`), made by root before the sandbox's
  first process. Every bwrap run starts through a one-line `sh` that writes its own pid into the
  cgroup and then execs prlimit/setpriv/bwrap, so everything the sandbox runs is in it. The memory limit
  counts the sandbox's files too (they live in RAM, below), without swap; at the limit the kernel's OOM
  killer kills a process of that sandbox only. The pids limit counts processes and threads; a fork at
  the limit fails with EAGAIN in that sandbox only. The cgroup is removed on `destroy()`. On cgroup v2
  the backend enables the memory and pids controllers in the hierarchy's root and in `swe-grpo`; where
  it may not (the root of a container's cgroup namespace holds processes), `create()` raises
  `SandboxError` naming the cause. No memory nor pids cgroup at all: `SandboxError` as well, unless both
  limits are None. The sum of `pids` over concurrent sandboxes must stay below the host's pid_max.
- disk: the sandbox's host directory is a tmpfs of `disk_bytes` (and one inode per 4 KiB), so all it
  writes (the overlay's upper layer, `/tmp`) is bounded; beyond it writes fail with ENOSPC. With the
  `copy` method the copy of the checkout lives there too and counts against it. With `fuse-overlayfs`
  the upper layer is written by the daemon (the backend's cgroup), so it counts against the disk limit
  but not the sandbox's memory. Keep `disk_bytes` well below `memory_bytes` (the defaults: 2 and 4
  GiB): files the sandbox wrote stay charged to its memory, so a sandbox whose files reach its memory
  limit can start nothing more (each new process is OOM-killed): it has exhausted its memory, and only
  `destroy()` frees it.
  The CPU limit is a CFS quota: `cpus` cores' worth of CPU time per 100 ms, however many processes share
  it; between sandboxes that want more than the host has, the kernel shares it equally (one cgroup each).
- per process (rlimits): CPU seconds, file size and open files (a process at `open_files` gets EMFILE).
- no nested namespaces: each exec has a user namespace of its own in which no other user namespace can
  be made (`bwrap --disable-userns`, bubblewrap >= 0.8; older ones warn), so `unshare -U` fails inside;
  and a seccomp filter refuses io_uring, keyrings, bpf, perf events and userfaultfd (`sandbox.seccomp`).
`exhausted()` tells which limit a sandbox hit: "memory" (an OOM kill in its cgroup), "pids" (a fork
refused at its limit), both from kernel counters that never go down, or "disk" (its tmpfs found full,
of blocks or inodes, after an exec or when asked: a command that fills it and deletes its files before
returning goes unseen, and harmed no other sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from swe_grpo.paths import cache_root
from swe_grpo.sandbox.base import (
    WORKDIR,
    ExecResult,
    FileTooLarge,
    Mount,
    Sandbox,
    SandboxBackend,
    SandboxError,
    owner_gone,
)
from swe_grpo.sandbox.process import HOST_GIT_ENV, CgroupLayout, Exhaustion, OutputTail
from swe_grpo.sandbox.seccomp import filter_fd

if TYPE_CHECKING:
    from swe_grpo.tasks import Task

log = logging.getLogger(__name__)

#: How a sandbox gets its private, writable view of the cached checkout.
CowMethod = Literal["overlay", "fuse-overlayfs", "copy"]

_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_HOME = "/tmp/home"
# The user's git config inside: a repository mounted from elsewhere may belong to another uid, and an
# agent that commits needs an identity.
_GITCONFIG = "[safe]\n\tdirectory = *\n[user]\n\tname = swe-sandbox\n\temail = swe-sandbox@localhost\n"
# Pid 1 of every exec: runs the command and reaps what gets orphaned meanwhile; its exit ends the
# namespace. (When a command dies of a signal, this shell adds e.g. "Killed" to its stderr.)
_REAPER = ["sh", "-c", '"$@"; exit $?', "sh"]
_PREFIX = "swe-grpo-"  # of per-sandbox host directories: `swe-grpo-<pid of the owning process>-<random>`
_KILL_WAIT_S = 10.0
_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2  # umount2 flag: lazy unmount


CGROUP_PARENT = "swe-grpo"  # under each hierarchy's root; a sandbox's cgroup is named as its host_dir
_CPU_PERIOD_US = 100_000  # the CFS period a sandbox's CPU quota is given in (the kernel's default)


@dataclass(frozen=True)
class LocalLimits:
    """Resource limits (`None`: unlimited; see the module docstring for how each holds). Per sandbox:
    `memory_bytes` (its processes' memory plus its files), `pids` (processes and threads), `cpus` (CPU
    time per wall-clock time, in cores) and `disk_bytes` (everything it writes). Per process: `cpu_s`,
    `file_size_bytes` and `open_files` (rlimits). `output_bytes` caps what `exec` keeps of each of stdout
    and stderr (the end is kept)."""

    memory_bytes: int | None = 4 << 30
    pids: int | None = 1024
    cpus: float | None = 2.0
    disk_bytes: int | None = 2 << 30
    cpu_s: int | None = 3600
    file_size_bytes: int | None = 1 << 30
    open_files: int | None = 1024
    output_bytes: int = 4 << 20


class _Cgroup:
    """A sandbox's own cgroup (one directory per hierarchy on v1, one on v2)."""

    def __init__(self, layout: CgroupLayout, name: str) -> None:
        self.layout = layout
        self.memory = layout.memory / CGROUP_PARENT / name
        self.pids = layout.pids / CGROUP_PARENT / name
        self.cpu = layout.cpu / CGROUP_PARENT / name if layout.cpu is not None else None
        self.dirs = sorted({self.memory, self.pids, *([self.cpu] if self.cpu is not None else [])})

    def make(self, limits: LocalLimits) -> None:
        """Create it with the limits set (before any process joins)."""
        unlimited = "-1" if self.layout.version == 1 else "max"
        memory = unlimited if limits.memory_bytes is None else str(limits.memory_bytes)
        files = {self.pids / "pids.max": unlimited if limits.pids is None else str(limits.pids)}
        if self.layout.version == 1:  # the memory+swap limit must not be below the memory limit: set it after
            files |= {
                self.memory / "memory.limit_in_bytes": memory,
                self.memory / "memory.memsw.limit_in_bytes": memory,
            }
        else:
            files |= {self.memory / "memory.max": memory, self.memory / "memory.swap.max": "0"}
        if limits.cpus is not None:  # `cpus` cores' worth of CPU time in every period (CFS bandwidth control)
            assert self.cpu is not None, "LocalBackend checks that a CPU limit has its controller"
            quota = str(max(int(limits.cpus * _CPU_PERIOD_US), 1000))
            if self.layout.version == 1:
                files |= {self.cpu / "cpu.cfs_period_us": str(_CPU_PERIOD_US), self.cpu / "cpu.cfs_quota_us": quota}
            else:
                files |= {self.cpu / "cpu.max": f"{quota} {_CPU_PERIOD_US}"}
        for d in self.dirs:
            d.mkdir()
        for path, value in files.items():
            # Only the swap files may be missing (a kernel that does not account swap); any other missing
            # file fails the write: a limit is never skipped silently.
            if path.exists() or path.name not in ("memory.memsw.limit_in_bytes", "memory.swap.max"):
                path.write_text(value)

    def exhausted(self) -> Exhaustion | None:
        return self.layout.exhausted(self.memory, self.pids)

    def remove(self) -> None:
        """Remove it, SIGKILLing whatever is still in it (nothing, once every run has ended)."""
        for d in self.dirs:
            for _ in range(500):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise SandboxError(f"cannot remove the cgroup {d}: {e}") from e
                    for pid in (d / "cgroup.procs").read_text().split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(pid), signal.SIGKILL)
                    time.sleep(0.01)
            else:
                raise SandboxError(f"the cgroup {d} keeps processes that SIGKILL did not end")


class _Run:
    """One bubblewrap process and the pid namespace it made; `end()` leaves nothing of it running.

    bwrap runs with --as-pid-1 and pid 1 is `_REAPER`, a shell that runs the command, reaps orphans
    and exits with the command's status. When pid 1 exits the kernel kills every other process in the
    namespace (setsid'd and daemonised ones too), and bwrap reaps pid 1 only after that: so bwrap's exit
    means the whole tree is gone. To kill it, SIGKILL pid 1 through a pidfd (immune to pid reuse) and
    wait for bwrap. (Killing bwrap itself would not do: pid 1 arms --die-with-parent only after setup.)"""

    def __init__(self, proc: asyncio.subprocess.Process, info_fd: int) -> None:
        self.proc = proc
        self._pid1 = asyncio.create_task(_pid1_fd(info_fd))
        self._ending: asyncio.Future[None] | None = None

    async def end(self) -> None:
        """Kill the tree if it still runs and wait until it is gone; concurrent and repeated calls share
        one ending, which a cancelled caller does not interrupt."""
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._end())
        await asyncio.shield(self._ending)

    async def _end(self) -> None:
        try:
            pidfd = await asyncio.wait_for(asyncio.shield(self._pid1), _KILL_WAIT_S)
        except TimeoutError:
            self._pid1.cancel()
            pidfd = None
        if pidfd is None:
            # bwrap reports pid 1 before letting it run, so pid 1 has run nothing (or is gone): killing
            # bwrap's process group, which pid 1 is then still in, is enough.
            await _wait_or_kill(self.proc, timeout_s=0)
            return
        try:
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)
        await _wait_or_kill(self.proc)


class LocalSandbox(Sandbox):
    """A sandbox made by `LocalBackend`. `host_dir` is where it lives on the host (for diagnostics), and
    `cgroup_dirs` its cgroup; both are gone after `destroy()`."""

    def __init__(self, host_dir: Path, bwrap_argv: list[str], limits: LocalLimits, cgroup: _Cgroup | None) -> None:
        self.host_dir = host_dir
        self.cgroup_dirs = cgroup.dirs if cgroup is not None else []
        self._argv = bwrap_argv
        self._limits = limits
        self._cgroup = cgroup
        self._exhaustion: Exhaustion | None = None
        self._runs: set[_Run] = set()
        self._fuse: asyncio.subprocess.Process | None = None
        self._teardown: asyncio.Future[None] | None = None

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
        one teardown, which a cancelled caller does not interrupt. Raises `SandboxError` when something
        could not be removed."""
        if self._teardown is None:
            self._teardown = asyncio.ensure_future(self._tear_down())
        await asyncio.shield(self._teardown)

    async def _tear_down(self) -> None:
        # Go on when a run could not be ended: the mount and directories must go regardless.
        ended = await asyncio.gather(*(run.end() for run in list(self._runs)), return_exceptions=True)
        self._observe()  # the last look: the counters and the tmpfs go below
        testbed = self.host_dir / "testbed"
        if _mounts_under(testbed):
            await _umount(testbed)
        if self._fuse is not None:  # it exits once its mount is gone
            await _wait_or_kill(self._fuse)
        if _mounts_under(testbed):  # never delete through a mount (into the cached checkout)
            raise SandboxError(f"{testbed} is still mounted; not removing {self.host_dir}")
        if os.path.ismount(self.host_dir):  # the tmpfs
            await _umount(self.host_dir)
        if self._cgroup is not None:
            await asyncio.to_thread(self._cgroup.remove)
        await asyncio.to_thread(shutil.rmtree, self.host_dir, ignore_errors=True)
        if self.host_dir.exists():
            raise SandboxError(f"could not remove {self.host_dir}")
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

    async def _start(self, argv: list[str], cwd: str, env: dict[str, str], with_stdin: bool) -> _Run:
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
                *_REAPER,
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
        run = _Run(proc, info_r)
        self._runs.add(run)
        if self._teardown is not None:  # destroy() began while bwrap was starting: it missed this run
            await run.end()
            self._runs.discard(run)
            raise SandboxError("the sandbox has been destroyed")
        return run


class LocalBackend(SandboxBackend):
    """bubblewrap sandboxes over cached checkouts. Needs root (for mounts and to switch to `user`),
    `bwrap`, `setpriv` and `prlimit` (util-linux), `git`, `fuse-overlayfs` where kernel overlayfs is
    not allowed, and the memory and pids cgroup controllers (v1 or v2) unless `limits` sets neither
    `memory_bytes` nor `pids`. `run_dir` must be traversable by `user` (bwrap, running as that user, binds from it);
    `method` forces a copy-on-write method instead of detecting one."""

    name = "local"

    def __init__(
        self,
        *,
        limits: LocalLimits | None = None,
        user: str = "swe-sandbox",
        cache_dir: Path | None = None,
        run_dir: Path | None = None,
        method: CowMethod | None = None,
    ) -> None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise SandboxError(f"no user {user!r} to run sandboxes as (scripts/setup.sh creates it)") from None
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.limits = limits or LocalLimits()
        self.cache_dir = cache_dir or cache_root() / "checkouts"
        self.run_dir = run_dir or Path(tempfile.gettempdir())
        self.method = method
        self._cgroups: CgroupLayout | None = None
        self._method_lock = asyncio.Lock()
        self._fill_locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        """Check that the limits can be enforced, remove what sandboxes of dead processes left behind, and
        detect the copy-on-write method."""
        self._check_reachable(self.run_dir)
        layout = self._cgroup_layout()
        await asyncio.to_thread(_reap_leftovers, self.run_dir, layout)
        await self._cow_method()

    def _cgroup_layout(self) -> CgroupLayout | None:
        """The cgroup controllers, with the sandboxes' parent cgroups made (once); None when no limit
        needs them. `SandboxError` when they cannot be had."""
        if self.limits.memory_bytes is None and self.limits.pids is None and self.limits.cpus is None:
            return None
        if self._cgroups is None:
            layout = CgroupLayout.detect()
            if self.limits.cpus is not None and layout.cpu is None:
                raise SandboxError("no cpu cgroup controller here: the sandboxes' CPU limit needs it (or cpus=None)")
            enable = "+memory +pids" + (" +cpu" if layout.cpu is not None else "")
            try:
                if layout.version == 2:  # a child has only the controllers its parent enables for it
                    (layout.memory / "cgroup.subtree_control").write_text(enable)
                for root in {layout.memory, layout.pids, *([layout.cpu] if layout.cpu is not None else [])}:
                    (root / CGROUP_PARENT).mkdir(exist_ok=True)
                if layout.version == 2:
                    (layout.memory / CGROUP_PARENT / "cgroup.subtree_control").write_text(enable)
            except OSError as e:
                hint = (
                    " (cgroup v2 enables controllers only in a cgroup without processes, or the real root: in a"
                    " container, move this process into a child cgroup first)"
                    if layout.version == 2
                    else ""
                )
                raise SandboxError(
                    f"cannot make the parent cgroup of the sandboxes under {layout.memory}: {e}{hint}"
                ) from e
            self._cgroups = layout
        return self._cgroups

    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = True) -> LocalSandbox:
        sandbox = None
        try:
            for mount in mounts:
                if not mount.host_path.exists() or not mount.sandbox_path.startswith("/"):
                    raise SandboxError(f"bad mount {mount}: the host path must exist, the sandbox path be absolute")
                self._check_reachable(mount.host_path)
            lower = await self._checkout(task)
            method = await self._cow_method()
            layout = self._cgroup_layout()
            host_dir = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=self.run_dir))
            cgroup = _Cgroup(layout, host_dir.name) if layout is not None else None
            argv = self._bwrap_argv(host_dir, mounts, network, cgroup)
            sandbox = LocalSandbox(host_dir, argv, self.limits, cgroup)
            if cgroup is not None:
                cgroup.make(self.limits)
            sandbox._fuse = await self._prepare(host_dir, lower, method)
            # Proves bwrap starts with every bind in place, so a bad mount fails here, not in the agent.
            code, _, err, _, _ = await sandbox._run(["true"], timeout_s=30, cwd=WORKDIR)
            if code != 0:
                raise SandboxError(f"bwrap failed (exit {code}): {err.text()[-1000:]}")
        except BaseException as e:
            if sandbox is not None:
                try:
                    await sandbox.destroy()
                except SandboxError as cleanup:
                    log.warning("cleaning up after a failed create: %s", cleanup)
            if isinstance(e, Exception) and not isinstance(e, SandboxError):
                raise SandboxError(f"cannot create a sandbox for {task.instance_id}: {e!r}") from e
            raise
        return sandbox

    def _check_reachable(self, path: Path) -> None:
        """bwrap runs as the sandbox user, so it can bind only what that user can reach: name the
        directory that stops it (a checkout under a 0700 `mktemp -d` did), instead of bwrap's bare
        "Permission denied" from inside every rollout."""
        resolved = path.resolve()
        for directory in [*reversed(resolved.parents), *([resolved] if resolved.is_dir() else [])]:
            st = directory.stat()
            bit = 0o100 if st.st_uid == self.uid else 0o010 if st.st_gid == self.gid else 0o001
            if not st.st_mode & bit:
                raise SandboxError(
                    f"the sandbox user (uid {self.uid}) cannot reach {path}: {directory} is mode "
                    f"{st.st_mode & 0o777:o}; `chmod o+x {directory}` or move it under a traversable directory"
                )

    async def _prepare(self, host_dir: Path, lower: Path, method: CowMethod) -> asyncio.subprocess.Process | None:
        """Make the sandbox's directories and its view of `lower` at `host_dir/testbed`; the fuse
        daemon when there is one. With a disk limit, all of it is on a tmpfs of that size."""
        if (size := self.limits.disk_bytes) is not None:
            options = f"size={size},nr_inodes={max(size // 4096, 1024)},mode=0711"
            _mount("tmpfs", "swe-grpo-sandbox", host_dir, options)
        host_dir.chmod(0o711)
        tmp = host_dir / "tmp"
        (tmp / "home").mkdir(parents=True)
        (tmp / "home" / ".gitconfig").write_text(_GITCONFIG)
        for path in (tmp, tmp / "home", tmp / "home" / ".gitconfig"):
            os.chown(path, self.uid, self.gid)
        tmp.chmod(0o700)
        (host_dir / "testbed").mkdir()
        return await _mount_cow(method, lower, host_dir)

    def _bwrap_argv(self, host_dir: Path, mounts: Sequence[Mount], network: bool, cgroup: _Cgroup | None) -> list[str]:
        argv = []
        if cgroup is not None:  # joins the cgroup, then becomes prlimit, setpriv and bwrap (same pid)
            join = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in cgroup.dirs)
            argv += ["sh", "-c", f'{join} && exec "$@"', "sh"]
        rlimits = {"cpu": self.limits.cpu_s, "fsize": self.limits.file_size_bytes, "nofile": self.limits.open_files}
        argv += ["prlimit", *(f"--{k}={v}:{v}" for k, v in rlimits.items() if v is not None), "--"]
        argv += ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--"]
        argv += ["bwrap", *_no_nested_userns(), "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--as-pid-1"]
        if not network:
            argv.append("--unshare-net")
        argv += ["--new-session", "--die-with-parent"]
        argv += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--dev", "/dev", "--proc", "/proc"]
        argv += ["--bind", str(host_dir / "tmp"), "/tmp", "--bind", str(host_dir / "testbed"), WORKDIR]
        for m in mounts:
            argv += ["--bind" if m.writable else "--ro-bind", str(m.host_path), m.sandbox_path]
        # Writes outside the binds would land in bwrap's throwaway root and vanish: make them fail.
        return [*argv, "--remount-ro", "/"]

    async def _cow_method(self) -> CowMethod:
        async with self._method_lock:
            if self.method is None:
                self.method = await _detect_cow_method(self.run_dir)
                log.info("local sandboxes use %s for their copy of the checkout", self.method)
            return self.method

    async def _checkout(self, task: Task) -> Path:
        """The cached checkout of the task's repo at its base commit, made on first use. Concurrent
        callers (in this process: an asyncio lock; across processes: a file lock) fill it once."""
        source, is_bundle = _git_source(task.repo)
        digest = hashlib.sha256(f"{source}\n{task.base_commit}".encode()).hexdigest()[:16]
        dest = self.cache_dir / f"{re.sub(r'[^A-Za-z0-9._-]', '_', Path(source).name)[:40]}-{digest}"
        if dest.is_dir():
            return dest
        async with self._fill_locks.setdefault(dest.name, asyncio.Lock()):
            await asyncio.to_thread(self._fill_locked, source, is_bundle, task, dest)
        return dest

    def _fill_locked(self, source: str, is_bundle: bool, task: Task, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / f"{dest.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if dest.is_dir():
                return
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}-", suffix=".tmp", dir=dest.parent))
            try:
                self._fill(source, is_bundle, task, tmp)
                tmp.rename(dest)  # atomic: a checkout directory that exists is complete
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        log.info("cached %s@%s in %s", task.repo, task.base_commit, dest)

    def _fill(self, source: str, is_bundle: bool, task: Task, tmp: Path) -> None:
        commit = task.base_commit

        def git(*args: str) -> None:
            _check(["git", "-C", str(tmp), *args], what=f"{task.repo}@{commit}")

        git("init", "-q")
        try:
            # Fetching just the commit brings only its history: the agent cannot find the fix in later
            # commits.
            git("fetch", "-q", "--no-tags", "--", source, commit)
        except SandboxError as e:
            if source.startswith("https://"):
                hint = "this box may not reach GitHub: give Task.repo as a local path or bundle"
                raise SandboxError(f"{e}\n({hint})") from e
            raise
        git("checkout", "-q", "-B", "main", commit)  # on a branch, as the docker backend's /testbed is
        (tmp / ".git" / "FETCH_HEAD").unlink()  # names the host path
        if is_bundle:  # a bundle hands over its whole pack: drop the objects the commit does not reach
            git("repack", "-a", "-d", "-q")
            git("prune", "--expire=now")
        tmp.chmod(0o755)  # becomes /testbed's mode
        # -h: a symlink in the repository must not make us chown its target on the host.
        _check(["chown", "-hR", f"{self.uid}:{self.gid}", str(tmp)], what="chown")
        # chown changed every ctime and uid the index recorded: refresh it, or the first `git status`
        # inside re-hashes the whole tree. git rewrites the index as root, so hand it back.
        git("update-index", "-q", "--refresh")
        os.chown(tmp / ".git" / "index", self.uid, self.gid)


@functools.cache
def _no_nested_userns() -> list[str]:
    """bwrap's flags for a user namespace of its own (bwrap makes one anyway when not setuid) in which no other
    can be made: nested namespaces are kernel attack surface a coding agent never needs. bwrap < 0.8 cannot
    (Ubuntu 22.04 has 0.6): then a warning, and sandboxes without it."""
    usage = subprocess.run(["bwrap", "--help"], capture_output=True, text=True).stdout
    if "--disable-userns" in usage:
        return ["--unshare-user", "--disable-userns"]
    log.warning("this bwrap has no --disable-userns (bubblewrap >= 0.8): sandboxes can make user namespaces")
    return []


def _git_source(repo: str) -> tuple[str, bool]:
    """What `git fetch` gets for `Task.repo`, and whether it is a bundle file."""
    if os.path.isabs(repo):
        if not os.path.exists(repo):
            raise SandboxError(f"task repository {repo} does not exist")
        return os.path.realpath(repo), os.path.isfile(repo)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        return f"https://github.com/{repo}", False
    raise SandboxError(f"Task.repo {repo!r} is neither an absolute path nor a GitHub owner/name")


def _check(argv: list[str], *, what: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **HOST_GIT_ENV})
    if result.returncode != 0:
        raise SandboxError(f"{what}: `{' '.join(argv)}` failed: {result.stderr.strip()[-1000:]}")


async def _host(*argv: str) -> None:
    """Run a host command as root; `SandboxError` with its stderr when it fails."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(f"`{' '.join(argv)}` failed: {err.decode(errors='replace').strip()}")


async def _mount_cow(method: CowMethod, lower: Path, host_dir: Path) -> asyncio.subprocess.Process | None:
    """Make `host_dir/testbed` a private, writable view of `lower` (upper/work dirs in `host_dir`);
    returns the fuse-overlayfs daemon, which runs until the mount is gone."""
    testbed = host_dir / "testbed"
    if method == "copy":
        await _host("cp", "-a", "--reflink=auto", f"{lower}/.", str(testbed))
        return None
    upper, work = host_dir / "upper", host_dir / "work"
    upper.mkdir()
    work.mkdir()
    # The overlay's root directory takes its owner and mode from the upper dir.
    st = lower.stat()
    os.chown(upper, st.st_uid, st.st_gid)
    upper.chmod(st.st_mode & 0o7777)
    if any(c in str(p) for p in (lower, upper, work) for c in ",:\\"):
        raise SandboxError(f"overlay paths must not contain ',', ':' or '\\': {lower}, {upper}")
    opts = f"lowerdir={lower},upperdir={upper},workdir={work}"
    if method == "overlay":
        _mount("overlay", "overlay", testbed, opts)
        return None
    # In the foreground, so the daemon is our child and teardown can wait for it. allow_other: the
    # sandbox user must see a mount made by root.
    fuse = await asyncio.create_subprocess_exec(
        "fuse-overlayfs", "-f", "-o", f"{opts},allow_other", str(testbed),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not _mounts_under(testbed):
        if fuse.returncode is not None or time.monotonic() > deadline:
            await _wait_or_kill(fuse, timeout_s=0)
            assert fuse.stderr is not None
            err = (await fuse.stderr.read()).decode(errors="replace").strip()
            raise SandboxError(f"fuse-overlayfs did not mount {testbed}: {err}")
        await asyncio.sleep(0.002)
    return fuse


def _mount(fstype: str, source: str, target: Path, options: str) -> None:
    """mount(2) itself: running mount(8) costs a process start per mount, felt in every sandbox's start."""
    if _libc.mount(source.encode(), bytes(target), fstype.encode(), 0, options.encode()) != 0:
        raise SandboxError(f"cannot mount {fstype} ({options}) on {target}: {os.strerror(ctypes.get_errno())}")


async def _umount(target: Path) -> None:
    if not (error := await asyncio.to_thread(_umount2, target, 0)):
        return
    # Busy: a host process is in there. Detach it; it goes when they leave.
    log.warning("cannot unmount %s (%s); detaching it lazily", target, os.strerror(error))
    if detach_error := await asyncio.to_thread(_umount2, target, _MNT_DETACH):
        raise SandboxError(f"cannot unmount {target}: {os.strerror(error)}; detaching: {os.strerror(detach_error)}")


def _umount2(target: Path, flags: int) -> int:
    """umount2(2); 0 or the errno (read in the calling thread: ctypes keeps errno per thread)."""
    return 0 if _libc.umount2(bytes(target), flags) == 0 else ctypes.get_errno()


async def _detect_cow_method(run_dir: Path) -> CowMethod:
    """The first method that mounts a tiny overlay here: kernel overlayfs, then fuse-overlayfs."""
    probe = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-probe-", dir=run_dir))
    try:
        (probe / "lower").mkdir()
        (probe / "testbed").mkdir()
        methods: tuple[CowMethod, ...] = ("overlay", "fuse-overlayfs")
        for method in methods:
            try:
                fuse = await _mount_cow(method, probe / "lower", probe)
                await _umount(probe / "testbed")
                if fuse is not None:
                    await _wait_or_kill(fuse)
                return method
            except (SandboxError, OSError) as e:
                log.info("copy-on-write by %s is not available: %s", method, e)
            shutil.rmtree(probe / "upper", ignore_errors=True)
            shutil.rmtree(probe / "work", ignore_errors=True)
        return "copy"
    finally:
        if not _mounts_under(probe):
            shutil.rmtree(probe, ignore_errors=True)


async def _pid1_fd(info_fd: int) -> int | None:
    """A pidfd for the `child-pid` bwrap reports on `--info-fd` (before it lets that child run, so it is
    alive then); None when bwrap exits without reporting, or pid 1 is gone already."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(info_fd, "rb", 0)
    )
    try:
        pid = int(json.loads(await reader.read())["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None
    finally:
        transport.close()
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


async def _wait_or_kill(proc: asyncio.subprocess.Process, timeout_s: float = _KILL_WAIT_S) -> None:
    """Wait until `proc` (a process group leader) has exited and its pipes are closed; after
    `timeout_s`, SIGKILL its process group first. `SandboxError` if even that does not end it."""
    waiter = asyncio.ensure_future(proc.wait())
    done, _ = await asyncio.wait([waiter], timeout=timeout_s)
    if not done and proc.returncode is None:  # once reaped, its group id may belong to someone else
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        await asyncio.wait_for(waiter, _KILL_WAIT_S)
    except TimeoutError:
        raise SandboxError(f"process {proc.pid}, or one holding its pipes, survived SIGKILL") from None


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


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or below `path` in this mount namespace."""
    prefix = str(path)
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split(" ")[4])
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return points


def _reap_leftovers(run_dir: Path, layout: CgroupLayout | None) -> None:
    """Unmount and remove the sandbox directories, and remove the cgroups, whose owning process is dead."""
    for entry in run_dir.glob(f"{_PREFIX}*"):
        if not entry.is_dir() or not owner_gone(entry.name, _PREFIX):
            continue
        for point in sorted(_mounts_under(entry), reverse=True):  # innermost first
            subprocess.run(["umount", "-l", point], capture_output=True)
        if not _mounts_under(entry):
            shutil.rmtree(entry, ignore_errors=True)
            log.info("removed the leftover sandbox %s", entry)
    if layout is not None:
        for entry in (layout.memory / CGROUP_PARENT).glob(f"{_PREFIX}*"):
            if owner_gone(entry.name, _PREFIX):
                _Cgroup(layout, entry.name).remove()
                log.info("removed the leftover cgroup %s", entry.name)
