"""A tool-call layout of one's own: how a model family that swe_grpo does not read yet writes its calls.

A family TRL ships no template for (Qwen3-Coder, Kimi K2, Devstral, DeepSeek-V3.1+) is served with its own chat
template (the tokenizer's, or one given) and, where its calls are in no layout `ResponseParser` reads, a class of
one's own named by dotted path (`mypkg.layouts:KimiK2`, as sandboxes and agents are: `swe_grpo.plugins`). The class
is built with no arguments and reads a reply's calls as `CallLayout` says. At start the parser renders a probe call
with the template and requires the layout to read it back exactly (`ResponseParser`); the refusal names the text the
template wrote and what the layout read. The pieces a layout needs to keep the guarantees are public:
`call_values.openai_call` (the OpenAI call, refusing a name or arguments the agent would read otherwise),
`call_values.strict_json` (JSON as the agent reads it), `call_values.typed_value` (a value written as raw text, typed
by the tool's schema) and `call_values.Reading`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from swe_grpo.plugins import load_object
from swe_grpo.tokens.call_values import Reading, ToolTypes


@runtime_checkable
class CallLayout(Protocol):
    """Reads the tool calls of one family's replies.

    `reasoning` is the opener and closer of the reasoning block the template writes before a reply (`("<think>",
    "</think>")`), or None: the parser splits a leading block off before `read` sees the rest. `read(text, types)`
    returns every call in `text` (the reply after its reasoning, special tokens kept) with how many were attempted
    and the text outside them; `types` are the request's parameter types (None: it named no tools). It must not raise
    for any text: a call it cannot read exactly counts as attempted and is left out of `calls` (the reply then goes
    back to the agent as plain text, counted)."""

    reasoning: tuple[str, str] | None

    def read(self, text: str, types: ToolTypes | None) -> Reading: ...


def load_layout(spec: str) -> CallLayout:
    """The layout class `spec` ("package.module:Class") names, built with no arguments; `ValueError` naming `spec`
    and what is wrong (not importable, not a class, no `read` or `reasoning`)."""
    layout = load_object(spec, "tool-call layout")()
    if not isinstance(layout, CallLayout):
        raise ValueError(f"tool-call layout {spec!r} has no read(text, types) method and reasoning attribute")
    return layout
