"""The sandbox interface: one isolated, disposable copy of a task's repository at its base commit.

A rollout creates one sandbox for the agent and, after the agent is done, a FRESH one for grading, so
nothing the agent left behind can change a grade. Backends (`local`, `docker`, `hf`) implement
`SandboxBackend.create`; everything else talks to `Sandbox` only.

Guarantees every backend gives:
- `exec` runs a command inside the sandbox; on timeout OR cancellation of the awaiting task the whole
  process tree inside is killed before it returns/raises. It never raises for a non-zero exit.
- `destroy` is idempotent and safe in `finally`; after it nothing of the sandbox remains (processes,
  mounts, containers, temporary directories).
- Failures of the sandbox machinery itself raise `SandboxError` (an infrastructure failure, never a
  model failure), with the cause.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swe_grpo.sandbox._common import Exhaustion
    from swe_grpo.tasks import Task

#: Where the repository is inside every sandbox (SWE-bench images use this path too).
WORKDIR = "/testbed"


class SandboxError(Exception):
    """The sandbox could not be created or used. An infrastructure failure, not the agent's."""


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
    async def get_file(self, path: str) -> bytes:
        """Read a file from inside the sandbox; `SandboxError` if it does not exist."""

    async def diff(self, timeout_s: float = 60.0) -> str:
        """The working tree's changes against the base commit, as a `git apply`-able patch that
        includes new (untracked) files and binary changes."""
        script = "git add -A >/dev/null 2>&1 && git -c core.quotepath=off diff --cached --binary --no-color HEAD"
        result = await self.exec(script, timeout_s=timeout_s, cwd=self.workdir)
        if result.exit_code != 0:
            raise SandboxError(f"git diff failed (exit {result.exit_code}): {result.stderr[-500:]}")
        return result.stdout

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

    async def start(self) -> None:  # noqa: B027  (optional hook)
        """Prepare the backend (check the engine, reap leftovers)."""

    @abstractmethod
    async def create(self, task: Task, mounts: Sequence[Mount] = (), *, network: bool = True) -> Sandbox:
        """A new sandbox with the task's repository at its base commit at `WORKDIR`. `network=False`: no
        network at all, only a loopback of its own (grading asks for that). Raises `SandboxError` when it
        cannot be made; never leaves anything behind when it fails."""

    async def close(self) -> None:  # noqa: B027  (optional hook)
        """Release what the backend holds (caches are kept)."""
