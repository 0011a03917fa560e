"""Tool-call values as an agent reads them: the JSON, the types and the OpenAI call record every call layout shares.

A layout module (`calls_tagged`, `calls_harmony`, ...) finds a call's name and argument text in a generation; this
module turns them into what the agent executes, refusing (`Malformed`) whatever the agent would read differently from
what the tokens say: JSON an agent's parser reads otherwise (`strict_json`: NaN, numbers a double cannot hold, repeated
keys), a name that is no string, arguments that are no object, text that is no UTF-8. `typed_value` decides what an
argument written as raw text means (Qwen3.5 XML, GLM), by the tool's schema (`parameter_types`).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

ToolTypes = dict[str, dict[str, set[str]]]  # tool name -> parameter -> the JSON types its schema allows


class Malformed(ValueError):
    """An attempted tool call that must not reach the agent."""


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


def strict_json(text: str) -> Any:
    """JSON as an agent's parser reads it, refused where it would read something else: no NaN or Infinity, no number
    that overflows to one or that a double cannot hold, no repeated key."""
    return json.loads(text, **_STRICT)


# Hermes call bodies, read as `strict_json` reads them, to find where one ends.
JSON_DECODER = json.JSONDecoder(**_STRICT)
SPACE = re.compile(r"\s*")


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


def typed_value(text: str, types: set[str]) -> Any:
    """An argument written as raw text (a Qwen3.5 `<parameter>`, a GLM `<arg_value>`). The template writes a string
    as its raw text and any other value as `tojson`, so the text means a non-string value only when it is exactly
    what `tojson` writes for one ("42", "true", '{"a": 1}'; never "042", "1e3", " 42") and the parameter's `types`
    (`_schema_types`), where the schema types it, allow that value's type. Everything else is the string the
    tokens say; a number a double cannot hold where no string is allowed is refused (`Malformed`)."""
    try:
        value = strict_json(text)
    except _Unholdable:
        if types and "string" not in types:
            raise Malformed("a number the agent would read as another value") from None
        return text
    except (ValueError, RecursionError):
        return text
    if isinstance(value, str) or _tojson(value) != text:
        return text
    return value if not types or _json_types(value) & types else text


def parameter_types(tools: list | None) -> ToolTypes | None:
    """Tool name -> its parameters' allowed JSON types (for `typed_value`); None when the request named no tools."""
    if tools is None:
        return None
    out: ToolTypes = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            parameters = fn.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            if not isinstance(properties, dict):
                properties = {}
            out[fn["name"]] = {key: _schema_types(schema, parameters) for key, schema in properties.items()}
    return out


def openai_call(name: Any, arguments: Any) -> dict[str, Any]:
    """A call's name and arguments as read -> an OpenAI tool call (a fresh id, `arguments` as a JSON object string).
    Raises `Malformed` (a ValueError) for a name that is no non-empty string, arguments that are no object, or text
    that cannot reach the agent as UTF-8."""
    # A name the request's tools do not list is still a call, as vLLM's own tool parsers return it: the agent
    # answers it ("tool not found"), and that answer is what the policy learns from.
    if not isinstance(name, str) or not name:
        raise Malformed(f"a call needs a name, got {name!r}")
    if not isinstance(arguments, dict):
        raise Malformed("arguments are not an object")
    serialised = json.dumps(arguments, ensure_ascii=False)
    (name + serialised).encode()  # a lone surrogate ("\ud800" in JSON) cannot reach the agent as UTF-8
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": serialised},
    }


@dataclass(frozen=True)
class Reading:
    """What a layout read in a reply: the OpenAI `calls`, how many calls were `attempted` (fewer calls than attempts:
    one was malformed, and the reply goes back as plain text), the `content` (text outside the calls) and the
    `reasoning` a layout writes in its own channel (harmony's analysis)."""

    calls: list[dict[str, Any]]
    attempted: int
    content: str
    reasoning: str = ""
