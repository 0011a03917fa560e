"""The `docker` sandbox backend: one container per sandbox, through the Docker SDK.

Which image. `task.image` if set; else the SWE-Gym image of the task
(`xingyaoww/sweb.eval.x86_64.<id>`) when it exists locally; else the backend's default image (an
offline Debian with git, python3 and pytest; see `tests/docker_env.py`), into which the backend puts
the task's local repository (a path or a git bundle) itself. Images are never pulled: pull them first.

Prepared images. Before its first sandbox, each (source image, base commit) becomes a "prepared" image,
built once and kept (`swe-grpo-sandbox:<key>`, label `swe_grpo.image=1`): the repository at the base
commit in /testbed (copied in for the default image, with no remote, branch or object beyond the base
commit), checked to be at the base commit, owned by the sandbox user, with a home directory, a system
git configuration (`safe.directory=*`, a committer identity) and a git index that matches the image's
files (so no sandbox re-reads the tree on its first git command). Every sandbox is then a
copy-on-write container of that image: no per-sandbox copy of the repository, nothing on the host to
clean up, and ready in ~0.3 s for a 100 MB repository (`benchmarks/p3_sandbox_docker.py`). Prepared
images add up (about one repository's size per task): remove them with
`docker image prune -a --filter label=swe_grpo.image=1`.

Containers run `sleep infinity` under `--init`, as an unprivileged user (uid 1000 by default, all
capabilities dropped, no-new-privileges), with per-container limits (`DockerLimits`) and labels
`swe_grpo.sandbox=1` + `swe_grpo.owner=<host>/<pid>/<start time>`. `start()` removes labelled
containers whose owner process is gone (crashed earlier runs), never those of a live process, so two
runs on one engine do not reap each other.

Network. Default `host`: the agent reaches the host's InterceptionServer on 127.0.0.1 with no set-up,
but it also reaches every other service listening on the host (vLLM itself included) and whatever
network the host reaches. A named network (e.g. `bridge`) isolates the sandbox; the host is then
`host.docker.internal` (`host_address`) and the InterceptionServer must listen on the bridge address,
not 127.0.0.1. `none` cuts the network. A sandbox created with `network=False` (grading) is always
`none`: a loopback of its own and nothing else.

Limits, per container, so that a sandbox that exhausts its own cannot make another fail: memory (the
container's cgroup; memory+swap equal, so no swap; at the limit the OOM killer kills a process of that
container only), processes and threads (`pids`: a fork at the limit fails in that container only), CPU
(`cpus` cores' worth of CPU time, a CFS quota), open files per process (`open_files`, RLIMIT_NOFILE), and
disk (`disk`, 2 GiB by default). The disk limit holds on every engine and storage driver, remote ones
included: the container's root filesystem is read-only, and the only places it can write are anonymous
tmpfs volumes (Docker's `local` driver: the engine mounts them, so `put_archive` reaches them, unlike
`--tmpfs`) of `disk` bytes each (and one inode per 4 KiB): /testbed, /tmp, /var/tmp and the sandbox
user's home (plus Docker's own 64 MiB /dev/shm); beyond one, writes fail with ENOSPC. The repository is
copied into /testbed by the sandbox's first exec, `cp -a` from a hard-linked twin of /testbed that every
prepared image holds at `TWIN` (Docker's own copy of an image directory into a new volume fills a tmpfs
it then drops), .git included, so that nothing the agent does in /testbed reaches the image's copy; a
repository bigger than `disk` fails `create()`. Git's `core.checkStat=minimal` (and `trustCtime=false`)
in the container's environment keeps the prepared index valid for the copy (same sizes and mtimes, new
inodes and ctimes), so the first git command does not re-read the tree. All the sandbox's files, the copy
included, are RAM charged to its memory limit: one path never exceeds `disk`, and all of them never exceed
`memory`; keep `disk` well below `memory`. The cost: each sandbox holds its own copy of the repository in
RAM, made as it starts (98 MB of tree and 55 MB of .git: 1-1.5 s on the 2-core test box at load ~20;
`benchmarks/p3_sandbox_docker.py`). With `uid=None` (the image's own user) the home directory is not
writable. `disk=None`: no disk limit, a copy-on-write writable layer that can fill the engine's data root.
Why not `--storage-opt size` (the writable layer's quota): Docker refuses it on overlay2 over ext4 (the
common default, and this project's test engine), needs an xfs data root mounted with `pquota` (this
project's CI kernel has no XFS quota), and on btrfs counts the image's shared data against the limit,
fails writes with EDQUOT and is invisible to statfs, so a full layer cannot even be told.
`exhausted()`: "memory" and "pids" from the container's cgroup counters (memory `oom_kill`, pids `max`;
see `_common`): on the host when the engine runs here (readable even while the pids limit is held), else
from inside the container by one exec (which the pids limit refuses while it is held: then it tells once
those processes are gone); "disk" when one of the tmpfs mounts is found full (of blocks or inodes), asked
from inside by that exec when asked (a command that fills it and deletes its files before returning goes
unseen, and harmed no other sandbox).

Remote engines (`DOCKER_HOST` or `base_url` other than a unix socket: `tcp://`, `ssh://`). Everything the
backend does goes through the engine's API: task repositories from host paths are exported here and
uploaded into the prepared image; limits, exec, files, diff and the reaper work unchanged. Host paths do
not exist there, so `live_mounts` is False: a mount (the Pi bundle) becomes a named volume on the engine,
`swe-grpo-mount-<content hash>` (label `swe_grpo.mount=1`), filled once per engine and content through a
helper container and mounted read-only; a writable mount cannot be kept and is refused. With no live
mount there is no door: the agent reaches the InterceptionServer's `public_base_url` over the backend's
network (`host` by default: the remote machine's), with its per-rollout token, as `hf` does. A `tcp://`
engine without TLS is root on its machine for anyone who can reach the port: `start()` refuses one that
is not on the loopback (use TLS through `DOCKER_TLS_VERIFY`/`DOCKER_CERT_PATH`, or `ssh://`). Owner
labels carry this machine's host name, so the reaper of a later run on this machine removes the
containers of a dead run here; those of a dead client on another machine stay until a run there starts
(or `docker rm -f $(docker ps -aq --filter label=swe_grpo.sandbox=1)`).

Exec. The SDK blocks, so every call runs in the backend's own thread pool (sized for long agent runs,
which each hold a thread). `docker exec` has no timeout: on timeout or cancellation every process of
the exec is killed by its environment marker (see `_common`), `setsid` children included, before
`exec` returns or raises. An exec whose sandbox is destroyed under it ends with exit code 137 (or
`SandboxError` when it loses the race with the removal).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import io
import ipaddress
import logging
import os
import posixpath
import re
import socket
import tarfile
import tempfile
import time
import urllib.parse
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, TypeVar

import docker
import docker.errors
import requests
from docker.models.containers import Container
from docker.models.images import Image

from swe_grpo.sandbox.base import WORKDIR, ExecResult, FileTooLarge, Mount, Sandbox, SandboxBackend, SandboxError
from swe_grpo.sandbox.process import (
    EXEC_MARKER_VAR,
    PREPARE_TESTBED,
    CgroupLayout,
    Exhaustion,
    OutputTail,
    export_repo,
    kill_tree_argv,
    local_repo,
)
from swe_grpo.tasks import Task, swe_gym_image

log = logging.getLogger(__name__)
T = TypeVar("T")

#: The image used when a task has none: Debian bookworm minbase + git, python3, pytest, procps.
DEFAULT_IMAGE = "swe-grpo-base:bookworm"
SANDBOX_LABEL = "swe_grpo.sandbox"
OWNER_LABEL = "swe_grpo.owner"
TASK_LABEL = "swe_grpo.task"
IMAGE_LABEL = "swe_grpo.image"
MOUNT_LABEL = "swe_grpo.mount"
PREPARED_REPOSITORY = "swe-grpo-sandbox"
HOME = "/home/sandbox"
#: A hard-linked twin of /testbed in every prepared image: what a disk-limited sandbox copies into its tmpfs.
TWIN = "/var/lib/swe-grpo/testbed"
# Part of every prepared image's key: bump it when `PREPARE_TESTBED`, `_MAKE_TWIN` or the export changes.
_PREPARE_VERSION = "3"
# Run as root after `PREPARE_TESTBED` (same arguments), in the same layer, so the links share its files.
_MAKE_TWIN = f"""
rm -rf {TWIN} && mkdir -p {posixpath.dirname(TWIN)} && cp -al /testbed {TWIN}
"""
# Run as the sandbox user after git's index is refreshed: the twin gets the refreshed index (a new file).
_TWIN_INDEX = f"cp /testbed/.git/index {TWIN}/.git/index.new && mv {TWIN}/.git/index.new {TWIN}/.git/index"
# Git in a disk-limited sandbox trusts size and mtime (which the copy keeps), not inodes and ctimes (which
# it does not): otherwise the first git command re-reads the whole tree.
_GIT_STAT_ENV = {
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.checkStat",
    "GIT_CONFIG_VALUE_0": "minimal",
    "GIT_CONFIG_KEY_1": "core.trustCtime",
    "GIT_CONFIG_VALUE_1": "false",
}
# The most a tar archive of one file adds to it (headers with long names, padding, the end blocks).
_TAR_OVERHEAD = 64 << 10
# How long a killed exec may take to report back before the kill is declared a failure.
_KILL_GRACE_S = 15.0
# Prints the container's cgroup counters ("oom_kill N", "max N": v1 and v2 file names) and, for each
# writable path, "free BLOCKS INODES".
_READ_INSIDE = """
cat /sys/fs/cgroup/memory/memory.oom_control /sys/fs/cgroup/memory.events \\
  /sys/fs/cgroup/pids/pids.events /sys/fs/cgroup/pids.events 2>/dev/null | grep -E '^(oom_kill|max) '
for path in {paths}; do stat -f -c 'free %a %d' "$path" || exit 1; done
exit 0
"""
# In a mount's volume: the file whose presence says the copy is complete, and the fillers' lock.
_VOLUME_COMPLETE = ".swe-grpo-complete"
# Fills /m from /stage unless complete, under the lock, clearing what a filler that died left.
_FILL_VOLUME = f"""
exec 9>/m/.swe-grpo-lock && flock 9 || exit 1
[ -e /m/{_VOLUME_COMPLETE} ] && exit 0
find /m -mindepth 1 -maxdepth 1 ! -name .swe-grpo-lock -exec rm -rf {{}} +
cp -a /stage/. /m/ && touch /m/{_VOLUME_COMPLETE}
"""
_ENGINE_ERRORS = (docker.errors.DockerException, requests.RequestException)


@dataclass(frozen=True)
class DockerLimits:
    """Per-container limits (see the module docstring). `memory` is also the memory+swap limit (no swap);
    `disk` the size of each writable tmpfs (None: unlimited). `output_bytes` caps what `exec` keeps of each of
    stdout and stderr (the end is kept, as by the `local` backend)."""

    memory: str = "4g"
    cpus: float = 2.0
    pids: int = 1024
    disk: str | None = "2g"
    open_files: int = 1024  # RLIMIT_NOFILE of every process (soft and hard): at it, EMFILE
    output_bytes: int = 4 << 20


def _process_start(pid: int | str) -> str:
    # Field 22 of /proc/PID/stat (start time in clock ticks); fields are counted after the ")" that
    # closes the command name, which may itself contain spaces.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def _owner_alive(owner: str) -> bool:
    """Whether the process named by an owner label still runs. Another machine's owner counts as alive
    (not ours to judge); a malformed label as dead."""
    parts = owner.split("/")
    if len(parts) != 3:
        return False
    host, pid, start = parts
    if host != socket.gethostname():
        return True
    try:
        return _process_start(pid) == start
    except (OSError, IndexError):
        return False


def _loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", errors="replace")


class DockerSandbox(Sandbox):
    """One running container. Made by `DockerBackend.create`."""

    def __init__(self, backend: DockerBackend, container: Container, uid: int | None) -> None:
        self._backend = backend
        self._container = container
        self._uid = uid
        self._removal: asyncio.Future[None] | None = None
        self._exhaustion: Exhaustion | None = None
        self.id: str = container.id or ""
        self.name: str = container.name or ""

    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        argv = ["bash", "-lc", command] if isinstance(command, str) else list(command)
        marker = uuid.uuid4().hex
        started = time.monotonic()
        run = self._backend.submit(self._run, argv, {**(env or {}), EXEC_MARKER_VAR: marker}, cwd or self.workdir)
        try:
            # asyncio.wait neither cancels `run` on timeout nor when this task is cancelled: the thread
            # keeps reading the exec's output, which ends once its processes are killed.
            done, _ = await asyncio.wait({run}, timeout=timeout_s)
        except asyncio.CancelledError:
            try:
                await asyncio.shield(self._kill(marker, run))
            except SandboxError as e:
                log.warning("sandbox %s: %s", self.name, e)
            raise
        if not done:
            await self._kill(marker, run)
        try:
            exit_code, stdout, stderr = run.result()
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"exec in sandbox {self.name} failed: {e}") from e
        return ExecResult(
            exit_code=exit_code if done else None,
            stdout=stdout.text(),
            stderr=stderr.text(),
            timed_out=not done,
            wall_s=time.monotonic() - started,
        )

    def _run(self, argv: list[str], env: dict[str, str], cwd: str) -> tuple[int | None, OutputTail, OutputTail]:
        """Blocking: run one exec to its end, keeping the tail of its output."""
        api = self._backend.client.api
        exec_id = api.exec_create(self.id, argv, environment=env, workdir=cwd)["Id"]
        stdout, stderr = OutputTail(self._backend.limits.output_bytes), OutputTail(self._backend.limits.output_bytes)
        for out, err in api.exec_start(exec_id, stream=True, demux=True):
            stdout.add(out)
            stderr.add(err)
        return api.exec_inspect(exec_id)["ExitCode"], stdout, stderr

    async def _kill(self, marker: str, run: asyncio.Future[Any]) -> None:
        """Kill every process of the exec tagged `marker` and wait for the exec to end."""
        killer = self._backend.submit(self._container.exec_run, kill_tree_argv(marker))
        try:
            exit_code, output = await asyncio.wait_for(killer, _KILL_GRACE_S)
        except docker.errors.NotFound:
            return  # the container is gone, and its processes with it
        except (*_ENGINE_ERRORS, TimeoutError) as e:
            raise SandboxError(f"could not kill an exec in sandbox {self.name}: {e!r}") from e
        await asyncio.wait({run}, timeout=_KILL_GRACE_S)
        if exit_code != 0 or not run.done():
            raise SandboxError(f"processes of an exec in sandbox {self.name} survived the kill: {_text(output)}")

    async def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write `path` as the sandbox user would: missing parents are created by that user, and the
        file is owned by it (`SandboxError` where that user may not create the parents)."""
        parent, name = posixpath.split(path)
        if not posixpath.isabs(path) or not name:
            raise ValueError(f"put_file needs an absolute file path, not {path!r}")
        made = await self.exec(["mkdir", "-p", "--", parent], timeout_s=60)
        if made.exit_code != 0:
            raise SandboxError(f"cannot create {parent} in sandbox {self.name}: {made.stderr.strip()}")
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            info.uid = info.gid = self._uid or 0
            tar.addfile(info, io.BytesIO(data))
        try:
            await self._backend.submit(self._container.put_archive, parent, buffer.getvalue())
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot write {path} in sandbox {self.name}: {e}") from e

    async def get_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        def read() -> bytes:
            stream, stat = self._container.get_archive(path)
            if max_bytes is None:
                return b"".join(stream)
            archive = bytearray()
            for chunk in stream:  # the size in `stat` may be stale by the time the stream runs: count too
                archive += chunk
                if stat.get("size", 0) > max_bytes or len(archive) > max_bytes + _TAR_OVERHEAD:
                    stream.close()
                    raise FileTooLarge(path, max_bytes)
            return bytes(archive)

        try:
            archive = await self._backend.submit(read)
        except docker.errors.NotFound as e:
            raise SandboxError(f"{path} does not exist in sandbox {self.name}") from e
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot read {path} in sandbox {self.name}: {e}") from e
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            member = tar.next()
            extracted = tar.extractfile(member) if member is not None and member.isfile() else None
            if extracted is None:
                raise SandboxError(f"{path} in sandbox {self.name} is not a regular file")
            if max_bytes is not None and member.size > max_bytes:
                raise FileTooLarge(path, max_bytes)
            return extracted.read()

    async def exhausted(self) -> Exhaustion | None:
        if self._exhaustion is None and self._removal is None:
            try:
                self._exhaustion = await self._backend.submit(self._read_exhaustion)
            except _ENGINE_ERRORS as e:
                raise SandboxError(f"cannot inspect sandbox {self.name}: {e}") from e
        return self._exhaustion

    def _read_exhaustion(self) -> Exhaustion | None:
        """Blocking: the container's cgroup counters on the host where its processes are visible here (they
        can be read even at the pids limit); else, and for the disk, what one exec sees from inside."""
        self._container.reload()
        state = self._container.attrs["State"]
        layout = self._backend.cgroups
        cause: Exhaustion | None = None
        with contextlib.suppress(OSError, KeyError):  # e.g. an engine in another pid or cgroup namespace
            pid = state.get("Pid")
            if not self._backend.remote and layout and pid and self.id in Path(f"/proc/{pid}/cgroup").read_text():
                cause = layout.exhausted(*layout.of_process(pid))
        if cause is None and state.get("Running"):
            cause = self._read_inside()
        if cause is None and state.get("OOMKilled"):
            cause = "memory"
        return cause

    def _read_inside(self) -> Exhaustion | None:
        """Blocking: the container's own cgroup counters (v1 or v2, as mounted in it) and whether one of its
        tmpfs mounts has no block or no inode left, in one exec. None when the exec is refused (e.g. at the
        pids limit: the counters are read once its processes are gone)."""
        paths = " ".join(self._backend.writable_paths())
        try:
            exit_code, output = self._container.exec_run(["sh", "-c", _READ_INSIDE.format(paths=paths)])
        except _ENGINE_ERRORS:
            return None
        if exit_code != 0:
            return None
        rows = [line.split() for line in _text(output).splitlines() if line.strip()]
        if any(row[0] == "oom_kill" and int(row[1]) for row in rows):
            return "memory"
        if any(row[0] == "max" and int(row[1]) for row in rows):
            return "pids"
        if any(row[0] == "free" and "0" in row[1:] for row in rows):
            return "disk"
        return None

    async def destroy(self) -> None:
        """Remove the container (killing everything in it) and its anonymous volumes. Concurrent and
        repeated calls share one removal; a failed removal is retried by the next call."""
        if self._removal is None:
            self._removal = asyncio.ensure_future(self._remove())
        removal = self._removal
        try:
            await asyncio.shield(removal)
        except SandboxError:
            if self._removal is removal:
                self._removal = None
            raise

    async def _remove(self) -> None:
        with contextlib.suppress(*_ENGINE_ERRORS):  # the last look at its counters, which go with it
            if self._exhaustion is None:
                self._exhaustion = await self._backend.submit(self._read_exhaustion)
        try:
            await self._backend.submit(self._container.remove, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot remove sandbox {self.name}: {e}") from e
        self._backend.live.discard(self)


class DockerBackend(SandboxBackend):
    """Docker sandboxes (see the module docstring). `base_url` defaults to `DOCKER_HOST`, else the
    local socket; `uid=None` runs as the image's own user (root for SWE-bench images) with Docker's
    default capabilities; `network` is `host`, `none` or a network name."""

    name = "docker"

    def __init__(
        self,
        default_image: str = DEFAULT_IMAGE,
        *,
        limits: DockerLimits = DockerLimits(),
        network: str = "host",
        uid: int | None = 1000,
        base_url: str | None = None,
        max_concurrency: int = 256,
    ) -> None:
        self.default_image = default_image
        self.limits = limits
        self.network = network
        self.uid = uid
        self.base_url = base_url
        #: Whether the engine is reached other than by a unix socket, and so may be on another machine.
        self.remote = not (base_url or os.environ.get("DOCKER_HOST") or "unix://").startswith("unix://")
        self.live_mounts = not self.remote
        #: The address the InterceptionServer has from inside a sandbox.
        self.host_address = "host.docker.internal" if network not in ("host", "none") else "127.0.0.1"
        self.live: set[DockerSandbox] = set()
        self._max_concurrency = max_concurrency
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="swe-grpo-docker")
        self._client: docker.DockerClient | None = None
        self._owner = f"{socket.gethostname()}/{os.getpid()}/{_process_start(os.getpid())}"
        self._prepare_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._volume_locks: defaultdict[Path, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._volumes: dict[Path, str] = {}  # host path -> its volume on a remote engine
        #: This host's cgroup controllers, where `exhausted()` reads a local engine's containers (None: none).
        self.cgroups: CgroupLayout | None = None
        with contextlib.suppress(SandboxError):
            self.cgroups = CgroupLayout.detect()

    def writable_paths(self) -> list[str]:
        """Where a sandbox can write: the tmpfs mounts of the disk limit (none without one)."""
        if self.limits.disk is None:
            return []
        return [WORKDIR, "/tmp", "/var/tmp", *([HOME] if self.uid is not None else [])]

    def _tmpfs_volumes(self, size: str) -> list[docker.types.Mount]:
        """The writable paths as anonymous tmpfs volumes of `size` (removed with their container). Volumes,
        not Docker's `--tmpfs`: the engine mounts them itself, so `put_archive`/`get_archive` reach them."""
        common = f"size={size},nr_inodes={docker.utils.parse_bytes(size) // 4096}"
        owned = "mode=755" if self.uid is None else f"mode=755,uid={self.uid},gid={self.uid}"
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
        return asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            raise SandboxError("DockerBackend.start() was not called")
        return self._client

    async def start(self) -> None:
        """Connect to the engine (`SandboxError` with the cause if unreachable) and remove the containers
        of dead owners."""

        def connect() -> docker.DockerClient:
            pool = self._max_concurrency
            client = (
                docker.DockerClient(base_url=self.base_url, max_pool_size=pool)
                if self.base_url
                else docker.from_env(max_pool_size=pool)
            )
            client.ping()
            return client

        # Checked before any connection (the SDK asks the engine its version as it is made).
        url = urllib.parse.urlsplit(self.base_url or os.environ.get("DOCKER_HOST") or "")
        tls = not self.base_url and any(os.environ.get(v) for v in ("DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"))
        if url.scheme in ("tcp", "http") and not tls and not _loopback(url.hostname or ""):
            raise SandboxError(
                f"refusing the Docker engine at {url.geturl()}: plain tcp without TLS gives anyone who reaches that"
                " port root on its machine; use TLS (DOCKER_HOST with DOCKER_TLS_VERIFY=1, DOCKER_CERT_PATH) or ssh://"
            )
        try:
            self._client = await self.submit(connect)
        except _ENGINE_ERRORS as e:
            where = self.base_url or os.environ.get("DOCKER_HOST") or "the default socket"
            raise SandboxError(f"no Docker engine reachable at {where}: {e}") from e
        reaped = await self.submit(self._reap)
        if reaped:
            log.info("removed %d leftover sandbox containers: %s", len(reaped), ", ".join(reaped))

    def _reap(self) -> list[str]:
        reaped = []
        for container in self.client.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"}):
            if not _owner_alive(container.labels.get(OWNER_LABEL, "")):
                with contextlib.suppress(docker.errors.NotFound):
                    container.remove(force=True, v=True)
                    reaped.append(container.name or container.id or "?")
        return reaped

    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = True) -> DockerSandbox:
        image = await self._prepared_image(task)
        slug = re.sub(r"[^a-zA-Z0-9_.-]", "-", task.instance_id)[:40]
        kwargs: dict[str, Any] = {
            "image": image,
            "entrypoint": ["sleep", "infinity"],  # whatever the image's entrypoint: nothing runs but this
            "name": f"swe-grpo-{slug}-{uuid.uuid4().hex[:8]}",
            "init": True,  # PID 1 reaps orphans, so killed trees do not pile up as zombies
            "labels": {SANDBOX_LABEL: "1", OWNER_LABEL: self._owner, TASK_LABEL: task.instance_id},
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
            kwargs["mounts"] = [await self._volume_mount(m, image) for m in mounts]
        else:
            kwargs["volumes"] = {
                str(m.host_path): {"bind": m.sandbox_path, "mode": "rw" if m.writable else "ro"} for m in mounts
            }
        if disk := self.limits.disk:
            kwargs |= {"read_only": True, "mounts": kwargs.get("mounts", []) + self._tmpfs_volumes(disk)}
            kwargs["environment"] |= _GIT_STAT_ENV
        if self.uid is not None:
            kwargs |= {"user": f"{self.uid}:{self.uid}", "cap_drop": ["ALL"]}
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
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot start a sandbox for {task.instance_id} from {image}: {e}") from e
        except SandboxError as e:
            raise SandboxError(f"cannot start a sandbox for {task.instance_id}: {e}") from e
        sandbox = DockerSandbox(self, container, self.uid)
        self.live.add(sandbox)
        return sandbox

    def _run_container(self, kwargs: dict[str, Any]) -> Container:
        """Blocking: create and start the container; with a disk limit, copy the repository into its tmpfs."""
        container = self.client.containers.create(**kwargs)
        try:
            container.start()
            if self.limits.disk is not None:
                exit_code, output = container.exec_run(["cp", "-a", f"{TWIN}/.", f"{WORKDIR}/"])
                if exit_code != 0:
                    raise SandboxError(
                        f"the repository does not fit the sandbox's disk limit ({self.limits.disk}) "
                        f"or cannot be copied: {_text(output).strip()[-500:]}"
                    )
        except BaseException:
            container.remove(force=True, v=True)
            raise
        return container

    async def _discard(self, made: asyncio.Future[Container]) -> None:
        await asyncio.wait({made})
        if not made.cancelled() and made.exception() is None:
            with contextlib.suppress(*_ENGINE_ERRORS):
                await self.submit(made.result().remove, force=True, v=True)

    async def _image_exists(self, name: str) -> bool:
        try:
            await self.submit(self.client.images.get, name)
        except docker.errors.ImageNotFound:
            return False
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot inspect image {name}: {e}") from e
        return True

    async def _prepared_image(self, task: Task) -> str:
        """The prepared image for `task` (see the module docstring), built on first use."""
        source = task.image or swe_gym_image(task.instance_id)
        repo = None
        if not task.image and not await self._image_exists(source):
            repo = local_repo(task)
            if repo is None:
                raise SandboxError(
                    f"task {task.instance_id}: no image {source} here, and {task.repo!r} is not a local repository"
                )
            source = self.default_image
        try:
            image = await self.submit(self.client.images.get, source)
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"task {task.instance_id}: image {source} is not on this engine (pull it)") from e
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot inspect image {source}: {e}") from e
        parts = [_PREPARE_VERSION, image.id or "", task.base_commit, str(repo is not None), str(self.uid)]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
        tag = f"{PREPARED_REPOSITORY}:{key}"
        async with self._prepare_locks[key]:
            if not await self._image_exists(tag):
                # Shielded: a cancelled create must not stop a build halfway (its thread runs on).
                await asyncio.shield(self.submit(self._prepare, image, repo, task.base_commit, tag))
        return tag

    def _prepare(self, image: Image, repo: Path | None, commit: str, tag: str) -> None:
        """Build the prepared image in two committed steps: set /testbed up (as root), then refresh git's
        index as the sandbox user. The second step exists because a commit gives the files of its layer
        new inodes and ctimes: an index written before it matches in no sandbox, and every sandbox's
        first git command would re-read the whole tree (~0.5 s for 100 MB)."""
        source = image.tags[0] if image.tags else image.id
        uid = "" if self.uid is None else str(self.uid)
        config = image.attrs.get("Config") or {}
        # A commit takes the container's configuration: give the image back the source's user, entrypoint
        # and command, and blank our container labels (the engine merges labels, and a label on an image
        # passes to every container made from it).
        final = {
            "Labels": {IMAGE_LABEL: "1", SANDBOX_LABEL: "", OWNER_LABEL: ""},
            "User": config.get("User") or "0",
            "Entrypoint": config.get("Entrypoint") or [],
            "Cmd": config.get("Cmd") or ["sh"],
        }
        try:
            with tempfile.TemporaryDirectory(prefix="swe-grpo-repo-") as tmp, tempfile.TemporaryFile() as archive:
                if repo is not None:
                    export_repo(repo, commit, Path(tmp) / "testbed")
                    with tarfile.open(fileobj=archive, mode="w") as tar:
                        tar.add(Path(tmp) / "testbed", arcname="testbed")
                    archive.seek(0)
                set_up = self._step(
                    image.id,
                    ["sh", "-c", PREPARE_TESTBED + _MAKE_TWIN, "sh", commit, uid],
                    "0",
                    archive if repo is not None else None,
                    f"image {source} cannot be used for base commit {commit}",
                )
            try:
                user = f"{uid}:{uid}" if uid else final["User"]
                refresh = ["sh", "-c", f"git -C {WORKDIR} update-index -q --refresh && {_TWIN_INDEX}"]
                self._step(set_up, refresh, user, None, "refreshing git's index failed", tag, final)
            except BaseException:
                with contextlib.suppress(*_ENGINE_ERRORS):
                    self.client.images.remove(set_up)
                raise
        except _ENGINE_ERRORS as e:
            raise SandboxError(f"cannot prepare image {source}: {e}") from e

    def _step(
        self,
        image_id: str,
        argv: list[str],
        user: str,
        archive: IO[bytes] | None,
        failure: str,
        tag: str | None = None,
        conf: dict[str, Any] | None = None,
    ) -> str:
        """Run `argv` in a new container of `image_id` (`archive` extracted at / first) and commit it as
        `tag` (untagged if None) with configuration `conf`; returns the new image's id."""
        with self._helper(image_id, argv, user) as container:
            if archive is not None:
                container.put_archive("/", archive)
            container.start()
            if container.wait(timeout=1800).get("StatusCode") != 0:
                raise SandboxError(f"{failure}: {_text(container.logs()).strip()[-1000:]}")
            repository, _, name = (tag or "").partition(":")
            return container.commit(repository=repository or None, tag=name or None, conf=conf).id or ""

    @contextlib.contextmanager
    def _helper(self, image: str, argv: list[str], user: str, **kwargs: Any) -> Iterator[Container]:
        """Blocking: a created (not started) container without network that runs `argv`, removed on exit."""
        labels = {SANDBOX_LABEL: "1", OWNER_LABEL: self._owner}  # reaped if this process dies meanwhile
        container = self.client.containers.create(
            image, entrypoint=argv, user=user, network_mode="none", labels=labels, **kwargs
        )
        try:
            yield container
        finally:
            with contextlib.suppress(*_ENGINE_ERRORS):
                container.remove(force=True, v=True)

    async def _volume_mount(self, mount: Mount, image: str) -> docker.types.Mount:
        """A remote engine's stand-in for a bind mount: the volume holding a copy of `mount.host_path`
        (see the module docstring), mounted read-only."""
        if mount.writable:
            raise SandboxError(f"a remote Docker engine cannot mount {mount.host_path} writable (it is not there)")
        path = mount.host_path.resolve()
        async with self._volume_locks[path]:
            if path not in self._volumes:
                try:
                    self._volumes[path] = await asyncio.shield(self.submit(self._fill_volume, path, image))
                except _ENGINE_ERRORS as e:
                    raise SandboxError(f"cannot copy {path} to the Docker engine: {e}") from e
        return docker.types.Mount(mount.sandbox_path, self._volumes[path], read_only=True)

    def _fill_volume(self, path: Path, image: str) -> str:
        """Blocking: the volume named after `path`'s content (names, sizes, modes, mtimes), filled here
        unless an earlier run did: uploaded into a helper container, then copied into the volume under a
        lock, its completion marked last (a volume without the mark is filled again)."""
        digest = hashlib.sha256()
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                stat = os.lstat(os.path.join(root, name))
                entry = (os.path.relpath(os.path.join(root, name), path), stat.st_size, stat.st_mode, stat.st_mtime_ns)
                digest.update(repr(entry).encode())
        name = f"swe-grpo-mount-{digest.hexdigest()[:24]}"
        self.client.volumes.create(name, labels={MOUNT_LABEL: "1"})
        volumes = {name: {"bind": "/m", "mode": "rw"}}
        with self._helper(image, ["test", "-e", f"/m/{_VOLUME_COMPLETE}"], "0", volumes=volumes) as probe:
            probe.start()
            if probe.wait(timeout=300).get("StatusCode") == 0:
                return name
        with (
            tempfile.TemporaryFile() as archive,
            self._helper(image, ["sh", "-c", _FILL_VOLUME], "0", volumes=volumes) as fill,
        ):
            with tarfile.open(fileobj=archive, mode="w") as tar:
                tar.add(path, arcname="stage")
            archive.seek(0)
            fill.put_archive("/", archive)
            fill.start()
            if fill.wait(timeout=1800).get("StatusCode") != 0:
                raise SandboxError(f"cannot place the copy of {path} in volume {name}: {_text(fill.logs())[-500:]}")
        return name

    async def close(self) -> None:
        """Destroy the sandboxes still alive, then release the client and threads (images are kept)."""
        results = await asyncio.gather(*(sandbox.destroy() for sandbox in list(self.live)), return_exceptions=True)
        for error in results:
            if isinstance(error, BaseException):
                log.warning("closing the docker backend: %s", error)
        if self._client is not None:
            self._client.close()
            self._client = None
        self._pool.shutdown(wait=False, cancel_futures=True)
