"""What the agent executes is what the tokens say: tool-call arguments written by each supported chat template
(through the TRAINING template, as the chain renders them) parse back exactly, with no whitespace stripped and no
type coerced; what the parser returns, echoed back by an agent, is the held message again and re-renders to the
very tokens generated. Plus the parser's start-up refusal of a template it cannot read back exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import TEMPLATES, tiny_tokenizer
from pi_shapes import echo_assistant, scripted_output

from swe_grpo.tokens.chain import TrainingTemplate, normalize_message, same_message
from swe_grpo.tokens.responses import ResponseParser, UnsupportedTemplateError


def _schema(**types: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {name: {"type": t} for name, t in types.items()}}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write",
            "description": "Write a file.",
            "parameters": _schema(
                content="string",
                path="string",
                mode="string",
                exponent="string",
                digits="string",
                word="string",
                json_text="string",
                empty="string",
                blank="string",
                escapes="string",
                unicode="string",
                count="integer",
                ratio="number",
                whole="number",
                flag="boolean",
                options="object",
                items="array",
                maybe=["string", "null"],
            ),
        },
    },
]

# Every value here is one the agent must receive exactly as the template wrote it.
ARGUMENTS: dict[str, Any] = {
    "content": "\n    def f():\n        return 1\n\n",
    "path": "  spaced name.txt  ",
    "mode": "007",
    "exponent": "1e3",
    "digits": "42",
    "word": "true",
    "json_text": '{"a": [1, 2]}',
    "empty": "",
    "blank": " \n\t ",
    "escapes": 'quote " backslash \\ tab \t cr \r',
    "unicode": "héllo ✓ 日本 🚀",
    "count": 42,
    "ratio": 1.5,
    "whole": 1.0,
    "flag": True,
    "options": {"nested": {"list": [1, "2", None, {"x": []}], "s": " padded\n"}, "unicode": "é"},
    "items": ["a", 1, [2.5, False]],
    "maybe": None,
}


def _exact(value: Any) -> str:
    """A form in which 1, 1.0 and True differ (Python's == does not tell them apart)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _generate(template: str, message: dict[str, Any]) -> tuple[ResponseParser, TrainingTemplate, list[int], Any]:
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    ids = scripted_output(training, message)
    prompt = training.prompt_ids([{"role": "user", "content": "Fix the bug."}], TOOLS)
    return ResponseParser(tokenizer), training, ids, prompt


def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": "call_0", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize("template", TEMPLATES)
def test_arguments_reach_the_agent_exactly_as_generated(template: str) -> None:
    message = {"role": "assistant", "content": "", "tool_calls": [_call("write", ARGUMENTS)]}
    parser, _, ids, prompt = _generate(template, message)
    parsed = parser.parse(ids, prompt, "stop", TOOLS)
    assert parsed.finish_reason == "tool_calls" and parsed.malformed_tool_calls == 0
    (call,) = parsed.message["tool_calls"]
    assert call["function"]["name"] == "write"
    assert _exact(json.loads(call["function"]["arguments"])) == _exact(ARGUMENTS)


@pytest.mark.parametrize("template", TEMPLATES)
def test_echoed_reply_is_the_held_message_and_renders_the_generated_tokens(template: str) -> None:
    message = {"role": "assistant", "content": "", "tool_calls": [_call("write", ARGUMENTS)]}
    parser, training, ids, prompt = _generate(template, message)
    parsed = parser.parse(ids, prompt, "stop", TOOLS)
    held = normalize_message(parsed.message)
    echoed = normalize_message(echo_assistant(parsed.message))  # arguments re-serialised as JSON.stringify does
    assert same_message(held, echoed)
    assert scripted_output(training, echoed) == ids


@pytest.mark.parametrize("template", ["qwen3", "qwen3_6"])
def test_parallel_calls_with_reasoning_round_trip(template: str) -> None:
    second = {"command": "  cd /repo &&\n  pytest -x\n", "timeout": "30"}
    message = {
        "role": "assistant",
        "content": "Writing, then testing.",
        "reasoning_content": "Two steps.",
        "tool_calls": [_call("write", ARGUMENTS), _call("bash", second)],
    }
    parser, training, ids, prompt = _generate(template, message)
    tools = [
        *TOOLS,
        {"type": "function", "function": {"name": "bash", "parameters": _schema(command="string", timeout="string")}},
    ]
    parsed = parser.parse(ids, prompt, "stop", tools)
    arguments = [json.loads(c["function"]["arguments"]) for c in parsed.message["tool_calls"]]
    assert [_exact(a) for a in arguments] == [_exact(ARGUMENTS), _exact(second)]
    assert scripted_output(training, normalize_message(echo_assistant(parsed.message))) == ids


@pytest.mark.parametrize("template", ["qwen3", "llama3_2"])
def test_json_templates_keep_the_type_the_tokens_say_whatever_the_schema(template: str) -> None:
    # The schema says integer, the model wrote a JSON string: the agent gets the string (its own check decides).
    arguments = {"count": "007", "ratio": "1e3", "flag": "true", "options": '{"a": 1}'}
    message = {"role": "assistant", "content": "", "tool_calls": [_call("write", arguments)]}
    parser, _, ids, prompt = _generate(template, message)
    (call,) = parser.parse(ids, prompt, "stop", TOOLS).message["tool_calls"]
    assert _exact(json.loads(call["function"]["arguments"])) == _exact(arguments)


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_reply_cut_anywhere_gives_whole_exact_calls_or_none(template: str) -> None:
    calls = [_call("write", ARGUMENTS)]
    if template != "llama3_2":  # Llama 3.x writes one call a turn
        calls.append(_call("bash", {"command": "ls\n"}))
    parser, _, ids, prompt = _generate(template, {"role": "assistant", "content": "", "tool_calls": calls})
    tools = [*TOOLS, {"type": "function", "function": {"name": "bash", "parameters": _schema(command="string")}}]
    want = [(c["function"]["name"], _exact(c["function"]["arguments"])) for c in calls]
    for cut in range(len(ids) + 1):
        parsed = parser.parse(ids[:cut], prompt, "length", tools)
        got = [
            (c["function"]["name"], _exact(json.loads(c["function"]["arguments"])))
            for c in parsed.message.get("tool_calls", [])
        ]
        assert got == want[: len(got)], cut
    assert got == want


# qwen3_6 writes a string parameter as its raw text and anything else as `tojson`, so "42" is either the string
# "42" or the number 42. The rule: text is a non-string value only when it is exactly what tojson writes for one
# and the tool's schema (when it types that parameter) allows that value's type; otherwise it is the text.
@pytest.mark.parametrize(
    ("text", "schema_type", "expected"),
    [
        ("42", "string", "42"),
        ("42", "integer", 42),
        ("42", None, 42),
        ("042", "integer", "042"),  # tojson never writes 042: the text is what the agent gets, and its schema check
        ("1e3", "number", "1e3"),  # ... may reject it, as it would had the model written "1e3" in JSON as a string
        ("1.0", "number", 1.0),
        ("1.0", "integer", "1.0"),
        ("true", "boolean", True),
        ("true", "string", "true"),
        ("null", None, None),
        ("NaN", "number", "NaN"),
        ('{"a": 1}', "object", {"a": 1}),
        ('{"a":1}', "object", '{"a":1}'),  # tojson writes ", " and ": "
        ('["x", 2]', None, ["x", 2]),
        (" 42", "integer", " 42"),
        ("42\n", None, "42\n"),
    ],
)
def test_qwen3_6_value_typing_rule(text: str, schema_type: str | None, expected: Any) -> None:
    tokenizer = tiny_tokenizer("qwen3_6")
    training = TrainingTemplate(tokenizer)
    properties = {"v": {"type": schema_type}} if schema_type else {}
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": properties}}}
    ]
    ids = training.encode(
        f"\n</think>\n\n<tool_call>\n<function=f>\n<parameter=v>\n{text}\n</parameter>\n</function>\n</tool_call><|im_end|>"
    )
    prompt = training.prompt_ids([{"role": "user", "content": "hi"}], tools)
    parsed = ResponseParser(tokenizer).parse(ids, prompt, "stop", tools)
    (call,) = parsed.message["tool_calls"]
    assert _exact(json.loads(call["function"]["arguments"])) == _exact({"v": expected})


# Writes calls in a way no layout reads back: LFM2.5 Python-style calls (every template:
# tests/test_template_matrix.py).
@pytest.mark.parametrize("template", ["lfm2_2_5"])
def test_a_template_that_cannot_be_read_back_exactly_is_refused_at_start_up(template: str) -> None:
    with pytest.raises(UnsupportedTemplateError, match="do not parse back exactly"):
        ResponseParser(tiny_tokenizer(template))
