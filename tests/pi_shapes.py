"""Conversations in the exact request shape Pi sends (see PLATFORM.md), for driving the chain and the
server without a model that can act. The texts are our own; the SHAPE is Pi's: user content as a list
of text parts, the full history re-sent each turn, the assistant's tool-call `arguments` re-serialised
the way JavaScript's JSON.stringify does (no spaces), empty text sent as `content: null`, reasoning
echoed back under the field it came in, tool results as `{role: tool, tool_call_id, content}`.

`scripted_output` gives the token ids a model would produce for an assistant message under a template:
these are SCRIPTED outputs (the template's own rendering), used where a random tiny model cannot act.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from swe_grpo.chain import TrainingTemplate

SYSTEM_PROMPT = (
    "You are a coding agent working in a git repository. You can read files, run shell commands, edit "
    "files and write new ones. Work step by step: inspect the code, reproduce the problem, make the "
    "smallest change that fixes it, and check the fix by running the tests. " * 12
)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters, "strict": False},
    }


TOOLS = [
    _tool("read", "Read a file.", {"path": {"type": "string"}, "offset": {"type": "number"}}, ["path"]),
    _tool(
        "bash",
        "Run a shell command.",
        {"command": {"type": "string"}, "timeout": {"type": "number"}},
        ["command"],
    ),
    _tool(
        "edit",
        "Replace text in a file.",
        {"path": {"type": "string"}, "oldText": {"type": "string"}, "newText": {"type": "string"}},
        ["path", "oldText", "newText"],
    ),
    _tool(
        "write",
        "Write a file.",
        {"path": {"type": "string"}, "content": {"type": "string"}},
        ["path", "content"],
    ),
]


def js_stringify(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def echo_assistant(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as Pi sends it back in the next request."""
    echoed: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content"):
        echoed["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        echoed["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": js_stringify(json.loads(call["function"]["arguments"])),
                },
            }
            for call in message["tool_calls"]
        ]
    return echoed


class PiConversation:
    """The growing history of one Pi session."""

    def __init__(self, task: str = "The test test_parse fails on empty input. Fix it.", max_tokens: int = 256):
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "text", "text": task}]},
        ]
        self.max_tokens = max_tokens

    def request(self, stream: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "policy",
            "messages": copy.deepcopy(self.messages),
            "tools": copy.deepcopy(TOOLS),
            "stream": stream,
            "max_tokens": self.max_tokens,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def add_reply(self, message: dict[str, Any], tool_outputs: list[str] | None = None) -> None:
        """Echo the assistant reply and answer each of its tool calls (outputs given, or a default)."""
        self.messages.append(echo_assistant(message))
        for i, call in enumerate(message.get("tool_calls") or []):
            output = tool_outputs[i] if tool_outputs else f"output of {call['function']['name']} #{i}\nline 2"
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


def scripted_output(template: TrainingTemplate, message: dict[str, Any]) -> list[int]:
    """SCRIPTED model output: the ids the template renders for `message` after the generation prompt,
    through the end-of-turn token. `message` is in normalised form (arguments as objects)."""
    user = {"role": "user", "content": "."}
    prompt = template.render([user], generation_prompt=True)
    full = template.render([user, message])
    assert full.startswith(prompt), "template writes the generation prompt differently from the turn"
    end = full.rfind(template.eos_token) + len(template.eos_token)
    return template.encode(full[len(prompt) : end])
