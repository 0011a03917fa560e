"""Codex (npm `@openai/codex`, `CODEX_VERSION`) as a rollout's agent, run inside a sandbox.

Its bundle is installed once on the host by `scripts/setup.sh` (`npm install @openai/codex`, whose optional
dependency `@openai/codex-linux-x64` holds a static musl binary) into `swe_grpo.paths.codex_dir()`, and mounted
read-only at `CODEX_MOUNT`. Nothing is installed inside a sandbox.

Per rollout it runs `codex exec` on the task (its stdin, from a file in the sandbox's private /tmp), configured
only by `-c` overrides on its command line (no secret among them): a model provider `swe_grpo` speaking OpenAI
Responses (`wire_api = "responses"`) at the rollout's endpoint, whose key Codex reads from the environment
variable `API_KEY_ENV` (`env_key`: the token is only in its environment); no login; approvals never asked and
its own sandbox off (`--dangerously-bypass-approvals-and-sandbox`: ours contains it); no update check, analytics
or feedback; auto-compaction past the context window (it would rewrite the history the chain extends). Its home
(`CODEX_HOME`) is in the sandbox's private /tmp and `--ephemeral` keeps no session files.

What a repository can still do: `project_doc_max_bytes = 0` stops it reading `AGENTS.md`; `--ignore-rules` its
`.rules` exec policies; `skills.include_instructions = false` its skills (`.agents/skills`, `.codex/skills`, which
otherwise reach the model); a project's `.codex/config.toml` (which can name MCP servers, hooks, providers) is read
only for a TRUSTED project and nothing here trusts one (no `--trust`, no `--dangerously-bypass-hook-trust`).
Whatever it still runs, runs inside the sandbox, whose only way out is the door to this rollout's endpoint.
"""

from __future__ import annotations

import json

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.agents.npm_bundle import BundleError, NpmBundle
from swe_grpo.paths import codex_dir
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

CODEX_VERSION = "0.171.0"  # scripts/setup.sh installs it (a test keeps them equal)
CODEX_MOUNT = "/opt/swe_grpo/codex"
PROVIDER = "swe_grpo"
API_KEY_ENV = "SWE_GRPO_ROLLOUT_TOKEN"
_BINARY = "node_modules/@openai/codex-linux-x64/vendor/x86_64-unknown-linux-musl/bin/codex"
_HOME = "/tmp/swe_grpo/codex"
_TASK_FILE = "/tmp/swe_grpo/task.md"
# Features off: `shell_snapshot` writes the shell's environment, the token with it, to a file under CODEX_HOME;
# `multi_agent` adds a tool of type "namespace" and `web_search` a hosted tool (neither a function the
# training template can render); the rest add tools, hooks or code from elsewhere that a rollout has no use for.
_FEATURES_OFF = ("shell_snapshot", "multi_agent", "goals", "hooks", "plugins", "apps", "image_generation")


class CodexBundleError(BundleError):
    """The Codex bundle is missing or incomplete."""


class CodexBundle(NpmBundle):
    """`@openai/codex` and its linux-x64 binary in a host directory (`NpmBundle`)."""

    PACKAGE = "@openai/codex"
    BINARIES = (_BINARY,)
    LABEL = "Codex"
    DIR_ENV = "SWE_GRPO_CODEX_DIR"
    ERROR = CodexBundleError

    @classmethod
    def default(cls) -> CodexBundle:
        """The bundle rollouts use: `swe_grpo.paths.codex_dir()`."""
        return cls.at(codex_dir())


def overrides(endpoint: RolloutEndpoint, config: AgentConfig) -> list[str]:
    """Codex's configuration for one rollout as `-c key=value` TOML overrides (no secret in them)."""
    settings = {
        "model": endpoint.model,
        "model_provider": PROVIDER,
        f"model_providers.{PROVIDER}.name": PROVIDER,
        f"model_providers.{PROVIDER}.base_url": endpoint.base_url,
        f"model_providers.{PROVIDER}.env_key": API_KEY_ENV,
        f"model_providers.{PROVIDER}.wire_api": "responses",
        f"model_providers.{PROVIDER}.request_max_retries": config.max_retries,
        f"model_providers.{PROVIDER}.stream_max_retries": config.max_retries,
        "model_context_window": config.context_window,
        "model_auto_compact_token_limit": config.context_window * 4,
        "approval_policy": "never",
        "sandbox_mode": "danger-full-access",
        "project_doc_max_bytes": 0,
        "check_for_update_on_startup": False,
        "analytics.enabled": False,
        "feedback.enabled": False,
        "history.persistence": "none",
        "web_search": "disabled",
        "skills.include_instructions": False,
        **{f"features.{name}": False for name in _FEATURES_OFF},
    }
    return [arg for key, value in settings.items() for arg in ("-c", f"{key}={json.dumps(value)}")]


class CodexAgent:
    """Codex as a rollout's `Agent` (`swe_grpo.agents.base`), from `bundle` (default: `CodexBundle.default()`)."""

    name = "codex"

    def __init__(self, bundle: CodexBundle | None = None):
        self.bundle = bundle or CodexBundle.default()

    def mount(self) -> Mount:
        return Mount(self.bundle.root, CODEX_MOUNT)

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """`codex exec` on `problem_statement` (its stdin) in `workdir`, configured as the module docstring says."""
        run = [f"{CODEX_MOUNT}/{self.bundle.binary}", "exec", *overrides(endpoint, config)]
        run += ["--dangerously-bypass-approvals-and-sandbox", "--ignore-rules", "--ephemeral"]
        run += ["--skip-git-repo-check", "--color", "never", "-C", workdir, "-"]
        return Launch(
            # A shell only to give Codex the task file as its stdin.
            argv=["/bin/sh", "-c", f'exec "$@" < {_TASK_FILE}', "sh", *run],
            env={"CODEX_HOME": _HOME, "HOME": _HOME, "NO_COLOR": "1"},
            files={_TASK_FILE: problem_statement.encode(), f"{_HOME}/.keep": b""},
            secret_env=API_KEY_ENV,
        )
