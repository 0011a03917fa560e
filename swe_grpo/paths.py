"""Where swe_grpo keeps things on the host: built artefacts (cache) and the agents' bundles."""

from __future__ import annotations

import os
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent


def cache_root() -> Path:
    """Built artefacts (tiny models, vLLM compile cache): `$SWE_GRPO_CACHE`, else `~/.cache/swe_grpo`."""
    return Path(os.environ.get("SWE_GRPO_CACHE", Path.home() / ".cache" / "swe_grpo"))


def pi_bundle_dir(version: str | None = None) -> Path:
    """A portable Node + Pi install made by `scripts/setup.sh`. The default one: `$SWE_GRPO_PI_DIR`,
    else `.deps/pi` in this checkout; another supported `version`: `pi-VERSION` beside it."""
    default = Path(os.environ.get("SWE_GRPO_PI_DIR", _CHECKOUT / ".deps" / "pi"))
    return default if version is None else default.with_name(f"pi-{version}")


def mini_swe_agent_dir() -> Path:
    """The mini-swe-agent bundle (a portable Python + mini-swe-agent) made by
    `scripts/setup.sh`: `$SWE_GRPO_MINI_DIR`, else `.deps/mini-swe-agent` in this checkout."""
    return Path(os.environ.get("SWE_GRPO_MINI_DIR", _CHECKOUT / ".deps" / "mini-swe-agent"))


def opencode_dir() -> Path:
    """The OpenCode bundle (`opencode-ai` with its linux-x64 binary) made by `scripts/setup.sh`:
    `$SWE_GRPO_OPENCODE_DIR`, else `.deps/opencode` in this checkout."""
    return Path(os.environ.get("SWE_GRPO_OPENCODE_DIR", _CHECKOUT / ".deps" / "opencode"))


def codex_dir() -> Path:
    """The Codex bundle (`@openai/codex` with its linux-x64 binary) made by `scripts/setup.sh`:
    `$SWE_GRPO_CODEX_DIR`, else `.deps/codex` in this checkout."""
    return Path(os.environ.get("SWE_GRPO_CODEX_DIR", _CHECKOUT / ".deps" / "codex"))


def claude_code_dir() -> Path:
    """The Claude Code bundle (`@anthropic-ai/claude-code` with its linux-x64 binary) made by `scripts/setup.sh`:
    `$SWE_GRPO_CLAUDE_CODE_DIR`, else `.deps/claude-code` in this checkout."""
    return Path(os.environ.get("SWE_GRPO_CLAUDE_CODE_DIR", _CHECKOUT / ".deps" / "claude-code"))
