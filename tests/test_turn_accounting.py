"""Every turn accounted, off the byte-identical path (issue 23, section 5): through the real InterceptionServer on
loopback, with a STUB generator (`ScriptedGenerator`: scripted outputs, so that a reply's content is known) and
the real tiny tokenizers; the connection-level cases use raw sockets, as an agent's client would break them."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import tiny_tokenizer
from pi_shapes import TOOLS, PiConversation, tool_call
from test_interception import ScriptedGenerator, post_chat, sse_events, stub_server, training

from swe_grpo.tokens.chain import TokenChain
from swe_grpo.tokens.responses import ResponseParser
from swe_grpo.types import RolloutEndpoint


async def chat(http: aiohttp.ClientSession, endpoint: RolloutEndpoint, body: dict[str, Any]) -> dict[str, Any]:
    """A non-streaming chat completion that must succeed; its message."""
    async with await post_chat(http, endpoint, {**body, "stream": False}) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["message"]


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


# --------------------------------------------------------------------------- a call to a tool not in `tools`


async def test_a_call_to_an_unknown_tool_goes_to_the_agent_as_a_call(http) -> None:
    """vLLM's own tool parsers return a call to a tool the request did not list; the agent then answers "tool not
    found", and the policy learns from that; it is not turned into text with raw markup."""
    reply = {"role": "assistant", "content": "", "tool_calls": [tool_call("rm_rf", path="/")]}
    generator = ScriptedGenerator.replies(training("qwen3"), [reply, {"role": "assistant", "content": "Done."}])
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            message = await chat(http, endpoint, convo.request())
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "rm_rf" and json.loads(call["function"]["arguments"]) == {"path": "/"}
            convo.add_reply(message, tool_outputs=["Tool rm_rf not found"])
            await chat(http, endpoint, convo.request())
        record = handle.record
    assert record.malformed_tool_calls == 0 and record.errors == []
    assert [t.kind for t in record.turns] == ["clean", "clean"] and record.turns[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("template", "text"),
    [
        ("qwen3", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call><|im_end|>'),
        ("qwen3_6", "\n</think>\n\n<tool_call>\n<function=nope>\n</function>\n</tool_call><|im_end|>"),
        ("llama3_2", '{"name": "nope", "parameters": {}}<|eot_id|>'),
    ],
)
def test_every_template_reads_a_call_to_an_unlisted_tool_as_a_call(template: str, text: str) -> None:
    tokenizer = tiny_tokenizer(template)
    ids = training(template).encode(text)
    prompt = training(template).prompt_ids([{"role": "user", "content": "hi"}], TOOLS)
    parsed = ResponseParser(tokenizer).parse(ids, prompt, "stop", TOOLS)
    (call,) = parsed.message["tool_calls"]
    assert call["function"]["name"] in ("rm_rf", "nope") and json.loads(call["function"]["arguments"]) == {}
    assert parsed.finish_reason == "tool_calls" and parsed.malformed_tool_calls == 0


# --------------------------------------------------------------------------- echoes and retries, by meaning


async def test_arguments_echoed_with_other_number_spelling_stay_clean(http) -> None:
    """The model writes `1.0`; a JavaScript agent echoes the value back as `1` (under a call id of its own): the
    same value, a clean turn. A boolean is not a number, though: `1.0` echoed as `true` is another value and forks
    (Python's `1.0 == True` must not decide it)."""
    text = '<tool_call>\n{"name": "bash", "arguments": {"command": "sleep 1", "timeout": 1.0}}\n</tool_call><|im_end|>'
    generator = ScriptedGenerator.texts(training("qwen3"), [text, "Done.<|im_end|>"] * 2)
    async with stub_server("qwen3", generator) as srv, AsyncExitStack() as stack:
        handles = [await stack.enter_async_context(srv.rollout()) for _ in range(2)]
        endpoints = [h.endpoint for h in handles]
        for endpoint, echoed in zip(
            endpoints, ['{"command":"sleep 1","timeout":1}', '{"command":"sleep 1","timeout":true}'], strict=True
        ):
            convo = PiConversation()
            message = await chat(http, endpoint, convo.request())
            assert message["tool_calls"][0]["function"]["arguments"].endswith('"timeout": 1.0}')
            convo.add_reply(message)
            call = convo.messages[-2]["tool_calls"][0]
            call["function"]["arguments"] = echoed
            if echoed.endswith("1}"):
                call["id"] = convo.messages[-1]["tool_call_id"] = "toolu_01"
            await chat(http, endpoint, convo.request())
        await stack.aclose()
        clean, forked = (h.record for h in handles)
    assert [t.kind for t in clean.turns] == ["clean", "clean"]
    assert [t.kind for t in forked.turns] == ["clean", "fork"]


def _extra_tool(body: dict[str, Any]) -> None:
    body["tools"].append({"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}})


def _text_as_string(body: dict[str, Any]) -> None:
    user = body["messages"][-1]
    user["content"] = "".join(part["text"] for part in user["content"])


def _changed_system_line(body: dict[str, Any]) -> None:
    body["messages"][0]["content"] += "\nCurrent date: 2031-01-02"


@pytest.mark.parametrize("change", [_extra_tool, _text_as_string, _changed_system_line])
@pytest.mark.parametrize("turn", [0, 1])
async def test_a_retry_that_says_the_same_replaces_the_undelivered_turn(http, change, turn: int) -> None:
    """The agent re-sends its request after a lost reply, but not byte for byte (its client rebuilt it: another
    tool list, text parts joined, a fresh date line): the conversation is the same, so it is a retry, and the
    reply it never used is not trained. `turn`: the retried request is the rollout's first or its second."""
    template = training("qwen3")
    outputs = ["Zero.<|im_end|>"] * turn + ["Lost.<|im_end|>", "Used.<|im_end|>", "Done.<|im_end|>"]
    generator = ScriptedGenerator.texts(template, outputs)
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            for _ in range(turn):
                convo.add_reply(await chat(http, endpoint, convo.request()))
                convo.messages.append({"role": "user", "content": [{"type": "text", "text": "Go on."}]})
            assert (await chat(http, endpoint, convo.request()))["content"] == "Lost."  # the agent never sees it
            retry = convo.request()
            change(retry)
            used = await chat(http, endpoint, retry)
            assert used["content"] == "Used."
            convo.messages = retry["messages"]
            convo.add_reply(used)
            convo.messages.append({"role": "user", "content": "Go on."})
            await chat(http, endpoint, {**convo.request(), "tools": retry["tools"]})
        record = handle.record
    trained = "".join(
        template.tokenizer.decode([i for i, m in zip(row.input_ids, row.completion_mask, strict=True) if m])
        for row in record.rows
    )
    assert "Lost." not in trained and "Used." in trained and "Done." in trained
    assert [t.retries for t in record.turns] == [0] * turn + [1, 0] and record.retries == 1
    assert [t.kind for t in record.turns][-1] == "clean"


async def test_a_different_conversation_is_not_a_retry(http) -> None:
    """Same length, other words: a new request (a fork), and the reply before it stays trained."""
    template = training("qwen3")
    generator = ScriptedGenerator.texts(template, ["Kept.<|im_end|>", "Other.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            await chat(http, endpoint, PiConversation().request())
            await chat(http, endpoint, PiConversation(task="Something else entirely.").request())
        record = handle.record
    assert [(t.kind, t.retries) for t in record.turns] == [("clean", 0), ("fork", 0)] and len(record.rows) == 2


# --------------------------------------------------------------------------- refused, cut, concurrent, forked


async def test_requests_refused_before_the_turn_are_recorded_on_the_rollout(http) -> None:
    """A lone surrogate escape (orjson refuses it) and `max_tokens: 0` are refused before the turn starts; they
    are still the rollout's requests, recorded as `bad_request`."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            surrogate = b'{"messages": [{"role": "user", "content": "\\ud800"}]}'
            for body in (surrogate, {**PiConversation().request(), "max_tokens": 0}):
                async with await post_chat(http, endpoint, body) as r:
                    assert r.status == 400
        record = handle.record
    assert [e.kind for e in record.errors] == ["bad_request"] * 2 and record.requests == 2
    assert "JSON" in record.errors[0].message and "max_tokens" in record.errors[1].message


async def _request_then_vanish(path: str, token: str, rollout_id: str, body: dict[str, Any]) -> None:
    """As an agent's client that gives up while a big reply is being written to it: sends the request over the
    door's unix socket, reads until the reply starts, then closes the connection with the rest unread."""
    reader, writer = await asyncio.open_unix_connection(path)
    data = json.dumps(body).encode()
    head = (
        f"POST /rollout/{rollout_id}/v1/chat/completions HTTP/1.1\r\nHost: door\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    writer.write(head.encode() + data)
    await writer.drain()
    seen = b""
    while b'{"id":' not in seen:  # the reply's first SSE chunk, or its JSON
        chunk = await reader.read(4096)
        assert chunk, seen[-300:]
        seen = seen[-8:] + chunk
    writer.transport.abort()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_connection_lost_while_a_big_reply_is_written_is_a_client_disconnection(
    stream: bool, tmp_path: Path
) -> None:
    """aiohttp reports a connection lost mid-write as `ConnectionError("Connection lost")` (not only as
    `ConnectionResetError`): the agent went away, which is no failure of the host (it was recorded `internal`,
    an infra_error)."""
    big = "word " * 600_000  # a 3 MB reply: far more than the socket buffers take, so the write waits on the agent
    generator = ScriptedGenerator.texts(training("qwen3"), [big + "<|im_end|>"])
    async with stub_server("qwen3", generator) as srv:
        door = tmp_path / "door"  # a unix socket the server is handed
        async with srv.rollout(socket=door) as handle:
            endpoint = handle.endpoint
            body = PiConversation().request(stream=stream)
            await _request_then_vanish(str(door), endpoint.token, endpoint.rollout_id, body)
            await asyncio.sleep(0.5)
        record = handle.record
    assert not door.exists()  # the server removes the socket it was handed
    assert [e.kind for e in record.errors] == ["client_disconnected"] and record.turns == []


async def test_a_newer_request_supersedes_the_one_in_flight(http) -> None:
    """Two identical requests at once: only one reply may reach the agent, and it is the one trained. The older
    request is ended (an SSE error event, or 409 that OpenAI clients do not retry) and recorded `superseded`; the
    newer one is served and the conversation goes on from it, cleanly."""
    template = training("qwen3")
    generator = ScriptedGenerator.texts(template, ["One.<|im_end|>", "Two.<|im_end|>"], delay_s=0.5)
    async with stub_server("qwen3", generator, keepalive_s=0.05) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            for stream in (True, False):
                older = asyncio.create_task(read_status_and_body(http, endpoint, convo.request(stream=stream)))
                await asyncio.sleep(0.2)
                newer = await chat(http, endpoint, convo.request())
                status, text = await older
                if stream:
                    assert status == 200 and sse_events(text, done=False)[0]["error"]["code"] == "superseded"
                else:
                    assert status == 409 and json.loads(text)["error"]["code"] == "superseded"
                assert "One." not in text and "Two." not in text  # the older one got no reply at all
                convo.add_reply(newer)
                convo.messages.append({"role": "user", "content": "Go on."})
        record = handle.record
    assert [e.kind for e in record.errors] == ["superseded"] * 2
    assert [(t.kind, t.retries) for t in record.turns] == [("clean", 0)] * 2 and len(record.rows) == 1
    row = record.rows[0]
    trained = template.tokenizer.decode([i for i, m in zip(row.input_ids, row.completion_mask, strict=True) if m])
    assert trained == "One.<|im_end|>Two.<|im_end|>"  # what the agent received, and nothing else


async def read_status_and_body(http, endpoint: RolloutEndpoint, body: dict[str, Any]) -> tuple[int, str]:
    async with await post_chat(http, endpoint, body) as r:
        return r.status, await r.text()


async def test_a_requests_history_is_normalised_and_compared_once(http, monkeypatch) -> None:
    """Deciding how to serve a request (extend, retry, fork) normalises and compares its whole history; a request
    big enough to be asked whether it renders the history whole is not decided again when it is prepared."""
    normalised = 0
    normalize = TokenChain._normalize

    def counted(self: TokenChain, messages: list[Any]) -> list[Any]:
        nonlocal normalised
        normalised += 1
        return normalize(self, messages)

    monkeypatch.setattr(TokenChain, "_normalize", counted)
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        convo = PiConversation()
        convo.messages.append({"role": "user", "content": "context " * 10_000})  # past BULK_BYTES
        for turn in range(3):
            convo.add_reply(await chat(http, handle.endpoint, convo.request()))
            convo.messages.append({"role": "user", "content": f"Go on ({turn})."})
            assert normalised == turn + 1
    assert [t.kind for t in handle.record.turns] == ["clean"] * 3


async def test_a_fork_of_a_long_history_does_not_stall_the_event_loop(http) -> None:
    """A fork re-renders the whole history (4 MB here: most of a second of rendering and tokenising). The request
    brings little new, but it is prepared off the event loop as big ones are: the loop (every other rollout's
    requests) never waits that long."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            convo = PiConversation()
            convo.messages.append({"role": "user", "content": "context " * 500_000})
            convo.add_reply(await chat(http, endpoint, convo.request()))
            convo.messages[1]["content"][0]["text"] += " (edited)"  # the agent edits its history: a fork
            convo.messages.append({"role": "user", "content": "Go on."})
            lags: list[float] = []

            async def probe() -> None:
                while True:
                    started = time.monotonic()
                    await asyncio.sleep(0.01)
                    lags.append(time.monotonic() - started - 0.01)

            probing = asyncio.create_task(probe())
            await chat(http, endpoint, convo.request())
            probing.cancel()
        record = handle.record
    assert [t.kind for t in record.turns] == ["clean", "fork"]
    assert max(lags) < 0.2, max(lags)


async def test_a_turn_is_prepared_where_what_it_brings_says(http, monkeypatch) -> None:
    """A turn that brings a tool result's worth of new content is prepared in the server's turn threads (tokenising
    it releases the GIL: it runs beside the event loop); one that brings a line, on the loop itself; one that brings
    more than `BULK_BYTES`, in the bulk threads of lower priority."""
    threads: list[str] = []
    prepare = TokenChain.prepare

    def where(self: TokenChain, *args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(TokenChain, "prepare", where)
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        convo = PiConversation()
        for content in ["Go on.", "def f():\n    return 1\n" * 200, "Ok.", "x = 1\n" * 10_000]:
            convo.messages.append({"role": "user", "content": content})
            convo.add_reply(await chat(http, handle.endpoint, convo.request()))
    assert [t.kind for t in handle.record.turns] == ["clean"] * 4
    # The first request brings the whole conversation (Pi's system prompt and tools): not on the loop either.
    assert [name.rsplit("_", 1)[0] for name in threads[1:]] == [
        "interception-turn",
        threading.current_thread().name,
        "interception-bulk",
    ]
