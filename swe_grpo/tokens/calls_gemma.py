"""Tool calls in Gemma 4's layout (every Gemma 4 revision TRL ships, and DiffusionGemma).

A call is `<|tool_call>call:NAME{KEY:VALUE,...}<tool_call|>`, calls one after another. The template writes each value
by its type (its `format_argument`), with no space anywhere: a string as its raw text between `<|"|>` tokens (nothing
escaped), `true`/`false`, `null` (`None` in the revisions before v5, which print Python's name for it), a number as
Python prints it, an object as `{KEY:VALUE,...}` (keys bare, or between `<|"|>`), a list as `[VALUE,...]`. A value
is read back exactly that way and nothing else: a number through `call_values.strict_json` (no NaN, none a double
cannot hold), a repeated key, a space, an unclosed string or anything else is malformed. Reasoning is the thought
channel (`<|channel>thought ... <channel|>`), split off by the parser before the calls are read.
"""

from __future__ import annotations

import re
from typing import Any

from swe_grpo.tokens.call_values import Malformed, Reading, openai_call, strict_json

REASONING = ("<|channel>thought", "<channel|>")  # the opener (with its channel name) and closer of a thought
_OPENER = "<|tool_call>"
_CALL = _OPENER + "call:"
_CLOSER = "<tool_call|>"
_QUOTE = '<|"|>'
_NAME = re.compile(r"[^\s{}\[\]<>:,]+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None, "None": None}
_WORD = re.compile("|".join(_WORDS))


def _key(text: str, pos: int) -> tuple[str, int]:
    if text.startswith(_QUOTE, pos):
        return _string(text, pos)
    key = _NAME.match(text, pos)
    if key is None:
        raise Malformed("an object key is no name")
    return key.group(), key.end()


def _string(text: str, pos: int) -> tuple[str, int]:
    end = text.find(_QUOTE, pos + len(_QUOTE))
    if end == -1:
        raise Malformed("an unclosed string")
    return text[pos + len(_QUOTE) : end], end + len(_QUOTE)


def _items(text: str, pos: int, closer: str, item: Any) -> int:
    """Read the comma-separated items of a container whose opener is at `pos - 1` with `item(pos) -> end`; returns
    the position after `closer`."""
    if text.startswith(closer, pos):
        return pos + 1
    while True:
        pos = item(pos)
        if text.startswith(closer, pos):
            return pos + 1
        if not text.startswith(",", pos):
            raise Malformed(f"a container not closed by {closer}")
        pos += 1


def _object(text: str, pos: int, depth: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}

    def member(at: int) -> int:
        key, at = _key(text, at)
        if key in out or not text.startswith(":", at):
            raise Malformed("a repeated key, or a key without its value")
        out[key], at = _value(text, at + 1, depth + 1)
        return at

    return out, _items(text, pos + 1, "}", member)


def _value(text: str, pos: int, depth: int = 0) -> tuple[Any, int]:
    """The value written at `pos` and where it ends."""
    if depth > 100:
        raise RecursionError("a value nested too deep")
    if text.startswith(_QUOTE, pos):
        return _string(text, pos)
    if text.startswith("{", pos):
        return _object(text, pos, depth)
    if text.startswith("[", pos):
        values: list[Any] = []

        def element(at: int) -> int:
            value, at = _value(text, at, depth + 1)
            values.append(value)
            return at

        return values, _items(text, pos + 1, "]", element)
    if word := _WORD.match(text, pos):
        return _WORDS[word.group()], word.end()
    if number := _NUMBER.match(text, pos):
        return strict_json(number.group()), number.end()
    raise Malformed("a value that is none the template writes")


def read_gemma(text: str) -> Reading:
    """The calls in `text` (the reply after its thought) and the text outside them."""
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    attempted = pos = 0
    while (start := text.find(_OPENER, pos)) != -1:
        outside.append(text[pos:start])
        attempted += 1
        try:
            name = _NAME.match(text, start + len(_CALL))
            if not text.startswith(_CALL, start) or name is None or not text.startswith("{", name.end()):
                raise Malformed("not call:NAME{...}")
            arguments, end = _object(text, name.end(), 0)
            if not text.startswith(_CLOSER, end):
                raise Malformed("a call not closed by <tool_call|>")
            calls.append(openai_call(name.group(), arguments))
        except (ValueError, RecursionError):
            return Reading(calls, attempted, "".join(outside))
        pos = end + len(_CLOSER)
    outside.append(text[pos:])
    return Reading(calls, attempted, "".join(outside))
