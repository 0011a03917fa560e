"""The host uids sandboxes run as: one per live sandbox, leased from a reserved range (`UidPool`), shared by
the `local` and `docker` backends.

Why: the kernel counts some resources per host user (its `user_struct` and ucounts: epoll watches, inotify
instances and watches, pipe buffers, processes, pending signals, message queues). A user namespace does not
change that: bwrap's `--uid` only renames the user inside, the counters follow the real uid; a container's
uid is the host's (without the engine's `userns-remap`). Sandboxes that ran as one host user shared those
counters, so one could take them all and make its neighbour fail. Each sandbox's processes therefore run as a
host uid no other live sandbox has. `local` (`bwrap.bwrap_argv` starts them with it): inside they are still
the sandbox user (`swe-sandbox`), and what that user owns on the host (the cached checkout, mounts) is seen
through an idmapped mount as the leased uid's (`idmap_userns`, `host.bind_idmapped`). `docker`: the container
runs as the leased uid, and its /testbed is copied as that uid (`docker/backend.py`).

Leases are host-wide and crash-safe: a lease is an exclusive `flock` on `LEASE_DIR/<uid>`, held by an open
descriptor of the leasing process, so two live sandboxes (of this process or any other) never hold one uid,
and the kernel releases the lock of a process that dies however it dies. The lock file holds the leasing pid
until `release()` empties it: a lease found with a pid in it was never released (its owner died, or released
it with processes left), and whatever still runs as that uid is SIGKILLed before the uid is handed out again
(`UidLease.reclaimed` says so).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

from swe_grpo.sandbox.base import SandboxError

log = logging.getLogger(__name__)

#: The uids sandboxes run as: far above the uids distributions give users (below 60,000) and the
#: subordinate ranges of rootless containers (100,000 and up, 65,536 per user); no passwd entry names them.
SANDBOX_UIDS = range(1_800_000_000, 1_800_000_000 + 4096)
#: Where the leases' lock files live (root's, on the host's tmpfs: emptied at boot, when no sandbox lives).
LEASE_DIR = Path("/run/swe-grpo/uids")
_NO_UID = 4294967295  # (uid_t)-1: no uid


@dataclass
class UidLease:
    """One leased uid, until `release()`. `reclaimed`: it was taken from a process that died holding it."""

    uid: int
    fd: int
    reclaimed: bool = False

    def release(self, *, ended: bool = True) -> None:
        """Give the uid back (idempotent). `ended`: nothing of the sandbox runs any more; otherwise the
        next lease of the uid kills what still runs as it first, as for a process that died holding it."""
        if self.fd < 0:
            return
        if ended:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)  # released, not abandoned: the next lease need not sweep
        os.close(self.fd)  # drops the flock
        self.fd = -1


class UidPool:
    """Leases uids from `uids` (host-wide, through lock files in `lease_dir`)."""

    def __init__(self, uids: range = SANDBOX_UIDS, lease_dir: Path = LEASE_DIR) -> None:
        if not uids or uids.start < 1:
            raise ValueError(f"a pool of sandbox uids needs uids above 0, got {uids}")
        self.uids = uids
        self.lease_dir = lease_dir

    def check(self) -> None:
        """`SandboxError` when a user of this host (/etc/passwd) has a uid in the pool: its files and
        processes would be a sandbox's."""
        with open("/etc/passwd") as f:
            for line in f:
                fields = line.split(":")
                if len(fields) > 2 and fields[2].isdigit() and int(fields[2]) in self.uids:
                    raise SandboxError(f"the user {fields[0]} has uid {fields[2]}, in the sandboxes' range {self.uids}")

    def lease(self) -> UidLease:
        """A uid no live sandbox has, from a random place in the range (fewer processes contend for the
        same lock files); `SandboxError` when every one is leased."""
        self.lease_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        start = random.randrange(len(self.uids))
        for i in range(len(self.uids)):
            uid = self.uids[(start + i) % len(self.uids)]
            fd = os.open(self.lease_dir / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                lease = UidLease(uid, fd, reclaimed=bool(os.pread(fd, 32, 0).strip()))
                if lease.reclaimed:
                    kill_all_of(uid)
                    log.info("reclaimed the sandbox uid %d from a process that died holding it", uid)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            return lease
        raise SandboxError(f"every sandbox uid in {self.uids} is leased: too many live sandboxes on this host")


def kill_all_of(uid: int) -> None:
    """SIGKILL every process of the host running as `uid`: `kill(-1)` as that uid reaches exactly those."""
    done = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "kill", "-KILL", "-1"],
        capture_output=True,
        text=True,
    )
    # kill exits 1 with "No such process" when there was nothing to kill: that is the expected case.
    if done.returncode not in (0, 1):
        raise SandboxError(f"cannot end the processes of uid {uid}: {done.stderr.strip()}")


def idmap_userns(inside: int, outside: int) -> int:
    """A descriptor of a new user namespace that maps uid `inside` to `outside` and every other uid but
    `outside` to itself (gids all to themselves): an idmapped mount through it shows `inside`'s files as
    `outside`'s and the rest as they are. (A file whose owner an idmapped mount cannot map is read-only
    through it: root's door socket could not be connected to.) The caller closes it (mounts made through
    it keep the namespace)."""
    proc = subprocess.Popen(
        ["unshare", "--user", "--", "sh", "-c", "echo ready; exec cat"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    try:
        if proc.stdout.readline() != b"ready\n":  # printed once in the new namespace
            raise SandboxError(f"cannot make a user namespace: {proc.stderr.read().decode(errors='replace')}")
        low, high = sorted((inside, outside))
        same = [(0, low), (low + 1, high - low - 1), (high + 1, _NO_UID - high - 1)]  # all but the two
        lines = [f"{inside} {outside} 1\n", *(f"{first} {first} {count}\n" for first, count in same if count)]
        Path(f"/proc/{proc.pid}/uid_map").write_text("".join(lines))
        Path(f"/proc/{proc.pid}/gid_map").write_text("0 0 4294967295\n")
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SandboxError(f"cannot map uid {inside} to {outside} in a user namespace: {e}") from e
    finally:
        proc.stdin.close()
        proc.wait()
