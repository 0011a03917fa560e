"""Mounts on a remote Docker engine, where the host's paths do not exist (the backend's `live_mounts` is
False): a read-only mount (the Pi bundle) becomes a named volume on the engine,
`swe-grpo-mount-<content hash>` (label `swe_grpo.mount=1`), filled once per engine and content through a
helper container and mounted read-only; a writable mount cannot be kept and is refused (`SandboxError`).
The volumes are kept for later runs: remove them with `docker volume prune --filter label=swe_grpo.mount=1`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

import docker.types

from swe_grpo.sandbox.base import Mount, SandboxError
from swe_grpo.sandbox.docker.engine import ENGINE_ERRORS, Engine, text

MOUNT_LABEL = "swe_grpo.mount"
# In a mount's volume: the file whose presence says the copy is complete, and the fillers' lock.
_VOLUME_COMPLETE = ".swe-grpo-complete"
# Fills /m from /stage unless complete, under the lock, clearing what a filler that died left.
_FILL_VOLUME = f"""
exec 9>/m/.swe-grpo-lock && flock 9 || exit 1
[ -e /m/{_VOLUME_COMPLETE} ] && exit 0
find /m -mindepth 1 -maxdepth 1 ! -name .swe-grpo-lock -exec rm -rf {{}} +
cp -a /stage/. /m/ && touch /m/{_VOLUME_COMPLETE}
"""


class MountVolumes:
    """The volumes on `engine` standing in for host directories (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._locks: defaultdict[Path, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._volumes: dict[Path, str] = {}  # host path -> its volume

    async def mount(self, mount: Mount, image: str) -> docker.types.Mount:
        """A remote engine's stand-in for a bind mount: the volume holding a copy of `mount.host_path`,
        mounted read-only (filled by a helper container of `image`)."""
        if mount.writable:
            raise SandboxError(f"a remote Docker engine cannot mount {mount.host_path} writable (it is not there)")
        path = mount.host_path.resolve()
        async with self._locks[path]:
            if path not in self._volumes:
                try:
                    self._volumes[path] = await asyncio.shield(self._engine.submit(self._fill, path, image))
                except ENGINE_ERRORS as e:
                    raise SandboxError(f"cannot copy {path} to the Docker engine: {e}") from e
        return docker.types.Mount(mount.sandbox_path, self._volumes[path], read_only=True)

    def _fill(self, path: Path, image: str) -> str:
        """Blocking: the volume named after `path`'s content (names, sizes, modes, mtimes), filled here
        unless an earlier run did: uploaded into a helper container, then copied into the volume under a
        lock, its completion marked last (a volume without the mark is filled again)."""
        engine = self._engine
        digest = hashlib.sha256()
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                stat = os.lstat(os.path.join(root, name))
                entry = (os.path.relpath(os.path.join(root, name), path), stat.st_size, stat.st_mode, stat.st_mtime_ns)
                digest.update(repr(entry).encode())
        name = f"swe-grpo-mount-{digest.hexdigest()[:24]}"
        engine.client.volumes.create(name, labels={MOUNT_LABEL: "1"})
        volumes = {name: {"bind": "/m", "mode": "rw"}}
        with engine.helper(image, ["test", "-e", f"/m/{_VOLUME_COMPLETE}"], "0", volumes=volumes) as probe:
            probe.start()
            if probe.wait(timeout=300).get("StatusCode") == 0:
                return name
        with (
            tempfile.TemporaryFile() as archive,
            engine.helper(image, ["sh", "-c", _FILL_VOLUME], "0", volumes=volumes) as fill,
        ):
            with tarfile.open(fileobj=archive, mode="w") as tar:
                tar.add(path, arcname="stage")
            archive.seek(0)
            fill.put_archive("/", archive)
            fill.start()
            if fill.wait(timeout=1800).get("StatusCode") != 0:
                raise SandboxError(f"cannot place the copy of {path} in volume {name}: {text(fill.logs())[-500:]}")
        return name
