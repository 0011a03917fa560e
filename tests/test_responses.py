"""Generated ids -> OpenAI assistant messages, across TRL's shipped templates."""

from __future__ import annotations

import json

import pytest
from conftest import TEMPLATES, tiny_tokenizer
from pi_shapes import TOOLS, scripted_output, tool_call

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


GOOD = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
THOUGHT = "\n</think>\n\n"  # how a qwen3_6 reply goes on from its generation prompt's `<think>\n`
# (template, generated text, stop reason, attempted calls): every one is a malformed call.
MALFORMED = [
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": "ls -la"}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": ["ls"]}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": ["bash"], "arguments": {}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"timeout": NaN}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"timeout": 1e999}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {}, "id": 3}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n', "length", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}<|im_end|>', "stop", 1),
    ("qwen3", GOOD + "\n<tool_call>\n{not json}\n</tool_call><|im_end|>", "stop", 2),
    ("qwen3", GOOD + "\n<tool_call>\n" + "[" * 100_000 + "\n</tool_call><|im_end|>", "stop", 2),
    ("qwen3", GOOD + "\n<tool_call>\n{", "length", 2),
    ("qwen3_6", THOUGHT + '<tool_call>\n{"name": "bash", "arguments": "ls -la"}\n</tool_call><|im_end|>', "stop", 1),
    (
        "qwen3_6",
        THOUGHT + "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</function>\n</tool_call><|im_end|>",
        "stop",
        1,
    ),
    ("qwen3_6", THOUGHT + "<tool_call>\n<function=bash>\nls -la\n</function>\n</tool_call><|im_end|>", "stop", 1),
    ("qwen3_6", THOUGHT + "<tool_call>\n<function=>\n</function>\n</tool_call><|im_end|>", "stop", 1),
    ("qwen3_6", THOUGHT + "<tool_call>\n<function=nope>\n</function>\n</tool_call><|im_end|>", "stop", 1),
    ("qwen3_6", THOUGHT + "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n", "length", 1),
    (
        "qwen3_6",
        THOUGHT + "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n<parameter=command>\npwd\n"
        "</parameter>\n</function>\n</tool_call><|im_end|>",
        "stop",
        1,
    ),
    ("llama3_2", '{"name": "bash", "parameters": "ls -la"}<|eot_id|>', "stop", 1),
    ("llama3_2", '{"name": "bash", "parameters": {"command": "ls"}<|eot_id|>', "stop", 1),
    ("llama3_2", '{"name": "bash", "parameters": {"command": ', "length", 1),
    ("llama3_2", '{"name": "nope", "parameters": {}}<|eot_id|>', "stop", 1),
    ("llama3_2", 'Sure: {"name": "bash", "parameters": {"command": "ls"}}<|eot_id|>', "stop", 1),
    ("llama3_2", '<tool_call>\n{"name": "bash", "arguments": "ls"}\n</tool_call><|eot_id|>', "stop", 1),
]


@pytest.mark.parametrize(("template", "text", "stop_reason", "attempted"), MALFORMED)
def test_malformed_calls_go_back_as_the_whole_text_and_are_counted(
    template: str, text: str, stop_reason: str, attempted: int
) -> None:
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    ids = training.encode(text)
    prompt = training.prompt_ids([{"role": "user", "content": "hi"}], TOOLS)
    parsed = ResponseParser(tokenizer).parse(ids, prompt, stop_reason, TOOLS)
    assert parsed == ResponseParser(tokenizer).plain_text(ids, stop_reason, attempted)


def test_hermes_fallback_for_json_calls_under_an_xml_template() -> None:
    # Qwen3.6 expects <function=...> inside <tool_call>; a model that writes hermes JSON still gets through.
    text = THOUGHT + 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a"}}\n</tool_call><|im_end|>'
    parsed = parse("qwen3_6", text)
    (call,) = parsed.message["tool_calls"]
    assert call["function"]["name"] == "read" and json.loads(call["function"]["arguments"]) == {"path": "a"}
    assert parsed.message["content"] == "Let me look."
    assert parsed.malformed_tool_calls == 0


def test_a_call_inside_the_reasoning_is_part_of_the_reasoning() -> None:
    # The generation prompt opened <think> and the model never closed it: everything it wrote is reasoning.
    text = 'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "x.py"}}\n</tool_call><|im_end|>'
    parsed = parse("qwen3_6", text)
    assert parsed.message == {"role": "assistant", "content": "", "reasoning_content": text.removesuffix("<|im_end|>")}
    assert parsed.finish_reason == "stop" and parsed.malformed_tool_calls == 0


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
