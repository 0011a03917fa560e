"""The `local` sandbox backend: bubblewrap over a copy-on-write view of a cached checkout (Linux, root).

    backend = LocalBackend(limits=LocalLimits(memory_bytes=2 << 30))
    await backend.start()
    async with await backend.create(task) as sandbox:  # no network; `network=True`: the host's
        result = await sandbox.exec("pytest -q", timeout_s=600)

What it guarantees, besides `swe_grpo.sandbox.base`'s guarantees:
- Every `exec` is one bubblewrap run as an unprivileged user (`swe-sandbox` inside; on the host a uid no
  other live sandbox has, `uids.py`, so what the kernel counts per user is counted per sandbox), in
  namespaces of its own: when the command ends or is killed, every process it started is gone
  (`bwrap.py`). Only `/testbed`, `/tmp` and writable mounts keep state between execs; nothing of the host
  is visible but its system directories, read-only, and the requested mounts.
- Network: none by default (a loopback of its own); `create(network=True)` shares the host's.
- Per-sandbox memory, processes, CPU and disk, and per-process rlimits (`LocalLimits`, `limits.py`), so a
  sandbox that exhausts its own cannot make another fail; `exhausted()` tells which one it hit (`sandbox.py`).
- No nested user namespaces, and a seccomp filter that refuses io_uring, Linux AIO contexts, keyrings, bpf,
  perf events and userfaultfd (`seccomp.py`).
- `start()` removes what the sandboxes of dead processes left (directories, mounts, cgroups); a live
  process's are never touched.

Modules: `backend.py` (`LocalBackend`), `sandbox.py` (`LocalSandbox`), `limits.py` (`LocalLimits`, the
sandbox's cgroup), `uids.py` (the host uids sandboxes run as), `bwrap.py` (one bubblewrap run), `cow.py` (the
copy-on-write view), `checkout.py` (the cached checkouts), `host.py` (mounts and processes on the host),
`seccomp.py` (the syscall filter).
"""

from __future__ import annotations

from swe_grpo.sandbox.local.backend import LocalBackend
from swe_grpo.sandbox.local.cow import CowMethod
from swe_grpo.sandbox.local.limits import CGROUP_PARENT, Cgroup, LocalLimits
from swe_grpo.sandbox.local.sandbox import LocalSandbox

__all__ = ["CGROUP_PARENT", "Cgroup", "CowMethod", "LocalBackend", "LocalLimits", "LocalSandbox"]
