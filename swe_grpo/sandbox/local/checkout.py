"""The `local` backend's cache of checkouts: a task's repository checked out once per (repo, base commit)
into `cache_dir` (default `cache_root()/checkouts`), owned by the unprivileged sandbox user, holding the
base commit and its history only (no later commit, no tag), on branch `main`. Sandboxes see it read-only,
under a copy-on-write view (`cow.py`). Safe to fill from several tasks and processes at once: a checkout
directory that exists is complete."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from swe_grpo.sandbox.base import SandboxError
from swe_grpo.sandbox.local.host import check

if TYPE_CHECKING:
    from swe_grpo.tasks import Task

log = logging.getLogger(__name__)


class CheckoutCache:
    """The checkouts under `cache_dir`, owned by `uid`:`gid` (see the module docstring)."""

    def __init__(self, cache_dir: Path, uid: int, gid: int) -> None:
        self.cache_dir = cache_dir
        self.uid, self.gid = uid, gid
        self._fill_locks: dict[str, asyncio.Lock] = {}

    async def get(self, task: Task) -> Path:
        """The cached checkout of the task's repo at its base commit, made on first use. Concurrent
        callers (in this process: an asyncio lock; across processes: a file lock) fill it once."""
        source, is_bundle = git_source(task.repo)
        digest = hashlib.sha256(f"{source}\n{task.base_commit}".encode()).hexdigest()[:16]
        dest = self.cache_dir / f"{re.sub(r'[^A-Za-z0-9._-]', '_', Path(source).name)[:40]}-{digest}"
        if dest.is_dir():
            return dest
        async with self._fill_locks.setdefault(dest.name, asyncio.Lock()):
            await asyncio.to_thread(self._fill_locked, source, is_bundle, task, dest)
        return dest

    def _fill_locked(self, source: str, is_bundle: bool, task: Task, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / f"{dest.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if dest.is_dir():
                return
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.{os.getpid()}-", suffix=".tmp", dir=dest.parent))
            try:
                self._fill(source, is_bundle, task, tmp)
                tmp.rename(dest)  # atomic: a checkout directory that exists is complete
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        log.info("cached %s@%s in %s", task.repo, task.base_commit, dest)

    def _fill(self, source: str, is_bundle: bool, task: Task, tmp: Path) -> None:
        commit = task.base_commit

        def git(*args: str) -> None:
            check(["git", "-C", str(tmp), *args], what=f"{task.repo}@{commit}")

        git("init", "-q")
        try:
            # Fetching just the commit brings only its history: the agent cannot find the fix in later
            # commits.
            git("fetch", "-q", "--no-tags", "--", source, commit)
        except SandboxError as e:
            if source.startswith("https://"):
                hint = "this box may not reach GitHub: give Task.repo as a local path or bundle"
                raise SandboxError(f"{e}\n({hint})") from e
            raise
        git("checkout", "-q", "-B", "main", commit)  # on a branch, as the docker backend's /testbed is
        (tmp / ".git" / "FETCH_HEAD").unlink()  # names the host path
        if is_bundle:  # a bundle hands over its whole pack: drop the objects the commit does not reach
            git("repack", "-a", "-d", "-q")
            git("prune", "--expire=now")
        tmp.chmod(0o755)  # becomes /testbed's mode
        # -h: a symlink in the repository must not make us chown its target on the host.
        check(["chown", "-hR", f"{self.uid}:{self.gid}", str(tmp)], what="chown")
        # chown changed every ctime and uid the index recorded: refresh it, or the first `git status`
        # inside re-hashes the whole tree. git rewrites the index as root, so hand it back.
        git("update-index", "-q", "--refresh")
        os.chown(tmp / ".git" / "index", self.uid, self.gid)


def git_source(repo: str) -> tuple[str, bool]:
    """What `git fetch` gets for `Task.repo`, and whether it is a bundle file."""
    if os.path.isabs(repo):
        if not os.path.exists(repo):
            raise SandboxError(f"task repository {repo} does not exist")
        return os.path.realpath(repo), os.path.isfile(repo)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
        return f"https://github.com/{repo}", False
    raise SandboxError(f"Task.repo {repo!r} is neither an absolute path nor a GitHub owner/name")
