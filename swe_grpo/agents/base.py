"""The agent seam: what a harness (Pi, mini-swe-agent, ...) needs from a rollout and what it reports.

An `Agent` is a coding-agent CLI installed once on the host (its bundle, mounted read-only into every agent
sandbox at a path of its own: nothing is installed inside a sandbox) that talks to one OpenAI-compatible
endpoint, the rollout's interception endpoint, with the rollout's secret. A harness only says how to configure
and start its CLI: `mount()` and `launch(...)`, which returns a `Launch`. `run_agent(agent, ...)` is the one
place that runs it: it gives the harness the endpoint as the agent reaches it (through the sandbox's door),
writes the launch's per-rollout files into the sandbox's private /tmp, passes the secret only through the
environment (never argv or a file), puts the process behind the door, and ends it on exit, on the wall-clock
limit or when it stalls (no model request made or being served for `stall_timeout_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from swe_grpo.sandbox.base import Mount, Sandbox
from swe_grpo.sandbox.door import Door
from swe_grpo.types import RolloutEndpoint

#: How much of an agent's stdout and stderr an `AgentResult` keeps (the end).
TAIL_CHARS = 4000
#: With its waits for the server left out of its clock, an agent's run still ends at this many times its
#: wall-clock limit: a backstop for a server that never answers (the worker's rollout limit, shorter, ends such a
#: rollout first, as the host's `timeout`).
WAIT_BACKSTOP = 4


@dataclass(frozen=True)
class AgentConfig:
    """Limits of one agent run. `context_window` / `max_tokens`: what the agent is told about the model;
    `timeout_s`: wall-clock limit (the agent's own time: `run_agent` leaves its waits for generations out);
    `stall_timeout_s`: how long the agent may go without a model request being made or served; `max_retries`:
    how often it retries a failed model request; `command_timeout_s`: how long one command of the agent's shell
    tool may run before the harness kills it and the agent goes on (the model sees it fail): keep it under
    `stall_timeout_s`, or a long command ends the whole run as stalled first."""

    context_window: int
    max_tokens: int
    timeout_s: float = 1800.0
    stall_timeout_s: float = 300.0
    max_retries: int = 2
    command_timeout_s: float = 120.0


@dataclass(frozen=True)
class AgentResult:
    """How an agent run ended."""

    exit_code: int | None  # None when the agent was killed (wall-clock limit or stall)
    timed_out: bool
    stalled: bool
    wall_s: float
    stdout_tail: str
    stderr_tail: str


@dataclass(frozen=True)
class Launch:
    """What a harness runs for one rollout: `argv` inside the sandbox (its first element is a binary in
    the agent's bundle), `env` with no secret in it, `files` to write first (absolute sandbox paths under
    /tmp, no secret in them), and `secret_env`: the environment variable the agent reads its key from."""

    argv: list[str]
    env: Mapping[str, str]
    files: Mapping[str, bytes]
    secret_env: str


class Agent(Protocol):
    """A coding-agent harness: what to mount and what to run; `run_agent` runs it. Guarantees of `run_agent` with
    any harness: the agent works in `sandbox.workdir` on the problem statement, reaches nothing but the rollout's
    endpoint (through the door when there is one), holds the rollout's token only in its environment, cannot be
    configured by the repository it works on, and its whole process tree is gone when `run_agent` returns or is
    cancelled."""

    name: str

    def mount(self) -> Mount:
        """The agent's host install, mounted read-only into every agent sandbox."""
        ...

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """What runs in the sandbox to work in `workdir` on `problem_statement` against `endpoint` (as the agent
        reaches it: through the door when there is one). The launch carries no secret: `run_agent` gives the
        agent `endpoint.token` in its environment, as `Launch.secret_env`."""
        ...


async def run_agent(
    agent: Agent,
    sandbox: Sandbox,
    endpoint: RolloutEndpoint,
    problem_statement: str,
    config: AgentConfig,
    last_activity: Callable[[], float],
    door: Door | None = None,
    waiting_s: Callable[[], float] | None = None,
) -> AgentResult:
    """Run `agent` on `problem_statement` in `sandbox` (which mounts `agent.mount()`, and `door.mount()` with a
    door) against `endpoint`, until it exits, `config.timeout_s` of its own time passes (its wall clock less
    `waiting_s()`, the seconds it waited for generations: `RolloutView.waiting_s`), or `last_activity()` (a
    `time.monotonic()` stamp of the rollout's latest model request, made or being served:
    `RolloutView.last_activity`) is older than `config.stall_timeout_s`. A slow vLLM is the host's: neither limit
    counts the time the agent waits for it. See `Agent` for what it guarantees."""
    launch = agent.launch(sandbox.workdir, behind_door(endpoint, door), problem_statement, config)
    return await run_launch(sandbox, launch, endpoint.token, config, last_activity, door, waiting_s)


async def run_launch(
    sandbox: Sandbox,
    launch: Launch,
    token: str,
    config: AgentConfig,
    last_activity: Callable[[], float],
    door: Door | None = None,
    waiting_s: Callable[[], float] | None = None,
) -> AgentResult:
    """Run `launch` in `sandbox` with `token` in its environment as `launch.secret_env`, behind `door` when given,
    under the wall-clock limit (less `waiting_s()` when given, up to `WAIT_BACKSTOP` times the limit) and the stall
    watchdog (`run_agent`). The agent's process tree is killed on every path out, cancellation included."""
    for path, data in launch.files.items():
        await sandbox.put_file(path, data)
    argv = door.wrap(launch.argv) if door is not None else launch.argv
    env = {**launch.env, launch.secret_env: token}
    start = time.monotonic()
    backstop = config.timeout_s * (WAIT_BACKSTOP if waiting_s is not None else 1)
    run = asyncio.create_task(sandbox.exec(argv, timeout_s=backstop, env=env, cwd=sandbox.workdir))
    stalled = timed_out = False
    try:
        while not run.done():
            await asyncio.wait({run}, timeout=min(5.0, config.stall_timeout_s / 4, config.timeout_s / 4))
            if run.done():
                break
            now = time.monotonic()
            stalled = now - max(start, last_activity()) > config.stall_timeout_s
            timed_out = waiting_s is not None and now - start - waiting_s() > config.timeout_s
            if stalled or timed_out:
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
    finally:
        if not run.done():  # we were cancelled: the sandbox kills the agent's process tree
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
    wall_s = time.monotonic() - start
    if stalled or timed_out:
        return AgentResult(None, timed_out and not stalled, stalled, wall_s, "", "")
    result = run.result()
    return AgentResult(
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        stalled=False,
        wall_s=wall_s,
        stdout_tail=result.stdout[-TAIL_CHARS:],
        stderr_tail=result.stderr[-TAIL_CHARS:],
    )


def behind_door(endpoint: RolloutEndpoint, door: Door | None) -> RolloutEndpoint:
    """The endpoint as the agent sees it: through the door's forwarder when there is one."""
    return endpoint if door is None else replace(endpoint, base_url=door.base_url)
