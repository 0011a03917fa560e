"""`DockerSandbox`: one running container, made by `DockerBackend.create` (`backend.py`).

Exec. The SDK blocks, so every call runs in the backend's own thread pool (sized for long agent runs, which
each hold a thread). `docker exec` has no timeout: on timeout or cancellation every process of the exec is
killed by its environment marker (see `swe_grpo.sandbox.process`), `setsid` children included, before `exec`
returns or raises. An exec whose sandbox is destroyed under it ends with exit code 137 (or `SandboxError`
when it loses the race with the removal). `put_file` writes as the sandbox user would, `get_file` reads
through the engine's archive API, bounded by `max_bytes`. Every exec, the backend's own (the kill, the
counters) included, runs under the seccomp wrapper (`seccomp.py`): its tools are the image's, which a
sandbox running as root could have replaced.

`exhausted()`: "memory" and "pids" from the container's cgroup counters (memory `oom_kill`, pids `max`; see
`swe_grpo.sandbox.process.CgroupLayout`): on the host when the engine runs here (readable even while the
pids limit is held), else from inside the container by one exec (which the pids limit refuses while it is
held: then it tells once those processes are gone); "disk" when one of the tmpfs mounts is found full (of
blocks or inodes), asked from inside by that exec when asked (a command that fills it and deletes its files
before returning goes unseen, and harmed no other sandbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import posixpath
import tarfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import docker.errors
from docker.models.containers import Container

from swe_grpo.sandbox.base import ExecResult, Exhaustion, FileTooLarge, Sandbox, SandboxError
from swe_grpo.sandbox.docker.engine import ENGINE_ERRORS, Engine, text
from swe_grpo.sandbox.process import EXEC_MARKER_VAR, CgroupLayout, OutputTail, kill_tree_argv
from swe_grpo.sandbox.uids import UidLease

log = logging.getLogger(__name__)

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


class DockerSandbox(Sandbox):
    """One running container, made by `DockerBackend.create`: its calls go through `engine`; `uid` is the host
    uid its processes run as (None: the image's user), leased for it alone when `lease` is set (released once
    the container is removed); `output_bytes`
    caps what `exec` keeps of each stream; `writable_paths` are its tmpfs mounts; `cgroups` is this host's
    cgroup layout where the engine runs here (None: read the counters from inside); every exec's command
    runs under `exec_prefix` (the seccomp wrapper, `seccomp.py`); `on_removed` is told once the container
    is gone."""

    def __init__(
        self,
        engine: Engine,
        container: Container,
        *,
        uid: int | None,
        lease: UidLease | None,
        output_bytes: int,
        writable_paths: Sequence[str],
        cgroups: CgroupLayout | None,
        exec_prefix: Sequence[str],
        on_removed: Callable[[DockerSandbox], None],
    ) -> None:
        self._engine = engine
        self._container = container
        self.uid = uid
        self._lease = lease
        self._output_bytes = output_bytes
        self._writable_paths = list(writable_paths)
        self._cgroups = cgroups
        self._exec_prefix = list(exec_prefix)
        self._on_removed = on_removed
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
        argv = [*self._exec_prefix, *(["bash", "-lc", command] if isinstance(command, str) else command)]
        marker = uuid.uuid4().hex
        started = time.monotonic()
        run = self._engine.submit(self._run, argv, {**(env or {}), EXEC_MARKER_VAR: marker}, cwd or self.workdir)
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
        except ENGINE_ERRORS as e:
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
        api = self._engine.client.api
        exec_id = api.exec_create(self.id, argv, environment=env, workdir=cwd)["Id"]
        stdout, stderr = OutputTail(self._output_bytes), OutputTail(self._output_bytes)
        for out, err in api.exec_start(exec_id, stream=True, demux=True):
            stdout.add(out)
            stderr.add(err)
        return api.exec_inspect(exec_id)["ExitCode"], stdout, stderr

    async def _kill(self, marker: str, run: asyncio.Future[Any]) -> None:
        """Kill every process of the exec tagged `marker` and wait for the exec to end."""
        killer = self._engine.submit(self._container.exec_run, [*self._exec_prefix, *kill_tree_argv(marker)])
        try:
            exit_code, output = await asyncio.wait_for(killer, _KILL_GRACE_S)
        except docker.errors.NotFound:
            return  # the container is gone, and its processes with it
        except (*ENGINE_ERRORS, TimeoutError) as e:
            raise SandboxError(f"could not kill an exec in sandbox {self.name}: {e!r}") from e
        await asyncio.wait({run}, timeout=_KILL_GRACE_S)
        if exit_code != 0 or not run.done():
            raise SandboxError(f"processes of an exec in sandbox {self.name} survived the kill: {text(output)}")

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
            info.uid = info.gid = self.uid or 0
            tar.addfile(info, io.BytesIO(data))
        try:
            await self._engine.submit(self._container.put_archive, parent, buffer.getvalue())
        except ENGINE_ERRORS as e:
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
            archive = await self._engine.submit(read)
        except docker.errors.NotFound as e:
            raise SandboxError(f"{path} does not exist in sandbox {self.name}") from e
        except ENGINE_ERRORS as e:
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
                self._exhaustion = await self._engine.submit(self._read_exhaustion)
            except ENGINE_ERRORS as e:
                raise SandboxError(f"cannot inspect sandbox {self.name}: {e}") from e
        return self._exhaustion

    def _read_exhaustion(self) -> Exhaustion | None:
        """Blocking: the container's cgroup counters on the host where its processes are visible here (they
        can be read even at the pids limit); else, and for the disk, what one exec sees from inside."""
        self._container.reload()
        state = self._container.attrs["State"]
        layout = self._cgroups
        cause: Exhaustion | None = None
        with contextlib.suppress(OSError, KeyError):  # e.g. an engine in another pid or cgroup namespace
            pid = state.get("Pid")
            if layout and pid and self.id in Path(f"/proc/{pid}/cgroup").read_text():
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
        paths = " ".join(self._writable_paths)
        try:
            argv = [*self._exec_prefix, "sh", "-c", _READ_INSIDE.format(paths=paths)]
            exit_code, output = self._container.exec_run(argv)
        except ENGINE_ERRORS:
            return None
        if exit_code != 0:
            return None
        rows = [line.split() for line in text(output).splitlines() if line.strip()]
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
        with contextlib.suppress(*ENGINE_ERRORS):  # the last look at its counters, which go with it
            if self._exhaustion is None:
                self._exhaustion = await self._engine.submit(self._read_exhaustion)
        try:
            await self._engine.submit(self._container.remove, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot remove sandbox {self.name}: {e}") from e
        if self._lease is not None:
            self._lease.release()  # nothing runs as it any more: the container is gone
        self._on_removed(self)
