"""The captured traffic of the real OpenCode, Codex and Claude Code (tests/agent_traffic/AGENT-VERSION.json, made by
`python tests/agent_traffic.py`: each agent on the three demo tasks, its model turns scripted) replayed through the
InterceptionServer in the agent's own dialect (`agent_traffic.replay`): every turn as clean as it was at capture,
each fork with its named cause, the rows exactly the template's render of each request followed by the scripted
outputs, and what each agent does to its history pinned (`agent_traffic.history_facts`, quoted by
docs/rollouts-sandboxes-grading.md). Sub-agents too (tests/agent_traffic/subagent/). No model and no sandbox: the agents
ran when the capture was made."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from agent_traffic import (
    Capture,
    HistoryFacts,
    captured_files,
    chat_requests,
    history_facts,
    load,
    pack,
    replay,
    unpack,
)

from swe_grpo.testing.pi_capture import completion_ids
from swe_grpo.tokens.chain import TrainingTemplate

CAPTURES = [(path, capture) for path in captured_files() for capture in load(path)]
SUBAGENT_CAPTURES = [(path, capture) for path in captured_files(subagent=True) for capture in load(path)]
# What each agent did to its history on the demo tasks (see HistoryFacts); the first task holds the long output.
FACTS = {
    agent: HistoryFacts(
        reasoning_echoed=True,
        parallel_calls="one message",
        long_output_chars=chars,
        long_output_later="unchanged",
        system_changes=0,
        tools_changes=0,
    )
    for agent, chars in {"opencode": 12_122, "codex": 10_212, "claude-code": 2_224}.items()
}


def _id(case: tuple[Path, Capture]) -> str:
    where = "-subagent" if case[0].parent.name == "subagent" else ""
    return f"{case[0].stem}{where}-{case[1].instance_id.removeprefix('swe-grpo-demo__')}"


def test_every_agent_is_captured() -> None:
    assert sorted({c.agent for _, c in CAPTURES}) == sorted(FACTS)
    assert all(len([c for _, c in CAPTURES if c.agent == agent]) == 3 for agent in FACTS)


@pytest.mark.parametrize("case", CAPTURES + SUBAGENT_CAPTURES, ids=_id)
def test_a_capture_holds_no_secret_and_packs_exactly(case: tuple[Path, Capture]) -> None:
    """No header that carries a key is stored (the capture also checked that the token is nowhere in it), and the
    stored form gives every request back exactly."""
    _, capture = case
    assert not {"authorization", "x-api-key"} & {k for h in capture.headers for k in h}
    assert unpack(json.loads(json.dumps(pack(capture.bodies)))) == capture.bodies


@pytest.mark.parametrize("case", CAPTURES, ids=_id)
async def test_captured_traffic_replays_exactly(case: tuple[Path, Capture], tokenizer) -> None:
    """Through a fresh server, in the agent's dialect: every request answered, the turns as clean as at capture (each
    fork named), and each turn's prompt in the rows exactly the template's render of that request's conversation, its
    output exactly the scripted reply, trained, and nothing else trained."""
    _, capture = case
    record = await replay(capture, tokenizer)
    assert record.errors == [] and record.retries == 0
    assert [t.kind for t in record.turns] == capture.turns
    assert [t.fork_cause for t in record.turns if t.kind == "fork"] == []  # no agent rewrote its history here

    template = TrainingTemplate(tokenizer)
    chats = chat_requests(capture)
    outputs = [completion_ids(template, reply) for reply in capture.replies]
    assert len(record.turns) == len(chats) == len(outputs)
    [row] = record.rows
    ids, mask = row.input_ids.tolist(), row.completion_mask.tolist()
    at = 0
    for turn, chat, output in zip(record.turns, chats, outputs, strict=True):
        prompt = ids[: at + turn.new_prompt_tokens]
        assert tokenizer.decode(prompt) == template.render(chat["messages"], chat.get("tools"), generation_prompt=True)
        assert ids[len(prompt) : len(prompt) + len(output)] == output
        assert mask[at : len(prompt)] == [0] * turn.new_prompt_tokens and mask[len(prompt) : len(prompt) + len(output)]
        assert set(mask[len(prompt) : len(prompt) + len(output)]) == {1}
        at = len(prompt) + len(output)
    assert at == len(ids)


@pytest.mark.parametrize("agent", sorted(FACTS))
def test_what_each_agent_does_to_its_history(agent: str) -> None:
    """Reasoning echoed or not, parallel calls, the long output's cut (when first sent, and later), system-prompt and
    tool changes between turns: as FACTS (and docs/agents.md) say, on the task with the long output; the others agree
    on all but the long output."""
    captures = [c for _, c in CAPTURES if c.agent == agent]
    facts = [history_facts(c) for c in captures]
    assert facts[0] == FACTS[agent]
    for other in facts[1:]:
        assert other == HistoryFacts(**{**vars(FACTS[agent]), "long_output_chars": None})


# Two rewrites an agent could make of what it already sent, made to the last request of each agent's first capture.
REWRITES = {
    "reasoning_dropped": lambda text, capture: text.replace(capture.replies[0]["reasoning_content"], ""),
    # One line out of the long output (each agent keeps another part of it: the head, the tail, both).
    "tool_output_cut": lambda text, capture: re.sub(r"\\n\d{3,5}\\n", r"\\n", text, count=1),
}


@pytest.mark.parametrize("rewrite", sorted(REWRITES))
@pytest.mark.parametrize("agent", sorted(FACTS))
async def test_a_rewritten_history_forks_with_its_cause_named(agent: str, rewrite: str, tokenizer) -> None:
    """The replay sees a rewrite: the captured conversation with its last request's history edited forks at that
    request, in a new row, the fork named by what was edited (the replays above would show any such rewrite)."""
    capture = next(c for _, c in CAPTURES if c.agent == agent)
    edited = json.loads(REWRITES[rewrite](json.dumps(capture.bodies[-1]), capture))
    assert edited != capture.bodies[-1]
    record = await replay(replace(capture, bodies=[*capture.bodies[:-1], edited]), tokenizer)
    assert [t.kind for t in record.turns] == ["clean"] * (len(capture.bodies) - 1) + ["fork"]
    assert record.turns[-1].fork_cause.startswith(f"{rewrite} at messages[")
    assert len(record.rows) == 2


# A sub-agent is another conversation on the rollout's endpoint: the chain holds one, so its first turn forks and so
# does the agent's next turn after it. Claude Code's `Agent` runs in the background (the agent's own next turn comes
# first); the sub-agent has its own system prompt and 14 tools. OpenCode's `task` keeps the system prompt, gives the
# sub-agent 9 tools (no `task`) and the prompt as its task.
SUBAGENT_FORKS = {
    "claude-code": (["clean", "clean", "fork", "fork"], "tools_changed; system_prompt_changed at messages[0]"),
    "opencode": (["clean", "fork", "fork"], "tools_changed; user_message_changed at messages[1]"),
}


def test_every_subagent_tool_is_captured() -> None:
    assert sorted(c.agent for _, c in SUBAGENT_CAPTURES) == sorted(SUBAGENT_FORKS)


@pytest.mark.parametrize("case", SUBAGENT_CAPTURES, ids=_id)
async def test_a_subagent_forks_twice_each_fork_named(case: tuple[Path, Capture], tokenizer) -> None:
    """The agent's sub-agent tool called once (`agent_traffic.subagent_script`): replayed, the turns fork where they
    forked at capture, into the sub-agent's conversation and back, each fork with its cause; a row per conversation."""
    _, capture = case
    kinds, cause = SUBAGENT_FORKS[capture.agent]
    record = await replay(capture, tokenizer)
    assert record.errors == [] and [t.kind for t in record.turns] == capture.turns == kinds
    assert [t.fork_cause for t in record.turns if t.kind == "fork"] == [cause, cause]
    assert len(record.rows) == 3
