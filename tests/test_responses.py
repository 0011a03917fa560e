"""Generated ids -> OpenAI assistant messages, across TRL's shipped templates."""

from __future__ import annotations

import json

import pytest
from conftest import TEMPLATES, tiny_tokenizer
from pi_shapes import scripted_output, tool_call

from swe_grpo.chain import TrainingTemplate, normalize_message
from swe_grpo.responses import ResponseParser


def parse(template: str, text_or_message, stop_reason: str = "stop"):
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    if isinstance(text_or_message, str):
        ids = training.encode(text_or_message)
    else:
        ids = scripted_output(training, normalize_message(text_or_message))
    prompt = training.prompt_ids([{"role": "user", "content": "hi"}])
    return ResponseParser(tokenizer).parse(ids, prompt, stop_reason)


@pytest.mark.parametrize("template", TEMPLATES)
def test_tool_call_round_trips(template: str) -> None:
    reply = {"role": "assistant", "content": "", "tool_calls": [tool_call("bash", command="ls -la /tmp")]}
    parsed = parse(template, reply)
    assert parsed.finish_reason == "tool_calls" and parsed.malformed_tool_calls == 0
    (call,) = parsed.message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "bash"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"command": "ls -la /tmp"}
    assert not parsed.message["content"]


@pytest.mark.parametrize("template", ["qwen3", "qwen3_6"])
def test_reasoning_and_parallel_calls(template: str) -> None:
    reply = {
        "role": "assistant",
        "content": "Reading both.",
        "reasoning_content": "The parser is in src.",
        "tool_calls": [tool_call("read", path="a.py"), tool_call("read", path="b.py")],
    }
    parsed = parse(template, reply)
    message = parsed.message
    assert message["reasoning_content"] == "The parser is in src."
    assert message["content"].strip() == "Reading both."
    assert [json.loads(c["function"]["arguments"])["path"] for c in message["tool_calls"]] == ["a.py", "b.py"]
    assert len({c["id"] for c in message["tool_calls"]}) == 2


@pytest.mark.parametrize("template", TEMPLATES)
def test_plain_text(template: str) -> None:
    parsed = parse(template, {"role": "assistant", "content": "All tests pass now."})
    assert parsed.message["content"].strip() == "All tests pass now."
    assert "tool_calls" not in parsed.message and parsed.finish_reason == "stop"


def test_malformed_call_goes_back_as_text_and_is_counted() -> None:
    parsed = parse("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call><|im_end|>')
    assert "tool_calls" not in parsed.message
    assert parsed.malformed_tool_calls == 1
    assert '"name": "bash"' in parsed.message["content"]
    assert parsed.finish_reason == "stop"


def test_one_good_and_one_malformed_call() -> None:
    text = (
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
        "<tool_call>\n{not json}\n</tool_call><|im_end|>"
    )
    parsed = parse("qwen3", text)
    assert [c["function"]["name"] for c in parsed.message["tool_calls"]] == ["bash"]
    assert parsed.malformed_tool_calls == 1


def test_hermes_fallback_for_json_calls_under_an_xml_template() -> None:
    # Qwen3.6 expects <function=...> inside <tool_call>; a model that writes hermes JSON still gets through.
    text = 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "x.py"}}\n</tool_call><|im_end|>'
    parsed = parse("qwen3_6", text)
    (call,) = parsed.message["tool_calls"]
    assert call["function"]["name"] == "read" and json.loads(call["function"]["arguments"]) == {"path": "x.py"}
    assert parsed.message["content"] == "Let me look."
    assert parsed.malformed_tool_calls == 0


def test_cut_at_max_tokens_reports_length() -> None:
    parsed = parse("qwen3", "I will now start to", stop_reason="length")
    assert parsed.finish_reason == "length"
    assert parsed.message["content"] == "I will now start to"


def test_random_tokens_never_raise() -> None:
    tokenizer = tiny_tokenizer("qwen3")
    parser = ResponseParser(tokenizer)
    special = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    import random

    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.choice([*special, *range(10, 2000)]) for _ in range(rng.randint(0, 40))]
        parsed = parser.parse(ids, [], "stop")
        assert parsed.message["role"] == "assistant"
        assert parsed.finish_reason in ("stop", "tool_calls")


@pytest.mark.parametrize("stop_reason", ["stop", "length"])
def test_plain_text_degrades_a_reply_with_calls(stop_reason: str) -> None:
    tokenizer = tiny_tokenizer("qwen3")
    ids = TrainingTemplate(tokenizer).encode(
        'Run it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    )
    parsed = ResponseParser(tokenizer).plain_text(ids, stop_reason, 1)
    assert parsed.message == {
        "role": "assistant",
        "content": 'Run it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
    }
    assert parsed.finish_reason == stop_reason and parsed.malformed_tool_calls == 1
