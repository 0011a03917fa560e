"""`LocalLimits`, and the cgroup that holds a `local` sandbox to its memory, process and CPU limits.

Per sandbox, whatever runs in it and however many execs at once, so that a sandbox that exhausts its own
limits cannot make another fail:
- memory, processes and CPU: a cgroup of its own (`Cgroup`: `swe-grpo/<host_dir name>` under the root of the
  memory, pids and cpu hierarchies, cgroup v1 or v2; see `swe_grpo.sandbox.process.CgroupLayout`), made by
  root before the sandbox's first process. Every bwrap run starts through a one-line `sh` that writes its own
  pid into the cgroup and then execs prlimit/setpriv/bwrap (`bwrap.bwrap_argv`), so everything the sandbox
  runs is in it. The memory limit counts the sandbox's files too (they live in RAM, below), without swap; at
  the limit the kernel's OOM killer kills a process of that sandbox only. The pids limit counts processes and
  threads; a fork at the limit fails with EAGAIN in that sandbox only. The cgroup is removed on `destroy()`.
  On cgroup v2 the backend enables the memory and pids controllers in the hierarchy's root and in `swe-grpo`
  (`parent_cgroups`); where it may not (the root of a container's cgroup namespace holds processes),
  `create()` raises `SandboxError` naming the cause. No memory nor pids cgroup at all: `SandboxError` as well,
  unless both limits are None. The sum of `pids` over concurrent sandboxes must stay below the host's
  pid_max. The CPU limit is a CFS quota: `cpus` cores' worth of CPU time per 100 ms, however many processes
  share it; between sandboxes that want more than the host has, the kernel shares it equally (one cgroup
  each).
- disk: the sandbox's host directory is a tmpfs of `disk_bytes` (and one inode per 4 KiB), so all it writes
  (the overlay's upper layer, `/tmp`) is bounded; beyond it writes fail with ENOSPC. With the `copy` method
  the copy of the checkout lives there too and counts against it. With `fuse-overlayfs` the upper layer is
  written by the daemon (the backend's cgroup), so it counts against the disk limit but not the sandbox's
  memory. Keep `disk_bytes` well below `memory_bytes` (the defaults: 2 and 4 GiB): files the sandbox wrote
  stay charged to its memory, so a sandbox whose files reach its memory limit can start nothing more (each
  new process is OOM-killed): it has exhausted its memory, and only `destroy()` frees it.
- per process (rlimits, set by `prlimit` in `bwrap.bwrap_argv`): CPU seconds, file size and open files (a
  process at `open_files` gets EMFILE). The host's file table (`fs.file-max`, which the kernel enforces on
  unprivileged processes only: a sandbox's neighbours, not the server) is shared, and the kernel has no
  per-user or per-cgroup count of open files: a sandbox holds at most `pids` x `open_files` of it, 262,144
  with the defaults (10.6 % of a 24 GiB host's 2,466,177; `fs.file-max` grows with RAM), so that many
  sandboxes at once, not one, could fill it. Real rollouts need far less: over 106 sandboxes of Pi rollouts
  and their grades (the demo tasks), at most 20 tasks (processes and threads), 11 processes and 209 open files
  per sandbox, 134 in one process. (Each open file is also ~460 bytes of kernel memory charged to the
  sandbox's memory limit: 4 GiB of it would be ~9 M files, more than the table.)
- what the kernel counts per host user (epoll watches, inotify, pipe buffers): per sandbox, which runs as
  a uid of its own (`uids.py`); its limits are the host's per-user ones.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass

from swe_grpo.sandbox.base import Exhaustion, SandboxError
from swe_grpo.sandbox.process import CgroupLayout

#: Under each hierarchy's root; a sandbox's cgroup is named as its host_dir.
CGROUP_PARENT = "swe-grpo"
_CPU_PERIOD_US = 100_000  # the CFS period a sandbox's CPU quota is given in (the kernel's default)


@dataclass(frozen=True)
class LocalLimits:
    """Resource limits (`None`: unlimited; see the module docstring for how each holds). Per sandbox:
    `memory_bytes` (its processes' memory plus its files), `pids` (processes and threads), `cpus` (CPU
    time per wall-clock time, in cores) and `disk_bytes` (everything it writes). Per process: `cpu_s`,
    `file_size_bytes` and `open_files` (rlimits). `output_bytes` caps what `exec` keeps of each of stdout
    and stderr (the end is kept)."""

    memory_bytes: int | None = 4 << 30
    pids: int | None = 256
    cpus: float | None = 2.0
    disk_bytes: int | None = 2 << 30
    cpu_s: int | None = 3600
    file_size_bytes: int | None = 1 << 30
    open_files: int | None = 1024
    output_bytes: int = 4 << 20


def parent_cgroups(limits: LocalLimits) -> CgroupLayout | None:
    """The cgroup controllers, with the sandboxes' parent cgroups (`CGROUP_PARENT`) made; None when no limit
    needs them. `SandboxError` when they cannot be had."""
    if limits.memory_bytes is None and limits.pids is None and limits.cpus is None:
        return None
    layout = CgroupLayout.detect()
    if limits.cpus is not None and layout.cpu is None:
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
        raise SandboxError(f"cannot make the parent cgroup of the sandboxes under {layout.memory}: {e}{hint}") from e
    return layout


class Cgroup:
    """A sandbox's own cgroup (one directory per hierarchy on v1, one on v2), named `name`."""

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
            assert self.cpu is not None, "parent_cgroups checks that a CPU limit has its controller"
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
