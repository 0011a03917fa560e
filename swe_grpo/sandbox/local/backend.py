"""`LocalBackend`: makes `local` sandboxes (`sandbox.py`) and removes what sandboxes of dead processes left.

A sandbox is a private host directory (`run_dir/swe-grpo-<pid>-*`, mode 0711; a tmpfs of the disk limit)
holding a copy-on-write view of the task's cached checkout (`testbed/`, see `cow.py` and `checkout.py`) and
the sandbox's `/tmp` (`tmp/`, with `HOME` at `/tmp/home`), its cgroup (`limits.py`), and the bwrap argv every
exec of it starts with (`bwrap.py`). Its processes run as a host uid leased for it alone (`uids.py`); the
checkout and the requested mounts, owned on the host by the sandbox user, reach it through idmapped binds in
the directory (`lower/`, `mounts/<i>`) that show them as the leased uid's. `create()` either returns a sandbox
that has run a first command with every mount in place, or raises `SandboxError` having left nothing behind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from swe_grpo.paths import cache_root
from swe_grpo.sandbox.base import Mount, SandboxBackend, SandboxError, owner_gone
from swe_grpo.sandbox.local.bwrap import bwrap_argv
from swe_grpo.sandbox.local.checkout import CheckoutCache
from swe_grpo.sandbox.local.cow import CowMethod, detect_cow_method, mount_cow
from swe_grpo.sandbox.local.host import PREFIX, bind_idmapped, mount, mounts_under, remove_tree
from swe_grpo.sandbox.local.limits import CGROUP_PARENT, Cgroup, LocalLimits, parent_cgroups
from swe_grpo.sandbox.local.sandbox import LocalSandbox
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.sandbox.uids import SANDBOX_UIDS, UidLease, UidPool, idmap_userns

if TYPE_CHECKING:
    from swe_grpo.tasks import Task

log = logging.getLogger(__name__)

# The user's git config inside: a repository mounted from elsewhere may belong to another uid, and an
# agent that commits needs an identity.
_GITCONFIG = "[safe]\n\tdirectory = *\n[user]\n\tname = swe-sandbox\n\temail = swe-sandbox@localhost\n"


class LocalBackend(SandboxBackend):
    """bubblewrap sandboxes over cached checkouts. Needs root (for mounts and to switch users), Linux 5.12
    (idmapped mounts) and a cache and mounts on filesystems that allow them, `bwrap`, `setpriv`, `prlimit`
    and `unshare` (util-linux), `git`, `fuse-overlayfs` where kernel overlayfs is not allowed, and the memory
    and pids cgroup controllers (v1 or v2) unless `limits` sets neither `memory_bytes` nor `pids`. Inside,
    commands run as `user`; on the host, each sandbox's as its own uid from `uids` (`uids.py`). `run_dir`
    must be traversable by any user (bwrap, running as the leased uid, binds from it); `method` forces a
    copy-on-write method instead of detecting one."""

    name = "local"

    def __init__(
        self,
        *,
        limits: LocalLimits | None = None,
        user: str = "swe-sandbox",
        cache_dir: Path | None = None,
        run_dir: Path | None = None,
        method: CowMethod | None = None,
        uids: range = SANDBOX_UIDS,
    ) -> None:
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise SandboxError(f"no user {user!r} to run sandboxes as (scripts/setup.sh creates it)") from None
        self.uid, self.gid = entry.pw_uid, entry.pw_gid
        self.limits = limits or LocalLimits()
        self.checkouts = CheckoutCache(cache_dir or cache_root() / "checkouts", self.uid, self.gid)
        self.run_dir = run_dir or Path(tempfile.gettempdir())
        self.method = method
        self.uids = UidPool(uids)
        self._cgroups: CgroupLayout | None = None
        #: What the last `start()` found of dead runs and could not remove (paths): logged, never fatal.
        self.unreaped: list[str] = []
        self._method_lock = asyncio.Lock()
        self._teardowns: set[asyncio.Future[None]] = set()  # sandboxes' teardowns under way

    @property
    def cache_dir(self) -> Path:
        """Where the checkouts are cached."""
        return self.checkouts.cache_dir

    async def start(self) -> None:
        """Check that the limits can be enforced, remove what sandboxes of dead processes left behind, and
        detect the copy-on-write method."""
        self._check_reachable(self.run_dir, owner=False)
        self.uids.check()
        layout = self._cgroup_layout()
        self.unreaped = await asyncio.to_thread(reap_leftovers, self.run_dir, layout)
        if self.unreaped:
            log.warning("%d leftovers of dead runs could not be removed (see above)", len(self.unreaped))
        await self._cow_method()

    async def close(self) -> None:
        """Wait for the sandboxes' teardowns under way: a destroy() whose caller was cancelled goes on (shielded),
        and an event loop that ended before it would leave its mounts and directories. Sandboxes still alive
        are their owners' to destroy."""
        for failure in await asyncio.gather(*self._teardowns, return_exceptions=True):
            if isinstance(failure, Exception):
                log.warning("a sandbox's teardown failed: %s", failure)

    def _cgroup_layout(self) -> CgroupLayout | None:
        """The cgroup controllers, with the sandboxes' parent cgroups made (once); None when no limit
        needs them. `SandboxError` when they cannot be had."""
        if self._cgroups is None:
            self._cgroups = parent_cgroups(self.limits)
        return self._cgroups

    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = False) -> LocalSandbox:
        """See `SandboxBackend.create`. `network=True` shares the host's network: the sandbox reaches the
        host's 127.0.0.1 (an InterceptionServer there) and everything else the host reaches."""
        sandbox = None
        lease: UidLease | None = None
        try:
            for m in mounts:
                if not m.host_path.exists() or not m.sandbox_path.startswith("/"):
                    raise SandboxError(f"bad mount {m}: the host path must exist, the sandbox path be absolute")
                self._check_reachable(m.host_path)
            lower = await self.checkouts.get(task)
            method = await self._cow_method()
            layout = self._cgroup_layout()
            lease = await asyncio.to_thread(self.uids.lease)
            host_dir = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=self.run_dir))
            cgroup = Cgroup(layout, host_dir.name) if layout is not None else None
            binds = [Mount(host_dir / "mounts" / str(i), m.sandbox_path, m.writable) for i, m in enumerate(mounts)]
            argv = bwrap_argv(lease.uid, self.uid, self.gid, self.limits, host_dir, binds, network, cgroup)
            sandbox = LocalSandbox(host_dir, argv, self.limits, cgroup, lease, self._teardowns)
            lease = None  # the sandbox's now: its destroy() releases it
            if cgroup is not None:
                cgroup.make(self.limits)
            sandbox.fuse = await self._prepare(host_dir, lower, method, mounts, sandbox.uid)
            # Proves bwrap starts with every bind in place, so a bad mount fails here, not in the agent.
            first = await sandbox.exec(["true"], timeout_s=30)
            if first.exit_code != 0:
                raise SandboxError(f"bwrap failed (exit {first.exit_code}): {first.stderr[-1000:]}")
        except BaseException as e:
            if sandbox is not None:
                try:
                    await sandbox.destroy()
                except SandboxError as cleanup:
                    log.warning("cleaning up after a failed create: %s", cleanup)
            if lease is not None:
                lease.release()
            if isinstance(e, Exception) and not isinstance(e, SandboxError):
                raise SandboxError(f"cannot create a sandbox for {task.instance_id}: {e!r}") from e
            raise
        return sandbox

    def _check_reachable(self, path: Path, *, owner: bool = True) -> None:
        """bwrap runs as the sandbox's uid, so it can bind only what that uid can reach: name the
        directory that stops it, instead of bwrap's bare "Permission denied" from inside every rollout.
        `owner`: the sandbox user's directories are the sandbox's (`path` reaches it through an idmapped
        bind); otherwise the leased uid owns none of them."""
        resolved = path.resolve()
        for directory in [*reversed(resolved.parents), *([resolved] if resolved.is_dir() else [])]:
            st = directory.stat()
            bit = 0o100 if owner and st.st_uid == self.uid else 0o010 if st.st_gid == self.gid else 0o001
            if not st.st_mode & bit:
                raise SandboxError(
                    f"the sandbox user (uid {self.uid}) cannot reach {path}: {directory} is mode "
                    f"{st.st_mode & 0o777:o}; `chmod o+x {directory}` or move it under a traversable directory"
                )

    async def _prepare(
        self, host_dir: Path, lower: Path, method: CowMethod, mounts: Sequence[Mount], uid: int
    ) -> asyncio.subprocess.Process | None:
        """Make the sandbox's directories, owned by its `uid`; idmapped binds of the checkout
        (`lower/`) and of `mounts` (`mounts/<i>`) that show the sandbox user's files as `uid`'s; and its view
        of the checkout at `host_dir/testbed`; the fuse daemon when there is one. With a disk limit, all of it
        is on a tmpfs of that size."""
        if (size := self.limits.disk_bytes) is not None:
            options = f"size={size},nr_inodes={max(size // 4096, 1024)},mode=0711"
            mount("tmpfs", "swe-grpo-sandbox", host_dir, options)
        host_dir.chmod(0o711)
        tmp = host_dir / "tmp"
        (tmp / "home").mkdir(parents=True)
        (tmp / "home" / ".gitconfig").write_text(_GITCONFIG)
        for path in (tmp, tmp / "home", tmp / "home" / ".gitconfig"):
            os.chown(path, uid, self.gid)
        tmp.chmod(0o700)
        (host_dir / "testbed").mkdir()
        (host_dir / "lower").mkdir()
        (host_dir / "mounts").mkdir(mode=0o711)
        await asyncio.to_thread(self._bind_idmapped, host_dir, lower, mounts, uid)
        return await mount_cow(method, host_dir / "lower", host_dir)

    def _bind_idmapped(self, host_dir: Path, lower: Path, mounts: Sequence[Mount], uid: int) -> None:
        userns = idmap_userns(self.uid, uid)
        try:
            bind_idmapped(lower, host_dir / "lower", userns, read_only=True)
            for i, m in enumerate(mounts):
                (point := host_dir / "mounts" / str(i)).mkdir()
                bind_idmapped(m.host_path, point, userns, read_only=not m.writable)
        finally:
            os.close(userns)

    async def _cow_method(self) -> CowMethod:
        async with self._method_lock:
            if self.method is None:
                self.method = await detect_cow_method(self.run_dir)
                log.info("local sandboxes use %s for their copy of the checkout", self.method)
            return self.method


def reap_leftovers(run_dir: Path, layout: CgroupLayout | None) -> list[str]:
    """Unmount and remove the sandbox directories, and remove the cgroups, whose owning process is dead,
    whatever tree a sandbox left (`remove_tree`). Never raises for a leftover: what it cannot remove is logged
    and returned (a later start tries again)."""
    left = []
    for entry in run_dir.glob(f"{PREFIX}*"):
        if not entry.is_dir() or not owner_gone(entry.name, PREFIX):
            continue
        for point in sorted(mounts_under(entry), reverse=True):  # innermost first
            subprocess.run(["umount", "-l", point], capture_output=True)
        failure = "still mounted" if mounts_under(entry) else remove_tree(entry)
        if failure is None:
            log.info("removed the leftover sandbox %s", entry)
        else:
            log.warning("cannot remove the leftover sandbox %s: %s", entry, failure)
            left.append(str(entry))
    if layout is not None:
        for entry in (layout.memory / CGROUP_PARENT).glob(f"{PREFIX}*"):
            if owner_gone(entry.name, PREFIX):
                try:
                    Cgroup(layout, entry.name).remove()
                    log.info("removed the leftover cgroup %s", entry.name)
                except (SandboxError, OSError) as e:
                    log.warning("cannot remove the leftover cgroup %s: %s", entry.name, e)
                    left.append(str(entry))
    return left
