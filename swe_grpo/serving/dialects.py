"""The three wire dialects the InterceptionServer speaks, each a thin translation onto one canonical conversation.

Inside, every request is a chat-completions request (OpenAI chat messages and function tools: what the TokenChain
holds and the training template renders) and every reply a `ParsedResponse`; a `Dialect` is what differs at the edge:
how its request becomes that chat request (`to_chat`, raising `APIError` 400 for what the template cannot render),
how one answer is written (`wire`: a `Wire`, `swe_grpo.serving.openai_wire`), its error shape, and whether its
clients authenticate with `x-api-key` as well as `Authorization: Bearer` (`check_token`). Turn handling (the chain,
supersession, retries, bounds, counting) is the same code for all three (`swe_grpo.serving.interception`,
`swe_grpo.serving.turn`).

- `CHAT`: OpenAI chat completions (Pi, mini-swe-agent, OpenCode), `openai_wire`;
- `RESPONSES`: OpenAI Responses (Codex), `wire_responses`;
- `MESSAGES`: Anthropic Messages (Claude Code), `wire_messages`.

`error_shape` answers an error raised before a route's dialect is known (auth, door, unknown route) in the shape its
client reads: Anthropic's for a Messages route or a request that carries `anthropic-version`, else OpenAI's.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from swe_grpo.serving import wire_messages, wire_responses
from swe_grpo.serving.openai_wire import APIError, ChatWire, Wire


@dataclass(frozen=True)
class Dialect:
    """One wire dialect (see the module docstring)."""

    name: str
    to_chat: Callable[[dict[str, Any]], dict[str, Any]]
    wire: Callable[[str, bool], Wire]  # (the model name the agent sees, include usage) -> one answer's writer
    error_response: Callable[[APIError], web.Response]
    api_key_header: bool = False  # `x-api-key` authenticates too


CHAT = Dialect("chat", lambda body: body, ChatWire, APIError.response)
RESPONSES = Dialect("responses", wire_responses.to_chat, wire_responses.ResponsesWire, APIError.response)
MESSAGES = Dialect(
    "messages", wire_messages.to_chat, wire_messages.MessagesWire, wire_messages.error_response, api_key_header=True
)


def check_token(request: web.Request, dialect: Dialect, expected: str) -> None:
    """Raise 401 unless the request carries `expected` in the dialect's header: `Authorization: Bearer`, or for
    Anthropic's clients `x-api-key` as well (compared in constant time)."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        given = request.headers.get("x-api-key", "") if dialect.api_key_header else ""
    if not given or not hmac.compare_digest(given.strip().encode(), expected.encode()):
        header = "x-api-key or bearer token" if dialect.api_key_header else "bearer token"
        raise APIError(401, f"missing or invalid {header}", "authentication_error")


def of_request(request: web.Request) -> Dialect:
    """The dialect a request's client reads errors in (see the module docstring)."""
    anthropic = "/v1/messages" in request.path or "anthropic-version" in request.headers
    return MESSAGES if anthropic else CHAT


def error_shape(request: web.Request, error: APIError) -> web.Response:
    """`error` as the request's client reads it (`openai_wire.errors_as`)."""
    return of_request(request).error_response(error)
