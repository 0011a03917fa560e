"""OpenCode (npm `opencode-ai`, `OPENCODE_VERSION`) as a rollout's agent, run inside a sandbox.

Its bundle is installed once on the host by `scripts/setup.sh` (`npm install opencode-ai`, whose optional
dependency `opencode-linux-x64` is a self-contained binary linked against glibc only) into
`swe_grpo.paths.opencode_dir()`, and mounted read-only at `OPENCODE_MOUNT`. Nothing is installed inside a
sandbox.

Per rollout, in the sandbox's private /tmp, we write one config file (`OPENCODE_CONFIG`): a provider of the
bundled `@ai-sdk/openai-compatible` kind whose `baseURL` is the rollout's endpoint and whose `apiKey` is
`{env:SWE_GRPO_ROLLOUT_TOKEN}` (OpenCode substitutes the variable: the token is only in its environment),
every permission allowed (our sandbox contains it; OpenCode would otherwise stop to ask), no auto-update,
no sharing, no snapshots, auto-compaction and pruning off (they rewrite the history the chain extends). The
task reaches `opencode run` on its stdin, from a file (OpenCode quotes a message given on its command line).
`--title` is given so that OpenCode does not ask the model for a session title first (a second, unrelated
conversation). Its home directories (`XDG_*`) are in the sandbox's private /tmp.

A repository cannot configure it: `OPENCODE_DISABLE_PROJECT_CONFIG` stops it reading the project's
`opencode.json` / `opencode.jsonc` and `.opencode/` (agents, commands, plugins, tools, MCP servers),
`OPENCODE_DISABLE_CLAUDE_CODE` its `CLAUDE.md` and `.claude/` skills, `OPENCODE_DISABLE_EXTERNAL_SKILLS`
`.agents/skills`, and `--pure` external plugins. What it still reads from the repository is written down
and tested in tests/test_opencode.py. Update checks, model-list fetches, LSP downloads and sharing are off
(`OPENCODE_DISABLE_*`); whatever it still tries to reach goes to the door, which leads only to the
rollout's endpoint.
"""

from __future__ import annotations

import json

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.agents.npm_bundle import BundleError, NpmBundle
from swe_grpo.paths import opencode_dir
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

OPENCODE_VERSION = "1.18.33"  # scripts/setup.sh installs it (a test keeps them equal)
OPENCODE_MOUNT = "/opt/swe_grpo/opencode"
PROVIDER = "swe_grpo"
API_KEY_ENV = "SWE_GRPO_ROLLOUT_TOKEN"
# The platform package npm picks for glibc x86-64 Linux (`-baseline`: the same for CPUs without AVX2).
_BINARIES = ("node_modules/opencode-linux-x64/bin/opencode", "node_modules/opencode-linux-x64-baseline/bin/opencode")
_DIR = "/tmp/swe_grpo/opencode"
_CONFIG_FILE = f"{_DIR}/opencode.json"
_TASK_FILE = "/tmp/swe_grpo/task.md"
_TITLE = "swe_grpo rollout"


class OpenCodeBundleError(BundleError):
    """The OpenCode bundle is missing or incomplete."""


class OpenCodeBundle(NpmBundle):
    """`opencode-ai` and its linux-x64 binary in a host directory (`NpmBundle`)."""

    PACKAGE = "opencode-ai"
    BINARIES = _BINARIES
    LABEL = "OpenCode"
    DIR_ENV = "SWE_GRPO_OPENCODE_DIR"
    ERROR = OpenCodeBundleError

    @classmethod
    def default(cls) -> OpenCodeBundle:
        """The bundle rollouts use: `swe_grpo.paths.opencode_dir()`."""
        return cls.at(opencode_dir())


def config_file(endpoint: RolloutEndpoint, config: AgentConfig) -> bytes:
    """OpenCode's config for one rollout (no secret in it: the key is read from its environment)."""
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": PROVIDER,
        "options": {"baseURL": endpoint.base_url, "apiKey": f"{{env:{API_KEY_ENV}}}"},
        "models": {endpoint.model: {"limit": {"context": config.context_window, "output": config.max_tokens}}},
    }
    settings = {
        "provider": {PROVIDER: provider},
        "model": f"{PROVIDER}/{endpoint.model}",
        "enabled_providers": [PROVIDER],
        "autoupdate": False,
        "share": "disabled",
        "snapshot": False,
        "compaction": {"auto": False, "prune": False},
        "permission": {"*": "allow"},
    }
    return json.dumps(settings).encode()


class OpenCodeAgent:
    """OpenCode as a rollout's `Agent` (`swe_grpo.agents.base`), from `bundle` (default:
    `OpenCodeBundle.default()`)."""

    name = "opencode"

    def __init__(self, bundle: OpenCodeBundle | None = None):
        self.bundle = bundle or OpenCodeBundle.default()

    def mount(self) -> Mount:
        return Mount(self.bundle.root, OPENCODE_MOUNT)

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """`opencode run` on `problem_statement` (its stdin), configured as the module docstring says; it works in
        the directory it is started in, `workdir`."""
        run = [f"{OPENCODE_MOUNT}/{self.bundle.binary}", "run", "--pure", "--title", _TITLE]
        env = {
            "OPENCODE_CONFIG": _CONFIG_FILE,
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_AUTOCOMPACT": "1",
            "OPENCODE_DISABLE_PRUNE": "1",
            "OPENCODE_EXPERIMENTAL_BASH_DEFAULT_TIMEOUT_MS": str(int(config.command_timeout_s * 1000)),
            **{f"XDG_{kind}_HOME": f"{_DIR}/{kind.lower()}" for kind in ("CONFIG", "DATA", "CACHE", "STATE")},
        }
        return Launch(
            # A shell only to give OpenCode the task file as its stdin.
            argv=["/bin/sh", "-c", f'exec "$@" < {_TASK_FILE}', "sh", *run],
            env=env,
            files={_CONFIG_FILE: config_file(endpoint, config), _TASK_FILE: problem_statement.encode()},
            secret_env=API_KEY_ENV,
        )
