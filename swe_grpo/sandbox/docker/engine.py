"""The `docker` backend's dealings with the engine itself: connecting (and refusing an unsafe engine), whose
containers are whose (owner labels), removing the containers of dead owners, and short-lived helper
containers, through one backend's `Engine`.

Owners. Every container the backend makes is labelled `swe_grpo.sandbox=1` +
`swe_grpo.owner=<host>/<pid>/<start time>`. `reap` removes labelled containers whose owner process is gone
(crashed earlier runs), never those of a live process, so two runs on one engine do not reap each other.
Owner labels carry this machine's host name, so on a remote engine the reaper of a later run on this machine
removes the containers of a dead run here; those of a dead client on another machine stay until a run there
starts (or `docker rm -f $(docker ps -aq --filter label=swe_grpo.sandbox=1)`).

Transport. A `tcp://` engine without TLS is root on its machine for anyone who can reach the port:
`check_transport` refuses one that is not on the loopback (use TLS through `DOCKER_TLS_VERIFY`/
`DOCKER_CERT_PATH`, or `ssh://`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import os
import socket
import urllib.parse
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import docker
import docker.errors
import requests
from docker.models.containers import Container

from swe_grpo.sandbox.base import SandboxError

T = TypeVar("T")

log = logging.getLogger(__name__)

SANDBOX_LABEL = "swe_grpo.sandbox"
OWNER_LABEL = "swe_grpo.owner"
TASK_LABEL = "swe_grpo.task"
#: What a failed call to the engine raises.
ENGINE_ERRORS = (docker.errors.DockerException, requests.RequestException)


def text(data: bytes | None) -> str:
    """An engine's output as text (undecodable bytes replaced)."""
    return (data or b"").decode("utf-8", errors="replace")


def _process_start(pid: int | str) -> str:
    # Field 22 of /proc/PID/stat (start time in clock ticks); fields are counted after the ")" that
    # closes the command name, which may itself contain spaces.
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]


def owner_label() -> str:
    """This process's owner label: `<host>/<pid>/<start time>`."""
    return f"{socket.gethostname()}/{os.getpid()}/{_process_start(os.getpid())}"


def owner_alive(owner: str) -> bool:
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


def check_transport(base_url: str | None) -> None:
    """`SandboxError` for an engine reached by plain tcp, without TLS, off the loopback (`base_url`, else
    `DOCKER_HOST`). Checked before any connection: the SDK asks the engine its version as it is made."""
    url = urllib.parse.urlsplit(base_url or os.environ.get("DOCKER_HOST") or "")
    tls = not base_url and any(os.environ.get(v) for v in ("DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"))
    if url.scheme in ("tcp", "http") and not tls and not _loopback(url.hostname or ""):
        raise SandboxError(
            f"refusing the Docker engine at {url.geturl()}: plain tcp without TLS gives anyone who reaches that"
            " port root on its machine; use TLS (DOCKER_HOST with DOCKER_TLS_VERIFY=1, DOCKER_CERT_PATH) or ssh://"
        )


def connect(base_url: str | None, max_pool_size: int) -> docker.DockerClient:
    """A client of the engine at `base_url` (else the environment's), checked to answer."""
    client = (
        docker.DockerClient(base_url=base_url, max_pool_size=max_pool_size)
        if base_url
        else docker.from_env(max_pool_size=max_pool_size)
    )
    client.ping()
    return client


def reap(client: docker.DockerClient) -> list[str]:
    """Remove the labelled containers (and their anonymous volumes) whose owner is gone; their names. One the
    engine fails to remove is logged and left for a later start: a leftover never fails this one."""
    reaped = []
    for container in client.containers.list(all=True, filters={"label": f"{SANDBOX_LABEL}=1"}):
        if owner_alive(container.labels.get(OWNER_LABEL, "")):
            continue
        name = container.name or container.id or "?"
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            continue
        except ENGINE_ERRORS as e:
            log.warning("cannot remove the leftover sandbox container %s: %s", name, e)
            continue
        reaped.append(name)
    return reaped


class Engine:
    """One backend's link to the engine at `base_url` (else the environment's): the SDK client (after
    `open()`), the thread pool every blocking SDK call runs in (`submit`, sized for long agent runs, which
    each hold a thread), and the owner label of the containers it makes (`owner`)."""

    def __init__(self, base_url: str | None, max_concurrency: int) -> None:
        self.base_url = base_url
        self.owner = owner_label()
        self._max_concurrency = max_concurrency
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="swe-grpo-docker")
        self._client: docker.DockerClient | None = None

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run a blocking SDK call in the thread pool."""
        return asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    @property
    def client(self) -> docker.DockerClient:
        if self._client is None:
            raise SandboxError("DockerBackend.start() was not called")
        return self._client

    async def open(self) -> list[str]:
        """Connect (`SandboxError` with the cause if unreachable, or refused by `check_transport`) and remove
        the containers of dead owners; their names."""
        check_transport(self.base_url)
        try:
            self._client = await self.submit(connect, self.base_url, self._max_concurrency)
        except ENGINE_ERRORS as e:
            where = self.base_url or os.environ.get("DOCKER_HOST") or "the default socket"
            raise SandboxError(f"no Docker engine reachable at {where}: {e}") from e
        return await self.submit(reap, self._client)

    @contextlib.contextmanager
    def helper(self, image: str, argv: list[str], user: str, **kwargs: Any) -> Iterator[Container]:
        """Blocking: a created (not started) container without network that runs `argv`, removed on exit;
        labelled as this process's, so it is reaped if this process dies meanwhile."""
        labels = {SANDBOX_LABEL: "1", OWNER_LABEL: self.owner}
        container = self.client.containers.create(
            image, entrypoint=argv, user=user, network_mode="none", labels=labels, **kwargs
        )
        try:
            yield container
        finally:
            with contextlib.suppress(*ENGINE_ERRORS):
                container.remove(force=True, v=True)

    def close(self) -> None:
        """Release the client and the threads."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self._pool.shutdown(wait=False, cancel_futures=True)
