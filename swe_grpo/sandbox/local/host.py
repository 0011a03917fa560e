"""What the `local` backend does on the host, as root: mount(2), idmapped binds and umount2(2), the mount points under a
directory, host commands, and waiting for (or killing) a host process group. Every failure raises
`SandboxError` with its cause."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import re
import signal
import struct
import subprocess
from pathlib import Path

from swe_grpo.sandbox.base import SandboxError
from swe_grpo.sandbox.process import HOST_GIT_ENV

log = logging.getLogger(__name__)

#: Of per-sandbox host directories and cgroups: `swe-grpo-<pid of the owning process>-<random>`.
PREFIX = "swe-grpo-"
#: How long a process is waited for before it is SIGKILLed (and again after).
KILL_WAIT_S = 10.0
_libc = ctypes.CDLL(None, use_errno=True)
_MNT_DETACH = 2  # umount2 flag: lazy unmount
# The new mount API (linux/mount.h; one syscall table on every architecture since 5.1).
_OPEN_TREE, _MOVE_MOUNT, _MOUNT_SETATTR = 428, 429, 442
_AT_FDCWD, _AT_EMPTY_PATH, _OPEN_TREE_CLONE, _MOVE_MOUNT_F_EMPTY_PATH = -100, 0x1000, 1, 4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_IDMAP = 0x1, 0x100000


def check(argv: list[str], *, what: str) -> None:
    """Run `argv` on the host (git without this user's configuration); `SandboxError` naming `what` on failure."""
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **HOST_GIT_ENV})
    if result.returncode != 0:
        raise SandboxError(f"{what}: `{' '.join(argv)}` failed: {result.stderr.strip()[-1000:]}")


async def run_host(*argv: str) -> None:
    """Run a host command as root; `SandboxError` with its stderr when it fails."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise SandboxError(f"`{' '.join(argv)}` failed: {err.decode(errors='replace').strip()}")


def remove_tree(path: Path) -> str | None:
    """Remove `path` and everything under it, whatever an unprivileged user left there (any depth, names of
    any length, any mode), never crossing into another filesystem (a mount under it stays: unmount first).
    None once it is gone, else why not (rm's own words). GNU rm walks the tree through directory descriptors
    (fts), so neither depth nor path length bounds it; `shutil.rmtree` recurses once per level and raises
    RecursionError past ~1,000."""
    done = subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], capture_output=True, text=True)
    if not os.path.lexists(path):
        return None
    return done.stderr.strip()[-1000:] or f"rm exited {done.returncode} and left it"


def mount(fstype: str, source: str, target: Path, options: str) -> None:
    """mount(2) itself: running mount(8) costs a process start per mount, felt in every sandbox's start."""
    if _libc.mount(source.encode(), bytes(target), fstype.encode(), 0, options.encode()) != 0:
        raise SandboxError(f"cannot mount {fstype} ({options}) on {target}: {os.strerror(ctypes.get_errno())}")


def bind_idmapped(source: Path, target: Path, userns_fd: int, *, read_only: bool) -> None:
    """Bind `source` (not what is mounted below it) on `target`, its owners seen through the uid map of
    the user namespace `userns_fd` (an idmapped mount: Linux 5.12, and a filesystem that allows it, as
    ext4, xfs, btrfs and, from 6.3, tmpfs do). Nothing on disk changes."""
    fd = _libc.syscall(_OPEN_TREE, _AT_FDCWD, bytes(source), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        raise SandboxError(f"cannot clone the mount of {source}: {os.strerror(ctypes.get_errno())}")
    try:
        flags = _MOUNT_ATTR_IDMAP | (_MOUNT_ATTR_RDONLY if read_only else 0)
        attr = struct.pack("=QQQQ", flags, 0, 0, userns_fd)  # struct mount_attr
        if _libc.syscall(_MOUNT_SETATTR, fd, b"", _AT_EMPTY_PATH, attr, len(attr)) != 0:
            error = os.strerror(ctypes.get_errno())
            raise SandboxError(f"cannot make an idmapped mount of {source} (its filesystem may not allow it): {error}")
        if _libc.syscall(_MOVE_MOUNT, fd, b"", _AT_FDCWD, bytes(target), _MOVE_MOUNT_F_EMPTY_PATH) != 0:
            raise SandboxError(f"cannot mount {source} on {target}: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)


async def umount(target: Path) -> None:
    """Unmount `target`; when a host process keeps it busy, detach it (it goes when they leave)."""
    if not (error := await asyncio.to_thread(_umount2, target, 0)):
        return
    log.warning("cannot unmount %s (%s); detaching it lazily", target, os.strerror(error))
    if detach_error := await asyncio.to_thread(_umount2, target, _MNT_DETACH):
        raise SandboxError(f"cannot unmount {target}: {os.strerror(error)}; detaching: {os.strerror(detach_error)}")


def _umount2(target: Path, flags: int) -> int:
    """umount2(2); 0 or the errno (read in the calling thread: ctypes keeps errno per thread)."""
    return 0 if _libc.umount2(bytes(target), flags) == 0 else ctypes.get_errno()


def mounts_under(path: Path) -> list[str]:
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


async def wait_or_kill(proc: asyncio.subprocess.Process, timeout_s: float = KILL_WAIT_S) -> None:
    """Wait until `proc` (a process group leader) has exited and its pipes are closed; after
    `timeout_s`, SIGKILL its process group first. `SandboxError` if even that does not end it."""
    waiter = asyncio.ensure_future(proc.wait())
    done, _ = await asyncio.wait([waiter], timeout=timeout_s)
    if not done and proc.returncode is None:  # once reaped, its group id may belong to someone else
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    try:
        await asyncio.wait_for(waiter, KILL_WAIT_S)
    except TimeoutError:
        raise SandboxError(f"process {proc.pid}, or one holding its pipes, survived SIGKILL") from None
