"""Generated tokens -> the OpenAI assistant message an agent expects.

The model's output is parsed, never trusted. Only a leading think block is reasoning (see
`ResponseParser._split_reasoning`); tool calls are read from what follows it, in the layouts the supported templates
write, so that the arguments the agent executes are exactly what the tokens say (no whitespace stripped, no value
retyped, no text elsewhere in the reply taken out of them):

- `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes JSON: Qwen3, and any template as a fallback);
- `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>` (Qwen3.5+
  XML; see `_xml_value` for how a value's type is decided);
- a bare `{"name": ..., "parameters": {...}}` reply, for templates that write calls that way (Llama 3.x).

A reply with any malformed call attempt (not an object, not JSON, no name, an opener without its closer) goes
back to the agent as plain text, all attempted calls counted: never raised, never half passed on. A call to a
tool the request did not list is a call (as vLLM's parsers return it): the agent's "tool not found" is feedback.
At construction the parser renders a probe call through the tokenizer's template and refuses
(`UnsupportedTemplateError`) a template whose calls it cannot read back exactly.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

_CALL_OPENER = "<tool_call>"
_CALL_CLOSER = "</tool_call>"
# The Qwen3.5+ layout, as the template writes it; one newline on each side of a value is the template's own.
_XML_FUNCTION = re.compile(r"\s*<function=([^\n>]*)>\n?(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"\s*<parameter=([^\n>]*)>")
_XML_PARAMETER_CLOSER = "</parameter>"
_BARE_CALL = re.compile(r'\s*\{\s*"name"\s*:')
_CALL_KEYS = ({"name"}, {"name", "arguments"}, {"name", "parameters"})
_THINK_OPENER = "<think>"
_THINK_CLOSER = "</think>"
# How much of the prompt's end holds its generation prompt's think opener, where the template writes one.
_PROMPT_TAIL_TOKENS = 8

# The start-up probe: values a template must let through exactly (see `ResponseParser._check_round_trip`).
_PROBE_TYPES = {"text": "string", "digits": "string", "padded": "string", "count": "integer", "options": "object"}
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "start-up check",
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in _PROBE_TYPES.items()}},
    },
}
_PROBE_ARGUMENTS = {
    "text": "\n  indented\n\ttab\n",
    "digits": "42",
    "padded": "007",
    "count": 3,
    "options": {"a": [1, "2", None], "b": True},
}


class UnsupportedTemplateError(ValueError):
    """The tokenizer's chat template writes tool calls that cannot be read back exactly."""


class _Malformed(ValueError):
    """An attempted tool call that must not reach the agent."""


@dataclass(frozen=True)
class ParsedResponse:
    """`message` is an OpenAI assistant message (`content`, optional `reasoning_content`, optional
    `tool_calls` with ids and JSON-object-string `arguments`); `finish_reason` is "tool_calls", "stop" or
    "length"; `malformed_tool_calls` counts attempted calls when any of them was malformed."""

    message: dict[str, Any]
    finish_reason: str
    malformed_tool_calls: int = 0


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


class _Unholdable(ValueError):
    """A JSON number that an agent's parser (a double, as JavaScript's `JSON.parse`) would read as another value."""


def _holdable_int(text: str) -> int:
    """An integer as JSON text, refused unless a double holds it exactly (9007199254740993 would reach the agent as
    ...992, and 1 followed by 400 zeros as Infinity)."""
    try:
        value = int(text)
        if int(float(value)) == value:
            return value
    except (ValueError, OverflowError):
        pass
    raise _Unholdable(f"{text[:40]} is not a number a double holds")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object, refused when it repeats a key: agents' parsers keep the last value, ours would be a guess."""
    value = dict(pairs)
    if len(value) != len(pairs):
        raise ValueError("an object repeats a key")
    return value


_STRICT = {
    "parse_constant": _reject_constant,
    "parse_float": _finite_float,
    "parse_int": _holdable_int,
    "object_pairs_hook": _unique_keys,
}


def _strict_json(text: str) -> Any:
    """JSON as an agent's parser reads it, refused where it would read something else: no NaN or Infinity, no number
    that overflows to one or that a double cannot hold, no repeated key."""
    return json.loads(text, **_STRICT)


# Hermes call bodies, read as `_strict_json` reads them, to find where one ends.
_JSON = json.JSONDecoder(**_STRICT)
_SPACE = re.compile(r"\s*")


def _tojson(value: Any) -> str:
    """What transformers' `tojson` chat-template filter writes."""
    return json.dumps(value, ensure_ascii=False)


def _json_types(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {"object"} if isinstance(value, dict) else {"array"}


_MAX_SCHEMA_DEPTH = 32  # `$ref`s followed before a schema counts as unresolvable (a reference cycle)


def _resolve(ref: Any, root: Any) -> Any:
    """The schema a local JSON pointer (`#/$defs/Mode`) names inside `root`, or None (a remote or missing one)."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        key = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _schema_types(schema: Any, root: Any = None, depth: int = 0) -> set[str]:
    """The JSON types a parameter schema allows (`type`, a list of types, `anyOf` / `oneOf`, a local `$ref` into
    `root`, the tool's parameters, and `allOf`, which narrows them); empty: untyped. A reference that cannot be
    resolved, or an `allOf` nothing satisfies, allows a string only: the value is then the text the tokens say."""
    if not isinstance(schema, dict):
        return set()
    if depth > _MAX_SCHEMA_DEPTH:
        return {"string"}
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else {t for t in declared or [] if isinstance(t, str)}
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types |= _schema_types(choice, root, depth + 1)
    if "$ref" in schema:
        target = _resolve(schema["$ref"], root)
        types |= {"string"} if target is None else _schema_types(target, root, depth + 1)
    for part in schema.get("allOf") or []:
        narrowed = _schema_types(part, root, depth + 1)
        if narrowed:
            types = (types & narrowed or {"string"}) if types else narrowed
    return types


def _xml_value(text: str, types: set[str]) -> Any:
    """A `<parameter>` value. The template writes a string as its raw text and any other value as `tojson`, so
    the text means a non-string value only when it is exactly what `tojson` writes for one ("42", "true",
    '{"a": 1}'; never "042", "1e3", " 42") and the parameter's `types` (`_schema_types`), where the schema types
    it, allow that value's type. Everything else is the string the tokens say; a number a double cannot hold where
    no string is allowed is refused (`_Malformed`)."""
    try:
        value = _strict_json(text)
    except _Unholdable:
        if types and "string" not in types:
            raise _Malformed("a number the agent would read as another value") from None
        return text
    except (ValueError, RecursionError):
        return text
    if isinstance(value, str) or _tojson(value) != text:
        return text
    return value if not types or _json_types(value) & types else text


def _tool_properties(tools: list | None) -> dict[str, dict[str, set[str]]] | None:
    """Tool name -> its parameters' allowed JSON types (for typing `<parameter>` values); None when the request
    named no tools."""
    if tools is None:
        return None
    out: dict[str, dict[str, set[str]]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            parameters = fn.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            if not isinstance(properties, dict):
                properties = {}
            out[fn["name"]] = {key: _schema_types(schema, parameters) for key, schema in properties.items()}
    return out


def _block_end(text: str, body: int) -> int:
    """Where the call block whose body starts at `body` closes (its closer's index), or -1. A JSON body ends where
    its value does, so a closer in one of its strings (`grep "</tool_call>"`) is the string's text; any other body
    ends at the first closer."""
    value = _SPACE.match(text, body).end()
    if text.startswith("{", value):
        with contextlib.suppress(ValueError, RecursionError):
            closer = _SPACE.match(text, _JSON.raw_decode(text, value)[1]).end()
            if text.startswith(_CALL_CLOSER, closer):
                return closer
    return text.find(_CALL_CLOSER, body)


def _call_blocks(text: str) -> tuple[list[str], int, str]:
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


def _json_call(body: str) -> tuple[Any, Any]:
    obj = _strict_json(body)
    if not isinstance(obj, dict) or set(obj) not in _CALL_KEYS:
        raise _Malformed("a call is an object with a name and arguments (or parameters)")
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


def _xml_call(body: str, schemas: dict[str, dict[str, set[str]]] | None) -> tuple[Any, Any]:
    function = _XML_FUNCTION.fullmatch(body)
    if function is None:
        raise _Malformed("not a <function=...> block")
    name, parameters = function.groups()
    properties = (schemas or {}).get(name, {})
    arguments: dict[str, Any] = {}
    pos = 0
    # A scan, not a regex search: an opener without its closer must not cost a pass over the rest of the text.
    while opener := _XML_PARAMETER.match(parameters, pos):
        key, start = opener.group(1), opener.end()
        end = parameters.find(_XML_PARAMETER_CLOSER, start)
        if end == -1 or not key or key in arguments:
            raise _Malformed("an unclosed, nameless or repeated parameter")
        text = parameters[start:end].removeprefix("\n").removesuffix("\n")
        arguments[key] = _xml_value(text, properties.get(key, set()))
        pos = end + len(_XML_PARAMETER_CLOSER)
    if parameters[pos:].strip():
        raise _Malformed("text that is not a parameter")
    return name, arguments


def _call(body: str, schemas: dict[str, dict[str, set[str]]] | None) -> dict[str, Any]:
    """One attempted call's text -> an OpenAI tool call. Raises ValueError (or RecursionError, for absurdly
    nested JSON) for any defect. `schemas` is `_tool_properties` of the request's tools."""
    name, arguments = _xml_call(body, schemas) if body.lstrip().startswith("<function=") else _json_call(body)
    # A name the request's tools do not list is still a call, as vLLM's own tool parsers return it: the agent
    # answers it ("tool not found"), and that answer is what the policy learns from.
    if not isinstance(name, str) or not name:
        raise _Malformed(f"a call needs a name, got {name!r}")
    if not isinstance(arguments, dict):
        raise _Malformed("arguments are not an object")
    serialised = json.dumps(arguments, ensure_ascii=False)
    (name + serialised).encode()  # a lone surrogate ("\ud800" in JSON) cannot reach the agent as UTF-8
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": serialised},
    }


class ResponseParser:
    """Parses generations for one tokenizer (its chat template as the model writes replies). Raises
    UnsupportedTemplateError for a chat template whose tool calls do not parse back exactly."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._specials = re.compile("|".join(re.escape(t) for t in tokenizer.all_special_tokens))
        # Set by the probe: whether the template writes reasoning as a think block, and a call as the bare reply.
        self._thinks = False
        self._bare_calls = False
        self._check_round_trip()

    def parse(
        self,
        output_ids: list[int],
        prompt_ids: list[int],
        stop_reason: str = "stop",
        tools: list | None = None,
    ) -> ParsedResponse:
        """`stop_reason` is vLLM's finish reason ("stop" or "length"); `tools` the request's tools (they type
        `<parameter>` values). Never raises for any token sequence."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        thought, acted = self._split_reasoning(text, prompt_ids)
        whole = self._without_outer_specials(acted) if self._bare_calls else ""
        bare = _BARE_CALL.match(whole) is not None
        bodies, attempted, outside = ([whole], 1, "") if bare else _call_blocks(acted)
        schemas = _tool_properties(tools)
        try:
            calls = [_call(body, schemas) for body in bodies]
        except (ValueError, RecursionError):
            calls = []
        if len(calls) != attempted:
            return self.plain_text(output_ids, stop_reason, attempted)
        content = self._specials.sub("", outside).strip()
        message: dict[str, Any] = {"role": "assistant", "content": content}
        # A think block the model never closed runs to the end of the text, end-of-turn token included.
        reasoning = self._specials.sub("", thought).strip()
        if reasoning:
            message["reasoning_content"] = reasoning
        if not calls:
            return ParsedResponse(message, "length" if stop_reason == "length" else "stop")
        return ParsedResponse({**message, "content": content or None, "tool_calls": calls}, "tool_calls")

    def _split_reasoning(self, text: str, prompt_ids: list[int]) -> tuple[str, str]:
        """(reasoning, the rest of `text`). Only a think block that leads the reply is reasoning: one the
        generation prompt opened (Qwen3.5+) or one the reply opens before anything else (Qwen3). It ends at its
        first closer, or with the text when the model never closed it. What follows is the reply, taken as the
        tokens say it: a later think block is text, and a call in it is a call (as vLLM's reasoning parsers split
        at the first closer). A call written in the leading block is a thought, never executed."""
        if not self._thinks:
            return "", text
        prompt_end = self.tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        if not prompt_end.rstrip().endswith(_THINK_OPENER):
            opened = text.lstrip()
            if not opened.startswith(_THINK_OPENER):
                return "", text
            text = opened[len(_THINK_OPENER) :]
        thought, _, rest = text.partition(_THINK_CLOSER)
        return thought, rest

    def _without_outer_specials(self, text: str) -> str:
        """`text` without the special tokens around it (a bare call's end of turn, a `<|python_tag|>` before it),
        keeping any inside it: those are part of what the tokens say."""
        spans = [m.span() for m in self._specials.finditer(text)]
        start, end = 0, len(text)
        for opens, closes in spans:
            if text[start:opens].strip():
                break
            start = closes
        for opens, closes in reversed(spans):
            if closes <= start or text[closes:end].strip():
                break
            end = opens
        return text[start:end]

    def plain_text(self, output_ids: list[int], stop_reason: str, malformed: int) -> ParsedResponse:
        """The whole generation as plain text content (special tokens stripped, no tool calls), with
        `malformed` attempted calls counted: the reply for output that must not reach the agent as calls."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        message = {"role": "assistant", "content": self._specials.sub("", text)}
        return ParsedResponse(message, "length" if stop_reason == "length" else "stop", malformed)

    def _check_round_trip(self) -> None:
        """Render a probe call with the tokenizer's template, as the model would write it after the generation
        prompt, and require that it parses back to exactly the probe's name and arguments."""
        user = {"role": "user", "content": "Call the probe."}
        call = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": _PROBE_ARGUMENTS}}
        tools = [_PROBE_TOOL]
        try:
            prompt = self.tokenizer.apply_chat_template([user], tools=tools, tokenize=False, add_generation_prompt=True)
            full = self.tokenizer.apply_chat_template(
                [user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools, tokenize=False
            )
        except Exception as e:  # a template that cannot write a tool call at all
            raise UnsupportedTemplateError(
                f"the chat template cannot render a tool call to read back exactly: {e}"
            ) from e
        if not full.startswith(prompt):
            raise UnsupportedTemplateError(
                "cannot check that tool calls read back exactly: the chat template renders a reply that does not "
                "start with its own generation prompt"
            )
        written = full[len(prompt) :]
        eos = self.tokenizer.eos_token
        written = written[: written.rfind(eos) + len(eos)] if eos and eos in written else written
        self._thinks = _THINK_CLOSER in written  # the probe's reasoning is empty, its block still written
        self._bare_calls = _CALL_OPENER not in written
        ids = self.tokenizer.encode(written, add_special_tokens=False)
        parsed = self.parse(ids, self.tokenizer.encode(prompt, add_special_tokens=False), "stop", tools)
        got = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parsed.message.get("tool_calls", [])
        ]
        want = [("probe", _PROBE_ARGUMENTS)]
        if json.dumps(got, sort_keys=True) != json.dumps(want, sort_keys=True):
            raise UnsupportedTemplateError(
                f"tool calls written by this chat template do not parse back exactly: it wrote {written!r}, "
                f"which reads as {got!r}"
            )
