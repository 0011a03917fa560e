"""Tool calls in Muse Glimmer's ATEM layout.

A reply is a run of messages, each a header ` to=RECIPIENT<|message|>`, a body and the token that ends it: `<|eom|>`
(the turn goes on with `<|start|>assistant` and the next header) or `<|eot|>` (the turn ends). The generation prompt
has already written the first message's `<|start|>assistant`. The recipient says what a body is: `self` reasoning,
`user` content, any other name a call to that tool, whose body is exactly what the template writes:

    <atem:function_calls>\n<atem:invoke name="NAME">\n<atem:parameter name="K">V</atem:parameter>\n...
    </atem:invoke>\n</atem:function_calls>

with NAME the recipient. A value is all between its tags (the template strips nothing) and ends at the first
`</atem:parameter>` (as the layout's own regular expressions and vLLM's parser read it), which the template's newline
must follow; strings are written raw and other values as `tojson`, so a value is typed by the tool's schema
(`call_values.typed_value`). A body that is anything else (a cut call, a repeated or nameless key, text between
parameters, a value holding the closer, an invoke naming another tool than the recipient) is malformed, as is text
after the message that ended the turn. Markup in a `self` or `user` message is that
message's text: the recipient, not the markup, makes a call.
"""

from __future__ import annotations

import re
from typing import Any

from swe_grpo.tokens.call_values import Malformed, Reading, ToolTypes, openai_call, typed_value

_START = "<|start|>assistant"
_HEADER = re.compile(r" to=([^\s<]+)<\|message\|>")
_END = re.compile(r"<\|eom\|>|<\|eot\|>")
_TURN_END = "<|eot|>"
_INVOKE = re.compile(r'<atem:function_calls>\n<atem:invoke name="([^"\n<>]+)">\n')
_PARAMETER = re.compile(r'<atem:parameter name="([^"\n<>]+)">')
_PARAMETER_CLOSER = "</atem:parameter>"
_CLOSERS = "</atem:invoke>\n</atem:function_calls>"
_REASONING, _CONTENT = "self", "user"


def _call(recipient: str, body: str, types: ToolTypes | None) -> dict[str, Any]:
    """The OpenAI call a tool message's `body` says, or `Malformed`."""
    invoke = _INVOKE.match(body)
    if invoke is None or invoke.group(1) != recipient:
        raise Malformed("a tool message that is no <atem:invoke> of its recipient")
    properties = (types or {}).get(recipient, {})
    arguments: dict[str, Any] = {}
    pos = invoke.end()
    # A scan, not a regex search: a parameter without its closer must not cost a pass over the rest of the text.
    while parameter := _PARAMETER.match(body, pos):
        key, start = parameter.group(1), parameter.end()
        # The first closer ends the value, as the layout's own regular expressions read it (vLLM's too): a value
        # that holds the closer leaves text after it that is no parameter.
        end = body.find(_PARAMETER_CLOSER, start)
        pos = end + len(_PARAMETER_CLOSER) + 1
        if end == -1 or key in arguments or body[pos - 1 : pos] != "\n":
            raise Malformed("an unclosed or repeated parameter, or a value holding its closer")
        arguments[key] = typed_value(body[start:end], properties.get(key, set()))
    if body[pos:] != _CLOSERS:
        raise Malformed("text that is not a parameter, or a call not closed")
    return openai_call(recipient, arguments)


def read_atem(text: str, types: ToolTypes | None, specials: re.Pattern[str]) -> Reading:
    """The calls, content and reasoning of an ATEM reply `text` (what follows the generation prompt); `specials`
    matches the tokenizer's special tokens (one that ends generation may follow the last message)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    attempted = 0
    pos = 0
    while header := _HEADER.match(text, pos):
        recipient, body = header.group(1), header.end()
        end = _END.search(text, body)
        stop, pos = (end.start(), end.end()) if end else (len(text), len(text))
        if recipient == _REASONING:
            reasoning.append(text[body:stop])
        elif recipient == _CONTENT:
            content.append(text[body:stop])
        else:
            attempted += 1
            try:
                calls.append(_call(recipient, text[body:stop], types))
            except ValueError:  # Malformed, and a name or value the agent would read otherwise
                return Reading(calls, attempted, "\n".join(content))
        if (end and end.group() == _TURN_END) or not text.startswith(_START, pos):
            break
        pos += len(_START)
    # What no header opened: the whole reply when it has no ATEM structure at all, else text after the turn's end.
    # It is content, unless it addresses a recipient or writes a call: then a call attempt went wrong.
    rest = text[pos:]
    if " to=" in rest or "<atem:" in rest:
        return Reading(calls, attempted + 1, "\n".join(content))
    if specials.sub("", rest).strip():
        content.append(rest)
    return Reading(calls, attempted, "\n".join(content), "\n".join(reasoning))
