"""Coding-agent harnesses behind one seam (`base.Agent`): Pi (the default), mini-swe-agent, OpenCode,
Codex and Claude Code.

`make_agent(name)` builds one from its default host install: a name of `AGENTS` (`pi`, `mini-swe-agent`,
`opencode`, `codex`, `claude-code`), or a harness class of one's own as a dotted path (`mypkg.mod:MyAgent`, built
with no arguments, implementing `base.Agent`).
"""

from __future__ import annotations

from collections.abc import Sequence

from swe_grpo.agents.base import Agent, AgentConfig, AgentResult
from swe_grpo.plugins import load_choice

#: The built-in harnesses: name -> "module:Class".
AGENTS = {
    "pi": "swe_grpo.agents.pi:PiAgent",
    "mini-swe-agent": "swe_grpo.agents.mini_swe:MiniSweAgent",
    "opencode": "swe_grpo.agents.opencode:OpenCodeAgent",
    "codex": "swe_grpo.agents.codex:CodexAgent",
    "claude-code": "swe_grpo.agents.claude_code:ClaudeCodeAgent",
}

__all__ = ["AGENTS", "Agent", "AgentConfig", "AgentResult", "make_agent", "make_agents"]


def make_agent(name: str) -> Agent:
    """The harness `name` (one of `AGENTS`, or "package.module:Class"), from its default host install. Raises
    ValueError naming the problem for an unknown name or a path that does not lead to a class
    (`swe_grpo.plugins.load_object`), and the harness's bundle error when it is not installed."""
    agent: Agent = load_choice(name, AGENTS, "agent")()
    return agent


def make_agents(names: Sequence[str]) -> list[Agent]:
    """`make_agent` of each name, one harness per distinct name (a name repeated is the same object)."""
    built = {name: make_agent(name) for name in dict.fromkeys(names)}
    return [built[name] for name in names]
