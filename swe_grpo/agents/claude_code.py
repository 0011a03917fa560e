"""Claude Code (npm `@anthropic-ai/claude-code`, `CLAUDE_CODE_VERSION`) as a rollout's agent, run inside a sandbox.

Its bundle is installed once on the host by `scripts/setup.sh` (`npm install @anthropic-ai/claude-code`, whose
optional dependency `@anthropic-ai/claude-code-linux-x64` is a self-contained binary linked against glibc) into
`swe_grpo.paths.claude_code_dir()`, and mounted read-only at `CLAUDE_CODE_MOUNT`. Nothing is installed inside a
sandbox.

Per rollout it runs `claude -p` on the task (its stdin, from a file in the sandbox's private /tmp) against the
rollout's endpoint as Anthropic Messages: `ANTHROPIC_BASE_URL` is the endpoint without its `/v1` (Claude Code
appends `/v1/messages`), the key `ANTHROPIC_API_KEY` is the token (only in its environment), every model alias
is the rollout's model, permissions are skipped (`--dangerously-skip-permissions`; `IS_SANDBOX=1` lets it do so
as root: our sandbox contains it), and non-essential traffic, the auto-updater, telemetry, error reporting and
auto-compaction are off. Its home (`HOME`, `CLAUDE_CONFIG_DIR`) is in the sandbox's private /tmp.

A repository cannot configure it: `--safe-mode` disables CLAUDE.md, skills, plugins, hooks, MCP servers, custom
commands and agents; `--setting-sources user` leaves out the project's `.claude/settings.json` and
`.claude/settings.local.json` (hooks, permissions, env, apiKeyHelper); `--strict-mcp-config` its `.mcp.json`.
Whatever it still runs, runs inside the sandbox, whose only way out is the door to this rollout's endpoint.
"""

from __future__ import annotations

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.agents.npm_bundle import BundleError, NpmBundle
from swe_grpo.paths import claude_code_dir
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

CLAUDE_CODE_VERSION = "2.1.332"  # scripts/setup.sh installs it (a test keeps them equal)
CLAUDE_CODE_MOUNT = "/opt/swe_grpo/claude-code"
API_KEY_ENV = "ANTHROPIC_API_KEY"
_BINARY = "node_modules/@anthropic-ai/claude-code-linux-x64/claude"
_HOME = "/tmp/swe_grpo/claude"
_TASK_FILE = "/tmp/swe_grpo/task.md"


class ClaudeCodeBundleError(BundleError):
    """The Claude Code bundle is missing or incomplete."""


class ClaudeCodeBundle(NpmBundle):
    """`@anthropic-ai/claude-code` and its linux-x64 binary in a host directory (`NpmBundle`)."""

    PACKAGE = "@anthropic-ai/claude-code"
    BINARIES = (_BINARY,)
    LABEL = "Claude Code"
    DIR_ENV = "SWE_GRPO_CLAUDE_CODE_DIR"
    ERROR = ClaudeCodeBundleError

    @classmethod
    def default(cls) -> ClaudeCodeBundle:
        """The bundle rollouts use: `swe_grpo.paths.claude_code_dir()`."""
        return cls.at(claude_code_dir())


def environment(endpoint: RolloutEndpoint, config: AgentConfig) -> dict[str, str]:
    """Claude Code's environment for one rollout, less its key (`run_agent` adds it as `API_KEY_ENV`)."""
    model = endpoint.model
    return {
        "ANTHROPIC_BASE_URL": endpoint.base_url.removesuffix("/v1"),
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        **{f"ANTHROPIC_DEFAULT_{tier}_MODEL": model for tier in ("OPUS", "SONNET", "HAIKU")},
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(config.max_tokens),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTO_COMPACT": "1",
        "BASH_DEFAULT_TIMEOUT_MS": str(int(config.command_timeout_s * 1000)),
        "BASH_MAX_TIMEOUT_MS": str(int(config.command_timeout_s * 1000)),
        "IS_SANDBOX": "1",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "HOME": _HOME,
        "CLAUDE_CONFIG_DIR": f"{_HOME}/.claude",
    }


class ClaudeCodeAgent:
    """Claude Code as a rollout's `Agent` (`swe_grpo.agents.base`), from `bundle` (default:
    `ClaudeCodeBundle.default()`)."""

    name = "claude-code"

    def __init__(self, bundle: ClaudeCodeBundle | None = None):
        self.bundle = bundle or ClaudeCodeBundle.default()

    def mount(self) -> Mount:
        return Mount(self.bundle.root, CLAUDE_CODE_MOUNT)

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """`claude -p` on `problem_statement` (its stdin) in `workdir` (where it is started), configured as the
        module docstring says."""
        run = [f"{CLAUDE_CODE_MOUNT}/{self.bundle.binary}", "-p", "--model", endpoint.model]
        run += ["--dangerously-skip-permissions", "--safe-mode", "--setting-sources", "user", "--strict-mcp-config"]
        return Launch(
            # A shell only to give Claude Code the task file as its stdin.
            argv=["/bin/sh", "-c", f'exec "$@" < {_TASK_FILE}', "sh", *run],
            env=environment(endpoint, config),
            files={_TASK_FILE: problem_statement.encode(), f"{_HOME}/.claude/.keep": b""},
            secret_env=API_KEY_ENV,
        )
