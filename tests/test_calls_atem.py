"""Muse Glimmer's ATEM layout (`swe_grpo.tokens.calls_atem`) through `ResponseParser`, on the family's tiny tokenizer:
calls read exactly as the template writes them, the `self` channel as reasoning, and every call the tokens do not
say one way goes back as plain text with its attempts counted."""

from __future__ import annotations

import json
import time
from functools import cache

import pytest
from chain_driver import Driver
from conftest import tiny_tokenizer
from pi_shapes import TOOLS

from swe_grpo.tokens.chain import TrainingTemplate
from swe_grpo.tokens.responses import ParsedResponse, ResponseParser

_TEMPLATE = "muse_glimmer"


@cache
def _parser() -> tuple[ResponseParser, list[int]]:
    tokenizer = tiny_tokenizer(_TEMPLATE)
    training = TrainingTemplate(tokenizer)
    return ResponseParser(tokenizer, training), training.prompt_ids([{"role": "user", "content": "hi"}], TOOLS)


def _parse(text: str, stop_reason: str = "stop") -> ParsedResponse:
    parser, prompt = _parser()
    return parser.parse(parser.template.encode(text), prompt, stop_reason, TOOLS)


def _call(name: str, *parameters: tuple[str, str], recipient: str | None = None) -> str:
    """A tool message as the template writes it (after `<|start|>assistant`), without its end token."""
    body = "".join(f'<atem:parameter name="{k}">{v}</atem:parameter>\n' for k, v in parameters)
    invoke = f'<atem:function_calls>\n<atem:invoke name="{name}">\n{body}</atem:invoke>\n</atem:function_calls>'
    return f" to={recipient or name}<|message|>{invoke}"


def _calls(parsed: ParsedResponse) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.message["tool_calls"]]


def test_calls_after_reasoning_with_raw_values_typed_by_the_schema() -> None:
    text = " to=self<|message|>Look, then edit.<|eom|><|start|>assistant"
    text += _call("read", ("path", "007"), ("offset", "3")) + "<|eom|><|start|>assistant"
    text += _call("bash", ("command", "\n  ls -la\n\t"), ("timeout", "30")) + "<|eot|>"
    parsed = _parse(text)
    assert _calls(parsed) == [
        ("read", {"path": "007", "offset": 3}),
        ("bash", {"command": "\n  ls -la\n\t", "timeout": 30}),
    ]
    assert parsed.message["reasoning_content"] == "Look, then edit." and parsed.message["content"] is None
    assert parsed.finish_reason == "tool_calls" and parsed.malformed_tool_calls == 0


def test_a_string_parameter_keeps_text_that_looks_like_json() -> None:
    # The template writes a string raw: "true" and "42" under a string schema are the strings the tokens say.
    parsed = _parse(_call("write", ("path", "42"), ("content", "true")) + "<|eot|>")
    assert _calls(parsed) == [("write", {"path": "42", "content": "true"})]


def test_a_final_answer_after_reasoning_is_content() -> None:
    parsed = _parse(" to=self<|message|>Done?<|eom|><|start|>assistant to=user<|message|>All pass.<|eot|>")
    assert parsed.message == {"role": "assistant", "content": "All pass.", "reasoning_content": "Done?"}
    assert parsed.finish_reason == "stop" and parsed.malformed_tool_calls == 0


def test_a_call_written_in_reasoning_or_to_the_user_is_text() -> None:
    # The recipient makes a call, not the markup: an invoke in the `self` channel is a thought, never executed.
    invoke = _call("bash", ("command", "rm -rf /tmp/x")).partition("<|message|>")[2]
    text = f" to=self<|message|>{invoke}<|eom|><|start|>assistant to=user<|message|>Not now.<|eot|>"
    parsed = _parse(text)
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 0
    assert parsed.message["reasoning_content"] == invoke and parsed.message["content"] == "Not now."


MALFORMED = [
    _call("bash", ("command", "ls")),  # cut after the call, before its end token: still a call (below)
    _call("bash", ("command", "ls")).removesuffix("</atem:function_calls>"),  # cut
    _call("bash", ("command", "ls"), recipient="read"),  # the invoke names another tool than the recipient
    _call("bash", ("command", "ls"), ("command", "rm -rf build")),  # a repeated key
    _call("bash", ("command", 'ls</atem:parameter>\n<atem:invoke name="x">')),  # the closer, then markup
    _call("bash", ("command", "ls</atem:parameter>\nplease")),  # the closer, then text
    # The closer inside a value, as the layout's own regular expressions read it (the value ends there)
    _call("bash", ("command", "grep '</atem:parameter>' out.txt")),
    _call("bash", ("", "ls")),  # a nameless parameter
    _call("read", ("path", "a"), ("offset", "9007199254740993")),  # a number no double holds, where it is a number
    _call("bash", ("command", "ls")).replace("\n</atem:invoke>", "</atem:invoke>"),  # not as the template writes it
    " to=user<|message|>Sure.<|eom|><|start|>assistant to=bash<|message|>ls<|eot|>",  # a body that is no invoke
    '<atem:function_calls>\n<atem:invoke name="bash">\n</atem:invoke>\n</atem:function_calls><|eot|>',  # no header
]


@pytest.mark.parametrize("text", MALFORMED[1:])
def test_a_malformed_atem_call_goes_back_as_text(text: str) -> None:
    parsed = _parse(text + ("" if text.endswith(("<|eot|>", "<|message|>")) else "<|eot|>"))
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_a_message_after_the_turns_end_is_malformed() -> None:
    # `<|eot|>` ends the turn (generation stops there): a call and the message after it both go back as text.
    parsed = _parse(_call("bash", ("command", "ls")) + "<|eot|><|start|>assistant" + _call("read", ("path", "a")))
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 2


def test_a_call_the_output_stopped_after_is_the_call_its_tokens_say() -> None:
    # vLLM may leave the stop token out of the output: a whole invoke is still exactly one call.
    assert _calls(_parse(MALFORMED[0])) == [("bash", {"command": "ls"})]


def test_a_call_cut_at_max_tokens_is_text() -> None:
    parsed = _parse(_call("bash", ("command", "python -m pytest -x"))[:-30], "length")
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1
    assert parsed.finish_reason == "length"


def test_text_without_headers_is_content() -> None:
    parsed = _parse("Hello there.<|eot|>")
    assert parsed.message == {"role": "assistant", "content": "Hello there."} and parsed.malformed_tool_calls == 0


def test_degenerate_output_parses_in_linear_time() -> None:
    text = " to=self<|message|>x<|eom|><|start|>assistant" * 5000
    text += _call("bash", *((f"k{i}", "v") for i in range(3000))).removesuffix("</atem:function_calls>")
    parser, prompt = _parser()
    ids = parser.template.encode(text)
    start = time.perf_counter()
    parsed = parser.parse(ids, prompt, "length", TOOLS)
    assert time.perf_counter() - start < 1.0
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_text_beside_a_call_reaches_the_agent_and_stays_in_the_held_tokens() -> None:
    # The template renders a turn with calls without its content; a model may still write text to the user before a
    # call. The agent gets both, and the next prompt goes on from the tokens the model wrote (text included).
    d = Driver(_TEMPLATE)
    request = d.convo.request()
    prepared = d.chain.prepare(request["messages"], request["tools"])
    text = " to=user<|message|>Let me look.<|eom|><|start|>assistant" + _call("bash", ("command", "ls")) + "<|eot|>"
    output = d.template.encode(text)
    parsed = d.parser.parse(output, prepared.prompt_ids, "stop", request["tools"])
    assert parsed.message["content"] == "Let me look." and _calls(parsed) == [("bash", {"command": "ls"})]
    d.chain.commit(prepared, output, [-0.1] * len(output), 0, parsed.message, parsed.finish_reason)
    d.convo.add_reply(parsed.message)
    request = d.convo.request()
    following = d.chain.prepare(request["messages"], request["tools"])
    assert not following.fork and following.prompt_ids[: len(prepared.prompt_ids) + len(output)] == (
        prepared.prompt_ids + output
    )
