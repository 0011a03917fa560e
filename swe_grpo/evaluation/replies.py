"""What an upstream's reply adds up to, in each wire dialect, for `--passthrough`'s log and turn records.

`read_reply(dialect, data, streamed)` reads a forwarded reply, JSON or SSE, of any of the three dialects
(`swe_grpo.serving.dialects`) into `{"message", "finish_reason", "usage"}`: `message` in the dialect's own shape (a chat
assistant message, Responses output items, Messages content blocks), `usage` as `{"prompt_tokens",
"completion_tokens"}` whatever the dialect calls them (None when the upstream did not say). A reply that cannot be read
gives Nones: a log line, never a failed evaluation. `conversation` is the request and its reply as the one canonical
chat conversation (the dialect's own `to_chat`), for the rollout's trace.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from swe_grpo.serving import dialects
from swe_grpo.serving.dialects import Dialect
from swe_grpo.serving.openai_wire import APIError

NOTHING: dict[str, Any] = {"message": None, "finish_reason": None, "usage": None}


def _events(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of an SSE stream's `data:` lines (comments, `[DONE]` and unreadable lines skipped)."""
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        try:
            event = json.loads(line[5:])
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict):
            yield event


def _usage(usage: Any, prompt: str, completion: str) -> dict[str, int] | None:
    if not isinstance(usage, dict):
        return None
    return {"prompt_tokens": int(usage.get(prompt) or 0), "completion_tokens": int(usage.get(completion) or 0)}


def _chat_sse(data: bytes) -> dict[str, Any]:
    content, reasoning, tool_calls, finish, usage = "", "", {}, None, None
    for chunk in _events(data):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                slot = tool_calls.setdefault(call.get("index", 0), {"id": None, "name": "", "arguments": ""})
                slot["id"] = call.get("id") or slot["id"]
                function = call.get("function") or {}
                slot["name"] += function.get("name") or ""
                slot["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for _, c in sorted(tool_calls.items())
        ]
    return {"message": message, "finish_reason": finish, "usage": usage}


def _chat_json(body: dict[str, Any]) -> dict[str, Any]:
    choice = body["choices"][0]
    return {"message": choice.get("message"), "finish_reason": choice.get("finish_reason"), "usage": body.get("usage")}


def _responses_sse(data: bytes) -> dict[str, Any]:
    final = [e["response"] for e in _events(data) if e.get("type") in ("response.completed", "response.incomplete")]
    return _responses_json(final[-1]) if final else NOTHING


def _responses_json(body: dict[str, Any]) -> dict[str, Any]:
    usage = _usage(body.get("usage"), "input_tokens", "output_tokens")
    return {"message": body["output"], "finish_reason": body.get("status"), "usage": usage}


def _messages_sse(data: bytes) -> dict[str, Any]:
    blocks: dict[int, dict[str, Any]] = {}
    arguments: dict[int, str] = {}
    usage: dict[str, Any] = {}
    stop = None
    for event in _events(data):
        kind, index = event.get("type"), event.get("index")
        if kind == "message_start":
            usage.update((event.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            blocks[index] = dict(event.get("content_block") or {})
        elif kind == "content_block_delta" and index in blocks:
            delta, block = event.get("delta") or {}, blocks[index]
            for field, key in (("text", "text"), ("thinking", "thinking"), ("signature", "signature")):
                if key in delta:
                    block[field] = block.get(field, "") + delta[key]
            if "partial_json" in delta:
                arguments[index] = arguments.get(index, "") + delta["partial_json"]
        elif kind == "message_delta":
            stop = (event.get("delta") or {}).get("stop_reason") or stop
            usage.update(event.get("usage") or {})
    for index, text in arguments.items():
        try:
            blocks[index]["input"] = json.loads(text or "{}")
        except json.JSONDecodeError:
            blocks[index]["input"] = text  # logged as it came
    content = [blocks[i] for i in sorted(blocks)]
    return {"message": content, "finish_reason": stop, "usage": _usage(usage, "input_tokens", "output_tokens")}


def _messages_json(body: dict[str, Any]) -> dict[str, Any]:
    usage = _usage(body.get("usage"), "input_tokens", "output_tokens")
    return {"message": body["content"], "finish_reason": body.get("stop_reason"), "usage": usage}


_READERS = {
    dialects.CHAT.name: (_chat_sse, _chat_json),
    dialects.RESPONSES.name: (_responses_sse, _responses_json),
    dialects.MESSAGES.name: (_messages_sse, _messages_json),
}


def read_reply(dialect: Dialect, data: bytes, streamed: bool) -> dict[str, Any]:
    """The reply `data` (SSE when `streamed`, else JSON) in `dialect`, read (see the module docstring)."""
    from_sse, from_json = _READERS[dialect.name]
    try:
        return from_sse(data) if streamed else from_json(json.loads(data))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return NOTHING


def conversation(dialect: Dialect, body: dict[str, Any], reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The request `body` and its `reply` (from `read_reply`) as one chat conversation; [] when they do not
    translate (the upstream may accept what the training template cannot render)."""
    message = reply["message"]
    if dialect is dialects.RESPONSES and isinstance(message, list):
        asked = body.get("input")
        body = {
            **body,
            "input": [*(asked if isinstance(asked, list) else [{"role": "user", "content": asked}]), *message],
        }
    elif dialect is dialects.MESSAGES and isinstance(message, list):
        body = {**body, "messages": [*(body.get("messages") or []), {"role": "assistant", "content": message}]}
    try:
        messages = dialect.to_chat(body).get("messages")
    except (APIError, AttributeError, TypeError):
        return []
    if not isinstance(messages, list):
        return []
    return [*messages, message] if dialect is dialects.CHAT and message else messages
