"""OpenAI chat messages, as agents send them, in the one form chat templates render, and compared by what they say.

`normalize_message` turns one message into that form (content parts joined, tool-call arguments decoded into
objects, echoed reasoning under `reasoning_content`, `developer` as `system`) or raises `MessageFormatError`,
which a server answers 400. `same_message` decides whether a re-sent message says what a held one said: exact for
every role but the assistant's, whose echo may re-serialise the reply (`same_json` compares JSON values, numbers
by value). `fork_cause` names what an agent changed in the history it re-sent. Pure functions on plain dicts; no
tokenizer involved.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]


class MessageFormatError(ValueError):
    """A request's messages are not valid OpenAI chat messages (the caller answers 400)."""


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageFormatError(f"{where}: unsupported content part {kind!r} (only text is supported)")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageFormatError(f"{where}: content must be a string, a list of text parts, or null")


def _tool_call(call: Any, where: str) -> Message:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise MessageFormatError(f"{where}: a tool call needs a 'function' object")
    fn = call["function"]
    if not isinstance(fn.get("name"), str):
        raise MessageFormatError(f"{where}: a tool call needs a function name")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise MessageFormatError(f"{where}: tool call arguments are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise MessageFormatError(f"{where}: tool call arguments must be a JSON object")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalize_message(message: Any, index: int = 0) -> Message:
    """One OpenAI chat message, as an agent sends it, in the form chat templates render.

    Content parts are joined into one string and `null` becomes `""`; tool-call `arguments` JSON
    strings become objects, so re-serialised JSON compares equal; reasoning echoed back under
    `reasoning` or `reasoning_content` becomes `reasoning_content`; `developer` becomes `system`.
    """
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessageFormatError(f"{where}: must be an object")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise MessageFormatError(f"{where}: unsupported role {role!r}")
    out: Message = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning:
            out["reasoning_content"] = _text(reasoning, where)
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise MessageFormatError(f"{where}: tool_calls must be a list")
            out["tool_calls"] = [_tool_call(c, where) for c in calls]
    elif role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def same_json(a: Any, b: Any) -> bool:
    """Whether two decoded JSON values are the same value: numbers by value (`30.0` is `30`, as a JavaScript
    agent re-serialises it), but a boolean is no number (Python's `True == 1` must not decide it)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same_json, a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _same_assistant(held: Message, incoming: Message) -> bool:
    calls, echoed = held.get("tool_calls") or [], incoming.get("tool_calls") or []
    return (
        held["content"].strip() == incoming["content"].strip()
        and held.get("reasoning_content", "").strip() == incoming.get("reasoning_content", "").strip()
        and len(calls) == len(echoed)
        and all(
            a["function"]["name"] == b["function"]["name"]
            and same_json(a["function"]["arguments"], b["function"]["arguments"])
            for a, b in zip(calls, echoed, strict=True)
        )
    )


def same_message(held: Message, incoming: Message) -> bool:
    """Whether an incoming (normalised) message says what the held one said.

    Exact for every role but the assistant's: an agent echoing a reply back may re-serialise it (other
    tool-call ids, whitespace around text), and the chain already holds the tokens the model produced,
    so an assistant message matches when its text, reasoning, tool names and argument values (`same_json`) do.
    """
    if held is incoming:
        return True
    if held["role"] == incoming["role"] == "assistant":
        return _same_assistant(held, incoming)
    return held == incoming


def _difference(held: Message, incoming: Message) -> str:
    """What differs between two messages at the same place that `same_message` found different, named."""
    role = held["role"]
    if incoming["role"] != role:
        return "message_replaced"
    if role == "system":
        return "system_message_changed"
    if role == "user":
        return "user_message_changed"
    if role == "tool":
        # Cut: shorter, and keeping the output's start or end (agents cut the middle, or the tail, of an old output).
        text, kept = held["content"], incoming["content"]
        cut = len(kept) < len(text) and (text.startswith(kept[:32]) or text.endswith(kept[-32:]))
        return "tool_output_cut" if cut else "tool_output_changed"
    reasoning, echoed = held.get("reasoning_content", "").strip(), incoming.get("reasoning_content", "").strip()
    if reasoning != echoed:
        return "reasoning_dropped" if not echoed else "reasoning_changed"
    if held["content"].strip() != incoming["content"].strip():
        return "assistant_text_changed"
    return "tool_calls_changed"


def fork_cause(held: list[Message], held_tools: Any, incoming: list[Message], tools: Any) -> str:
    """Why a request's normalised `incoming` messages and `tools` do not extend `held` (a conversation through its
    last reply) and `held_tools`, named: `tools_changed`, and the first message that differs
    (`system_prompt_changed` for the leading system message, `system_message_changed`, `user_message_changed`,
    `tool_output_cut` or `tool_output_changed`, `reasoning_dropped` or `reasoning_changed`, `assistant_text_changed`,
    `tool_calls_changed`, `message_replaced` for another role there) with its index, or `history_dropped` when
    every message re-sent matches but fewer than were held; causes joined by "; ". Empty when it extends them."""
    causes = ["tools_changed"] if tools != held_tools else []
    for i, (a, b) in enumerate(zip(held, incoming, strict=False)):
        if not same_message(a, b):
            what = "system_prompt_changed" if i == 0 and a["role"] == b["role"] == "system" else _difference(a, b)
            causes.append(f"{what} at messages[{i}]")
            break
    else:
        if len(incoming) < len(held):
            causes.append(f"history_dropped: {len(incoming)} of {len(held)} held messages re-sent")
    return "; ".join(causes)
