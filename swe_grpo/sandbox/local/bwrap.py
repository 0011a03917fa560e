"""One bubblewrap run of a `local` sandbox: the argv every run of a sandbox starts with (`bwrap_argv`), and
`BwrapRun`, whose `end()` leaves nothing of the run's process tree.

Each run is started as the sandbox's leased host uid (`uids.py`), which bwrap's `--uid` names the sandbox user
inside (only a name: the kernel counts per host uid), in its cgroup (`limits.Cgroup`) under the per-process
rlimits, in fresh pid/ipc/uts namespaces and a user namespace in which no other user namespace can be made
(`--disable-userns`, bubblewrap >= 0.8; older ones warn), so `unshare -U` fails inside; the seccomp filter
(`seccomp.py`) is added per run. Without the network, a network namespace of its own with nothing but its own
loopback (`--unshare-net`); with it, the host's.
Inside: the host's `/usr`, `/bin`, `/lib*`, `/etc` read-only, a private `/proc` and `/dev`, the overlay at
`/testbed`, the sandbox's `/tmp`, and the requested mounts; nothing else of the host (no `/root`, `/home`,
`/work`); writes anywhere else fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shlex
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from swe_grpo.sandbox.base import WORKDIR, Mount
from swe_grpo.sandbox.local.host import KILL_WAIT_S, wait_or_kill
from swe_grpo.sandbox.local.limits import Cgroup, LocalLimits

log = logging.getLogger(__name__)

#: Pid 1 of every run: runs the command and reaps what gets orphaned meanwhile; its exit ends the namespace.
#: (When a command dies of a signal, this shell adds e.g. "Killed" to its stderr.)
REAPER = ["sh", "-c", '"$@"; exit $?', "sh"]


def bwrap_argv(
    host_uid: int,
    uid: int,
    gid: int,
    limits: LocalLimits,
    host_dir: Path,
    mounts: Sequence[Mount],
    network: bool,
    cgroup: Cgroup | None,
) -> list[str]:
    """The argv of the sandbox at `host_dir` up to bwrap's options; a run adds its own and the command. Its
    processes run as `host_uid` on the host and as `uid` (group `gid`, on the host too) inside."""
    argv = []
    if cgroup is not None:  # joins the cgroup, then becomes prlimit, setpriv and bwrap (same pid)
        join = " && ".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}" for d in cgroup.dirs)
        argv += ["sh", "-c", f'{join} && exec "$@"', "sh"]
    rlimits = {"cpu": limits.cpu_s, "fsize": limits.file_size_bytes, "nofile": limits.open_files}
    argv += ["prlimit", *(f"--{k}={v}:{v}" for k, v in rlimits.items() if v is not None), "--"]
    argv += ["setpriv", f"--reuid={host_uid}", f"--regid={gid}", "--clear-groups", "--"]
    argv += ["bwrap", "--unshare-user", *_no_nested_userns(), "--uid", str(uid), "--gid", str(gid)]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--as-pid-1"]
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


@functools.cache
def _no_nested_userns() -> list[str]:
    """bwrap's flag for a user namespace (its own: `--unshare-user`) in which no other can be made: nested
    namespaces are kernel attack surface a coding agent never needs. bwrap < 0.8 cannot: then a warning,
    and sandboxes without it."""
    usage = subprocess.run(["bwrap", "--help"], capture_output=True, text=True).stdout
    if "--disable-userns" in usage:
        return ["--disable-userns"]
    log.warning("this bwrap has no --disable-userns (bubblewrap >= 0.8): sandboxes can make user namespaces")
    return []


class BwrapRun:
    """One bubblewrap process and the pid namespace it made; `end()` leaves nothing of it running.

    bwrap runs with --as-pid-1 and pid 1 is `REAPER`, a shell that runs the command, reaps orphans
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
            pidfd = await asyncio.wait_for(asyncio.shield(self._pid1), KILL_WAIT_S)
        except TimeoutError:
            self._pid1.cancel()
            pidfd = None
        if pidfd is None:
            # bwrap reports pid 1 before letting it run, so pid 1 has run nothing (or is gone): killing
            # bwrap's process group, which pid 1 is then still in, is enough.
            await wait_or_kill(self.proc, timeout_s=0)
            return
        try:
            if self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        finally:
            os.close(pidfd)
        await wait_or_kill(self.proc)


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
