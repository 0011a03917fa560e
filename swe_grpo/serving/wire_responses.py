"""The OpenAI Responses dialect (`POST .../responses`, what Codex speaks), as a thin translation at the edge.

`to_chat` turns a Responses request into the chat-completions request the rest of the server serves (one canonical
conversation, one TokenChain): `instructions` and the leading system/developer messages become one system message;
`input` items become chat messages: `message` items by role, and the assistant's `reasoning`, `message` and
`function_call` items of one turn one assistant message (reasoning, text, tool calls, in that order);
`function_call_output` items tool messages. Function `tools` (flat, as Responses writes them) become chat tools;
`max_output_tokens` the token cap. What the template cannot render is refused (400, named): other item, content or
tool types (`local_shell`, `custom`, images...), `previous_response_id` (nothing is stored here: `store` is ignored).

`ResponsesWire` writes the reply as Responses output items: a `reasoning` item (its text as `reasoning_text` content
and as `encrypted_content`, so that a client that echoes either, as Codex does with `include:
["reasoning.encrypted_content"]`, gives it back), a `message` item with one `output_text` part (left out when the
reply is only tool calls), one `function_call` item per call (`call_id` the call's id, `arguments` the exact string
the tokens say). Streaming, the events OpenAI documents, each with its `sequence_number`: `response.created` and
`response.in_progress` with the headers, then per item `response.output_item.added`, its parts and deltas
(`response.content_part.added`, `response.output_text.delta`/`done`, `response.content_part.done`;
`response.function_call_arguments.delta`/`done`), `response.output_item.done`, and `response.completed` (or
`response.incomplete` when the token cap cut it). Errors are OpenAI's shape (`APIError`), in a stream an `error`
event and `response.failed` carrying the same code.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from swe_grpo.serving.openai_wire import KEEP_ALIVE, APIError, sse_event
from swe_grpo.tokens.responses import ParsedResponse

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    """A message's or output's content as one string: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: unsupported content part {kind!r} (only text is supported)")
        texts.append(part["text"])
    return "".join(texts)


def _reasoning(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` content, else its `encrypted_content` (ours is the text), else
    its summary."""
    content = item.get("content")
    if content:
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if isinstance(item.get("encrypted_content"), str):
        return item["encrypted_content"]
    return "".join(p.get("text", "") for p in item.get("summary") or [] if isinstance(p, dict))


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise APIError(400, "'input' must be a string or a list of items")
    system = body.get("instructions")
    if system is not None and not isinstance(system, str):
        raise APIError(400, "'instructions' must be a string")
    systems = [system] if system else []
    messages: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant message being gathered from its items
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where}: must be an object")
        kind = item.get("type", "message")
        role = item.get("role")
        if kind == "message" and role != "assistant":
            text = _text(item.get("content"), where)
            if role in ("system", "developer") and not messages:
                systems.append(text)  # before the conversation: part of the one system prompt
            elif role in ("system", "developer", "user"):
                messages.append({"role": "system" if role == "developer" else role, "content": text})
            else:
                raise APIError(400, f"{where}: unsupported role {role!r}")
            turn = None
            continue
        if kind == "function_call_output":
            output = _text(item.get("output"), where)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            turn = None
            continue
        if kind not in ("reasoning", "message", "function_call"):
            raise APIError(400, f"{where}: unsupported item type {kind!r}")
        # An assistant turn is its reasoning, then its text, then its calls: an item out of that order opens the next.
        if (
            turn is None
            or (kind == "reasoning" and (turn["content"] or "reasoning_content" in turn or "tool_calls" in turn))
            or (kind == "message" and "tool_calls" in turn)
        ):
            turn = {"role": "assistant", "content": ""}
            messages.append(turn)
        if kind == "reasoning":
            turn["reasoning_content"] = turn.get("reasoning_content", "") + _reasoning(item)
        elif kind == "message":
            turn["content"] += _text(item.get("content"), where)
        else:
            call = {"name": item.get("name"), "arguments": item.get("arguments")}
            turn.setdefault("tool_calls", []).append({"id": item.get("call_id"), "type": "function", "function": call})
    return [{"role": "system", "content": "\n\n".join(systems)}, *messages] if systems else messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tools[{i}]: unsupported tool type {kind!r} (only named function tools)")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the chat-completions request it asks for (see the module docstring); 400 for what
    the template cannot render."""
    if body.get("previous_response_id") is not None:
        raise APIError(400, "'previous_response_id' is not supported: send the whole conversation (store: false)")
    chat: dict[str, Any] = {"messages": _messages(body), "stream": body.get("stream", False)}
    if (tools := _tools(body.get("tools"))) is not None:
        chat["tools"] = tools
    if "max_output_tokens" in body:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message (`ParsedResponse.message`) as Responses output items."""
    items: list[dict[str, Any]] = []
    if reasoning := message.get("reasoning_content"):
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "encrypted_content": reasoning,
            }
        )
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        part = {"type": "output_text", "text": message.get("content") or "", "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "role": "assistant",
                "status": "completed",
                "content": [part],
            }
        )
    for call in calls:
        function = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    return items


class ResponsesWire:
    """The Responses dialect's `Wire` for one request (see the module docstring)."""

    def __init__(self, model: str, include_usage: bool = True):
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.sequence = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse_event(kind, data)

    def _response(self, status: str, output: list, usage: dict | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "store": False,
            "usage": usage,
            "metadata": {},
            **extra,
        }

    def _final(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        usage = {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        }
        items = output_items(parsed.message)
        if parsed.finish_reason == "length":
            return self._response("incomplete", items, usage, incomplete_details={"reason": "max_output_tokens"})
        return self._response("completed", items, usage)

    def head(self, prompt_tokens: int) -> bytes:
        opened = self._response("in_progress", [])
        return self._event("response.created", response=opened) + self._event("response.in_progress", response=opened)

    def keep_alive(self) -> bytes:
        return KEEP_ALIVE

    def body(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._final(parsed, prompt_tokens, completion_tokens)

    def stream(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> bytes:
        final = self._final(parsed, prompt_tokens, completion_tokens)
        out = []
        for index, item in enumerate(final["output"]):
            out.append(self._item_events(index, item))
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return b"".join(out) + self._event(kind, response=final)

    def _item_events(self, index: int, item: dict[str, Any]) -> bytes:
        where = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            text = part["text"]
            events = [
                self._event("response.output_item.added", output_index=index, item={**item, "content": []}),
                self._event("response.content_part.added", **where, content_index=0, part={**part, "text": ""}),
                self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]),
                self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=part),
            ]
        elif item["type"] == "function_call":
            arguments = item["arguments"]
            events = [
                self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
                self._event("response.function_call_arguments.delta", **where, delta=arguments),
                self._event("response.function_call_arguments.done", **where, name=item["name"], arguments=arguments),
            ]
        else:  # reasoning: whole at once
            events = [self._event("response.output_item.added", output_index=index, item=item)]
        return b"".join(events) + self._event("response.output_item.done", output_index=index, item=item)

    def stream_error(self, error: APIError) -> bytes:
        code = error.code or error.kind
        failed = self._response("failed", [], error={"code": code, "message": error.message})
        return self._event("error", code=code, message=error.message, param=None) + self._event(
            "response.failed", response=failed
        )

    def error_response(self, error: APIError) -> web.Response:
        return error.response()
