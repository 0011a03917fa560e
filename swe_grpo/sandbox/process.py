"""Pieces the container backends (`docker`, `hf`) share: where a task's repository comes from, how /testbed
is checked and set up, how much output an exec keeps, and how to kill everything one `exec` started.

Killing a process tree inside a container: neither `docker exec` nor an HF sandbox's `run` kills
children that left the process group (`setsid cmd &`). Every exec therefore carries a unique marker in
its environment, which every descendant inherits, and the kill finds the processes by that marker in
`/proc/*/environ`. It runs as the same user as the exec (a process may read the environ of its own
user's processes; no capability is needed). What escapes it: a descendant that replaces its whole
environment (`env -i ...`) or changes user; destroying the sandbox removes those too.

Cgroups (used by `local`, which makes one per sandbox, and by `docker`, which reads its containers'). The
memory, pids and cpu controllers are found in /proc/self/mountinfo: cgroup v1 (a hierarchy per controller,
as on hosts with a hybrid `unified` mount that carries no controller) or v2 (one hierarchy). Exhaustion
is read from counters the kernel only ever increments: memory `oom_kill` (v1 `memory.oom_control`, v2
`memory.events`) and pids `max` (`pids.events`, both versions), so a limit hit once stays visible.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from swe_grpo.sandbox.base import Exhaustion, SandboxError
from swe_grpo.tasks import Task

#: The environment variable that tags every process an exec starts (see the module docstring).
EXEC_MARKER_VAR = "SWE_GRPO_EXEC_ID"

# Kills every process whose environment holds `$1=$2` (the marker), repeating until none is left, so a
# process forked while the previous round was killing is caught by the next one. `grep -z` reads each
# environ as NUL-separated entries; zombies have an empty environ, so they do not keep the loop going.
# Bounded so a process stuck in the kernel cannot hang the caller; the caller checks the result.
_KILL_SCRIPT = """
m="$1=$2"
i=0
while [ $i -lt 50 ]; do
  pids=$(grep -lzxF -- "$m" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  [ -z "$pids" ] && exit 0
  kill -KILL $pids 2>/dev/null
  i=$((i + 1))
done
exit 1
"""


# Runs as root once /testbed holds the repository: $1 = base commit, $2 = the uid that gets /testbed and
# a home directory (empty: leave ownership alone).
PREPARE_TESTBED = """
set -eu
command -v git >/dev/null 2>&1 || { echo "the image has no git" >&2; exit 1; }
g() { git -c safe.directory='*' -C /testbed "$@"; }
head=$(g rev-parse HEAD) || { echo "no git repository at /testbed" >&2; exit 1; }
want=$(g rev-parse --verify -q "$1^{commit}") || { echo "base commit $1 is not in /testbed" >&2; exit 1; }
[ "$head" = "$want" ] || { echo "/testbed is at $head, not at the base commit $want" >&2; exit 1; }
# Any user may use the repository whoever owns it, and an agent that commits has an identity.
git config --system safe.directory '*'
git config --system user.name swe-sandbox
git config --system user.email swe-sandbox@localhost
if [ -n "$2" ]; then
  mkdir -p /home/sandbox
  chown -R "$2:$2" /testbed /home/sandbox
fi
"""


@dataclass(frozen=True)
class CgroupLayout:
    """Where this host mounts the memory, pids and cpu controllers: cgroup v1 (one hierarchy each) or v2 (all
    in one, `memory` == `pids` == `cpu`). `cpu` is None where there is no cpu controller."""

    version: Literal[1, 2]
    memory: Path
    pids: Path
    cpu: Path | None = None

    @staticmethod
    def detect() -> CgroupLayout:
        """The controllers as mounted here; `SandboxError` naming what is missing when there are none."""
        return CgroupLayout.parse(Path("/proc/self/mountinfo").read_text())

    @staticmethod
    def parse(mountinfo: str) -> CgroupLayout:
        """The controllers as a /proc/PID/mountinfo text mounts them (see `detect`)."""
        v1: dict[str, Path] = {}
        v2: Path | None = None
        for line in mountinfo.splitlines():
            left, _, right = line.partition(" - ")
            fields, (fstype, _source, options) = left.split(), right.split()[:3]
            if fstype == "cgroup":
                for controller in set(options.split(",")) & {"memory", "pids", "cpu"}:
                    v1.setdefault(controller, Path(fields[4]))
            elif fstype == "cgroup2" and v2 is None:
                v2 = Path(fields[4])
        if "memory" in v1 and "pids" in v1:
            return CgroupLayout(1, v1["memory"], v1["pids"], v1.get("cpu"))
        controllers = set((v2 / "cgroup.controllers").read_text().split()) if v2 is not None else set()
        if v2 is not None and {"memory", "pids"} <= controllers:
            return CgroupLayout(2, v2, v2, v2 if "cpu" in controllers else None)
        raise SandboxError(
            f"no memory and pids cgroup controllers here (cgroup v1: {sorted(v1) or 'none'}, cgroup v2: "
            f"{v2 or 'not mounted'}): per-sandbox memory and process limits need them"
        )

    def of_process(self, pid: int) -> tuple[Path, Path]:
        """The (memory, pids) cgroup directories of a host process."""
        paths: dict[str, str] = {}
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            # v1: "4:memory:/docker/ID"; v2: "0::/system.slice/docker-ID.scope" (v1 lines name controllers).
            names = controllers.split(",") if self.version == 1 else [] if controllers else ["memory", "pids"]
            for controller in names:
                paths[controller] = path.lstrip("/")
        return self.memory / paths["memory"], self.pids / paths["pids"]

    def exhausted(self, memory: Path, pids: Path) -> Exhaustion | None:
        """Whether the cgroup (`memory`, `pids` directories) ever had a process OOM-killed at its memory
        limit, or a fork refused at its pids limit."""
        if _counter(memory / ("memory.oom_control" if self.version == 1 else "memory.events"), "oom_kill"):
            return "memory"
        if _counter(pids / "pids.events", "max"):
            return "pids"
        return None


def _counter(path: Path, key: str) -> int:
    """The value of `key` in a cgroup file of "key value" lines (0 when absent)."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def kill_tree_argv(marker: str) -> list[str]:
    """The argv that kills every process of the exec tagged `marker` (exit 0 when none is left)."""
    return ["sh", "-c", _KILL_SCRIPT, "sh", EXEC_MARKER_VAR, marker]


class OutputTail:
    """The last `cap` bytes of a stream, and how many bytes before them were dropped."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    def add(self, chunk: bytes | None) -> None:
        if chunk:
            self.data += chunk
            if len(self.data) > 2 * self.cap:  # trim in batches: trimming every chunk is quadratic
                self._trim()

    def _trim(self) -> None:
        excess = len(self.data) - self.cap
        if excess > 0:
            del self.data[:excess]
            self.dropped += excess

    def text(self) -> str:
        """The kept bytes as text, after a `[... N bytes dropped ...]` line when some were dropped."""
        self._trim()
        text = self.data.decode("utf-8", errors="replace")
        return f"[... {self.dropped} bytes dropped ...]\n{text}" if self.dropped else text


def local_repo(task: Task) -> Path | None:
    """The task's repository as a local path (a git repository or a bundle file), or None when `repo` is
    a GitHub "owner/name" (its code must then come from an image)."""
    path = Path(task.repo)
    return path if path.is_absolute() and path.exists() else None


# Host-side git must not depend on this user's git configuration nor ask for credentials, and the source
# repository may belong to another user.
HOST_GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    "GIT_CONFIG_COUNT": "1",
    "GIT_CONFIG_KEY_0": "safe.directory",
    "GIT_CONFIG_VALUE_0": "*",
}


def host_git(*args: str, cwd: Path | None = None, stdin: str | None = None) -> str:
    """Run git on the host, independent of this user's git configuration; `SandboxError` on failure."""
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env={**os.environ, **HOST_GIT_ENV},
            input=stdin,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    except subprocess.CalledProcessError as e:
        raise SandboxError(f"git {' '.join(args)} failed: {e.stderr.strip()[-500:]}") from e
    except subprocess.TimeoutExpired as e:
        raise SandboxError(f"git {' '.join(args)} took more than {e.timeout:.0f} s") from e
    return done.stdout


def export_repo(repo: Path, commit: str, dest: Path) -> None:
    """Make `dest` a clone of `repo` (a repository or a bundle) with branch `main` checked out at `commit`
    and NOTHING reachable but `commit` and its history: no remote, no other branches or tags, no objects
    of later commits. So an agent cannot read the fix from the repository's future (`git log --all`)."""
    host_git("clone", "--quiet", "--no-checkout", str(repo), str(dest))
    try:
        host_git("cat-file", "-e", f"{commit}^{{commit}}", cwd=dest)
    except SandboxError as e:
        raise SandboxError(f"base commit {commit} is not in {repo}") from e
    host_git("remote", "remove", "origin", cwd=dest)
    host_git("checkout", "--quiet", "-B", "main", commit, cwd=dest)
    others = [
        ref for ref in host_git("for-each-ref", "--format=%(refname)", cwd=dest).split() if ref != "refs/heads/main"
    ]
    host_git("update-ref", "--stdin", cwd=dest, stdin="".join(f"delete {ref}\n" for ref in others))
    host_git("reflog", "expire", "--expire=now", "--all", cwd=dest)
    host_git("gc", "--quiet", "--prune=now", cwd=dest)
