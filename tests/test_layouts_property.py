"""Property, per newer layout (gpt-oss harmony, GLM-4-MoE, Gemma 4, LFM2 pythonic, Muse Glimmer ATEM): whatever calls
the model writes as its template writes them, the agent executes exactly those calls, or, where a value holds the
family's own markup (a special or added token, or a layout's tag written as text, which can end a value or a block),
the reply goes back as plain text with its attempts
counted: never another call. Cut at any token (max_tokens), the calls read are the first ones written, exactly, or
none. tests/test_responses_property.py does the same for the Hermes and Qwen3.5 XML layouts.

Each case is seeded random calls (names, keys, and values of every type the template writes: strings of whitespace,
quotes, backslashes, non-ASCII, digits, JSON and Python punctuation and the family's markup; numbers; booleans; null;
lists; objects), written by the family's training template itself, so what the tokens say is known without a second
parser.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from conftest import tiny_tokenizer

from swe_grpo.tokens.responses import ResponseParser

CASES = 150  # per template
TEMPLATES = ["gptoss", "glm4moe", "gemma4", "gemma4_v5", "lfm2_v2", "lfm2_2_5_vl", "muse_glimmer"]
ONE_CALL = {"gptoss"}  # the template writes a turn's first call only
PARTS = [
    *("ls", "python -m pytest -x", " ", "  ", "\n", "\t", "\r\n", '"', "'", "\\", "\\n", "é", "😀", "007", "42"),
    *("true", "null", "None", "{", "}", "[", "]", "(", ")", ",", ":", "=", ", x=", "')", "to=functions.x"),
]
# Markup a family writes as plain text, not as tokens: ATEM's tags (a value holding its closer ends there).
TEXT_MARKUP = {
    "muse_glimmer": [
        "</atem:parameter>",
        "</atem:parameter>\n",
        '<atem:parameter name="n">',
        "</atem:invoke>\n</atem:function_calls>",
    ]
}
NAMES = ["bash", "read", "edit_file", "x"]
STRINGS = ["command", "path", "oldText"]  # typed strings by the tools' schema: raw text (GLM) reads as a string
KEYS = [*STRINGS, "n", "a_b"]  # the others untyped, never given a string: raw `true` is the boolean there
_PROPERTIES = {**{key: {"type": "string"} for key in STRINGS}, "n": {"description": "any"}, "a_b": {"description": "x"}}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": name,
                                      "parameters": {"type": "object", "properties": _PROPERTIES}}}
    for name in NAMES
]  # fmt: skip


class Writer:
    """Random calls; `markup` are the family's added tokens, some of which go into strings."""

    def __init__(self, rng: random.Random, markup: list[str]):
        self.rng, self.markup = rng, markup

    def string(self) -> str:
        parts = PARTS + self.markup if self.rng.random() < 0.2 else PARTS
        return "".join(self.rng.choice(parts) for _ in range(self.rng.randint(0, 6)))

    def value(self, depth: int = 0, string: bool = True) -> Any:
        kinds = ["int", "float", "bool", "null"] + (["list", "dict"] if depth < 2 else [])
        kind = self.rng.choice(["string"] * 5 + kinds if string else kinds)
        if kind == "string":
            return self.string()
        if kind == "int":
            return self.rng.choice([0, 7, -3, 30, 2**31])
        if kind == "float":
            return self.rng.choice([2.5, -0.25, 0.5])
        if kind == "bool":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        if kind == "list":
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 3))]
        return {self.rng.choice(KEYS): self.value(depth + 1) for _ in range(self.rng.randint(0, 3))}

    def calls(self, one: bool) -> list[tuple[str, dict[str, Any]]]:
        count = 1 if one else self.rng.randint(1, 3)
        return [
            (
                self.rng.choice(NAMES),
                {
                    k: self.string() if k in STRINGS else self.value(string=False)
                    for k in self.rng.sample(KEYS, self.rng.randint(0, 3))
                },
            )
            for _ in range(count)
        ]


def _holds_markup(calls: list[tuple[str, dict[str, Any]]], markup: list[str]) -> bool:
    text = json.dumps([c[1] for c in calls], ensure_ascii=False)
    return any(json.dumps(m, ensure_ascii=False)[1:-1] in text for m in markup)


def _read(parser: ResponseParser, ids: list[int], prompt: list[int], stop: str) -> list | None:
    parsed = parser.parse(ids, prompt, stop, TOOLS)
    if parsed.malformed_tool_calls:
        assert "tool_calls" not in parsed.message
        return None
    calls = parsed.message.get("tool_calls") or []
    assert parsed.finish_reason == ("tool_calls" if calls else "length" if stop == "length" else "stop")
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_agent_executes_the_calls_the_template_wrote_or_none(template: str) -> None:
    tokenizer = tiny_tokenizer(template)
    parser = ResponseParser(tokenizer)
    training = parser.template
    markup = sorted(tokenizer.get_added_vocab()) + TEXT_MARKUP.get(template, [])
    writer = Writer(random.Random(f"layouts-{template}"), markup)
    prompt = training.prompt_ids([{"role": "user", "content": "."}], TOOLS)
    written = 0
    for case in range(CASES):
        calls = writer.calls(template in ONE_CALL)
        reply = {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
                for i, (n, a) in enumerate(calls)
            ],
        }
        try:
            text = training.reply_text(reply, TOOLS)
        except ValueError:  # a value the template cannot render (its own refusal)
            continue
        written += 1
        ids = training.encode(text)
        where = f"case {case}: {text!r}"
        got = _read(parser, ids, prompt, "stop")
        holds_markup = _holds_markup(calls, markup)
        assert got == calls or (got is None and holds_markup), where
        cut = writer.rng.randint(1, len(ids) - 1)
        got = _read(parser, ids[:cut], prompt, "length")
        assert got is None or got == calls[: len(got)] or holds_markup, f"{where} cut at {cut}"
    assert written > CASES // 2
