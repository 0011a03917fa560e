"""Every turn accounted, off the byte-identical path (issue 23, section 5): through the real InterceptionServer on
loopback, with a STUB generator (`ScriptedGenerator`: scripted outputs, so that a reply's content is known) and
the real tiny tokenizers; the connection-level cases use raw sockets, as an agent's client would break them."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from conftest import tiny_tokenizer
from pi_shapes import TOOLS, PiConversation, tool_call
from test_interception import ScriptedGenerator, post_chat, stub_server, training

from swe_grpo.interception import RolloutEndpoint
from swe_grpo.responses import ResponseParser


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
    found", and the policy learns from that. It used to end the episode as text with raw markup."""
    reply = {"role": "assistant", "content": "", "tool_calls": [tool_call("rm_rf", path="/")]}
    generator = ScriptedGenerator.replies(training("qwen3"), [reply, {"role": "assistant", "content": "Done."}])
    async with stub_server("qwen3", generator) as srv:
        endpoint = srv.open_rollout()
        convo = PiConversation()
        message = await chat(http, endpoint, convo.request())
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "rm_rf" and json.loads(call["function"]["arguments"]) == {"path": "/"}
        convo.add_reply(message, tool_outputs=["Tool rm_rf not found"])
        await chat(http, endpoint, convo.request())
        record = srv.close_rollout(endpoint.rollout_id)
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
