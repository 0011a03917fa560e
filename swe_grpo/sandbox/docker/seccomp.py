"""The sandboxes' seccomp filter (`swe_grpo.sandbox.seccomp`, which `local` sandboxes get from bwrap) in every
process of a `docker` sandbox, whatever the engine.

The engine's default seccomp profile refuses most of what the filter refuses, but not io_uring before
Docker 25, and nothing in it is ours to choose. So every exec of a docker sandbox starts with the wrapper
`seccomp-exec` (`seccomp_exec.c`, a static binary, so it runs in any image), which installs the filter
(`swe_grpo.sandbox.seccomp.program()`: io_uring, keyrings, bpf, perf events, userfaultfd, x32 calls
fail with EPERM) and then runs the command in its place. Seccomp filters stack: the engine's profile stays
in force under it (the kernel applies the strictest answer of all), and the command and everything it
starts keep the filter and cannot remove it. The container's only processes not started by an exec are
its init and `sleep infinity`.

The wrapper and the filter reach the container as one read-only host directory mounted at `MOUNT`
(through `volumes.py` on a remote engine), so the image needs nothing and no writable place.
`mount_dir()` makes that directory in the cache, named by a hash of both, once per content.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from swe_grpo.paths import cache_root
from swe_grpo.sandbox.native import build_static
from swe_grpo.sandbox.seccomp import program

log = logging.getLogger(__name__)

#: Where the wrapper's directory is mounted inside a sandbox.
MOUNT = "/run/swe-grpo-seccomp"
_SOURCE = Path(__file__).with_name("seccomp_exec.c")
_WRAPPER = "seccomp-exec"
_FILTER = "filter"


def wrapper() -> Path:
    """The wrapper binary, built from `seccomp_exec.c` into `cache_root()/seccomp/` the first time any
    process asks (`swe_grpo.sandbox.native.build_static`). Raises `NativeBuildError` saying what to install."""
    return build_static(_SOURCE, cache_root() / "seccomp", _WRAPPER, what="the docker sandbox's seccomp wrapper")


def mount_dir(machine: str) -> Path | None:
    """The host directory to mount at `MOUNT` in the sandboxes of an engine on `machine` (its `uname -m`):
    the wrapper and the filter, readable and runnable by any user. None, with a warning, where there is
    no filter for `machine` or it is not this host's (the wrapper is built here, for this host). Raises
    `NativeBuildError` when the wrapper cannot be built."""
    data = program(machine)
    if data is None or machine != platform.machine():
        _warn_unfiltered(machine)
        return None
    binary = wrapper()
    digest = hashlib.sha256(binary.name.encode() + b"\0" + data).hexdigest()[:16]
    directory = binary.parent / f"mount-{digest}"
    if directory.exists():
        return directory
    staging = Path(tempfile.mkdtemp(prefix=".mount-", dir=binary.parent))
    try:
        shutil.copyfile(binary, staging / _WRAPPER)
        (staging / _WRAPPER).chmod(0o755)
        (staging / _FILTER).write_bytes(data)
        (staging / _FILTER).chmod(0o644)
        staging.chmod(0o755)  # mkdtemp's 0700 would keep the sandbox user out
        os.rename(staging, directory)  # complete or absent, never half-made
    except OSError:
        if not directory.exists():  # else another process made it first: the same content
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def wrap(argv: Sequence[str]) -> list[str]:
    """`argv` run under the filter, in a sandbox that has `mount_dir()` at `MOUNT`."""
    return [f"{MOUNT}/{_WRAPPER}", f"{MOUNT}/{_FILTER}", *argv]


def _warn_unfiltered(machine: str) -> None:
    log.warning(
        "no seccomp filter of ours for a Docker engine on %s (this host: %s): docker sandboxes there have only "
        "the engine's default profile, which allows io_uring before Docker 25",
        machine,
        platform.machine(),
    )
