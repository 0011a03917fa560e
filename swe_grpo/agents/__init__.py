"""Coding-agent harnesses behind one seam (`base.Agent`): Pi (the default) and mini-swe-agent."""

from __future__ import annotations

from swe_grpo.agents.base import Agent, AgentConfig, AgentResult

AGENTS = ("pi", "mini-swe-agent")

__all__ = ["AGENTS", "Agent", "AgentConfig", "AgentResult", "make_agent"]


def make_agent(name: str) -> Agent:
    """The harness called `name` (one of `AGENTS`), from its default host install. Raises ValueError for
    another name, and the harness's bundle error when it is not installed."""
    if name == "pi":
        from swe_grpo.agents.pi import PiAgent

        return PiAgent()
    if name == "mini-swe-agent":
        from swe_grpo.agents.mini_swe import MiniSweAgent

        return MiniSweAgent()
    raise ValueError(f"unknown agent {name!r}: choose one of {', '.join(AGENTS)}")
