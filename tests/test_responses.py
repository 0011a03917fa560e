"""Generated ids -> OpenAI assistant messages, across TRL's shipped templates."""

from __future__ import annotations

import json
import random
import time

import pytest
from conftest import TEMPLATES, tiny_tokenizer
from pi_shapes import TOOLS, scripted_output, tool_call

from swe_grpo.tokens.chain import TrainingTemplate, normalize_message
from swe_grpo.tokens.responses import ParsedResponse, ResponseParser, UnsupportedTemplateError


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
# (template, generated text, stop reason, attempted calls): each goes back as the whole text.
MALFORMED = [
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": "ls -la"}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": ["ls"]}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"command": }\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"arguments": {"command": "ls"}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": ["bash"], "arguments": {}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"timeout": NaN}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"timeout": 1e999}}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {}, "id": 3}\n</tool_call><|im_end|>', "stop", 1),
    ("qwen3", '<tool_call>\n{"name": "bash", "arguments": {"command": "\\ud800"}}\n</tool_call><|im_end|>', "stop", 1),
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
    # Llama 3.x writes a call as the whole reply: JSON after text is text, and no call was attempted.
    ("llama3_2", 'Sure: {"name": "bash", "parameters": {"command": "ls"}}<|eot_id|>', "stop", 0),
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


PYTEST_CALL = {
    "qwen3": '<tool_call>\n{"name": "bash", "arguments": {"command": "python -m pytest -x tests"}}\n</tool_call>',
    "qwen3_6": "<tool_call>\n<function=bash>\n<parameter=command>\npython -m pytest -x tests\n</parameter>\n"
    "</function>\n</tool_call>",
}
# Qwen3.5+'s generation prompt opens the think block itself; a Qwen3 reply opens it.
THINK_OPENER = {"qwen3": "<think>\n", "qwen3_6": ""}


@pytest.mark.parametrize("template", ["qwen3", "qwen3_6"])
def test_a_think_block_after_a_call_leaves_the_call_as_written(template: str) -> None:
    # Removing the reasoning's text wherever it first occurs took "pytest" out of the command.
    call = PYTEST_CALL[template]
    text = THINK_OPENER[template] + "Run the tests.\n</think>\n\n" + call + "\n<think>\npytest\n</think><|im_end|>"
    parsed = parse(template, text)
    (executed,) = parsed.message["tool_calls"]
    assert json.loads(executed["function"]["arguments"]) == {"command": "python -m pytest -x tests"}
    assert parsed.message["reasoning_content"] == "Run the tests."
    assert parsed.message["content"] == "<think>\npytest\n</think>"  # only a leading think block is reasoning


@pytest.mark.parametrize("template", ["qwen3", "qwen3_6"])
def test_a_call_in_the_leading_think_block_stays_reasoning_when_a_second_block_follows(template: str) -> None:
    reasoning = "Maybe " + PYTEST_CALL[template] + " first?"
    text = THINK_OPENER[template] + reasoning + "\n</think>\n\n<think>\nNo.\n</think>\n\nDone.<|im_end|>"
    parsed = parse(template, text)
    assert parsed.message == {
        "role": "assistant",
        "content": "<think>\nNo.\n</think>\n\nDone.",
        "reasoning_content": reasoning,
    }
    assert parsed.finish_reason == "stop" and parsed.malformed_tool_calls == 0


def test_a_special_token_inside_a_bare_call_stays_in_its_arguments() -> None:
    # The special tokens around a bare call (a `<|python_tag|>` before it, the end of turn) are not its text; one
    # inside it is what the tokens say.
    text = '<|python_tag|>{"name": "bash", "parameters": {"command": "echo <|start_header_id|>"}}<|eot_id|>'
    (call,) = parse("llama3_2", text).message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"command": "echo <|start_header_id|>"}


@pytest.mark.parametrize("template", TEMPLATES)
def test_an_argument_may_hold_the_call_markup(template: str) -> None:
    # An agent working on LLM tooling greps for the markup itself: one call, not a malformed second one.
    command = 'grep -n "<tool_call>" src/parse.py'
    parsed = parse(template, {"role": "assistant", "content": "", "tool_calls": [tool_call("bash", command=command)]})
    (call,) = parsed.message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"command": command}


def test_a_json_argument_may_hold_the_call_closer() -> None:
    # In JSON a closer inside a string is the string's text: the block ends where its JSON value does. (Qwen3.5+
    # writes values raw, so there the closer ends the block; Llama 3.x's bare call is the whole reply.)
    command = 'grep -n "</tool_call>" src/parse.py'
    reply = {"role": "assistant", "content": "Looking.", "tool_calls": [tool_call("bash", command=command)]}
    parsed = parse("qwen3", reply)
    (call,) = parsed.message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"command": command}
    assert parsed.message["content"] == "Looking."


def test_cut_at_max_tokens_reports_length() -> None:
    parsed = parse("qwen3", "I will now start to", stop_reason="length")
    assert parsed.finish_reason == "length"
    assert parsed.message["content"] == "I will now start to"


def _not_json(constant: str) -> None:
    raise AssertionError(f"{constant} is not JSON, and an agent's parser rejects it")


def _assert_well_formed(parsed: ParsedResponse, tools: list | None) -> None:
    """What any reply must be: valid JSON for the agent; either named calls with JSON-object
    arguments (nothing malformed), or plain text."""
    message = parsed.message
    assert message["role"] == "assistant"
    json.dumps(message, ensure_ascii=False, allow_nan=False).encode()
    if "tool_calls" not in message:
        assert parsed.finish_reason in ("stop", "length") and isinstance(message["content"], str)
        return
    assert parsed.finish_reason == "tool_calls" and parsed.malformed_tool_calls == 0 and message["tool_calls"]
    for call in message["tool_calls"]:
        name = call["function"]["name"]
        assert isinstance(name, str) and name  # a name `tools` does not list is still a call, as vLLM returns it
        assert isinstance(json.loads(call["function"]["arguments"], parse_constant=_not_json), dict)


FRAGMENTS = [
    *("<tool_call>", "</tool_call>", "<function=bash>", "<function=", "</function>", "<think>", "</think>"),
    *("<parameter=command>", "<parameter=", "</parameter>", ">", "\n", "\n", " ", "{", "}", "[", "]", ",", ":"),
    *('"', '"name"', '"arguments"', '"parameters"', '"bash"', '"command"', '"ls"', '{"name": "bash", '),
    *("42", "1e999", "NaN", "\\ud800", "null", "true", "\\", "x", "é", "<|im_end|>", "<|eot_id|>"),
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_no_token_sequence_makes_the_parser_raise_or_pass_on_a_bad_call(template: str) -> None:
    """Seeded fuzzing: random ids, random markup fragments, and valid calls with random edits."""
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    parser = ResponseParser(tokenizer)
    prompt = training.prompt_ids([{"role": "user", "content": "hi"}], TOOLS)
    valid = training.tokenizer.decode(
        scripted_output(training, normalize_message({"role": "assistant", "content": "", "tool_calls": [
            tool_call("bash", command="ls -la\n", timeout=5)
        ]})),
        skip_special_tokens=False,
    )  # fmt: skip
    rng = random.Random(10)
    for i in range(900):
        if i % 3 == 0:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 60))]
        else:
            if i % 3 == 1:
                text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 40)))
            else:
                text = valid
                for _ in range(rng.randint(1, 3)):
                    a, b = sorted(rng.randrange(len(text) + 1) for _ in range(2))
                    text = text[:a] + rng.choice(["", rng.choice(FRAGMENTS), text[a:b] * 2]) + text[b:]
            ids = training.encode(text)
        tools = TOOLS if i % 2 else None
        _assert_well_formed(parser.parse(ids, prompt, rng.choice(["stop", "length"]), tools), tools)


@pytest.mark.parametrize("template", TEMPLATES)
def test_degenerate_output_parses_in_linear_time(template: str) -> None:
    # ~30k tokens of unclosed parameters: a parser that scans on from each opener is quadratic in them.
    text = THOUGHT + "<tool_call>\n<function=bash>\n" + "<parameter=command>\n" * 4000 + "</function>\n</tool_call>"
    tokenizer = tiny_tokenizer(template)
    ids = TrainingTemplate(tokenizer).encode(text)
    parser = ResponseParser(tokenizer)
    start = time.perf_counter()
    parsed = parser.parse(ids, [], "length", TOOLS)
    assert time.perf_counter() - start < 1.0
    assert parsed.malformed_tool_calls == 1


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


# A number a double cannot hold: the agent's JSON parser (JavaScript's, as Pi's) reads another value
# (9007199254740993 -> ...992; 1 followed by 400 zeros -> Infinity). Such a call must not reach it.
UNHOLDABLE = ["9007199254740993", "1" + "0" * 400, "-9007199254740993"]


@pytest.mark.parametrize("number", UNHOLDABLE)
@pytest.mark.parametrize("template", ["qwen3", "llama3_2"])
def test_an_integer_a_double_cannot_hold_is_refused(template: str, number: str) -> None:
    key = "arguments" if template == "qwen3" else "parameters"
    body = f'{{"name": "read", "{key}": {{"path": "a", "offset": {number}}}}}'
    text = f"<tool_call>\n{body}\n</tool_call><|im_end|>" if template == "qwen3" else body + "<|eot_id|>"
    parsed = parse(template, text)
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_an_xml_integer_a_double_cannot_hold_is_refused_where_the_schema_wants_a_number() -> None:
    for typed, number in (("offset", UNHOLDABLE[0]), ("timeout", UNHOLDABLE[1])):
        name = "read" if typed == "offset" else "bash"
        body = f"<function={name}>\n<parameter={typed}>\n{number}\n</parameter>\n</function>"
        parsed = parse_with_tools("qwen3_6", THOUGHT + f"<tool_call>\n{body}\n</tool_call><|im_end|>")
        assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_an_integer_a_double_holds_is_a_call() -> None:
    text = '<tool_call>\n{"name": "read", "arguments": {"path": "a", "offset": 9007199254740992}}\n</tool_call>'
    (call,) = parse("qwen3", text + "<|im_end|>").message["tool_calls"]
    assert json.loads(call["function"]["arguments"])["offset"] == 2**53


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "bash", "arguments": {"command": "ls", "command": "rm -rf /"}}',  # the agent runs the last
        '{"name": "bash", "name": "read", "arguments": {"command": "ls"}}',
        '{"name": "bash", "arguments": {"command": "ls"}, "arguments": {"command": "pwd"}}',
        '{"name": "bash", "arguments": {"command": "ls", "env": {"A": "1", "A": "2"}}}',
    ],
)
def test_duplicate_keys_are_refused(body: str) -> None:
    parsed = parse("qwen3", f"<tool_call>\n{body}\n</tool_call><|im_end|>")
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def parse_with_tools(template: str, text: str, tools: list | None = None):
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    prompt = training.prompt_ids([{"role": "user", "content": "hi"}], tools or TOOLS)
    return ResponseParser(tokenizer).parse(training.encode(text), prompt, "stop", tools or TOOLS)


def _ref_tool(parameter: dict) -> list[dict]:
    parameters = {
        "type": "object",
        "$defs": {"Mode": {"type": "string", "enum": ["42", "fast"]}, "Count": {"type": "integer"}},
        "definitions": {"Name": {"type": "string"}},
        "properties": {"mode": parameter},
    }
    return [{"type": "function", "function": {"name": "run", "parameters": parameters}}]


@pytest.mark.parametrize(
    ("parameter", "value"),
    [
        ({"$ref": "#/$defs/Mode"}, "42"),  # a string-typed enum through $ref: "42" stays the string the tokens say
        ({"allOf": [{"$ref": "#/$defs/Mode"}]}, "42"),
        ({"$ref": "#/definitions/Name"}, "42"),
        ({"$ref": "#/$defs/Missing"}, "42"),  # unresolvable: a string
        ({"$ref": "https://example.com/schema.json"}, "42"),
        ({"$ref": "#/$defs/Count"}, 42),  # resolved to an integer: a number it is
        ({"allOf": [{"$ref": "#/$defs/Count"}, {"minimum": 1}]}, 42),
    ],
)
def test_a_parameter_typed_through_ref_or_allof_is_typed_as_its_schema_says(parameter: dict, value) -> None:
    body = "<function=run>\n<parameter=mode>\n42\n</parameter>\n</function>"
    tools = _ref_tool(parameter)
    parsed = parse_with_tools("qwen3_6", THOUGHT + f"<tool_call>\n{body}\n</tool_call><|im_end|>", tools)
    (call,) = parsed.message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"mode": value}


# --------------------------------------------------------------------------- gpt-oss harmony

HARMONY_CALL = ' to=functions.bash<|channel|>commentary json<|message|>{"command": "ls -la\\n\\tx  "}<|call|>'


def test_a_harmony_call_and_its_analysis() -> None:
    text = "<|channel|>analysis<|message|>List first.<|end|><|start|>assistant" + HARMONY_CALL
    parsed = parse_with_tools("gptoss", text)
    (call,) = parsed.message["tool_calls"]
    assert call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "ls -la\n\tx  "}
    assert parsed.message["reasoning_content"] == "List first." and parsed.message["content"] is None


def test_a_harmony_call_as_the_models_write_it() -> None:
    # The recipient after the channel and the content type behind <|constrain|>: how gpt-oss writes a call.
    text = '<|channel|>commentary to=functions.read <|constrain|>json<|message|>{"path": "a.py"}<|call|>'
    (call,) = parse_with_tools("gptoss", text).message["tool_calls"]
    assert call["function"]["name"] == "read" and json.loads(call["function"]["arguments"]) == {"path": "a.py"}


def test_a_harmony_final_answer_after_analysis() -> None:
    text = "<|channel|>analysis<|message|>Done?<|end|><|start|>assistant<|channel|>final<|message|>All pass.<|return|>"
    parsed = parse_with_tools("gptoss", text)
    assert parsed.message == {"role": "assistant", "content": "All pass.", "reasoning_content": "Done?"}
    assert parsed.finish_reason == "stop" and parsed.malformed_tool_calls == 0


HARMONY_MALFORMED = [
    ' to=browser.search<|channel|>commentary json<|message|>{"query": "x"}<|call|>',  # no function
    ' to=functions.bash<|channel|>commentary json<|message|>{"command": "ls"}<|end|>',  # not ended by <|call|>
    ' to=functions.bash<|channel|>commentary json<|message|>{"command": "ls"} <|call|>',  # text after the value
    ' to=functions.bash<|channel|>commentary json<|message|>"ls"<|call|>',  # arguments no object
    ' to=functions.bash<|channel|>commentary json<|message|>{"command": "ls", "command": "rm"}<|call|>',
    ' to=functions.bash<|channel|>commentary json<|message|>{"command": "l',  # cut
    ' to=functions.bash<|channel|>commentary to=functions.read json<|message|>{"path": "a"}<|call|>',
    "<|channel|>final<|message|>Sure.<|end|><|start|>assistant to=functions.bash<|channel|>oops<|message|>{}<|call|>",
]


@pytest.mark.parametrize("text", HARMONY_MALFORMED)
def test_a_malformed_harmony_call_goes_back_as_text(text: str) -> None:
    parsed = parse_with_tools("gptoss", text)
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_a_second_harmony_call_is_malformed() -> None:
    # <|call|> ends a turn and the template renders only a turn's first call: both attempts go back as text.
    parsed = parse_with_tools("gptoss", HARMONY_CALL + "<|start|>assistant" + HARMONY_CALL)
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 2


def test_harmony_text_without_channels_is_content() -> None:
    parsed = parse_with_tools("gptoss", "Hello there.<|return|>")
    assert parsed.message == {"role": "assistant", "content": "Hello there."} and parsed.malformed_tool_calls == 0


# --------------------------------------------------------------------------- GLM-4-MoE


def _glm(*calls: str, reasoning: str = "") -> str:
    return f"\n<think>{reasoning}</think>" + "".join(f"\n<tool_call>{c}</tool_call>" for c in calls) + "<|observation|>"


def test_glm_calls_with_raw_values_typed_by_the_schema() -> None:
    write = "write\n<arg_key>path</arg_key>\n<arg_value>007</arg_value>\n"
    write += "<arg_key>content</arg_key>\n<arg_value>\n  42\n\t</arg_value>\n"
    read = "read\n<arg_key>path</arg_key>\n<arg_value>a.py</arg_value>\n"
    read += "<arg_key>offset</arg_key>\n<arg_value>3</arg_value>\n"
    parsed = parse_with_tools("glm4moe", _glm(write, read, reasoning="Two things."))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.message["tool_calls"]] == [
        ("write", {"path": "007", "content": "\n  42\n\t"}),
        ("read", {"path": "a.py", "offset": 3}),
    ]
    assert parsed.message["reasoning_content"] == "Two things." and parsed.malformed_tool_calls == 0


GLM_MALFORMED = [
    "bash\n<arg_key>command</arg_key>\n<arg_value>ls\n",  # unclosed value
    "bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n<arg_key>command</arg_key>\n<arg_value>rm</arg_value>\n",
    "bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\nplease\n",  # text that is no argument
    "bash extra\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n",
    "\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n",  # no name
    "read\n<arg_key>offset</arg_key>\n<arg_value>9007199254740993</arg_value>\n",  # a number no double holds
]


@pytest.mark.parametrize("body", GLM_MALFORMED)
def test_a_malformed_glm_call_goes_back_as_text(body: str) -> None:
    parsed = parse_with_tools("glm4moe", _glm(body))
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_a_json_body_is_no_glm_call_by_accident() -> None:
    # Under a Hermes template a body that is not JSON is malformed; it becomes a GLM call only under GLM's template.
    parsed = parse_with_tools("qwen3", "<tool_call>\nbash\n</tool_call><|im_end|>")
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


# --------------------------------------------------------------------------- Gemma 4

Q = '<|"|>'


def test_gemma_calls_read_as_the_template_writes_values() -> None:
    first = f"call:edit{{newText:{Q}  x = {{'a': \"b\"}}\n\t{Q},path:{Q}a.py{Q}}}"
    second = f"call:write{{content:{Q}{Q},opts:{{deep:[1,-2.5,1e+20,null,None,true,{Q}s{Q}]}}}}"
    text = f"<|channel>thought\nTwo edits.\n<channel|><|tool_call>{first}<tool_call|><|tool_call>{second}<tool_call|>"
    parsed = parse_with_tools("gemma4_v5", text + "<|tool_response>")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.message["tool_calls"]] == [
        ("edit", {"newText": "  x = {'a': \"b\"}\n\t", "path": "a.py"}),
        ("write", {"content": "", "opts": {"deep": [1, -2.5, 1e20, None, None, True, "s"]}}),
    ]
    assert parsed.message["reasoning_content"] == "Two edits." and parsed.malformed_tool_calls == 0


GEMMA_MALFORMED = [
    f"call:bash{{command:{Q}ls}}",  # unclosed string
    f"call:bash{{command: {Q}ls{Q}}}",  # a space the template never writes
    f"call:bash{{command:{Q}ls{Q},command:{Q}rm{Q}}}",
    "call:read{offset:9007199254740993}",
    "call:read{offset:NaN}",
    "call:read{offset:07}",
    f"call:bash{{command:{Q}ls{Q}}}",  # with no closer (below)
    f"call bash{{command:{Q}ls{Q}}}",
]


@pytest.mark.parametrize("call", GEMMA_MALFORMED)
def test_a_malformed_gemma_call_goes_back_as_text(call: str) -> None:
    closer = "" if call == GEMMA_MALFORMED[6] else "<tool_call|>"
    parsed = parse_with_tools("gemma4_v5", f"<|tool_call>{call}{closer}<|tool_response>")
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


# --------------------------------------------------------------------------- LFM2 pythonic


def _lfm(calls: str) -> str:
    return f"<|tool_call_start|>[{calls}]<|tool_call_end|><|im_end|>"


def test_lfm_calls_with_escaped_strings_and_printed_values() -> None:
    """Strings escaped, numbers and words as Python prints them, objects and lists as `tojson` (as LFM2 v2's
    template writes a list: `[1, "two", null]`; read as Python's `[1, 'two', None]` until the layout property test
    rendered one)."""
    calls = (
        "edit(path='a b.py', newText='it\\'s\\n\tx\\\\y', count=3, ratio=-1.5, flag=True, none=None, "
        'opts={"k": [1, "2"]}, items=[1, "two", null]), read(path=\'c.py\')'
    )
    parsed = parse_with_tools("lfm2_v2", "Editing.\n" + _lfm(calls))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.message["tool_calls"]] == [
        (
            "edit",
            {
                "path": "a b.py",
                "newText": "it's\n\tx\\y",
                "count": 3,
                "ratio": -1.5,
                "flag": True,
                "none": None,
                "opts": {"k": [1, "2"]},
                "items": [1, "two", None],
            },
        ),
        ("read", {"path": "c.py"}),
    ]
    assert parsed.message["content"] == "Editing." and parsed.malformed_tool_calls == 0


LFM_MALFORMED = [
    "bash(command='ls)",  # unclosed string
    "bash(command='ls', command='pwd')",
    "bash(command='ls\nx')",  # a raw line break: the template escapes it
    "bash(command='a\\qb')",  # an escape the template never writes
    "read(offset=03)",
    "read(offset=1_000)",
    "read(offset=9007199254740993)",
    "bash(command='ls') extra",
    "bash(command = 'ls')",
    "read(items=[1, 'two', None])",  # a list as Python prints it: this revision writes `tojson`
]


@pytest.mark.parametrize("calls", LFM_MALFORMED)
def test_a_malformed_lfm_call_goes_back_as_text(calls: str) -> None:
    parsed = parse_with_tools("lfm2_v2", _lfm(calls))
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1


def test_raw_quoted_strings_read_more_than_one_way() -> None:
    """LFM2.5's template writes a string raw between single quotes: a call with two string arguments reads both as
    written and with the first swallowing `', b='` of the second. That is why it is refused; one string is fine."""
    from swe_grpo.tokens.calls_pythonic import read_pythonic

    ambiguous = read_pythonic("<|tool_call_start|>[f(a='x', b='y')]<|tool_call_end|>", escaped=False)
    assert ambiguous.calls == [] and ambiguous.attempted == 1
    (call,) = read_pythonic("<|tool_call_start|>[f(a='it's', n=3)]<|tool_call_end|>", escaped=False).calls
    assert json.loads(call["function"]["arguments"]) == {"a": "it's", "n": 3}
    with pytest.raises(UnsupportedTemplateError, match="do not parse back exactly"):
        ResponseParser(tiny_tokenizer("lfm2_2_5"))


# Each ~30k+ tokens a parser that scans on from every opener (or tries every closer) reads in quadratic time.
DEGENERATE = {
    "gptoss": "<|channel|>analysis<|message|>x<|end|><|start|>assistant" * 5000 + " to=functions.bash",
    "glm4moe": "\n<think></think>\n<tool_call>bash" + "\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>" * 3000,
    "gemma4_v5": "<|tool_call>call:f{a:" + "[" * 90 + "]" * 90 + ",b:" + "{x:" * 99 + "1" + "}" * 5000,
    "lfm2_v2": "<|tool_call_start|>[f(a=[" + "]" * 20000 + ")]<|tool_call_end|>",
}


@pytest.mark.parametrize("template", DEGENERATE)
def test_degenerate_output_in_each_layout_parses_in_linear_time(template: str) -> None:
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    ids = training.encode(DEGENERATE[template])
    parser = ResponseParser(tokenizer, training)
    start = time.perf_counter()
    parsed = parser.parse(ids, [], "length", TOOLS)
    assert time.perf_counter() - start < 1.0
    assert "tool_calls" not in parsed.message and parsed.malformed_tool_calls == 1
