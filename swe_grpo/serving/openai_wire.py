"""The OpenAI chat-completions wire format, as the InterceptionServer speaks it: a request's body read within
bounds (`read_body`) and its streaming options (`stream_mode`), errors in OpenAI's shape (`APIError`,
`errors_as_json`), a reply as JSON or as SSE chunks (`Reply`), and `Answer`, the agent's side of one request
(headers first and keep-alive comments while streaming, every write to a connection the agent closed reported
instead of raised)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiohttp.web_exceptions import HTTPRequestEntityTooLarge

from swe_grpo.tokens.responses import ParsedResponse

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered in OpenAI's shape. `retry=False` adds `x-should-retry: false`, which the OpenAI clients
    (openai-python, openai-node in Pi) obey instead of retrying statuses such as 409 by themselves; `close=True`
    closes the connection once answered."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        retry: bool | None = None,
        close: bool = False,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.retry = status, message, kind, code, retry
        self.close = close

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.code}}

    def response(self) -> web.Response:
        headers = None if self.retry is None else {"x-should-retry": str(self.retry).lower()}
        response = json_response(self.body(), self.status, headers)
        if self.close:
            response.force_close()
        return response


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


@web.middleware
async def errors_as_json(request: web.Request, handler: Callable) -> web.StreamResponse:
    """Every error a route raises, answered in OpenAI's shape (a bug: a logged 500, never a traceback)."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return APIError(e.status, e.reason).response()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("internal error serving %s", request.path)
        return APIError(500, "internal server error", "server_error").response()


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> tuple[dict[str, Any], int]:
    """The request's JSON object and its size in bytes: 413 over `max_bytes` (refused before a byte is read when
    its Content-Length says so), 408 when it has not arrived whole within `timeout_s`, 400 when it is not a JSON
    object. A `ConnectionError` (the agent went away mid-body) is raised as it is."""
    too_big = f"request body over {max_bytes} bytes"
    if (request.content_length or 0) > max_bytes:
        raise APIError(413, too_big)
    refused: APIError | None = None
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # aiohttp stops at `client_max_size` (the same limit) too
    except TimeoutError:
        refused = APIError(408, f"request body not received within {timeout_s:g} s")
    except HTTPRequestEntityTooLarge:
        refused = APIError(413, too_big)
    # Raised out here, not in the handlers: an exception raised there would chain the reader's, whose frame holds
    # what was read (up to `max_bytes`), in a cycle only the cyclic collector frees; repeated, those pile up.
    if refused is not None:
        raise refused
    try:
        body = orjson.loads(raw)  # the whole history, every turn: decode it fast
    except orjson.JSONDecodeError:
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body, len(raw)


def stream_mode(body: dict[str, Any]) -> tuple[bool, bool]:
    """(`stream`, `stream_options.include_usage`) of a request body; 400 when they are of the wrong type."""
    stream = body.get("stream", False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(stream_options, dict):
        raise APIError(400, "'stream' must be a boolean and 'stream_options' an object")
    return stream, bool(stream_options.get("include_usage"))


@dataclass(frozen=True)
class Reply:
    """One answered chat completion, rendered as OpenAI JSON or as SSE chunks."""

    id: str
    created: int
    model: str
    parsed: ParsedResponse
    prompt_tokens: int
    completion_tokens: int

    def _usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def completion(self) -> dict[str, Any]:
        choice = {"index": 0, "message": self.parsed.message, "finish_reason": self.parsed.finish_reason}
        return {**self._envelope("chat.completion", [choice]), "usage": self._usage()}

    def chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        message = self.parsed.message

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return self._envelope("chat.completion.chunk", [{"index": 0, "delta": delta, "finish_reason": finish}])

        out = [chunk({"role": "assistant", "content": ""})]
        if message.get("reasoning_content"):
            out.append(chunk({"reasoning_content": message["reasoning_content"]}))
        if message.get("content"):
            out.append(chunk({"content": message["content"]}))
        for i, call in enumerate(message.get("tool_calls") or []):
            out.append(chunk({"tool_calls": [{"index": i, **call}]}))
        out.append(chunk({}, self.parsed.finish_reason))
        if include_usage:
            out.append({**self._envelope("chat.completion.chunk", []), "usage": self._usage()})
        return out


def sse(event: Any) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


class Answer:
    """The agent's side of one chat completion. Streaming: headers at `start`, keep-alive comments while
    generating, then the reply's chunks, or an SSE error event. Not streaming: the JSON reply, or an error
    with its HTTP status, sent whole. Every write to a connection the agent closed is reported, not raised."""

    def __init__(self, request: web.Request, stream: bool, include_usage: bool, model: str):
        self.request, self.stream, self.include_usage, self.model = request, stream, include_usage, model
        self.response: web.StreamResponse | None = None
        self.parsed: ParsedResponse | None = None  # the reply that was sent

    def _gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def _write(self, data: bytes = b"", eof: bool = False) -> bool:
        """Send the headers if not yet sent, then `data`; False when the agent's connection is gone."""
        if self._gone():
            return False
        try:
            await self.response.prepare(self.request)  # once; later calls return at once
            if data:
                await self.response.write(data)
            if eof:
                await self.response.write_eof()
        except ConnectionError:  # reset, broken pipe, or aiohttp's "Connection lost" while a big write drains
            return False
        return True

    async def start(self) -> None:
        """Send the response headers now (streaming only)."""
        if self.stream:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self._write()

    async def keep_alive(self) -> bool:
        """An SSE comment (streaming), or just a look at the connection; False when the agent is gone."""
        return await self._write(b": keep-alive\n\n") if self.stream else not self._gone()

    async def send(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> bool:
        """Send the reply; True when it was written whole to the agent's connection."""
        reply = Reply(
            f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model, parsed, prompt_tokens, completion_tokens
        )
        self.parsed = parsed
        if self.stream:
            return await self._write(b"".join(map(sse, reply.chunks(self.include_usage))) + b"data: [DONE]\n\n", True)
        self.response = web.Response(body=orjson.dumps(reply.completion()), content_type="application/json")
        return await self._write(eof=True)

    async def fail(self, error: APIError) -> web.StreamResponse:
        """Answer with `error`: an error response, or an SSE error event when the headers are out."""
        if self.response is None:
            return error.response()
        if self.parsed is None:  # else the reply went out whole: nothing more can be said
            await self._write(sse(error.body()), eof=True)
        return self.response

    def abandoned(self) -> web.StreamResponse:
        """What the handler returns for an agent that went away (aiohttp drops it)."""
        return self.response or web.Response(status=499, reason="Client Closed Request")
