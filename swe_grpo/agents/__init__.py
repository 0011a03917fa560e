"""Coding-agent harnesses behind one seam (`base.Agent`): Pi (the default), mini-swe-agent, OpenCode,
Codex and Claude Code.

`make_agent(name)` builds one from its default host install: a name of `AGENTS` (`pi`, `mini-swe-agent`,
`opencode`, `codex`, `claude-code`), or a harness class of one's own as a dotted path (`mypkg.mod:MyAgent`, built
with no arguments, implementing `base.Agent`). Where several harnesses take turns (the worker's groups, `swe-grpo
rollout`'s tasks), a MIX names them with weights: `{"pi": 2, "codex": 1}`, or as a flag writes it, `pi=2,codex=1`
(`check_mix`, `agent_schedule`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swe_grpo.agents.base import Agent, AgentConfig, AgentResult
from swe_grpo.plugins import check_choice, load_choice

#: The built-in harnesses: name -> "module:Class".
AGENTS = {
    "pi": "swe_grpo.agents.pi:PiAgent",
    "mini-swe-agent": "swe_grpo.agents.mini_swe:MiniSweAgent",
    "opencode": "swe_grpo.agents.opencode:OpenCodeAgent",
    "codex": "swe_grpo.agents.codex:CodexAgent",
    "claude-code": "swe_grpo.agents.claude_code:ClaudeCodeAgent",
}

__all__ = [
    "AGENTS", "Agent", "AgentConfig", "AgentResult", "agent_schedule", "check_mix", "make_agent", "make_agents"
]  # fmt: skip


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


def check_mix(spec: str | Mapping[str, int]) -> str | dict[str, int]:
    """`spec` checked without importing anything: one agent (a name of `AGENTS` or a dotted path, returned as it
    is), or a mix, `{name: weight}` or its flag form "pi=2,codex=1", returned as a new dict. Raises ValueError
    naming what is wrong: an unknown name, a weight that is not a whole number >= 1, an empty mix."""
    if isinstance(spec, str) and "=" in spec:
        pairs = [part.partition("=") for part in spec.split(",")]
        if not all(name.strip() and sep and weight.strip().isdigit() for name, sep, weight in pairs):
            raise ValueError(f"agent: {spec!r} is not a mix of NAME=WEIGHT, e.g. 'pi=2,opencode=1'")
        spec = {name.strip(): int(weight) for name, _, weight in pairs}
    if isinstance(spec, str):
        return check_choice(spec, AGENTS, "agent")
    if not spec:
        raise ValueError("agent: an empty mix; give a name, or {name: weight} with at least one agent")
    for name, weight in spec.items():
        check_choice(name, AGENTS, "agent")
        if not isinstance(weight, int) or isinstance(weight, bool) or weight < 1:
            raise ValueError(f"agent: the weight of {name!r} must be a whole number >= 1, not {weight!r}")
    return dict(spec)


def agent_schedule(spec: str | Mapping[str, int]) -> tuple[str, ...]:
    """The agents successive turns (groups, tasks) run, to be cycled: each agent of the mix `spec` (`check_mix`)
    as many times in a row as its weight; one agent: that one."""
    mix = check_mix(spec)
    if isinstance(mix, str):
        return (mix,)
    return tuple(name for name, weight in mix.items() for _ in range(weight))
