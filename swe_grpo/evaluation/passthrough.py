"""`swe-grpo eval --passthrough URL`: evaluate an agent against any OpenAI-compatible endpoint, no token ids.

`PassthroughServer` stands where the InterceptionServer stands in `run_rollout` (`RolloutServer`: its
`rollout()` gives the same handle, `swe_grpo.serving.handle`): each rollout gets its own URL and secret, and
the agent's requests, in any of the three dialects (`swe_grpo.serving.dialects`: chat completions, Responses,
Messages; its token in the dialect's header), are forwarded to the same route of `URL` (`{URL}/chat/completions`,
`{URL}/responses`, `{URL}/messages`: an upstream that speaks the agent's dialect) with the evaluation's model name
and sampling (temperature, top_p, and the token cap under the dialect's name), streamed back to the agent byte for
byte, and logged: one JSON line per call (the request body, the reply's message in its dialect's shape, finish
reason, usage and status; `swe_grpo.evaluation.replies`) in `log_dir/{rollout_id}.jsonl`. A rollout's record has
a `TurnRecord` per answered call (token counts from the reply's `usage` when the endpoint reports it), its
conversation as chat messages, and no training rows. The upstream's failures are named as the
InterceptionServer names vLLM's: unreachable or 5xx `server_unavailable`, a context-length refusal
`context_overflow`, another 4xx `bad_response`, so attempts end with the same outcomes.

There is no door (a sandbox's door, `swe_grpo.sandbox.door`, is served by the InterceptionServer): the agent
reaches this server over the sandbox backend's network, as with `--no-door`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import aiohttp
from aiohttp import web

from swe_grpo.evaluation.replies import NOTHING, conversation, read_reply
from swe_grpo.serving import dialects
from swe_grpo.serving.dialects import Dialect
from swe_grpo.serving.handle import Socket
from swe_grpo.serving.limits import ServingLimits
from swe_grpo.serving.openai_wire import APIError, errors_as, json_response, read_body
from swe_grpo.serving.session import RolloutRecord
from swe_grpo.serving.vllm_client import SamplingParams
from swe_grpo.tokens.chain import TurnRecord
from swe_grpo.types import RequestError, RolloutEndpoint

log = logging.getLogger(__name__)

# The context length an agent is told when the endpoint's `/models` does not say (vLLM's does).
DEFAULT_CONTEXT_WINDOW = 32768
_CONTEXT_MARKERS = ("maximum context length", "context length", "context_length_exceeded", "too long")
_ROUTES = {"chat/completions": dialects.CHAT, "responses": dialects.RESPONSES, "messages": dialects.MESSAGES}
# The agent's headers that say how to read its request (Anthropic's API version and betas); no others go upstream.
_FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta")


@dataclass
class _Rollout:
    endpoint: RolloutEndpoint
    turns: list[TurnRecord] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    in_flight: int = 0
    generation_s: float = 0.0
    last_activity: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0  # time with a request of it in flight, the requests before the latest
    waiting_since: float = 0.0  # when its requests in flight started to be (valid while `in_flight`)

    def error(self, kind: str, message: str) -> None:
        self.errors.append(RequestError(kind, message[:1000], len(self.turns), time.time()))


class PassthroughServer:
    """Forwards each rollout's chat completions to the OpenAI-compatible `upstream` (`.../v1`) as `model`."""

    def __init__(
        self,
        upstream: str,
        model: str,
        *,
        sampling: SamplingParams = SamplingParams(),  # noqa: B008  (frozen)
        api_key: str | None = None,
        log_dir: Path | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        public_base_url: str | None = None,
        request_timeout_s: float = 600.0,
        limits: ServingLimits = ServingLimits(),  # noqa: B008  (frozen)
    ):
        self.upstream, self.model, self.sampling = upstream.rstrip("/"), model, sampling
        self.log_dir = log_dir
        self.host, self.port, self._public_base_url = host, port, public_base_url
        self.limits = limits
        self._api_key = api_key
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._rollouts: dict[str, _Rollout] = {}
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None

    @property
    def public_base_url(self) -> str:
        return (self._public_base_url or f"http://{self.host}:{self.port}").rstrip("/")

    async def start(self) -> PassthroughServer:
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        app = web.Application(
            middlewares=[errors_as(dialects.error_shape)], client_max_size=self.limits.max_request_bytes
        )
        for route, dialect in _ROUTES.items():
            app.router.add_post(
                f"/rollout/{{rollout_id}}/v1/{route}", functools.partial(self._forward, dialect=dialect)
            )
        app.router.add_get("/rollout/{rollout_id}/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> PassthroughServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def context_window(self) -> int | None:
        """The model's context length if the upstream's `/models` says it (vLLM does), else None."""
        assert self._session is not None, "not started"
        try:
            async with self._session.get(f"{self.upstream}/models") as resp:
                models = await resp.json(content_type=None) if resp.status < 400 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        entry = next((m for m in models.get("data", []) if m.get("id") == self.model), None)
        length = (entry or {}).get("max_model_len")
        return int(length) if isinstance(length, int) else None

    # ----------------------------------------------------------------- rollouts, as run_rollout uses them

    def rollout(self, rollout_id: str | None = None, *, socket: Socket | None = None) -> PassthroughRollout:
        """A handle on a new rollout (`RolloutServer.rollout`). There is no door here: `socket` is refused."""
        if socket is not None:
            raise ValueError("a passthrough server serves no door's socket: run with the door off (--no-door)")
        return PassthroughRollout(self, rollout_id or uuid.uuid4().hex)

    def _open(self, rollout_id: str) -> _Rollout:
        if rollout_id in self._rollouts:
            raise ValueError(f"rollout {rollout_id!r} already exists")
        endpoint = RolloutEndpoint(
            rollout_id, f"{self.public_base_url}/rollout/{rollout_id}/v1", secrets.token_urlsafe(32), self.model
        )
        rollout = self._rollouts[rollout_id] = _Rollout(endpoint)
        return rollout

    def _close(self, rollout_id: str) -> RolloutRecord:
        rollout = self._rollouts.pop(rollout_id)
        return RolloutRecord(
            rollout_id=rollout_id,
            rows=[],
            turns=rollout.turns,
            errors=rollout.errors,
            requests=rollout.requests,
            malformed_tool_calls=0,
            generation_s=rollout.generation_s,
            messages=rollout.messages,
        )

    @property
    def open_rollouts(self) -> int:
        return len(self._rollouts)

    # ----------------------------------------------------------------- routes

    def _authorize(self, request: web.Request, dialect: Dialect = dialects.CHAT) -> _Rollout:
        rollout = self._rollouts.get(request.match_info["rollout_id"])
        if rollout is None:
            raise APIError(404, "unknown or closed rollout", "not_found_error")
        dialects.check_token(request, dialect, rollout.endpoint.token)
        return rollout

    async def _models(self, request: web.Request) -> web.Response:
        self._authorize(request)
        return json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def _forwarded(self, body: dict[str, Any], dialect: Dialect = dialects.CHAT) -> dict[str, Any]:
        """The body sent upstream: the evaluation's model and sampling; the agent may ask for fewer tokens (under
        the dialect's name for the cap: Responses' `max_output_tokens`, the others' `max_tokens`)."""
        body = {**body, "model": self.model, "temperature": self.sampling.temperature, "top_p": self.sampling.top_p}
        cap_name = "max_output_tokens" if dialect is dialects.RESPONSES else "max_tokens"
        asked = body.pop("max_completion_tokens", None) or body.get(cap_name)
        cap = self.sampling.max_tokens
        limit = min(asked, cap) if isinstance(asked, int) and cap else (asked if isinstance(asked, int) else cap)
        if limit:
            body[cap_name] = limit
        return body

    async def _forward(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        rollout = self._authorize(request, dialect)
        rollout.requests += 1
        try:
            body, _ = await read_body(request, self.limits.max_request_bytes, self.limits.body_timeout_s)
        except APIError as e:
            rollout.error("bad_request", e.message)
            raise
        forwarded = self._forwarded(body, dialect)
        assert self._session is not None, "not started"
        start = time.monotonic()
        if not rollout.in_flight:
            rollout.waiting_since = start
        rollout.in_flight += 1
        reply: dict[str, Any] = NOTHING
        status, response = 0, cast(web.StreamResponse | None, None)
        url = f"{self.upstream}/{request.path.rpartition('/v1/')[2]}"
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED_HEADERS}
        if self._api_key and dialect.api_key_header:
            headers["x-api-key"] = self._api_key
        try:
            async with self._session.post(url, json=forwarded, headers=headers) as upstream:
                status = upstream.status
                if status >= 400:
                    text = await upstream.text()
                    lowered = text.lower()
                    kind = "server_unavailable" if status >= 500 else "bad_response"
                    if status < 500 and any(marker in lowered for marker in _CONTEXT_MARKERS):
                        kind = "context_overflow"
                    rollout.error(kind, f"upstream HTTP {status}: {text[:500]}")
                    return web.Response(status=status, text=text, content_type="application/json")
                if not forwarded.get("stream"):
                    data = await upstream.read()
                    reply = read_reply(dialect, data, streamed=False)
                    response = web.Response(body=data, content_type="application/json")
                else:
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                    received = bytearray()
                    async for data in upstream.content.iter_any():
                        received += data
                        try:
                            await response.write(data)
                        except ConnectionError:  # the agent's side (aiohttp's reset error is a ClientError too)
                            rollout.error("client_disconnected", "the agent went away before its reply was delivered")
                            return response
                    await response.write_eof()
                    reply = read_reply(dialect, bytes(received), streamed=True)
        except (aiohttp.ClientError, TimeoutError) as e:
            rollout.error("server_unavailable", f"upstream: {type(e).__name__}: {e}")
            if isinstance(response, web.StreamResponse) and response.prepared:
                return response  # the stream just ends: the agent sees a cut-off reply
            raise APIError(502, f"upstream unreachable: {type(e).__name__}", "server_error") from e
        finally:
            rollout.in_flight -= 1
            rollout.last_activity = time.monotonic()
            if not rollout.in_flight:
                rollout.waited_s += rollout.last_activity - rollout.waiting_since
            rollout.generation_s += rollout.last_activity - start
            self._log(rollout, forwarded, reply, status)
        usage = reply["usage"] or {}
        rollout.turns.append(
            TurnRecord(
                turn=len(rollout.turns),
                row=0,
                kind="clean",
                prompt_tokens=int(usage.get("prompt_tokens") or 0),
                new_prompt_tokens=0,
                output_tokens=int(usage.get("completion_tokens") or 0),
                model_version=0,
                finish_reason=reply["finish_reason"] or "stop",
            )
        )
        rollout.messages = conversation(dialect, body, reply)
        return response

    def _log(self, rollout: _Rollout, body: dict[str, Any], reply: dict[str, Any], status: int) -> None:
        if self.log_dir is None:
            return
        line = {"turn": len(rollout.turns), "status": status, "request": body, **reply}
        with (self.log_dir / f"{rollout.endpoint.rollout_id}.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


class PassthroughRollout:
    """A `PassthroughServer`'s handle on one rollout: a `RolloutView` (`swe_grpo.serving.handle`). Single use."""

    socket = None  # no door

    def __init__(self, server: PassthroughServer, rollout_id: str):
        self._server, self._id = server, rollout_id
        self._rollout: _Rollout | None = None
        self.record: RolloutRecord | None = None

    async def __aenter__(self) -> PassthroughRollout:
        if self._rollout is not None or self.record is not None:
            raise RuntimeError("a rollout handle is used once")
        self._rollout = self._server._open(self._id)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.record = self._server._close(self._id)

    def _live(self) -> _Rollout:
        if self._rollout is None:
            raise RuntimeError("the rollout is not open: use `async with server.rollout(...) as session`")
        return self._rollout

    @property
    def endpoint(self) -> RolloutEndpoint:
        return self._live().endpoint

    def last_activity(self) -> float:
        return time.monotonic() if self.in_flight() else self._live().last_activity

    def in_flight(self) -> bool:
        """Whether a request of the rollout is being forwarded: a reply its agent has not had."""
        return self._live().in_flight > 0

    def waiting_s(self) -> float:
        live = self._live()
        return live.waited_s + (time.monotonic() - live.waiting_since if live.in_flight else 0.0)

    def oldest_version(self) -> int | None:
        return None  # no policy versions: nothing here is trained on


@asynccontextmanager
async def passthrough_server(
    upstream: str,
    model: str,
    sampling: SamplingParams,
    *,
    log_dir: Path | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    public_url: str | None = None,
) -> AsyncIterator[tuple[PassthroughServer, int]]:
    """A started PassthroughServer to `upstream` (its key from `OPENAI_API_KEY`), and the context length."""
    server = PassthroughServer(
        upstream,
        model,
        sampling=sampling,
        api_key=os.environ.get("OPENAI_API_KEY"),
        log_dir=log_dir,
        host=host,
        port=port,
        public_base_url=public_url,
    )
    async with server:
        yield server, await server.context_window() or DEFAULT_CONTEXT_WINDOW
