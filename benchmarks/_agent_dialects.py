"""The simulated Pi session (`_pi_agent.PiConversation`) on the wires of the other agent CLIs the server speaks to:
Codex's (OpenAI Responses) and Claude Code's (Anthropic Messages), shaped after their captured requests
(tests/agent_traffic/codex-0.171.0.json, claude-code-2.1.332.json). The conversation is the same in every dialect
(Pi's system prompt, task and tools; the same tool results), so that a benchmark's dialects differ by the wire alone.

- `RESPONSES` (Codex 0.171): `Authorization: Bearer`, `accept: text/event-stream`; the system prompt a `developer`
  message item and the task a `user` one (`input_text` parts); flat function tools, `tool_choice`,
  `parallel_tool_calls`, `reasoning`, `store: false`, `include: ["reasoning.encrypted_content"]`,
  `prompt_cache_key`, `stream: true`. It reads the answer's `response.output_item.done` items and echoes them back
  as they came (the reasoning item with its `encrypted_content`, the `function_call` items), then one
  `function_call_output` item per call.
- `MESSAGES` (Claude Code 2.1.332): `x-api-key`, `anthropic-version`; the system prompt as text blocks (with
  `cache_control`), the task a user text block; tools as `name`/`description`/`input_schema`, `metadata`,
  `max_tokens`, `thinking`, `stream: true`. It accumulates the content blocks from their start/delta/stop events
  (`thinking` with its signature, `text`, `tool_use` with its input JSON) and echoes them as an assistant message,
  then one user message of `tool_result` blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
from _pi_agent import CHAT, SYSTEM_PROMPT, TOOLS, USER_TASK, Answer, ClientWire, request_tail

_SESSION = "01a21eea-e377-73d1-8feb-7a0bfb0a08bc"  # a session id, as Codex and Claude Code send one


def _events(payload: bytes) -> list[dict[str, Any]]:
    """The `data:` objects of an SSE stream, in order (keep-alive comments skipped)."""
    out = []
    for event in payload.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(orjson.loads(line[len(b"data: ") :]))
    return out


@dataclass(frozen=True)
class ResponsesClient:
    """Codex's wire: OpenAI Responses (see the module docstring)."""

    name: str = "responses"
    route: str = "/responses"
    tail: bytes = request_tail(
        {
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"},
            "store": False,
            "stream": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": _SESSION,
        }
    )

    def headers(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}", "Content-Type": "application/json", "accept": "text/event-stream"}

    def head(self, model: str) -> bytes:
        return b'{"model":' + orjson.dumps(model) + b',"input":['

    def opening(self) -> list[dict[str, Any]]:
        return [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM_PROMPT}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER_TASK}]},
        ]

    def parse(self, payload: bytes) -> Answer:
        answer = Answer()
        for event in _events(payload):
            kind = event.get("type")
            if kind == "response.output_item.done":
                item = event["item"]
                answer.echo.append(item)
                if item["type"] == "function_call":
                    call = {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
                    answer.tool_calls.append(call)
                elif item["type"] == "message":
                    answer.content += "".join(p.get("text", "") for p in item["content"])
                elif item["type"] == "reasoning":
                    answer.reasoning += "".join(p.get("text", "") for p in item.get("content") or [])
            elif kind in ("response.completed", "response.incomplete", "response.failed"):
                response = event["response"]
                answer.finish_reason = response["status"]
                usage = response.get("usage") or {}
                answer.usage = {"prompt_tokens": usage.get("input_tokens", 0)}
        return answer

    def turn(self, answer: Answer, results: list[str]) -> list[dict[str, Any]]:
        outputs = [
            {"type": "function_call_output", "call_id": call["id"], "output": result}
            for call, result in zip(answer.tool_calls, results, strict=True)
        ]
        return [*answer.echo, *outputs]


@dataclass(frozen=True)
class MessagesClient:
    """Claude Code's wire: Anthropic Messages (see the module docstring)."""

    name: str = "messages"
    route: str = "/messages"
    tail: bytes = request_tail(
        {
            "tools": [
                {
                    "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"],
                }
                for t in TOOLS
            ],
            "metadata": {"user_id": json.dumps({"session_id": _SESSION})},
            "max_tokens": 32000,
            "thinking": {"type": "adaptive"},
            "stream": True,
        }
    )

    def headers(self, token: str) -> dict[str, str]:
        return {"x-api-key": token, "anthropic-version": "2023-06-01", "Content-Type": "application/json"}

    def head(self, model: str) -> bytes:
        system = [{"type": "text", "text": SYSTEM_PROMPT, "cache_control": {"type": "ephemeral"}}]
        return b'{"model":' + orjson.dumps(model) + b',"system":' + orjson.dumps(system) + b',"messages":['

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": USER_TASK}]}]

    def parse(self, payload: bytes) -> Answer:
        answer = Answer()
        blocks: dict[int, dict[str, Any]] = {}
        partial: dict[int, str] = {}  # a tool_use block's input JSON, as its deltas bring it
        for event in _events(payload):
            kind = event.get("type")
            if kind == "message_start":
                answer.usage = {"prompt_tokens": event["message"]["usage"]["input_tokens"]}
            elif kind == "content_block_start":
                blocks[event["index"]] = dict(event["content_block"])
            elif kind == "content_block_delta":
                block, delta = blocks[event["index"]], event["delta"]
                if delta["type"] == "input_json_delta":
                    partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
                else:  # thinking_delta, signature_delta, text_delta: the field they are named after
                    field = delta["type"].removesuffix("_delta")
                    block[field] = block.get(field, "") + delta[field]
            elif kind == "content_block_stop" and event["index"] in partial:
                blocks[event["index"]]["input"] = json.loads(partial[event["index"]] or "{}")
            elif kind == "message_delta":
                answer.finish_reason = event["delta"]["stop_reason"]
        answer.echo = [blocks[i] for i in sorted(blocks)]
        for block in answer.echo:
            if block["type"] == "tool_use":
                answer.tool_calls.append(
                    {"id": block["id"], "name": block["name"], "arguments": json.dumps(block["input"])}
                )
            elif block["type"] == "text":
                answer.content += block["text"]
            elif block["type"] == "thinking":
                answer.reasoning += block["thinking"]
        return answer

    def turn(self, answer: Answer, results: list[str]) -> list[dict[str, Any]]:
        outputs = [
            {"tool_use_id": call["id"], "type": "tool_result", "content": result, "is_error": False}
            for call, result in zip(answer.tool_calls, results, strict=True)
        ]
        return [{"role": "assistant", "content": answer.echo}, {"role": "user", "content": outputs}]


RESPONSES = ResponsesClient()
MESSAGES = MessagesClient()
WIRES: dict[str, ClientWire] = {"chat": CHAT, "responses": RESPONSES, "messages": MESSAGES}
