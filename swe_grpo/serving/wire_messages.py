"""The Anthropic Messages dialect (`POST .../v1/messages`, what Claude Code speaks), as a thin translation at the edge.

`to_chat` turns a Messages request into the chat-completions request the rest of the server serves (one canonical
conversation, one TokenChain): `system` (a string, or text blocks joined by a blank line) the system message, and
a message of role `system` among the messages (Claude Code sends one after the task) a system message there; an
assistant message's `thinking` blocks its reasoning, its `text` blocks its content, its `tool_use` blocks its tool
calls (`input` the arguments); a user message's `tool_result` blocks tool messages (in their order, before the
message's text, which becomes a user message); text blocks of one message joined by a blank line. `tools` (`name`,
`description`, `input_schema`) become function tools, `max_tokens` the token cap. Sampling fields (`temperature`,
`thinking`...) are ignored: the rollout's sampling holds. What the template cannot render is refused (400, named):
images, documents, server tools, redacted thinking. `cache_control` is ignored, and so is a tool result's `is_error`
(the template has no place for it).

`MessagesWire` writes the reply as content blocks: a `thinking` block (the reasoning; its `signature` names this
server), a `text` block (left out when the reply is only tool calls), one `tool_use` block per call (`id` the call's
id, `input` the arguments the tokens say), `stop_reason` `end_turn`, `tool_use` or `max_tokens`. Streaming, the
events Anthropic documents: `message_start` and a `ping` with the headers, then per block `content_block_start`, a
`content_block_delta` (`thinking_delta` and `signature_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`. Errors are Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`; in a stream an `error` event), their named cause (`superseded`,
`context_length_exceeded`) leading the message; a context overflow says "prompt is too long", which Claude Code reads
as its cue to compact.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from swe_grpo.serving.openai_wire import KEEP_ALIVE, APIError, json_response, sse_event
from swe_grpo.tokens.responses import ParsedResponse

SIGNATURE = "swe_grpo"  # a thinking block's signature: ours carries no secret, it only names who wrote the block
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """`error` in Anthropic's shape."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    message = error.message
    if error.code == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    elif error.code:
        message = f"{error.code}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: APIError) -> web.Response:
    headers = None if error.retry is None else {"x-should-retry": str(error.retry).lower()}
    response = json_response(error_body(error), error.status, headers)
    if error.close:
        response.force_close()
    return response


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}: content must be a string or a list of blocks")
    return content


def _joined(texts: list[str]) -> str:
    return "\n\n".join(texts)


def _text_of(block: dict[str, Any], where: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}: unsupported content block {block.get('type')!r} (only text is supported)")
    return block["text"]


def _assistant(content: Any, where: str) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for block in _blocks(content, where):
        kind = block.get("type")
        if kind == "thinking":
            thinking.append(block.get("thinking") or "")
        elif kind == "tool_use":
            if not isinstance(block.get("input"), dict):
                raise APIError(400, f"{where}: a tool_use block's input must be an object")
            function = {"name": block.get("name"), "arguments": block["input"]}
            calls.append({"id": block.get("id"), "type": "function", "function": function})
        else:
            texts.append(_text_of(block, where))
    message: dict[str, Any] = {"role": "assistant", "content": _joined(texts)}
    if thinking:
        message["reasoning_content"] = _joined(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message as chat messages: its tool results, then its text."""
    results, texts = [], []
    for block in _blocks(content, where):
        if block.get("type") == "tool_result":
            output = block.get("content")
            text = output if isinstance(output, str) else _joined([_text_of(b, where) for b in _blocks(output, where)])
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        else:
            texts.append(_text_of(block, where))
    return results + ([{"role": "user", "content": _joined(texts)}] if texts or not results else [])


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type", "custom") != "custom"
            or not isinstance(tool.get("name"), str)
        ):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tools[{i}]: unsupported tool {kind!r} (only named tools with an input_schema)")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Messages request as the chat-completions request it asks for (see the module docstring); 400 for what the
    template cannot render."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        messages.append(
            {"role": "system", "content": _joined([_text_of(b, "system") for b in _blocks(system, "system")])}
        )
    asked = body.get("messages")
    if not isinstance(asked, list):
        raise APIError(400, "'messages' must be a list")
    for i, message in enumerate(asked):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role == "assistant":
            messages.append(_assistant(message.get("content"), where))
        elif role == "user":
            messages.extend(_user(message.get("content"), where))
        elif role == "system":  # Claude Code 2.1.332 sends one after the first user message
            text = _joined([_text_of(b, where) for b in _blocks(message.get("content"), where)])
            messages.append({"role": "system", "content": text})
        else:
            raise APIError(400, f"{where}: unsupported role {role!r}")
    chat: dict[str, Any] = {"messages": messages, "stream": body.get("stream", False)}
    if (tools := _tools(body.get("tools"))) is not None:
        chat["tools"] = tools
    if "max_tokens" in body:
        chat["max_tokens"] = body["max_tokens"]
    return chat


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An assistant message (`ParsedResponse.message`) as Messages content blocks."""
    blocks: list[dict[str, Any]] = []
    if reasoning := message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": SIGNATURE})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        blocks.append({"type": "text", "text": message.get("content") or ""})
    for call in calls:
        function = call["function"]
        arguments = json.loads(function["arguments"])  # a JSON object's text, as the tokens say (ResponseParser)
        blocks.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": arguments})
    return blocks


def _block_event(kind: str, index: int, **fields: Any) -> bytes:
    return sse_event(kind, {"type": kind, "index": index, **fields})


class MessagesWire:
    """The Messages dialect's `Wire` for one request (see the module docstring)."""

    def __init__(self, model: str, include_usage: bool = True):
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"

    def _message(self, content: list, stop_reason: str | None, prompt_tokens: int, output_tokens: int) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def head(self, prompt_tokens: int) -> bytes:
        started = {"type": "message_start", "message": self._message([], None, prompt_tokens, 0)}
        return sse_event("message_start", started) + sse_event("ping", {"type": "ping"})

    def keep_alive(self) -> bytes:
        return KEEP_ALIVE

    def body(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        stop = _STOP_REASONS.get(parsed.finish_reason, "end_turn")
        return self._message(content_blocks(parsed.message), stop, prompt_tokens, completion_tokens)

    def stream(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> bytes:
        out = []
        calls = iter(parsed.message.get("tool_calls") or [])
        for index, block in enumerate(content_blocks(parsed.message)):
            kind = block["type"]
            if kind == "thinking":
                opened = {**block, "thinking": "", "signature": ""}
                deltas = [
                    {"type": "thinking_delta", "thinking": block["thinking"]},
                    {"type": "signature_delta", "signature": block["signature"]},
                ]
            elif kind == "text":
                opened, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": block["text"]}]
            else:  # tool_use: its arguments exactly as generated
                opened = {**block, "input": {}}
                deltas = [{"type": "input_json_delta", "partial_json": next(calls)["function"]["arguments"]}]
            out.append(_block_event("content_block_start", index, content_block=opened))
            out.extend(_block_event("content_block_delta", index, delta=delta) for delta in deltas)
            out.append(_block_event("content_block_stop", index))
        stop = _STOP_REASONS.get(parsed.finish_reason, "end_turn")
        delta = {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}}
        delta["usage"] = {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}
        out.append(sse_event("message_delta", delta))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def stream_error(self, error: APIError) -> bytes:
        return sse_event("error", error_body(error))

    def error_response(self, error: APIError) -> web.Response:
        return error_response(error)
