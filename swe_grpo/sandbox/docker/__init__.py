"""The `docker` sandbox backend: one container per sandbox, through the Docker SDK, on a local or remote engine.

    backend = DockerBackend(limits=DockerLimits(memory="2g"))
    await backend.start()
    async with await backend.create(task) as sandbox:  # no network; `network=True`: the backend's `network`
        result = await sandbox.exec("pytest -q", timeout_s=600)

What it guarantees, besides `swe_grpo.sandbox.base`'s guarantees:
- Every sandbox is a container of the task's prepared image (`images.py`): the repository at the base commit
  in /testbed, nothing of its later history. Images are never pulled.
- It runs as an unprivileged user with no capabilities, under per-container memory, process, CPU, open-file
  and disk limits (`DockerLimits`, `backend.py`), so a sandbox that exhausts its own cannot make another
  fail; `exhausted()` tells which one it hit (`sandbox.py`).
- Every process an exec starts runs under the `local` backend's seccomp filter (io_uring, keyrings, bpf,
  perf events, userfaultfd and x32 calls fail with EPERM) stacked on the engine's default profile, on
  any engine version (`seccomp.py`).
- Network: none by default (a loopback of its own); `create(network=True)` gives it the backend's `network`
  (`host` by default).
- `exec` kills every process it started on timeout or cancellation, `setsid` children included (`sandbox.py`).
- `start()` removes the containers of dead owners, never a live process's (`engine.py`); a remote engine
  reached by plain tcp off the loopback is refused.
- On a remote engine everything works through the engine's API; mounts are copied into read-only volumes
  (`volumes.py`) and `live_mounts` is False.

Modules: `backend.py` (`DockerBackend`, `DockerLimits`), `sandbox.py` (`DockerSandbox`), `images.py` (which
image, prepared images), `volumes.py` (mounts on a remote engine), `engine.py` (connection, owner labels,
reaper, helper containers), `seccomp.py` (the filter's wrapper, `seccomp_exec.c`).
"""

from __future__ import annotations

from swe_grpo.sandbox.docker.backend import HOME, DockerBackend, DockerLimits
from swe_grpo.sandbox.docker.engine import OWNER_LABEL, SANDBOX_LABEL, TASK_LABEL
from swe_grpo.sandbox.docker.images import DEFAULT_IMAGE, IMAGE_LABEL, PREPARED_REPOSITORY, TWIN
from swe_grpo.sandbox.docker.sandbox import DockerSandbox
from swe_grpo.sandbox.docker.volumes import MOUNT_LABEL

__all__ = [
    "DEFAULT_IMAGE",
    "HOME",
    "IMAGE_LABEL",
    "MOUNT_LABEL",
    "OWNER_LABEL",
    "PREPARED_REPOSITORY",
    "SANDBOX_LABEL",
    "TASK_LABEL",
    "TWIN",
    "DockerBackend",
    "DockerLimits",
    "DockerSandbox",
]
