"""The real traffic of OpenCode, Codex and Claude Code on the demo tasks: captured, stored small, replayed.

A capture runs the real agent of the installed bundle on a demo task in a real `local` sandbox behind the
InterceptionServer (`capture_agent_run`), its model turns SCRIPTED (`script`: a random tiny model cannot act) to do
what a coding model does and what agents treat specially: a reply with reasoning (is it echoed back?), two calls in
one reply (parallel calls), a command with 12,000 lines of output (is the output cut before the model sees it, or
later?), the task's fix, the tests, a final answer. Every request the agent sends is recorded as it left it (the
rollout's token removed with the headers that carry it: a test checks that it is nowhere in a capture), in its own
dialect, and stored in tests/agent_traffic/AGENT-VERSION.json (`pack`: each request as what changed since the
previous one, so Claude Code's ~100 kB system prompt and tools are stored once).

`replay` sends a capture's requests again, in order, to a fresh InterceptionServer on the agent's route, whose
generator answers each with the output it answered at capture (the same script), rewriting the tool-call ids the
capture's server gave into those the replay's server gives: the record it returns says which turns were clean and
which forked, with the named cause of each fork (`TurnRecord.fork_cause`).

A sub-agent capture (`subagent_script`, tests/agent_traffic/subagent/) calls the agent's sub-agent tool once instead.

Re-capture with `python tests/agent_traffic.py [--subagent] [AGENT...]` (the agents of setup.sh; about a minute a
task, under `heavy`) and review the diff: it is what the agent changed.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from aiohttp import ClientSession
from transformers import PreTrainedTokenizerBase

from swe_grpo.agents.base import Agent
from swe_grpo.demo.warm_start import load_candidates
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.serving.dialects import CHAT, MESSAGES, RESPONSES
from swe_grpo.serving.interception import InterceptionServer, RolloutRecord
from swe_grpo.tasks import Task
from swe_grpo.testing.pi_capture import ScriptedGenerator, capture_agent_run, completion_ids
from swe_grpo.tokens.chain import Message, TrainingTemplate, normalize_message

TRAFFIC_DIR = Path(__file__).resolve().parent / "agent_traffic"
# The context the capturing and replaying servers say they serve: Claude Code's first prompt alone is ~32k tokens.
MAX_MODEL_LEN = 131072
# The headers that carry the rollout's token, or differ between machines and runs for no reason of the agent's.
_UNKEPT_HEADERS = {"authorization", "x-api-key", "host", "content-length"}
_CALL_ID = re.compile(r"call_[0-9a-f]{24}")  # the ids the server gives tool calls (`openai_call`)
LONG_OUTPUT = "seq 1 12000"  # 12,000 lines, 59 kB: past every agent's cut for one tool output


@dataclass(frozen=True)
class AgentWire:
    """How an agent talks: its registry name, its dialect's route under the rollout's base URL, the header its key
    goes in (and its prefix), and its shell tool with the argument that holds the command."""

    name: str
    route: str
    key_header: str
    key_prefix: str
    shell: str
    argument: str

    def agent(self) -> Agent:
        from swe_grpo.agents import make_agent

        return make_agent(self.name)


WIRES = {
    "opencode": AgentWire("opencode", "/chat/completions", "Authorization", "Bearer ", "bash", "command"),
    "codex": AgentWire("codex", "/responses", "Authorization", "Bearer ", "exec_command", "cmd"),
    "claude-code": AgentWire("claude-code", "/messages", "x-api-key", "", "Bash", "command"),
}
DIALECTS = {"opencode": CHAT, "codex": RESPONSES, "claude-code": MESSAGES}
# The demo tasks' file to look at (each task's fix is the warm start's resolving candidate).
_TASK_FILES = {
    "swe-grpo-demo__strutil-1": "strutil.py",
    "swe-grpo-demo__intervals-1": "intervals/core.py",
    "swe-grpo-demo__iniparse-1": "iniparse.py",
}


def script(wire: AgentWire, instance_id: str, long_output: bool) -> list[Message]:
    """The model turns of a capture: reasoning with a call, text with two calls at once, (`long_output`: a 12,000-line
    output), the fix, the tests, a final answer."""
    path = _TASK_FILES[instance_id]
    [fix] = [c.command for c in load_candidates()[instance_id] if c.resolves]

    def calls(*commands: str) -> list[dict[str, Any]]:
        return [
            {"id": f"call_{k}", "type": "function", "function": {"name": wire.shell, "arguments": {wire.argument: c}}}
            for k, c in enumerate(commands)
        ]

    turns: list[Message] = [
        {
            "role": "assistant",
            "reasoning_content": "I should see the repository first.",
            "content": "",
            "tool_calls": calls("ls"),
        },
        {
            "role": "assistant",
            "content": "Reading the code and its history.",
            "tool_calls": calls(f"cat {path}", "git log --oneline | head -3"),
        },
    ]
    if long_output:
        turns.append({"role": "assistant", "content": "", "tool_calls": calls(LONG_OUTPUT)})
    turns += [
        {"role": "assistant", "content": "", "tool_calls": calls(fix)},
        {"role": "assistant", "content": "", "tool_calls": calls("python3 -m pytest -q 2>&1 | tail -3")},
        {"role": "assistant", "content": f"Fixed {path}; the tests pass."},
    ]
    return turns


# The agents that offer a sub-agent tool (Codex's, `multi_agent`, is off): the tool and the sub-agent type to ask for.
SUBAGENT_TOOLS = {"opencode": ("task", "general"), "claude-code": ("Agent", "general-purpose")}


def subagent_script(wire: AgentWire) -> list[Message]:
    """The model turns of a sub-agent capture: the agent's sub-agent tool called, the sub-agent's answer (its own
    conversation, on the same endpoint), the agent's final answer."""
    tool, kind = SUBAGENT_TOOLS[wire.name]
    arguments = {
        "description": "Survey the repository",
        "prompt": "List the files and say what each is for.",
        "subagent_type": kind,
    }
    call = {"id": "call_0", "type": "function", "function": {"name": tool, "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "assistant", "content": "The repository holds the module and its tests."},
        {"role": "assistant", "content": "Done."},
    ]


# --------------------------------------------------------------------------- storing a capture small


def pack(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each body as what changed since the previous one: a top-level field equal to the previous body's is left out
    (listed in `same`), one equal to an earlier body's is `{"as": index}` (a sub-agent's turns between two of the
    agent's), and a list field that extends the previous one's is `{"keep": n, "then": [...]}` (its first n items are
    the previous body's). `unpack` gives the bodies back exactly."""
    packed: list[dict[str, Any]] = []
    for k, body in enumerate(bodies):
        previous = bodies[k - 1] if k else {}
        entry: dict[str, Any] = {"same": [], "fields": {}}
        for key, value in body.items():
            before = previous.get(key)
            earlier = next((j for j in range(k - 2, -1, -1) if bodies[j].get(key) == value), None)
            if key in previous and before == value:
                entry["same"].append(key)
            elif earlier is not None and len(json.dumps(value)) > 64:
                entry["fields"][key] = {"as": earlier}
            elif isinstance(value, list) and isinstance(before, list):
                keep = next((i for i, (a, b) in enumerate(zip(before, value, strict=False)) if a != b), None)
                keep = min(len(before), len(value)) if keep is None else keep
                entry["fields"][key] = {"keep": keep, "then": value[keep:]}
            else:
                entry["fields"][key] = {"value": value}
        packed.append(entry)
    return packed


def unpack(packed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []
    for entry in packed:
        previous = bodies[-1] if bodies else {}
        body = {key: previous[key] for key in entry["same"]}
        for key, field in entry["fields"].items():
            if "as" in field:
                body[key] = bodies[field["as"]][key]
            else:
                body[key] = field["value"] if "value" in field else previous[key][: field["keep"]] + field["then"]
        bodies.append(body)
    return bodies


@dataclass(frozen=True)
class Capture:
    """One captured conversation: the agent, its version, the task, the scripted model turns, the requests it sent
    (headers without the token's, bodies) and the turn kinds the capturing server recorded."""

    agent: str
    version: str
    instance_id: str
    replies: list[Message]
    headers: list[dict[str, str]]
    bodies: list[dict[str, Any]]
    turns: list[str]


def stored(captures: list[Capture]) -> dict[str, Any]:
    """One agent's captures as tests/agent_traffic/AGENT-VERSION.json holds them: the requests of all of them packed
    as one sequence (`pack`: the system prompt and tools are stored once), each capture with its count."""
    return {
        "agent": captures[0].agent,
        "version": captures[0].version,
        "captures": [
            {
                "instance_id": c.instance_id,
                "replies": c.replies,
                "turns": c.turns,
                "headers": c.headers,
                "requests": len(c.bodies),
            }
            for c in captures
        ],
        "requests": pack([body for c in captures for body in c.bodies]),
    }


def load(path: Path) -> list[Capture]:
    kept = json.loads(path.read_text(encoding="utf-8"))
    bodies, captures = unpack(kept["requests"]), []
    for c in kept["captures"]:
        mine, bodies = bodies[: c["requests"]], bodies[c["requests"] :]
        captures.append(
            Capture(kept["agent"], kept["version"], c["instance_id"], c["replies"], c["headers"], mine, c["turns"])
        )
    return captures


def captured_files(subagent: bool = False) -> list[Path]:
    """The stored captures: of the demo tasks, or (`subagent`) of an agent's sub-agent tool."""
    return sorted((TRAFFIC_DIR / "subagent" if subagent else TRAFFIC_DIR).glob("*.json"))


# --------------------------------------------------------------------------- capturing


async def capture(
    wire: AgentWire,
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    task: Task,
    replies: list[Message],
) -> Capture:
    """The real agent of `wire` on `task` with its model turns scripted to `replies` (see the module docstring)."""
    agent = wire.agent()
    # A wall clock for a loaded box: OpenCode takes ~2 s of CPU a request and ~25 s to its first one at load 11-14.
    run = await capture_agent_run(agent, tokenizer, backend, task, replies, max_model_len=MAX_MODEL_LEN, timeout_s=900)
    turns = [t.kind for t in run.record.turns]
    assert run.result.exit_code == 0 and not run.result.timed_out, (run.result, len(run.captured.requests), turns)
    headers = [{k: v for k, v in h.items() if k not in _UNKEPT_HEADERS} for h, _ in run.captured.requests]
    found = Capture(
        wire.name,
        agent.bundle.version,
        task.instance_id,
        replies,
        headers,
        run.captured.bodies,
        turns,
    )
    assert run.token not in json.dumps(stored([found])), "the rollout's token must not be in a capture"
    return found


# --------------------------------------------------------------------------- replaying


async def replay(capture: Capture, tokenizer: PreTrainedTokenizerBase) -> RolloutRecord:
    """`capture`'s requests sent again, in order, to a fresh InterceptionServer (see the module docstring); the
    rollout's record. Every request must be answered 200."""
    wire = WIRES[capture.agent]
    template = TrainingTemplate(tokenizer)
    generator = ScriptedGenerator([completion_ids(template, reply) for reply in capture.replies], MAX_MODEL_LEN)
    given: dict[str, str] = {}  # the capture's call ids -> the replay's
    async with (
        InterceptionServer(generator, tokenizer) as server,
        server.rollout() as session,
        ClientSession() as http,
    ):
        endpoint = session.endpoint
        headers = {wire.key_header: wire.key_prefix + endpoint.token, "content-type": "application/json"}
        for k, body in enumerate(capture.bodies):
            text = json.dumps(body)
            # The ids the capture's server gave the reply to request k: the first new ones a later request brings (the
            # next one, or the one after a sub-agent's turns).
            later = [i for b in capture.bodies[k + 1 :] for i in _CALL_ID.findall(json.dumps(b))]
            new = [i for i in dict.fromkeys(later) if i not in given and i not in text]
            text = _CALL_ID.sub(lambda m: given.get(m.group(0), m.group(0)), text)
            async with http.post(endpoint.base_url + wire.route, data=text, headers=headers) as response:
                answer = await response.text()
                assert response.status == 200, (k, response.status, answer[:500])
            answered = list(dict.fromkeys(_CALL_ID.findall(answer)))
            given.update(zip(new[: len(answered)], answered, strict=False))
    assert session.record is not None
    return session.record


def chat_requests(capture: Capture) -> list[dict[str, Any]]:
    """Each captured request as the chat request the server serves (its dialect's `to_chat`), messages normalised."""
    to_chat = DIALECTS[capture.agent].to_chat
    chats = []
    for body in capture.bodies:
        chat = to_chat(body)
        chat["messages"] = [normalize_message(m, i) for i, m in enumerate(chat["messages"])]
        chats.append(chat)
    return chats


@dataclass(frozen=True)
class HistoryFacts:
    """What an agent did to its history in a capture, read off the requests as the server serves them:
    `reasoning_echoed` (the reply with reasoning came back with it), `parallel_calls` (how the two calls of one reply
    came back: "one message" or "split"), `long_output_chars` (how many characters of the 12,000-line output reached
    the model when it was first sent; None: no such turn), `long_output_later` (how that output was re-sent later:
    "unchanged", or a named change), `system_changes` and `tools_changes` (requests whose system prompt or tools
    differ from the previous request's)."""

    reasoning_echoed: bool
    parallel_calls: str
    long_output_chars: int | None
    long_output_later: str
    system_changes: int
    tools_changes: int


def history_facts(capture: Capture) -> HistoryFacts:
    chats = chat_requests(capture)
    last = chats[-1]["messages"]
    assistants = [m for m in last if m["role"] == "assistant"]
    reasoning = capture.replies[0]["reasoning_content"]
    echoed = any(m.get("reasoning_content", "").strip() == reasoning for m in assistants)
    parallel = "one message" if any(len(m.get("tool_calls") or []) == 2 for m in assistants) else "split"
    long_chars, later = None, "unchanged"
    long_index = next((k for k, r in enumerate(capture.replies) if LONG_OUTPUT in json.dumps(r)), None)
    if long_index is not None and long_index + 1 < len(chats):
        first = chats[long_index + 1]["messages"]
        at = max(i for i, m in enumerate(first) if m["role"] == "tool")
        long_chars = len(first[at]["content"])
        for chat in chats[long_index + 2 :]:
            kept = chat["messages"][at] if at < len(chat["messages"]) else None
            if kept != first[at]:
                later = "dropped" if kept is None else f"rewritten to {len(kept['content'])} characters"
                break
    changes = list(pairwise(chats))
    system = sum(a["messages"][0] != b["messages"][0] for a, b in changes)
    tools = sum(a.get("tools") != b.get("tools") for a, b in changes)
    return HistoryFacts(echoed, parallel, long_chars, later, system, tools)


def main(names: list[str]) -> None:
    """Re-capture: `python tests/agent_traffic.py [AGENT...]` writes tests/agent_traffic/AGENT-VERSION.json for each
    agent (default: all three) on the three demo tasks (the first with the 12,000-line output); with `--subagent`,
    tests/agent_traffic/subagent/AGENT-VERSION.json: the first task with `subagent_script` (default: the agents of
    `SUBAGENT_TOOLS`)."""
    import asyncio
    import tempfile

    from transformers import AutoTokenizer

    from swe_grpo.demo.tasks import demo_tasks
    from swe_grpo.extras.tiny_model import build_tiny_model
    from swe_grpo.sandbox.local import LocalBackend

    tasks = sorted(demo_tasks(), key=lambda t: list(_TASK_FILES).index(t.instance_id))

    subagent = "--subagent" in names
    names = [name for name in names if name != "--subagent"] or list(SUBAGENT_TOOLS if subagent else WIRES)
    where = TRAFFIC_DIR / "subagent" if subagent else TRAFFIC_DIR

    async def run(wire: AgentWire) -> list[Capture]:
        if subagent:
            scripts = [(tasks[0], subagent_script(wire))]
        else:
            scripts = [(task, script(wire, task.instance_id, long_output=i == 0)) for i, task in enumerate(tasks)]
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            root.chmod(0o711)  # the sandbox user must traverse it
            backend = LocalBackend(cache_dir=root / "checkouts", run_dir=root)
            return [await capture(wire, tokenizer, backend, task, replies) for task, replies in scripts]

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    where.mkdir(parents=True, exist_ok=True)
    for name in names:
        captures = asyncio.run(run(WIRES[name]))
        path = where / f"{name}-{captures[0].version}.json"
        path.write_text(json.dumps(stored(captures), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(path, [c.turns for c in captures])


if __name__ == "__main__":
    main(sys.argv[1:])
