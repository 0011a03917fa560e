"""A Docker engine and the offline base image for tests and benchmarks, on a machine with no registry.

`docker_engine()` uses an engine that is already reachable (`DOCKER_HOST`, else the default socket).
Otherwise, as root, it starts a private `dockerd` (no bridge, no iptables: it leaves the host's network
alone) whose data root is under the swe_grpo cache, so images survive across runs, and stops it when
the `with` block ends; one session at a time per cache (a file lock; others wait). `ensure_base_image()`
builds `swe-grpo-base:bookworm` when it is missing: `debootstrap --variant=minbase` from the Debian
mirror apt uses here, trimmed, then `docker import` (~100 s once). Both raise `DockerUnavailable` with
the cause when they cannot; tests turn that into a skip that prints it.

On CI (`CI=true`) they raise `DockerRequired` instead, which no test turns into a skip: a CI run without a
Docker engine fails rather than passing with the Docker tests skipped.

`python tests/docker_env.py` does both once (a setup step): it leaves the image built and the engine
stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import docker
import docker.errors
import requests

from swe_grpo.paths import cache_root
from swe_grpo.sandbox.docker import DEFAULT_IMAGE

SUITE = "bookworm"
# What the image must hold: git (diff, repository set-up), python3 + pytest (task tests), procps (`ps`).
PACKAGES = "git,python3,python3-pytest,procps,ca-certificates"
FALLBACK_MIRROR = "http://deb.debian.org/debian"


class DockerUnavailable(Exception):
    """No Docker engine could be reached or started, or the base image could not be built: the tests that
    need one skip."""


class DockerRequired(RuntimeError):
    """As `DockerUnavailable`, where an engine is required (`must_have_docker`): the tests that need one fail."""


def must_have_docker(env: Mapping[str, str] = os.environ) -> bool:
    """Whether a missing engine fails the tests instead of skipping them: on CI (`CI=true`, as GitHub Actions,
    GitLab CI and most others set it), where a skip would pass a run in which no Docker test ran."""
    return env.get("CI", "").strip().lower() in ("true", "1", "yes")


def unavailable(reason: str) -> DockerUnavailable | DockerRequired:
    """The error for an engine that cannot be had: `DockerRequired` where one must be, else `DockerUnavailable`."""
    if must_have_docker():
        return DockerRequired(f"{reason}\n(CI is set: the Docker tests must run, not skip)")
    return DockerUnavailable(reason)


def _reachable(url: str) -> bool:
    try:
        with contextlib.closing(docker.DockerClient(base_url=url, timeout=10)) as client:
            return bool(client.ping())
    except (docker.errors.DockerException, requests.RequestException):
        return False


@contextlib.contextmanager
def docker_engine(wait_s: float = 900) -> Iterator[str]:
    """Yield the URL of a working Docker engine; a private dockerd started here is stopped on exit.
    One private dockerd per cache directory at a time: a second session waits (up to `wait_s`) for the
    first to finish, as two engines on one data root would corrupt it."""
    url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if _reachable(url):
        yield url
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        raise unavailable(f"no Docker engine at {url}, and a private dockerd needs root and `dockerd`")
    home = cache_root() / "docker"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "dockerd.lock", "w") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise unavailable(f"another session holds the private dockerd of {home}") from None
                time.sleep(1)
        # The exec root holds containerd's unix sockets: a short path (108-byte limit), fixed per data root
        # so that a dockerd started after a crash finds the containers the crashed one left running.
        exec_root = Path(f"/run/swe-grpo-dockerd-{hashlib.sha256(str(home).encode()).hexdigest()[:8]}")
        with _private_dockerd(home, exec_root, f"unix://{exec_root / 'docker.sock'}") as url:
            yield url


@contextlib.contextmanager
def tcp_engine(source_url: str, images: tuple[str, ...] = (DEFAULT_IMAGE,)) -> Iterator[str]:
    """A second, throwaway dockerd made from nothing, reached over plain tcp on 127.0.0.1 (a stand-in for a
    remote engine: it shares no path with this process's idea of the engine), with `images` copied from
    the engine at `source_url`; stopped and its data root removed on exit. Needs root. While it runs, any
    local user who connects to its port is root here: it lives only as long as the tests that use it."""
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        raise unavailable("a second dockerd needs root and `dockerd`")
    cache_root().mkdir(parents=True, exist_ok=True)
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="swe-grpo-tcp-dockerd-", dir=cache_root()) as home:
        exec_root = Path(f"/run/swe-grpo-dockerd-tcp-{port}")
        with _private_dockerd(Path(home), exec_root, f"tcp://127.0.0.1:{port}") as url:
            with (
                contextlib.closing(docker.DockerClient(base_url=source_url)) as source,
                contextlib.closing(docker.DockerClient(base_url=url)) as target,
            ):
                for image in images:  # streamed engine to engine: no copy of the archive on disk
                    target.images.load(source.api.get_image(image))
            yield url
        shutil.rmtree(exec_root, ignore_errors=True)


@contextlib.contextmanager
def _private_dockerd(home: Path, exec_root: Path, url: str) -> Iterator[str]:
    """A dockerd with its data in `home` and its state in `exec_root`, listening at `url`, until exit."""
    log_path = home / "dockerd.log"
    cmd = [
        "dockerd",
        f"--data-root={home / 'data'}",
        f"--exec-root={exec_root}",
        f"--pidfile={exec_root / 'dockerd.pid'}",
        f"--host={url}",
        # No bridge, no iptables: this must not touch the host's firewall or network; sandboxes use the
        # host network (or none).
        "--iptables=false",
        "--ip-masq=false",
        "--bridge=none",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _reachable(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise unavailable(f"dockerd did not start ({' '.join(cmd)}); log tail:\n{tail}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # dockerd then stops its containers and its containerd
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _unmount_under(exec_root)


def _unmount_under(root: Path) -> None:
    """Unmount what dockerd left mounted under `root` (it bind-mounts the host's network namespace at
    `netns/default` and does not unmount it when it stops)."""
    mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{root}/")), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", mount], capture_output=True)


def debian_mirror() -> str:
    """The Debian mirror apt uses here (`$SWE_GRPO_DEBIAN_MIRROR` overrides): the first source of the
    `bookworm` suite in /etc/apt/sources.list or /etc/apt/sources.list.d/ (one-line or deb822 format)."""
    if mirror := os.environ.get("SWE_GRPO_DEBIAN_MIRROR"):
        return mirror
    apt = Path("/etc/apt")
    for path in [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*"))]:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for stanza in re.split(r"\n\s*\n", text):  # deb822: "URIs: ..." and "Suites: ..." in one stanza
            fields = dict(re.findall(r"^(\w+):\s*(.*)$", stanza, re.MULTILINE))
            if "URIs" in fields and SUITE in fields.get("Suites", "").split():
                return fields["URIs"].split()[0]
        for line in text.splitlines():  # one-line: "deb [options] URI SUITE COMPONENTS"
            words = re.sub(r"\[[^]]*\]", "", line).split()
            if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
                return words[1]
    return FALLBACK_MIRROR


def ensure_base_image(url: str, image: str = DEFAULT_IMAGE) -> str:
    """Build `image` on the engine at `url` unless it exists; returns its name."""
    with contextlib.closing(docker.DockerClient(base_url=url)) as client:
        if client.images.list(name=image):
            return image
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        raise unavailable(f"{image} is missing, and building it needs root and `debootstrap`")
    mirror = debian_mirror()
    with tempfile.TemporaryDirectory(prefix="swe-rootfs-", dir=cache_root()) as tmp:
        rootfs = Path(tmp) / "rootfs"
        build = (
            f"debootstrap --variant=minbase --include={PACKAGES} {SUITE} {rootfs} {mirror} >{tmp}/debootstrap.log"
            # Package caches, apt lists, docs and locales are a third of the tree and useless inside.
            f" && rm -rf {rootfs}/var/cache/apt/archives/*.deb {rootfs}/var/lib/apt/lists/*"
            f" {rootfs}/usr/share/doc/* {rootfs}/usr/share/man/* {rootfs}/usr/share/locale/*"
            f" && tar -C {rootfs} -c . | docker -H {url} import"
            " --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'"
            f" --change 'ENV LANG=C.UTF-8' - {image} >/dev/null"
        )
        done = subprocess.run(["bash", "-o", "pipefail", "-c", build], capture_output=True, text=True)
        if done.returncode != 0:
            log = Path(tmp, "debootstrap.log")
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise unavailable(f"building {image} failed: {done.stderr[-2000:]}\n{tail}")
    return image


if __name__ == "__main__":
    started = time.monotonic()
    with docker_engine() as engine_url:
        print(f"{ensure_base_image(engine_url)} ready on {engine_url} ({time.monotonic() - started:.0f} s)")
