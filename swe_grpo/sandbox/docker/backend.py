"""`DockerBackend`: one container per sandbox (`DockerSandbox`), through the Docker SDK, from the task's
prepared image (`images.py`).

Containers run `sleep infinity` under `--init`, as an unprivileged user (all capabilities dropped,
no-new-privileges), every exec under our seccomp filter stacked on the engine's default profile
(`seccomp.py`), with per-container limits (`DockerLimits`) and owner labels (`engine.py`: `start()` removes
the containers of dead owners, never a live process's).

Each container runs as a host uid of its own, leased for its life from the pool the `local` backend leases
from (`swe_grpo.sandbox.uids`: host-wide, crash-safe), because the kernel counts epoll watches, inotify
instances, pipe buffers and processes per host uid: containers that shared one (the sandbox user's, 1000)
shared those, and one could take them all from its neighbours. The prepared image's /testbed stays the
sandbox user's (`uid`); each sandbox's copy of it in its /testbed tmpfs is made by the leased uid, so it owns
it. Without a disk limit there is no copy (the container writes the image's /testbed in place), so every
container runs as `uid` and shares its counters; the same on an engine with `userns-remap` (it maps only
65,536 uids, far below the pool's), with a warning at `start()`. On a remote engine the uids are the remote
kernel's and the leases coordinate only this host's backends.

Limits, per container, so that a sandbox that exhausts its own cannot make another fail: memory (the
container's cgroup; memory+swap equal, so no swap; at the limit the OOM killer kills a process of that
container only), processes and threads (`pids`: a fork at the limit fails in that container only), CPU
(`cpus` cores' worth of CPU time, a CFS quota), open files per process (`open_files`, RLIMIT_NOFILE), and
disk (`disk`, 2 GiB by default). The disk limit holds on every engine and storage driver, remote ones
included: the container's root filesystem is read-only, and the only places it can write are anonymous
tmpfs volumes (Docker's `local` driver: the engine mounts them, so `put_archive` reaches them, unlike
`--tmpfs`) of `disk` bytes each (and one inode per 4 KiB): /testbed, /tmp, /var/tmp and the sandbox user's
home (plus Docker's own 64 MiB /dev/shm); beyond one, writes fail with ENOSPC. The repository is copied into
/testbed by the sandbox's first exec, `cp -a` from the prepared image's hard-linked twin at `TWIN` (Docker's
own copy of an image directory into a new volume fills a tmpfs it then drops), .git included, so that nothing
the agent does in /testbed reaches the image's copy; a repository bigger than `disk` fails `create()`. Git's
`core.checkStat=minimal` (and `trustCtime=false`) in the container's environment keeps the prepared index
valid for the copy (same sizes and mtimes, new inodes and ctimes), so the first git command does not re-read
the tree. All the sandbox's files, the copy included, are RAM charged to its memory limit: one path never
exceeds `disk`, and all of them never exceed `memory`; keep `disk` well below `memory`. Each sandbox holds
its own copy of the repository in RAM, made as it starts. With `uid=None` (the image's own user) the home
directory is not writable. `disk=None`: no disk limit, a copy-on-write writable layer that can fill the
engine's data root (`--storage-opt size` is not used: most engines' storage drivers refuse or miscount it).

Remote engines (`DOCKER_HOST` or `base_url` other than a unix socket: `tcp://`, `ssh://`). Everything the
backend does goes through the engine's API: task repositories from host paths are exported here and
uploaded into the prepared image; limits, exec, files, diff and the reaper work unchanged. Mounts become
volumes (`volumes.py`). With no live mount there is no door: the agent reaches the InterceptionServer's
`public_base_url` over the backend's network (`host` by default: the remote machine's), with its per-rollout
token, as `hf` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import docker
import docker.types
import docker.utils
from docker.models.containers import Container

from swe_grpo.sandbox.base import WORKDIR, Mount, SandboxBackend, SandboxError
from swe_grpo.sandbox.docker.engine import ENGINE_ERRORS, OWNER_LABEL, SANDBOX_LABEL, TASK_LABEL, Engine, text
from swe_grpo.sandbox.docker.images import DEFAULT_IMAGE, TWIN, PreparedImages
from swe_grpo.sandbox.docker.sandbox import DockerSandbox
from swe_grpo.sandbox.docker.seccomp import MOUNT as SECCOMP_MOUNT
from swe_grpo.sandbox.docker.seccomp import mount_dir, wrap
from swe_grpo.sandbox.docker.volumes import MountVolumes
from swe_grpo.sandbox.native import NativeBuildError
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.sandbox.uids import SANDBOX_UIDS, UidLease, UidPool

if TYPE_CHECKING:
    from swe_grpo.tasks import Task

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The sandbox user's home directory (uid not None).
HOME = "/home/sandbox"
# Git in a disk-limited sandbox trusts size and mtime (which the copy keeps), not inodes and ctimes (which
# it does not): otherwise the first git command re-reads the whole tree.
_GIT_STAT_ENV = {
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.checkStat",
    "GIT_CONFIG_VALUE_0": "minimal",
    "GIT_CONFIG_KEY_1": "core.trustCtime",
    "GIT_CONFIG_VALUE_1": "false",
}


@dataclass(frozen=True)
class DockerLimits:
    """Per-container limits (see the module docstring). `memory` is also the memory+swap limit (no swap);
    `disk` the size of each writable tmpfs (None: unlimited). `output_bytes` caps what `exec` keeps of each of
    stdout and stderr (the end is kept, as by the `local` backend)."""

    memory: str = "4g"
    cpus: float = 2.0
    pids: int = 256  # with `open_files`, at most 262,144 of the host's file table (see `sandbox.local.limits`)
    disk: str | None = "2g"
    open_files: int = 1024  # RLIMIT_NOFILE of every process (soft and hard): at it, EMFILE
    output_bytes: int = 4 << 20


class DockerBackend(SandboxBackend):
    """Docker sandboxes (see the module docstring). `base_url` defaults to `DOCKER_HOST`, else the
    local socket; `uid=None` runs as the image's own user (root for SWE-bench images) with Docker's
    default capabilities; `uids` the host uids containers run as, one leased per sandbox (module docstring;
    None: each runs as `uid`); `network` is what a sandbox created with `network=True` gets: `host`, `none` or a
    network name (e.g. `bridge`, which isolates it: the host is then `host.docker.internal`, `host_address`,
    and the InterceptionServer must listen on the bridge address). `host` reaches the host's 127.0.0.1 with
    no set-up, but also every other service listening on the host (vLLM itself included) and whatever
    network the host reaches. A sandbox created with `network=False` (the default) is `none`: a loopback of
    its own and nothing else."""

    name = "docker"

    def __init__(
        self,
        default_image: str = DEFAULT_IMAGE,
        *,
        limits: DockerLimits = DockerLimits(),
        network: str = "host",
        uid: int | None = 1000,
        uids: range | None = SANDBOX_UIDS,
        base_url: str | None = None,
        max_concurrency: int = 256,
    ) -> None:
        self.limits = limits
        self.network = network
        self.uid = uid
        #: Where each sandbox's uid is leased from (None: every container runs as `uid`).
        self.uid_pool = UidPool(uids) if uids is not None and uid is not None and limits.disk is not None else None
        self.base_url = base_url
        #: Whether the engine is reached other than by a unix socket, and so may be on another machine.
        self.remote = not (base_url or os.environ.get("DOCKER_HOST") or "unix://").startswith("unix://")
        self.live_mounts = not self.remote
        #: The address the InterceptionServer has from inside a sandbox.
        self.host_address = "host.docker.internal" if network not in ("host", "none") else "127.0.0.1"
        self.live: set[DockerSandbox] = set()
        self.engine = Engine(base_url, max_concurrency)
        self.images = PreparedImages(self.engine, default_image, uid)
        self._volumes = MountVolumes(self.engine)
        #: This host's cgroup controllers, where `exhausted()` reads a local engine's containers (None: none).
        self.cgroups: CgroupLayout | None = None
        with contextlib.suppress(SandboxError):
            self.cgroups = CgroupLayout.detect()
        #: The host directory of the seccomp wrapper (`seccomp.py`), mounted into every sandbox; set by
        #: `start()` (None: the engine's architecture is not this host's, only the engine's profile holds).
        self.seccomp_dir: Path | None = None

    @property
    def default_image(self) -> str:
        """The image of a task that has none and no SWE-Gym image on the engine (`images.py`)."""
        return self.images.default_image

    def writable_paths(self) -> list[str]:
        """Where a sandbox can write: the tmpfs mounts of the disk limit (none without one)."""
        if self.limits.disk is None:
            return []
        return [WORKDIR, "/tmp", "/var/tmp", *([HOME] if self.uid is not None else [])]

    def _tmpfs_volumes(self, size: str, uid: int | None) -> list[docker.types.Mount]:
        """The writable paths as anonymous tmpfs volumes of `size` (removed with their container), owned by
        `uid` (None: root). Volumes, not Docker's `--tmpfs`: the engine mounts them itself, so
        `put_archive`/`get_archive` reach them."""
        common = f"size={size},nr_inodes={docker.utils.parse_bytes(size) // 4096}"
        owned = "mode=755" if uid is None else f"mode=755,uid={uid},gid={uid}"
        return [
            docker.types.Mount(
                path,
                None,
                no_copy=True,  # the engine would fill a tmpfs it then drops: the copy is made at start
                driver_config=docker.types.DriverConfig(
                    "local",
                    {
                        "type": "tmpfs",
                        "device": "tmpfs",
                        "o": f"{common},{'mode=1777' if path.endswith('tmp') else owned}",
                    },
                ),
            )
            for path in self.writable_paths()
        ]

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run a blocking SDK call in the backend's thread pool."""
        return self.engine.submit(fn, *args, **kwargs)

    @property
    def client(self) -> docker.DockerClient:
        """The SDK client (`SandboxError` before `start()`)."""
        return self.engine.client

    async def start(self) -> None:
        """Connect to the engine (`SandboxError` with the cause if unreachable, or reached by plain tcp off the
        loopback), remove the containers of dead owners, and make the seccomp wrapper for the engine's
        architecture (`SandboxError` saying what to install when it cannot be built)."""
        reaped = await self.engine.open()
        if reaped:
            log.info("removed %d leftover sandbox containers: %s", len(reaped), ", ".join(reaped))
        try:
            info = await self.submit(self.client.info)
            if self.uid_pool is not None and any("name=userns" in o for o in info.get("SecurityOptions") or []):
                log.warning(
                    "the Docker engine remaps users (userns-remap): every sandbox runs as uid %s and they share "
                    "its per-user kernel counters (epoll watches, inotify, pipe buffers, processes)",
                    self.uid,
                )
                self.uid_pool = None
            self.seccomp_dir = await self.submit(mount_dir, info.get("Architecture", ""))
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot ask the Docker engine its architecture: {e}") from e
        except NativeBuildError as e:
            raise SandboxError(str(e)) from e

    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = False) -> DockerSandbox:
        """See `SandboxBackend.create`; `network=True` gives the sandbox the backend's `network`."""
        image = await self.images.get(task)
        lease = await asyncio.to_thread(self.uid_pool.lease) if self.uid_pool is not None else None
        try:
            return await self._create(task, image, mounts, network, lease)
        except BaseException:
            if lease is not None:  # a container whose removal failed may still run as it: swept before reuse
                lease.release(ended=False)
            raise

    async def _create(
        self, task: Task, image: str, mounts: Sequence[Mount], network: bool, lease: UidLease | None
    ) -> DockerSandbox:
        """`create` once the image is ready, running as `lease`'s uid (None: as `uid`)."""
        uid = lease.uid if lease is not None else self.uid
        if self.seccomp_dir is not None:
            mounts = [*mounts, Mount(self.seccomp_dir, SECCOMP_MOUNT)]
        slug = re.sub(r"[^a-zA-Z0-9_.-]", "-", task.instance_id)[:40]
        kwargs: dict[str, Any] = {
            "image": image,
            "entrypoint": ["sleep", "infinity"],  # whatever the image's entrypoint: nothing runs but this
            "name": f"swe-grpo-{slug}-{uuid.uuid4().hex[:8]}",
            "init": True,  # PID 1 reaps orphans, so killed trees do not pile up as zombies
            "labels": {SANDBOX_LABEL: "1", OWNER_LABEL: self.engine.owner, TASK_LABEL: task.instance_id},
            "working_dir": WORKDIR,
            "mem_limit": self.limits.memory,
            "memswap_limit": self.limits.memory,
            "nano_cpus": int(self.limits.cpus * 1e9),
            "pids_limit": self.limits.pids,
            "ulimits": [docker.types.Ulimit(name="nofile", soft=self.limits.open_files, hard=self.limits.open_files)],
            "security_opt": ["no-new-privileges"],
            "environment": {},
        }
        if self.remote:
            kwargs["mounts"] = [await self._volumes.mount(m, image) for m in mounts]
        else:
            kwargs["volumes"] = {
                str(m.host_path): {"bind": m.sandbox_path, "mode": "rw" if m.writable else "ro"} for m in mounts
            }
        if disk := self.limits.disk:
            kwargs |= {"read_only": True, "mounts": kwargs.get("mounts", []) + self._tmpfs_volumes(disk, uid)}
            kwargs["environment"] |= _GIT_STAT_ENV
        if uid is not None:
            kwargs |= {"user": f"{uid}:{uid}", "cap_drop": ["ALL"]}
            kwargs["environment"]["HOME"] = HOME
        if not network:
            kwargs["network_mode"] = "none"
        elif self.network in ("host", "none"):
            kwargs["network_mode"] = self.network
        else:
            kwargs |= {"network": self.network, "extra_hosts": {"host.docker.internal": "host-gateway"}}
        made = self.submit(self._run_container, kwargs)
        try:
            await asyncio.wait({made})
        except asyncio.CancelledError:
            # The thread still finishes creating the container: remove it before letting the
            # cancellation through, so a cancelled create leaves nothing behind.
            await asyncio.shield(self._discard(made))
            raise
        try:
            container = made.result()
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot start a sandbox for {task.instance_id} from {image}: {e}") from e
        except SandboxError as e:
            raise SandboxError(f"cannot start a sandbox for {task.instance_id}: {e}") from e
        sandbox = DockerSandbox(
            self.engine,
            container,
            uid=uid,
            lease=lease,
            output_bytes=self.limits.output_bytes,
            writable_paths=self.writable_paths(),
            cgroups=None if self.remote else self.cgroups,
            exec_prefix=wrap([]) if self.seccomp_dir is not None else [],
            on_removed=self.live.discard,
        )
        self.live.add(sandbox)
        return sandbox

    def _run_container(self, kwargs: dict[str, Any]) -> Container:
        """Blocking: create and start the container; with a disk limit, copy the repository into its tmpfs
        (as the container's user, who then owns the copy)."""
        container = self.client.containers.create(**kwargs)
        try:
            container.start()
            if self.limits.disk is not None:
                exit_code, output = container.exec_run(["cp", "-a", f"{TWIN}/.", f"{WORKDIR}/"])
                if exit_code != 0:
                    raise SandboxError(
                        f"the repository does not fit the sandbox's disk limit ({self.limits.disk}) "
                        f"or cannot be copied: {text(output).strip()[-500:]}"
                    )
        except BaseException:
            container.remove(force=True, v=True)
            raise
        return container

    async def _discard(self, made: asyncio.Future[Container]) -> None:
        await asyncio.wait({made})
        if not made.cancelled() and made.exception() is None:
            with contextlib.suppress(*ENGINE_ERRORS):
                await self.submit(made.result().remove, force=True, v=True)

    async def close(self) -> None:
        """Destroy the sandboxes still alive, then release the client and threads (images are kept)."""
        results = await asyncio.gather(*(sandbox.destroy() for sandbox in list(self.live)), return_exceptions=True)
        for error in results:
            if isinstance(error, BaseException):
                log.warning("closing the docker backend: %s", error)
        self.engine.close()
