"""Tool calls in `<tool_call>...</tool_call>` blocks, with the bodies the supported templates write:

- `{"name": ..., "arguments": {...}}` (Hermes JSON: Qwen3, and any tagged template as a fallback);
- `<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>` (Qwen3.5+ XML, Nemotron 3; one newline on
  each side of a value is the template's own);
- `NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n` (GLM-4-MoE; the value is all between its tags).

Raw-text values are typed by `call_values.typed_value`. `read_tagged` finds the blocks and reads every call in them;
a malformed one (not JSON, no name, an unclosed or repeated key, text between parameters) leaves the reading with
fewer calls than attempts.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from swe_grpo.tokens.call_values import (
    JSON_DECODER,
    SPACE,
    Malformed,
    Reading,
    ToolTypes,
    openai_call,
    strict_json,
    typed_value,
)

_CALL_OPENER = "<tool_call>"
_CALL_CLOSER = "</tool_call>"
_XML_FUNCTION = re.compile(r"\s*<function=([^\n>]*)>\n?(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"\s*<parameter=([^\n>]*)>")
_XML_PARAMETER_CLOSER = "</parameter>"
_CALL_KEYS = ({"name"}, {"name", "arguments"}, {"name", "parameters"})
_GLM_KEY, _GLM_KEY_CLOSER = "\n<arg_key>", "</arg_key>"
_GLM_VALUE, _GLM_VALUE_CLOSER = "\n<arg_value>", "</arg_value>"
_GLM_NAME = re.compile(r"[^\s<>]+")


def _block_end(text: str, body: int) -> int:
    """Where the call block whose body starts at `body` closes (its closer's index), or -1. A JSON body ends where
    its value does, so a closer in one of its strings (`grep "</tool_call>"`) is the string's text; any other body
    ends at the first closer."""
    value = SPACE.match(text, body).end()
    if text.startswith("{", value):
        with contextlib.suppress(ValueError, RecursionError):
            closer = SPACE.match(text, JSON_DECODER.raw_decode(text, value)[1]).end()
            if text.startswith(_CALL_CLOSER, closer):
                return closer
    return text.find(_CALL_CLOSER, body)


def call_blocks(text: str) -> tuple[list[str], int, str]:
    """The bodies of the closed `<tool_call>...</tool_call>` blocks, how many calls were attempted (one a block,
    and one for an opener left without its closer), and the text outside the blocks. An opener inside a block is
    the block's text (an argument such as `grep "<tool_call>"`)."""
    bodies: list[str] = []
    outside: list[str] = []
    pos = 0
    start = text.find(_CALL_OPENER)
    while start != -1 and (end := _block_end(text, start + len(_CALL_OPENER))) != -1:
        outside.append(text[pos:start])
        bodies.append(text[start + len(_CALL_OPENER) : end])
        pos = end + len(_CALL_CLOSER)
        start = text.find(_CALL_OPENER, pos)
    outside.append(text[pos:])
    return bodies, len(bodies) + (start != -1), "".join(outside)


def json_call(body: str) -> tuple[Any, Any]:
    obj = strict_json(body)
    if not isinstance(obj, dict) or set(obj) not in _CALL_KEYS:
        raise Malformed("a call is an object with a name and arguments (or parameters)")
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


def _xml_call(body: str, types: ToolTypes | None) -> tuple[Any, Any]:
    function = _XML_FUNCTION.fullmatch(body)
    if function is None:
        raise Malformed("not a <function=...> block")
    name, parameters = function.groups()
    properties = (types or {}).get(name, {})
    arguments: dict[str, Any] = {}
    pos = 0
    # A scan, not a regex search: an opener without its closer must not cost a pass over the rest of the text.
    while opener := _XML_PARAMETER.match(parameters, pos):
        key, start = opener.group(1), opener.end()
        end = parameters.find(_XML_PARAMETER_CLOSER, start)
        if end == -1 or not key or key in arguments:
            raise Malformed("an unclosed, nameless or repeated parameter")
        text = parameters[start:end].removeprefix("\n").removesuffix("\n")
        arguments[key] = typed_value(text, properties.get(key, set()))
        pos = end + len(_XML_PARAMETER_CLOSER)
    if parameters[pos:].strip():
        raise Malformed("text that is not a parameter")
    return name, arguments


def _glm_call(body: str, types: ToolTypes | None) -> tuple[Any, Any]:
    name = _GLM_NAME.match(body)
    if name is None:
        raise Malformed("a GLM call starts with its name")
    properties = (types or {}).get(name.group(), {})
    arguments: dict[str, Any] = {}
    pos = name.end()
    while body.startswith(_GLM_KEY, pos):
        key_end = body.find(_GLM_KEY_CLOSER, pos)
        key = body[pos + len(_GLM_KEY) : key_end]
        value = key_end + len(_GLM_KEY_CLOSER)
        if key_end == -1 or not key or key in arguments or not body.startswith(_GLM_VALUE, value):
            raise Malformed("an unclosed, nameless or repeated key, or a key without its value")
        value += len(_GLM_VALUE)
        end = body.find(_GLM_VALUE_CLOSER, value)
        if end == -1:
            raise Malformed("an unclosed value")
        arguments[key] = typed_value(body[value:end], properties.get(key, set()))
        pos = end + len(_GLM_VALUE_CLOSER)
    if body[pos:] not in ("", "\n"):
        raise Malformed("text that is not an argument")
    return name.group(), arguments


def read_tagged(text: str, types: ToolTypes | None, glm: bool = False) -> Reading:
    """The calls in `text`'s blocks and the text outside them. A body is XML when it opens `<function=`, JSON when
    it opens `{`, and otherwise a GLM call where the template writes those (`glm`), else malformed."""
    bodies, attempted, outside = call_blocks(text)
    calls: list[dict[str, Any]] = []
    for body in bodies:
        start = body.lstrip()
        try:
            if start.startswith("<function="):
                calls.append(openai_call(*_xml_call(body, types)))
            elif glm and not start.startswith("{"):
                calls.append(openai_call(*_glm_call(body, types)))
            else:
                calls.append(openai_call(*json_call(body)))
        except (ValueError, RecursionError):  # Malformed, and JSON the agent would read otherwise
            break
    return Reading(calls, attempted, outside)
