"""Tool calls in LFM2's pythonic layout: `<|tool_call_start|>[NAME(KEY=VALUE, ...), ...]<|tool_call_end|>`.

The template writes a string between single quotes, an object as `tojson`, and anything else as Python prints it
(`3`, `1.5`, `True`, `None`). Two revisions differ in strings and lists: LFM2 v2 and LFM2.5-VL escape strings
(`\\\\`, `\\'`, `\\n`, `\\r`) and write a list as `tojson` (`[1, "2", null]`); LFM2.5 writes strings raw and a list
as Python prints it (`[1, '2', None]`), so a raw string holding a quote followed by `, KEY=` or `)` can
be read two ways. A reply is read every way the template could have written it; a call list with no reading, or
with more than one (ambiguous), is malformed, so what the agent executes is the one thing the tokens can say. A
value other than a string or an object must be exactly how Python prints what it reads as (`03`, `1_000`, `(1,)`
are no value the template writes).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

from swe_grpo.tokens.call_values import JSON_DECODER, Malformed, Reading, openai_call, strict_json

_OPENER = "<|tool_call_start|>"
_CLOSER = "<|tool_call_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_LITERAL = re.compile(r"True|False|None|-?\d+(?:\.\d+)?(?:e[+-]\d+)?")
_ESCAPES = {"\\\\": "\\", "\\'": "'", "\\n": "\n", "\\r": "\r"}
_ESCAPED_STRING = re.compile(r"'((?:[^'\\\n\r]|\\[\\'nr])*)'")  # no raw line break: the template escapes it
_BUDGET = 10_000  # readings tried before a reply counts as malformed (raw strings full of quotes)


def _list_end(text: str, pos: int) -> int:
    """Where the Python list literal opened at `pos` ends (after its `]`), or -1: brackets counted outside its
    strings (quoted with `'` or `"`, backslash escapes), in one pass."""
    depth, quote, i = 0, "", pos
    while i < len(text):
        char = text[i]
        if quote:
            if char == "\\":
                i += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
            if depth == 0:
                return i + 1 if char == "]" else -1
        i += 1
    return -1


def _holdable(value: Any) -> Any:
    """`value`, refused (`Malformed`, a ValueError) where the agent's JSON parser would read it as another value."""
    return strict_json(json.dumps(value))


class _Reader:
    """Every reading of one call list, tried within a budget."""

    def __init__(self, text: str, escaped: bool):
        self.text, self.escaped, self.steps = text, escaped, 0

    def _step(self) -> None:
        self.steps += 1
        if self.steps > _BUDGET:
            raise Malformed("too many ways to read a call list")

    def strings(self, pos: int) -> Iterator[tuple[str, int]]:
        text = self.text
        if self.escaped:
            if m := _ESCAPED_STRING.match(text, pos):
                yield re.sub(r"\\[\\'nr]", lambda e: _ESCAPES[e.group()], m.group(1)), m.end()
            return
        end = text.find("'", pos + 1)
        while end != -1:
            self._step()
            yield text[pos + 1 : end], end + 1
            end = text.find("'", end + 1)

    def values(self, pos: int) -> Iterator[tuple[Any, int]]:
        text = self.text
        if text.startswith("'", pos):
            yield from self.strings(pos)
        elif text.startswith("{", pos) or (self.escaped and text.startswith("[", pos)):
            try:
                value, end = JSON_DECODER.raw_decode(text, pos)
            except (ValueError, RecursionError):
                return
            yield value, end
        elif text.startswith("[", pos):
            yield from self._list(pos)
        elif literal := _LITERAL.match(text, pos):
            try:
                value = ast.literal_eval(literal.group())
            except (ValueError, SyntaxError):  # 03
                return
            if str(value) == literal.group():
                yield _holdable(value), literal.end()

    def _list(self, pos: int) -> Iterator[tuple[Any, int]]:
        """A list as Python prints it: its text must be `repr` of what it reads as."""
        self._step()
        end = _list_end(self.text, pos)
        if end == -1:
            return
        try:
            value = ast.literal_eval(self.text[pos:end])
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return
        if isinstance(value, list) and repr(value) == self.text[pos:end]:
            yield _holdable(value), end

    def arguments(self, pos: int, seen: dict[str, Any]) -> Iterator[tuple[dict[str, Any], int]]:
        """The arguments from `pos` through the call's `)`."""
        text = self.text
        if text.startswith(")", pos):
            yield dict(seen), pos + 1
            return
        key = _NAME.match(text, pos)
        if key is None or key.group() in seen or not text.startswith("=", key.end()):
            return
        for value, end in self.values(key.end() + 1):
            after = {**seen, key.group(): value}
            if text.startswith(", ", end):
                yield from self.arguments(end + 2, after)
            elif text.startswith(")", end):
                yield after, end + 1

    def calls(self, pos: int) -> Iterator[list[tuple[str, dict[str, Any]]]]:
        """Every reading of the calls from `pos` through the list's `]` at the text's end."""
        text = self.text
        name = _NAME.match(text, pos)
        if name is None or not text.startswith("(", name.end()):
            return
        for arguments, end in self.arguments(name.end() + 1, {}):
            if end == len(text) - 1 and text.endswith("]"):
                yield [(name.group(), arguments)]
            elif text.startswith(", ", end):
                for rest in self.calls(end + 2):
                    yield [(name.group(), arguments), *rest]


def read_pythonic(text: str, escaped: bool) -> Reading:
    """The calls in `text`'s call lists and the text outside them; `escaped`: the template escapes strings."""
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    attempted = pos = 0
    while (start := text.find(_OPENER, pos)) != -1:
        outside.append(text[pos:start])
        end = text.find(_CLOSER, start)
        body = text[start + len(_OPENER) : end]
        try:
            readings: list[list[tuple[str, dict[str, Any]]]] = []
            if end != -1 and body.startswith("["):
                for reading in _Reader(body, escaped).calls(1):
                    readings.append(reading)
                    if len(readings) > 1:
                        break
            if len(readings) != 1:
                raise Malformed("a call list unclosed, or that reads no way or more than one")
            listed = [openai_call(name, arguments) for name, arguments in readings[0]]
        except (ValueError, RecursionError):
            return Reading(calls, attempted + 1, "".join(outside))
        calls += listed
        attempted += len(listed)
        pos = end + len(_CLOSER)
    outside.append(text[pos:])
    return Reading(calls, attempted, "".join(outside))
