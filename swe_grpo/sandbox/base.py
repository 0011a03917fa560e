"""The sandbox interface: one isolated, disposable copy of a task's repository at its base commit.

A rollout creates one sandbox for the agent and, after the agent is done, a FRESH one for grading, so
nothing the agent left behind can change a grade. Backends (`local`, `docker`, `hf`) implement
`SandboxBackend.create`; everything else talks to `Sandbox` only.

Guarantees every backend gives:
- `exec` runs a command inside the sandbox; on timeout OR cancellation of the awaiting task the whole
  process tree inside is killed before it returns/raises. It never raises for a non-zero exit.
- `destroy` is idempotent and safe in `finally`; after it nothing of the sandbox remains (processes,
  mounts, containers, temporary directories).
- `get_file` returns the whole file, never a cut one (there is no output cap as on `exec`; `hf` refuses
  files over huggingface_hub's 512 MiB in-memory read limit with `SandboxError`).
- `diff(base_commit)` is the agent's work against the base commit whatever the agent did to git, read
  through a file, never cut, bounded in time and size; what the agent's doing makes untakeable raises a
  named `PatchError` (`PatchTooLarge`, `BaseCommitLost`, `DiffUnreadable`, `DiffTimeout`). Written once
  here, on `exec` and `get_file` only.
- Failures of the sandbox machinery itself raise `SandboxError` (an infrastructure failure, never a
  model failure), with the cause.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from swe_grpo.tasks import Task

#: Where the repository is inside every sandbox (SWE-bench images use this path too).
WORKDIR = "/testbed"


#: The largest patch `Sandbox.diff` returns unless told otherwise (bytes).
MAX_PATCH_BYTES = 32 << 20

#: The most lines of a patch `Sandbox.diff` returns unless told otherwise: what is done on the host with a patch
#: (splitting it, the grader's gate) costs per line, so short lines must not buy more work than the byte bound
#: means (10 M one-character lines fit in 30 MB). About the byte bound at 32 bytes a line.
MAX_PATCH_LINES = 1_000_000

#: How long `Sandbox.diff` may take unless told otherwise (seconds, in all).
DIFF_TIMEOUT_S = 120.0

#: What a sandbox ran out of, by its own doing: see `Sandbox.exhausted`.
Exhaustion = Literal["memory", "pids", "disk"]


class SandboxError(Exception):
    """The sandbox could not be created or used. An infrastructure failure, not the agent's."""


class FileTooLarge(Exception):
    """`Sandbox.get_file` was asked for a file larger than the caller's `max_bytes`: what the sandbox's
    content did (the caller names it), not a failure of the sandbox."""

    def __init__(self, path: str, limit: int) -> None:
        super().__init__(f"{path} is larger than {limit} bytes")
        self.limit = limit


class PatchError(Exception):
    """The agent's work cannot be taken as a patch, by what the agent did (not an infrastructure failure).
    `outcome` names it as a rollout outcome."""

    outcome: str


class PatchTooLarge(PatchError):
    """The patch is over a limit it was taken with, of bytes or of lines (never returned cut)."""

    outcome = "patch_too_large"

    def __init__(self, limit: int, unit: Literal["bytes", "lines"] = "bytes") -> None:
        super().__init__(f"the patch is larger than {limit} {unit}")
        self.limit = limit


class DiffUnreadable(PatchError):
    """git cannot read the agent's tree as a patch, by what the agent left in it: a tracked file replaced by
    a FIFO, socket or device, a file or directory it made unreadable, a symlink whose target is not UTF-8, an
    object store that borrows from elsewhere (`objects/info/alternates`) or holds anything but readable
    files and directories, a damaged object store."""

    outcome = "diff_unreadable"


class DiffTimeout(PatchError):
    """Taking the patch took longer than its bound (the agent's tree or object store is that costly to read,
    or a process the agent left keeps changing it)."""

    outcome = "diff_timeout"


class BaseCommitLost(PatchError):
    """The sandbox's repository no longer holds the objects of the base commit (the agent deleted them,
    e.g. `rm -rf .git`): the work cannot be diffed against it."""

    outcome = "base_commit_lost"


@dataclass(frozen=True)
class Mount:
    """A host directory made visible inside the sandbox (read-only unless `writable`)."""

    host_path: Path
    sandbox_path: str
    writable: bool = False


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when killed by the timeout
    stdout: str
    stderr: str
    timed_out: bool
    wall_s: float


class Sandbox(ABC):
    """A live sandbox. The repository is at `WORKDIR`, checked out at the task's base commit, with
    git available inside."""

    workdir: str = WORKDIR

    @abstractmethod
    async def exec(
        self,
        command: str | Sequence[str],
        *,
        timeout_s: float,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run `command` (a shell string, run with `bash -lc`, or an argv list) inside the sandbox.
        `env` is added to the sandbox's base environment (it is how secrets reach a process: never
        argv, never a file)."""

    @abstractmethod
    async def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file inside the sandbox (absolute path, parents created)."""

    @abstractmethod
    async def get_file(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """Read a file from inside the sandbox; `SandboxError` if it does not exist. With `max_bytes`, a file
        larger than that raises `FileTooLarge`, having been read (and held) no further than about that."""

    async def diff(
        self,
        base_commit: str,
        *,
        max_bytes: int = MAX_PATCH_BYTES,
        timeout_s: float = DIFF_TIMEOUT_S,
        max_lines: int = MAX_PATCH_LINES,
    ) -> str:
        """The agent's work: the working tree at `workdir` against `base_commit`, as a patch that
        `git apply` turns a checkout of `base_commit` into that tree.

        Only the files count, not what the agent did to git: commits, amends, branches, resets, a
        detached HEAD, a deleted or corrupted index all give the same patch for the same tree. Work the
        agent stashed (`git stash`) or reset away is not in the tree, so it is not in the patch. The patch
        holds every change git can record: modified, new (in new directories too) and deleted files,
        binary files, the executable bit, symlinks, any file name, the files of a repository the agent
        made inside the tree (not its `.git`); not empty directories, not untracked FIFOs, sockets or
        devices (git does not see them), and not the files the tree's own `.gitignore` files ignore unless
        the base commit tracks them (as `git add -A`).
        It is UTF-8 text: a file whose diff is not (non-UTF-8 text, a NUL byte) is a git binary patch.

        How: a scratch git directory and index under /tmp with a configuration of our own (no system,
        global or XDG files, no hooks, filters, fsmonitor, external diff or textconv, every
        content-converting attribute reset, no exclude file but the tree's `.gitignore`s), reading the
        repository's objects through `objects/info/alternates` and writing nothing into the repository (git
        may refresh the mtime of an object it finds there). So nothing in the agent's `.git` (config, hooks,
        HEAD, refs, index) or home directory can run code or change the patch; no login shell (whose
        profile the agent may write) is involved. The patch goes through a file and `get_file`: it is never
        cut, and never read back beyond `max_bytes`.

        Bounded: it takes at most `timeout_s` in all, and never waits on anything the agent left. Before
        git runs, the object store git reads must hold only readable files and directories (no FIFO,
        device, socket or symlink, which git would open and could block on, no `info/alternates` leading
        elsewhere), the tree no unreadable directory (git would skip it silently) and no `.git*` file that
        is not a regular file or a symlink (git opens `.gitignore` and `.gitattributes`). Its memory and
        processes are the sandbox's own (it runs inside, under the sandbox's limits).

        Not guaranteed: the agent runs as the same user, so it can tamper with what this relies on where
        it may: the git and bash binaries (only where it is root: `hf`, `docker` with `uid=None`), a
        process of its own still running (the backends end the agent's process tree first). Deleted
        objects of `base_commit` (`rm -rf .git`, a pruning gc) raise `BaseCommitLost`; otherwise damaged
        ones make git fail (`DiffUnreadable`) or give a patch that does not apply in grading, never a patch
        of someone else's work.

        Raises, each a `PatchError` the rollout names as the policy's outcome (reward 0.0): `PatchTooLarge`
        when the patch is over `max_bytes` or `max_lines`, both counted before anything parses it (it is never
        returned cut; when a file needs the binary form, the all-binary rendering it is taken from must fit
        too), `BaseCommitLost` (above), `DiffUnreadable` when
        what the agent left cannot be read as a patch (above; a symlink target that is not UTF-8, which git
        writes raw even in a binary patch, included), `DiffTimeout` past `timeout_s`. `SandboxError` only
        when the sandbox itself fails (an exec or a read that cannot be made)."""
        deadline = time.monotonic() + timeout_s
        scratch = f"/tmp/swe-grpo-diff-{uuid.uuid4().hex}"
        try:
            text = await self._render_patch(scratch, base_commit, "text", max_bytes, max_lines, deadline)
            sections = _sections(text)
            if all(_is_text(s) for s in sections):
                return text.decode()
            binary = await self._render_patch(scratch, base_commit, "binary", max_bytes, max_lines, deadline)
            patch = _merge_sections(sections, _sections(binary))
            if len(patch) > max_bytes:
                raise PatchTooLarge(max_bytes)
            return patch.decode()
        finally:
            with contextlib.suppress(SandboxError):
                await self.exec(["rm", "-rf", "--", scratch], timeout_s=60)

    async def _render_patch(
        self,
        scratch: str,
        base_commit: str,
        style: Literal["text", "binary"],
        max_bytes: int,
        max_lines: int,
        deadline: float,
    ) -> bytes:
        """Run `_DIFF_SCRIPT` in `style` (text: also check the tree and make the scratch git directory and
        index) within what is left until `deadline`, and read the patch it wrote, its lines counted first."""
        argv = ["bash", "-c", _DIFF_SCRIPT, "swe-grpo-diff", scratch, self.workdir, base_commit, style, str(max_bytes)]
        left = deadline - time.monotonic()
        result = await self.exec(argv, timeout_s=left, cwd="/") if left > 0 else None
        if result is None or result.timed_out:
            raise DiffTimeout("taking the patch took longer than its time bound")
        if result.exit_code == _BASE_LOST_EXIT:
            raise BaseCommitLost(f"the repository no longer holds base commit {base_commit}: {result.stderr[-500:]}")
        if result.exit_code != 0:
            raise DiffUnreadable(f"git cannot read the tree (exit {result.exit_code}): {result.stderr[-500:]}")
        size = int(result.stdout.split()[-1])
        if size > max_bytes:
            raise PatchTooLarge(max_bytes)
        try:
            patch = await self.get_file(f"{scratch}/patch", max_bytes=max_bytes)
        except FileTooLarge:
            patch = b""
        if len(patch) != size:  # only a process the agent left running can have changed it since
            raise DiffUnreadable(f"the {size}-byte patch changed while it was read back")
        if patch.count(b"\n") > max_lines:
            raise PatchTooLarge(max_lines, "lines")
        return patch

    async def exhausted(self) -> Exhaustion | None:
        """Which of its own limits the sandbox ran out of, if any: "memory" (a process was OOM-killed at
        the memory limit), "pids" (a fork or thread was refused at the process limit) or "disk" (its
        writable space was found full). Sticky: a limit hit once is reported until `destroy()`. The base
        class knows no limits and says None; `local` and `docker` say what they can (their docstrings)."""
        return None

    @abstractmethod
    async def destroy(self) -> None:
        """Kill everything and remove everything; idempotent."""

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.destroy()


class SandboxBackend(ABC):
    """Creates sandboxes of one kind. `start()` once (the docker backend reaps leftovers there),
    `create()` per sandbox, `close()` at the end."""

    name: str
    #: Whether a mount is the host directory itself, live (a unix socket in it can be connected to from
    #: inside), not a copy: what an agent's door (`swe_grpo.sandbox.door`) needs.
    live_mounts: bool = True

    async def start(self) -> None:  # noqa: B027  (optional hook)
        """Prepare the backend (check the engine, reap leftovers)."""

    @abstractmethod
    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = False) -> Sandbox:
        """A new sandbox with the task's repository at its base commit at `WORKDIR`, `mounts` visible inside.
        Without `network` (the default): no network at all, only a loopback of its own, so a caller's own
        loop is contained unless it asks; `network=True`: the backend's network (the host's, for `local`).
        Raises `SandboxError` when it cannot be made; never leaves anything behind when it fails."""

    async def close(self) -> None:  # noqa: B027  (optional hook)
        """Release what the backend holds (caches are kept); return once every `destroy()` begun has ended, a
        cancelled caller's too."""


# `Sandbox.diff`'s work inside the sandbox: $1 scratch directory, $2 work tree, $3 base commit, $4 style
# ("text": check what git will read, make the scratch git directory and index, then diff; "binary": diff
# again from them, every file as a binary patch), $5 the size limit. Writes $1/patch (at most limit + 1
# bytes: head stops git) and prints its size. Exit 3: the base commit's objects are gone; any other
# failure: git cannot read what the agent left.
_BASE_LOST_EXIT = 3
_DIFF_SCRIPT = r"""
set -u
scratch=$1 tree=$2 base=$3 style=$4 limit=$5
for name in $(compgen -e); do case $name in GIT_*) unset "$name" ;; esac; done
export GIT_DIR="$scratch/git" GIT_INDEX_FILE="$scratch/index" GIT_WORK_TREE="$tree" HOME="$scratch" \
  XDG_CONFIG_HOME="$scratch" GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_ATTR_NOSYSTEM=1 \
  GIT_NO_REPLACE_OBJECTS=1 GIT_TERMINAL_PROMPT=0 GIT_OPTIONAL_LOCKS=0 LC_ALL=C  # C: file names are bytes
g() { git -c safe.directory='*' "$@"; }
cd "$tree" || exit 1
if [ "$style" = text ]; then
  mkdir -m 700 "$scratch" && mkdir -p "$GIT_DIR/objects/info" "$GIT_DIR/refs" "$GIT_DIR/info" || exit 1
  echo 'ref: refs/heads/none' > "$GIT_DIR/HEAD"
  cat > "$GIT_DIR/config" <<'EOF'
[core]
  repositoryformatversion = 0
  bare = false
  filemode = true
  symlinks = true
  ignorecase = false
  autocrlf = false
  safecrlf = false
  quotePath = true
  hooksPath = /dev/null
  fsmonitor = false
  untrackedCache = false
  attributesFile = /dev/null
  excludesFile = /dev/null
[gc]
  auto = 0
EOF
  objects="$tree/.git/objects"
  [ -d "$objects" ] || { echo "$objects is gone" >&2; exit 3; }
  # git opens what the object store holds, and the stores its info/alternates names: a FIFO or a device
  # there would block it. So the store must be readable files and directories only, borrowing nothing.
  bad=$(find -H "$objects" \( \( ! -type f ! -type d \) -o ! -readable -o \( -type d ! -executable \) \
    -o -path "$objects/info/alternates" \) -print -quit 2>/dev/null)
  [ -z "$bad" ] || { echo "the object store holds $bad: only readable files and directories may be there" >&2; exit 1; }
  # git skips a directory it cannot read without a word (its files would be missing from the patch), and
  # opens every .gitignore and .gitattributes it meets (a FIFO would block it).
  bad=$(find "$tree" -name .git -prune -o \( -type d ! \( -readable -executable \) -o -name '.git?*' ! -type f \
    ! -type l \) -print -quit 2>/dev/null)
  [ -z "$bad" ] || { echo "the tree holds $bad, which git cannot read" >&2; exit 1; }
  echo "$objects" > "$GIT_DIR/objects/info/alternates"
  # rev-list --objects fails on any missing object of the base commit's tree, blobs included.
  g rev-list --objects --no-walk "$base^{commit}" > /dev/null && g read-tree "$base" || exit 3
fi
# Highest-precedence attributes: no content conversion at all; diff as text unless style is binary.
if [ "$style" = text ]; then diff='!diff'; else diff='-diff'; fi
echo "* $diff !text !eol !crlf !ident !filter !working-tree-encoding" > "$GIT_DIR/info/attributes"
if [ "$style" = text ]; then
  # The refresh hashes the files the base commit has without writing objects, so only changed and new
  # files are written (writing an object the repository has makes git touch its pack: on an overlay
  # filesystem a copy-up of the whole pack).
  g update-index -q --refresh > /dev/null
  g add -u >&2 || exit 1
  # Untracked files. A directory holding its own repository is listed as "dir/" (`git add -A` would
  # record it as a bare gitlink, or fail on one without a commit): its files count as any others.
  g ls-files -z -o --exclude-standard > "$scratch/new" || exit 1
  grep -zv '/$' "$scratch/new" | g update-index -z --add --replace --stdin || exit 1
  grep -z '/$' "$scratch/new" | while IFS= read -r -d '' dir; do
    find "./$dir" -name .git -prune -o \( -type f -o -type l \) -print0
  done | g check-ignore -z -v -n --stdin | while IFS= read -r -d '' source && IFS= read -r -d '' _ &&
    IFS= read -r -d '' _ && IFS= read -r -d '' path; do
    [ -n "$source" ] || printf '%s\0' "$path"
  done | g update-index -z --add --replace --stdin || exit 1
fi
g diff --cached --binary --full-index --no-renames --no-color --no-ext-diff --no-textconv \
  --src-prefix=a/ --dst-prefix=b/ "$base" -- | head -c $((limit + 1)) > "$scratch/patch"
status="${PIPESTATUS[*]}"
size=$(wc -c < "$scratch/patch") || exit 1
echo "$size"
# Over the limit git died of SIGPIPE: the size is all that counts then.
[ "$size" -gt "$limit" ] || [ "$status" = "0 0" ]
"""


def _sections(patch: bytes) -> list[bytes]:
    """A patch's per-file sections, each from its `diff --git` line (no other line of a patch starts so)."""
    return [section for section in re.split(rb"(?m)^(?=diff --git )", patch) if section]


def _is_text(section: bytes) -> bool:
    """Whether a section survives `str`: UTF-8 and no NUL byte (git diffs a file as text when its first
    8000 bytes hold no NUL, whatever its encoding)."""
    try:
        section.decode()
    except UnicodeDecodeError:
        return False
    return b"\0" not in section


def _merge_sections(text: list[bytes], binary: list[bytes]) -> bytes:
    """`text`'s sections with each one that is not text replaced by the same file's binary section (the
    two renderings of one diff have the same files in the same order)."""
    if [s.split(b"\n", 1)[0] for s in text] != [s.split(b"\n", 1)[0] for s in binary]:
        # Only a process the agent left running can have changed the tree between the two renderings.
        raise DiffUnreadable("the text and binary renderings of the patch name different files")
    merged = [t if _is_text(t) else b for t, b in zip(text, binary, strict=True)]
    if not all(_is_text(section) for section in merged):
        raise DiffUnreadable("a change has no text form (a symlink target that is not UTF-8?)")
    return b"".join(merged)


def owner_gone(name: str, prefix: str) -> bool:
    """Whether `name`, made as `<prefix><pid>-...` by the process `pid`, belongs to a process that is gone
    (what a killed process left on the host: sandbox directories, cgroups, doors)."""
    owner = re.match(rf"{re.escape(prefix)}(\d+)-", name)
    if owner is None:
        return False
    try:
        os.kill(int(owner.group(1)), 0)  # as root, only a missing process fails
    except ProcessLookupError:
        return True
    return False
