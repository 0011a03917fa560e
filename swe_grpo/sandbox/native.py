"""Small helper programs that run inside sandboxes, built from their C source on this host: the door's
forwarder (`swe_grpo.sandbox.door`) and the `docker` sandbox's seccomp wrapper
(`swe_grpo.sandbox.docker.seccomp`). Linked statically, so each runs in any sandbox image whatever its C
library (or none).

`build_static` builds one the first time any process asks, with `$CC` (default `cc`), into a directory of
the cache under a lock (concurrent first uses build it once), named by a hash of its source and the build
command, so an edited source is rebuilt and a built one is never rebuilt; `scripts/setup.sh` builds them
ahead so that the first rollout does not wait.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

# -static: the binary runs in any sandbox image, whatever its C library; -Os: small and plenty fast.
_CFLAGS = ("-static", "-Os", "-s")
_INSTALL = (
    "needs a C compiler with a static C library (Debian/Ubuntu: apt-get install gcc libc6-dev; Fedora: gcc "
    "glibc-static; or set CC), which scripts/setup.sh installs"
)


class NativeBuildError(RuntimeError):
    """A helper program could not be built (no C compiler, or none that links statically)."""


def build_static(
    source: Path,
    directory: Path,
    name: str,
    *,
    what: str,
    otherwise: str = "",
    error: type[NativeBuildError] = NativeBuildError,
) -> Path:
    """The static binary built from `source`: `directory/name-<hash>` (see the module docstring). Raises
    `error` (a `NativeBuildError`) saying which compiler failed at building `what` (e.g. "the door's
    forwarder"), what to install, and `otherwise` (what else the user can do, if anything)."""
    hint = f"{what} {_INSTALL}{'; ' + otherwise if otherwise else ''}"
    compiler = os.environ.get("CC", "cc")
    command = (compiler, *_CFLAGS)
    digest = hashlib.sha256(source.read_bytes() + "\0".join(command).encode()).hexdigest()[:16]
    binary = directory / f"{name}-{digest}"
    if binary.exists():
        return binary
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():  # another process built it while this one waited
            return binary
        partial = directory / f".{binary.name}.{os.getpid()}"
        try:
            built = subprocess.run([*command, "-o", str(partial), str(source)], capture_output=True, text=True)
        except OSError as e:
            raise error(f"cannot run the C compiler {compiler!r} to build {what}: {e}; {hint}") from e
        if built.returncode != 0:
            partial.unlink(missing_ok=True)
            raise error(f"{' '.join(command)} could not build {what} from {source}:\n{built.stderr.strip()}\n{hint}")
        partial.replace(binary)
    log.info("built %s %s", what, binary)
    return binary
