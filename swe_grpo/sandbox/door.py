"""An agent sandbox's one door to the network: its own rollout's endpoint, nothing else.

An agent sandbox (`local`, `docker`) is created with `network=False`: a network namespace of its own with
only its own loopback, no route anywhere. The door is how its agent still reaches its model:

- host side: `Door.make(rollout_id)` makes a fresh host directory with the forwarder in it, and
  `InterceptionServer.rollout(rollout_id, socket=door.socket)` serves that rollout on the unix socket
  `Door.socket` there (the server knows no sandbox: it is handed a path). A request that arrives on a door
  socket is served only if its path names the door's rollout (its two routes); anything else (`/health`,
  another rollout, an unknown path) gets 403. The rollout's token is checked as over TCP.
- sandbox side: the directory is mounted at `DOOR_MOUNT`, and the agent runs under the forwarder
  (`door_forwarder.c`: a static binary, so it runs in any image and needs nothing from the agent's bundle),
  which listens on `127.0.0.1:DOOR_PORT` inside the sandbox's namespace, pipes each connection to the
  socket, and starts the agent once listening. The agent's `base_url` is `Door.base_url`. The forwarder
  lives exactly as long as the agent (it passes signals on to it and exits with its status; the sandbox's
  pid namespace ends both). One process with an epoll loop: under 1 MiB per rollout (benchmark P6;
  `tests/test_door.py` holds it under 5 MiB), where Node running the `door.cjs` it replaced took ~55 MiB.

The forwarder is built from its source with the host's C compiler the first time a door is opened (or by
`scripts/setup.sh`), into `swe_grpo.paths.cache_root()`, under a lock, named by a hash of the source and
the build command: `forwarder()`. Without a compiler that links statically, opening a door raises
`ForwarderBuildError` saying what to install; there is no second implementation to fall back on.

So from inside, 127.0.0.1 is the sandbox's own loopback: vLLM, the trainer, the InterceptionServer's TCP
port and every other host service are unreachable, as is anything beyond the host. A unix socket is
reached by path, not by network namespace: the sandbox sees no host path but its mounts.
Closing the rollout's handle stops serving the socket, and `Door.remove` removes the directory;
the first door a process makes removes the doors that dead processes left (`remove_orphaned_doors`).

An allowlist (off by default: `Door.allow`, e.g. `("pypi.org:443", "files.pythonhosted.org:443")`) opens
more: `serve_allowlist` runs a host-side proxy on a second socket in the directory that answers HTTP
`CONNECT host:port` for exactly the listed targets (anything else: 403) and connects to them from the
host; the forwarder listens for it on `127.0.0.1:PROXY_PORT` and gives the agent `HTTPS_PROXY` and
`HTTP_PROXY` (with `NO_PROXY=127.0.0.1,localhost`), which pip, git, curl and most clients honour. Only
tunnels: a plain-HTTP request through the proxy (not `CONNECT`) is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from swe_grpo.paths import cache_root
from swe_grpo.sandbox.base import Mount, owner_gone
from swe_grpo.sandbox.native import NativeBuildError, build_static

#: Where a door's directory (the socket `s` and the forwarder) is mounted inside the sandbox.
DOOR_MOUNT = "/run/swe-grpo-door"
#: The loopback port the forwarder listens on inside the sandbox (its own namespace: any free port works).
DOOR_PORT = 18080
#: The loopback port of the allowlist proxy inside the sandbox (only with an allowlist).
PROXY_PORT = 18081
log = logging.getLogger(__name__)

_DIR_PREFIX = "swe-grpo-door-"  # then the pid of the process serving it
_SOURCE = Path(__file__).with_name("door_forwarder.c")
_FORWARDER = "door-forwarder"  # its name in a door's directory
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, NUL included
_PROXY_TIMEOUT_S = 30.0
_FORBIDDEN = b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class Door:
    """One rollout's door: `host_dir` holds the unix socket the InterceptionServer serves the rollout on,
    and the forwarder; `allow`: the `host:port`s the allowlist proxy admits (none: no proxy)."""

    rollout_id: str
    host_dir: Path
    allow: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_allow(self.allow)

    @classmethod
    def make(cls, rollout_id: str) -> Door:
        """A fresh directory (in the system's temporary directory, which the unprivileged sandbox user can
        traverse: it opens the mount) with the forwarder in it. Raises `ForwarderBuildError` if the
        forwarder cannot be built."""
        binary = forwarder()
        _remove_orphaned_doors_once()
        host_dir = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-"))
        host_dir.chmod(0o711)
        door = cls(rollout_id, host_dir)
        if len(str(door.socket)) > _UNIX_PATH_MAX:
            door.remove()
            raise ValueError(f"the door socket path {door.socket} is too long for a unix socket; set TMPDIR shorter")
        shutil.copyfile(binary, host_dir / _FORWARDER)
        (host_dir / _FORWARDER).chmod(0o755)
        return door

    @property
    def socket(self) -> Path:
        return self.host_dir / "s"

    @property
    def base_url(self) -> str:
        """The agent's `base_url` inside the sandbox."""
        return f"http://127.0.0.1:{DOOR_PORT}/rollout/{self.rollout_id}/v1"

    def mount(self) -> Mount:
        return Mount(self.host_dir, DOOR_MOUNT)

    @property
    def proxy_socket(self) -> Path:
        return self.host_dir / "p"

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run behind the door: the forwarder listens, then runs `argv` and exits with its status."""
        listen = [str(DOOR_PORT), f"{DOOR_MOUNT}/{self.socket.name}"]
        if self.allow:
            listen += [str(PROXY_PORT), f"{DOOR_MOUNT}/{self.proxy_socket.name}"]
        return [f"{DOOR_MOUNT}/{_FORWARDER}", *listen, "--", *argv]

    async def serve_allowlist(self) -> asyncio.Server:
        """Serve the allowlist proxy on `proxy_socket` until the returned server is closed."""
        server = await asyncio.start_unix_server(self._tunnel, path=self.proxy_socket)
        self.proxy_socket.chmod(0o666)
        return server

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One proxy connection: `CONNECT host:port` to a listed target, then bytes both ways."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _PROXY_TIMEOUT_S)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "CONNECT" or target not in self.allow:
                writer.write(_FORBIDDEN)
                return
            host, _, port = target.rpartition(":")
            try:
                opening = asyncio.open_connection(host.strip("[]"), int(port))
                up_reader, up_writer = await asyncio.wait_for(opening, _PROXY_TIMEOUT_S)
            except (OSError, TimeoutError):
                writer.write(_BAD_GATEWAY)
                return
            writer.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
        except (ValueError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # a malformed, oversized or too slow request line: the connection is closed
        finally:
            with contextlib.suppress(OSError):
                writer.close()

    def remove(self) -> None:
        shutil.rmtree(self.host_dir, ignore_errors=True)


class ForwarderBuildError(NativeBuildError):
    """The door's forwarder could not be built (no C compiler, or none that links statically)."""


def forwarder() -> Path:
    """The door's forwarder, built from `door_forwarder.c` by `$CC` (default `cc`) the first time any
    process asks, into `cache_root()/door/` under a lock (concurrent first uses build it once), and named
    by a hash of the source and the build command, so an edited source is rebuilt
    (`swe_grpo.sandbox.native.build_static`). Raises `ForwarderBuildError` saying what to install when it
    cannot be built."""
    return build_static(
        _SOURCE,
        cache_root() / "door",
        _FORWARDER,
        what="the door's forwarder",
        otherwise="or run without the door (--no-door)",
        error=ForwarderBuildError,
    )


def check_allow(allow: Iterable[str], door: bool = True) -> None:
    """Check an allowlist: every entry is `host:port` (a port from 1 to 65535) and there is a door to serve
    them through. Raises ValueError naming what is wrong (what `RolloutConfig`, `swe-grpo rollout --allow`
    and examples/train.py refuse)."""
    targets = tuple(allow)
    if targets and not door:
        raise ValueError(f"an allowlist ({', '.join(targets)}) is served through the door, which is off")
    for target in targets:
        host, _, port = target.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"an allowlist entry is host:port (a port from 1 to 65535), got {target!r}")


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close the other side."""
    with contextlib.suppress(OSError):
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


@functools.cache
def _remove_orphaned_doors_once() -> None:
    remove_orphaned_doors()


def remove_orphaned_doors(grace_s: float = 10.0) -> None:
    """Remove the door directories that a killed process left in the temporary directory: those whose
    owner (the pid in the name) is gone, and those whose socket nobody serves (a live server removes a
    door's directory before it stops serving it) and that are older than `grace_s` (a door being opened
    has no listening socket for a moment)."""
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}*"):
        if not owner_gone(path.name, _DIR_PREFIX):
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(str(path / "s"))
                    continue  # served: a live door
                except OSError:
                    pass
            with contextlib.suppress(FileNotFoundError):
                if time.time() - path.stat().st_mtime <= grace_s:
                    continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed the orphaned door %s", path)
