"""Which image a `docker` sandbox runs, and the prepared images every sandbox of a task starts from.

Which image. `task.image` if set; else the SWE-Gym image of the task (`xingyaoww/sweb.eval.x86_64.<id>`)
when it exists on the engine; else the backend's default image (`DEFAULT_IMAGE`: an offline Debian with git,
python3 and pytest; see `tests/docker_env.py`), into which the task's local repository (a path or a git
bundle) is put. A `task.image` labelled `swe_grpo.environment=1` (`ENVIRONMENT_LABEL`: an environment image,
the project's dependencies without its code, as `swe-grpo tasks synth` builds them) gets the task's local
repository put in the same way. Images are never pulled: pull them first.

Prepared images. Before its first sandbox, each (source image, base commit, sandbox uid) becomes a
"prepared" image, built once and kept (`swe-grpo-sandbox:<key>`, label `swe_grpo.image=1`): the repository
at the base commit in /testbed (copied in for the default image, with no remote, branch or object beyond
the base commit), checked to be at the base commit, owned by the sandbox user, with a home directory, a
system git configuration (`safe.directory=*`, a committer identity), a git index that matches the image's
files (so no sandbox re-reads the tree on its first git command), and a hard-linked twin of /testbed at
`TWIN` (what a disk-limited sandbox copies into its tmpfs). Every sandbox is then a copy-on-write container
of that image: no per-sandbox copy of the repository on the host, nothing on the host to clean up. Prepared
images add up (about one repository's size per task): remove them with
`docker image prune -a --filter label=swe_grpo.image=1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import posixpath
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

import docker.errors
from docker.models.images import Image

from swe_grpo.sandbox.base import WORKDIR, SandboxError
from swe_grpo.sandbox.docker.engine import ENGINE_ERRORS, OWNER_LABEL, SANDBOX_LABEL, Engine, text
from swe_grpo.sandbox.process import PREPARE_TESTBED, export_repo, local_repo
from swe_grpo.tasks import Task, swe_gym_image

#: The image used when a task has none: Debian bookworm minbase + git, python3, pytest, procps.
DEFAULT_IMAGE = "swe-grpo-base:bookworm"
IMAGE_LABEL = "swe_grpo.image"
#: On an image that holds a project's environment but not its code: the task's repository is put into it.
ENVIRONMENT_LABEL = "swe_grpo.environment"
PREPARED_REPOSITORY = "swe-grpo-sandbox"
#: A hard-linked twin of /testbed in every prepared image: what a disk-limited sandbox copies into its tmpfs.
TWIN = "/var/lib/swe-grpo/testbed"
# Part of every prepared image's key: bump it when `PREPARE_TESTBED`, `_MAKE_TWIN` or the export changes.
_PREPARE_VERSION = "4"
# Run as root after `PREPARE_TESTBED` (same arguments), in the same layer, so the links share its files. Every
# file readable by all: a sandbox's copy is made by the uid leased for it (`backend.py`), not the owner.
_MAKE_TWIN = f"""
rm -rf {TWIN} && mkdir -p {posixpath.dirname(TWIN)} && cp -al /testbed {TWIN} && chmod -R a+rX {TWIN}
"""
# Run as the sandbox user after git's index is refreshed: the twin gets the refreshed index (a new file).
_TWIN_INDEX = f"cp /testbed/.git/index {TWIN}/.git/index.new && mv {TWIN}/.git/index.new {TWIN}/.git/index"


class PreparedImages:
    """The prepared images on `engine` for sandboxes that run as `uid` (None: the image's own user), made from
    `default_image` for a task without an image of its own: `get(task)` builds a task's on first use, once
    however many sandboxes ask at once."""

    def __init__(self, engine: Engine, default_image: str, uid: int | None) -> None:
        self._engine = engine
        self.default_image = default_image
        self.uid = uid
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def exists(self, name: str) -> bool:
        """Whether the engine has image `name`."""
        try:
            await self._engine.submit(self._engine.client.images.get, name)
        except docker.errors.ImageNotFound:
            return False
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot inspect image {name}: {e}") from e
        return True

    async def get(self, task: Task) -> str:
        """The tag of the prepared image for `task` (see the module docstring), built on first use."""
        engine = self._engine
        source = task.image or swe_gym_image(task.instance_id)
        repo = None
        if not task.image and not await self.exists(source):
            repo = local_repo(task)
            if repo is None:
                raise SandboxError(
                    f"task {task.instance_id}: no image {source} here, and {task.repo!r} is not a local repository"
                )
            source = self.default_image
        try:
            image = await engine.submit(engine.client.images.get, source)
        except docker.errors.ImageNotFound as e:
            raise SandboxError(f"task {task.instance_id}: image {source} is not on this engine (pull it)") from e
        except ENGINE_ERRORS as e:
            raise SandboxError(f"cannot inspect image {source}: {e}") from e
        if task.image and (image.labels or {}).get(ENVIRONMENT_LABEL) == "1":
            repo = local_repo(task)
            if repo is None:
                raise SandboxError(f"task {task.instance_id}: {source} holds no code, and {task.repo!r} is not local")
        parts = [_PREPARE_VERSION, image.id or "", task.base_commit, str(repo is not None), str(self.uid)]
        key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]
        tag = f"{PREPARED_REPOSITORY}:{key}"
        async with self._locks[key]:
            if not await self.exists(tag):
                # Shielded: a cancelled create must not stop a build halfway (its thread runs on).
                await asyncio.shield(engine.submit(self._prepare, image, repo, task.base_commit, tag))
        return tag

    def _prepare(self, image: Image, repo: Path | None, commit: str, tag: str) -> None:
        """Build the prepared image in two committed steps: set /testbed up (as root), then refresh git's
        index as the sandbox user. The second step exists because a commit gives the files of its layer
        new inodes and ctimes: an index written before it matches in no sandbox, and every sandbox's
        first git command would re-read the whole tree."""
        client = self._engine.client
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
                with contextlib.suppress(*ENGINE_ERRORS):
                    client.images.remove(set_up)
                raise
        except ENGINE_ERRORS as e:
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
        with self._engine.helper(image_id, argv, user) as container:
            if archive is not None:
                container.put_archive("/", archive)
            container.start()
            if container.wait(timeout=1800).get("StatusCode") != 0:
                raise SandboxError(f"{failure}: {text(container.logs()).strip()[-1000:]}")
            repository, _, name = (tag or "").partition(":")
            return container.commit(repository=repository or None, tag=name or None, conf=conf).id or ""
