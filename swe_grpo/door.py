"""An agent sandbox's one door to the network: its own rollout's endpoint, nothing else.

An agent sandbox (`local`, `docker`) is created with `network=False`: a network namespace of its own with
only its own loopback, no route anywhere. The door is how its agent still reaches its model:

- host side: `InterceptionServer.open_door(rollout_id)` serves that rollout on a unix socket of its own
  (`Door.socket`, in a fresh host directory with the forwarder script beside it). A request that arrives
  on a door socket is served only if its path names the door's rollout (its two routes); anything else
  (`/health`, another rollout, an unknown path) gets 403. The rollout's token is checked as over TCP.
- sandbox side: the directory is mounted at `DOOR_MOUNT`, and the agent runs under `door.cjs` (run by the
  Pi bundle's Node, which every agent sandbox mounts: nothing is installed), which listens on
  `127.0.0.1:DOOR_PORT` inside the sandbox's namespace, pipes each connection to the socket, and starts
  the agent once listening. The agent's `base_url` is `Door.base_url`. The forwarder lives exactly as
  long as the agent's exec (it exits with the agent; the sandbox's pid namespace ends both).

So from inside, 127.0.0.1 is the sandbox's own loopback: vLLM, the trainer, the InterceptionServer's TCP
port and every other host service are unreachable, as is anything beyond the host. A unix socket is
reached by path, not by network namespace: the sandbox sees no host path but its mounts.
`close_door` stops serving the socket and removes the directory.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from swe_grpo.sandbox.base import Mount

#: Where a door's directory (the socket `s` and `door.cjs`) is mounted inside the sandbox.
DOOR_MOUNT = "/run/swe-grpo-door"
#: The loopback port the forwarder listens on inside the sandbox (its own namespace: any free port works).
DOOR_PORT = 18080
_SCRIPT = Path(__file__).with_name("door.cjs")
_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, NUL included


@dataclass(frozen=True)
class Door:
    """One rollout's door: `host_dir` holds the unix socket the InterceptionServer serves the rollout on,
    and the forwarder script."""

    rollout_id: str
    host_dir: Path

    @classmethod
    def make(cls, rollout_id: str) -> Door:
        """A fresh directory (in the system's temporary directory, which the unprivileged sandbox user can
        traverse: it opens the mount) with the forwarder script in it."""
        host_dir = Path(tempfile.mkdtemp(prefix="swe-grpo-door-"))
        host_dir.chmod(0o711)
        door = cls(rollout_id, host_dir)
        if len(str(door.socket)) > _UNIX_PATH_MAX:
            door.remove()
            raise ValueError(f"the door socket path {door.socket} is too long for a unix socket; set TMPDIR shorter")
        shutil.copyfile(_SCRIPT, host_dir / _SCRIPT.name)
        (host_dir / _SCRIPT.name).chmod(0o644)
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

    def wrap(self, node: str, argv: Sequence[str]) -> list[str]:
        """`argv` run behind the door: `node` (a path inside the sandbox) runs the forwarder, which runs `argv`."""
        return [node, f"{DOOR_MOUNT}/{_SCRIPT.name}", str(DOOR_PORT), f"{DOOR_MOUNT}/{self.socket.name}", *argv]

    def remove(self) -> None:
        shutil.rmtree(self.host_dir, ignore_errors=True)
