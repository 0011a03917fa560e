"""The OpenAI chat-completions wire format, as the InterceptionServer speaks it: a request's body read within
bounds (`read_body`) and its streaming options (`stream_mode`), errors in OpenAI's shape (`APIError`,
`errors_as_json`; `errors_as` for another dialect's shape), a reply as JSON or as SSE chunks (`Reply`, written by
`ChatWire`), and `Answer`, the agent's side of one request (headers first and keep-alive comments while streaming,
every write to a connection the agent closed reported instead of raised). `Answer` writes what a `Wire` renders:
`ChatWire` here, the other dialects' beside it (`swe_grpo.serving.dialects`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


def errors_as(shape: Callable[[web.Request, APIError], web.Response]) -> Callable:
    """A middleware that answers every error a route raises as `shape(request, error)` (a bug: a logged 500, never
    a traceback)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            return shape(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return shape(request, APIError(e.status, e.reason))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("internal error serving %s", request.path)
            return shape(request, APIError(500, "internal server error", "server_error"))

    return middleware


errors_as_json = errors_as(lambda request, error: error.response())  # OpenAI's shape


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


def sse_event(name: str, data: Any) -> bytes:
    """A named SSE event (`event:` line), as the Responses and Messages streams send them."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class Wire(Protocol):
    """How one request's answer is written in its dialect: the SSE sent with the headers (`head`, given the
    prompt's length) and while generating (`keep_alive`), the reply as SSE (`stream`) or as a JSON body (`body`),
    and an error after the headers (`stream_error`) or before them (`error_response`)."""

    def head(self, prompt_tokens: int) -> bytes: ...

    def keep_alive(self) -> bytes: ...

    def stream(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> bytes: ...

    def body(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]: ...

    def stream_error(self, error: APIError) -> bytes: ...

    def error_response(self, error: APIError) -> web.Response: ...


KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: every SSE reader skips it


class ChatWire:
    """The chat-completions dialect's `Wire`: `Reply` as chunks ending `data: [DONE]`, errors in OpenAI's shape."""

    def __init__(self, model: str, include_usage: bool):
        self.model, self.include_usage = model, include_usage

    def head(self, prompt_tokens: int) -> bytes:
        return b""

    def keep_alive(self) -> bytes:
        return KEEP_ALIVE

    def _reply(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> Reply:
        created = int(time.time())
        return Reply(f"chatcmpl-{uuid.uuid4().hex}", created, self.model, parsed, prompt_tokens, completion_tokens)

    def stream(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> bytes:
        chunks = self._reply(parsed, prompt_tokens, completion_tokens).chunks(self.include_usage)
        return b"".join(map(sse, chunks)) + b"data: [DONE]\n\n"

    def body(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return self._reply(parsed, prompt_tokens, completion_tokens).completion()

    def stream_error(self, error: APIError) -> bytes:
        return sse(error.body())

    def error_response(self, error: APIError) -> web.Response:
        return error.response()


class Answer:
    """The agent's side of one request, written by its dialect's `wire` (chat completions by default). Streaming:
    headers (and the wire's `head`) at `start`, keep-alives while generating, then the reply's events, or an SSE
    error event. Not streaming: the JSON reply, or an error with its HTTP status, sent whole. Every write to a
    connection the agent closed is reported, not raised."""

    def __init__(self, request: web.Request, stream: bool, include_usage: bool, model: str, wire: Wire | None = None):
        self.request, self.stream, self.include_usage, self.model = request, stream, include_usage, model
        self.wire = wire or ChatWire(model, include_usage)
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
            if eof:  # the last data and the stream's end in one send
                await self.response.write_eof(data)
            elif data:
                await self.response.write(data)
        except ConnectionError:  # reset, broken pipe, or aiohttp's "Connection lost" while a big write drains
            return False
        return True

    async def start(self, prompt_tokens: int = 0) -> None:
        """Send the response headers now, and what the dialect opens its stream with (streaming only)."""
        if self.stream:
            self.response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self._write(self.wire.head(prompt_tokens))

    async def keep_alive(self) -> bool:
        """An SSE keep-alive (streaming), or just a look at the connection; False when the agent is gone."""
        return await self._write(self.wire.keep_alive()) if self.stream else not self._gone()

    async def send(self, parsed: ParsedResponse, prompt_tokens: int, completion_tokens: int) -> bool:
        """Send the reply; True when it was written whole to the agent's connection."""
        self.parsed = parsed
        if self.stream:
            return await self._write(self.wire.stream(parsed, prompt_tokens, completion_tokens), True)
        body = self.wire.body(parsed, prompt_tokens, completion_tokens)
        self.response = web.Response(body=orjson.dumps(body), content_type="application/json")
        return await self._write(eof=True)

    async def fail(self, error: APIError) -> web.StreamResponse:
        """Answer with `error`: an error response, or an SSE error event when the headers are out."""
        if self.response is None:
            return self.wire.error_response(error)
        if self.parsed is None:  # else the reply went out whole: nothing more can be said
            await self._write(self.wire.stream_error(error), eof=True)
        return self.response

    def abandoned(self) -> web.StreamResponse:
        """What the handler returns for an agent that went away (aiohttp drops it)."""
        return self.response or web.Response(status=499, reason="Client Closed Request")
