"""Tool calls in gpt-oss's harmony layout.

A harmony reply is a run of messages, each a header, `<|message|>`, a body and the token that ends it: `<|end|>`
(a message; the turn goes on with `<|start|>assistant` and the next header), `<|call|>` (a tool call; the turn
ends) or `<|return|>` (the final answer; the turn ends). The generation prompt has already written the first
message's `<|start|>assistant`. A header names its channel (`analysis`: reasoning; `commentary`: a preamble the user
sees, or a call; `final`: the answer) and, for a call, its recipient `functions.NAME`, before the channel (as the
chat template writes it: ` to=functions.NAME<|channel|>commentary json`) or after it (as the models write it:
`<|channel|>commentary to=functions.NAME <|constrain|>json`). A call's body is its JSON arguments, read as an agent
reads them (`call_values.strict_json`) and ended by `<|call|>` right after the value.

The template renders one call a turn (the first), and `<|call|>` ends generation, so a call is the turn's last
message: anything after it is malformed, as is a header that is none of these, a recipient that is no function, or
a body that is no JSON object.
"""

from __future__ import annotations

import re
from typing import Any

from swe_grpo.tokens.call_values import JSON_DECODER, Reading, openai_call

_START = "<|start|>assistant"
_MESSAGE = "<|message|>"
_CALL = "<|call|>"
_END = re.compile(r"<\|end\|>|<\|return\|>|<\|call\|>")
_FUNCTIONS = "functions."
_HEADER = re.compile(
    r"(?: to=(?P<before>[^\s<]+))?<\|channel\|>(?P<channel>analysis|commentary|final)"
    r"(?: to=(?P<after>[^\s<]+))?(?: (?:<\|constrain\|>)?json)?"
)


def _message_end(text: str, body: int) -> tuple[int, int]:
    """(where the message whose body starts at `body` ends, where the next one starts): its first end token, or the
    end of the text for a message the model never ended. One search for all three: a reply of many messages is read
    in one pass."""
    end = _END.search(text, body)
    return (end.start(), end.end()) if end else (len(text), len(text))


def read_harmony(text: str, specials: re.Pattern[str]) -> Reading:
    """The call, content and reasoning of a harmony reply `text` (what follows the generation prompt); `specials`
    matches the tokenizer's special tokens (one that ends generation may follow the last message)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    attempted = 0
    pos = 0
    while (header_end := text.find(_MESSAGE, pos)) != -1:
        header = _HEADER.fullmatch(text, pos, header_end)
        if header is None:
            break
        body = header_end + len(_MESSAGE)
        if header["before"] is None and header["after"] is None:
            end, pos = _message_end(text, body)
            (reasoning if header["channel"] == "analysis" else content).append(text[body:end])
        else:
            attempted += 1
            recipient = header["before"] or header["after"]
            try:
                arguments, end = JSON_DECODER.raw_decode(text, body)
                if (header["before"] and header["after"]) or not recipient.startswith(_FUNCTIONS):
                    raise ValueError("a recipient that is no function, or two")
                if not text.startswith(_CALL, end):
                    raise ValueError("a call's arguments not ended by <|call|>")
                calls.append(openai_call(recipient[len(_FUNCTIONS) :], arguments))
            except (ValueError, RecursionError):
                return Reading(calls, attempted, "\n".join(content))
            pos = end + len(_CALL)
            break
        if not text.startswith(_START, pos):
            break
        pos += len(_START)
    # What no header opened: the whole reply when it has no harmony structure at all, else text after the last
    # message. It is content, unless it names a recipient: then it was a call attempt that went wrong, or one after
    # the turn's call.
    rest = text[pos:]
    if " to=" in rest:
        return Reading(calls, attempted + 1, "\n".join(content))
    if specials.sub("", rest).strip():
        content.append(rest)
    return Reading(calls, attempted, "\n".join(content), "\n".join(reasoning))
