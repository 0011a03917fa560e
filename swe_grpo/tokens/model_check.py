"""`swe-grpo check-model`: whether a model's tokenizer can be served exactly, told before a GPU is rented.

`check_model` loads the tokenizer (a directory or a hub name the local cache holds), optionally with a chat template
and a tool-call layout of one's own (`layouts`), builds what a rollout builds (`TrainingTemplate`, `ResponseParser`,
with the template's kwargs) and then plays two turns through a `TokenChain`: the model writes a tool call as the
template renders it, the parser must read back exactly that call, the agent's echo of the reply with the tool's result
must extend the held tokens (no fork) and equal a fresh render of the whole history (bridge-exact), and a final answer
must read back as its text. `ModelCheck.lines()` says which template and layout, which tokens end a turn and why, and
the round trip's result, or the refusal with the template's own defect named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swe_grpo.tokens.chain import TokenChain, TrainingTemplate
from swe_grpo.tokens.layouts import CallLayout
from swe_grpo.tokens.responses import ResponseParser

_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    }
]
# What the model writes: text no layout may strip or retype (whitespace at the edges, quotes, a backslash, non-ASCII,
# digits that stay a string) and an integer.
_ARGUMENTS = {"command": "\n  printf '%s\\n' \"é 😀\"\t007\n", "timeout": 30}
_CALL = {"id": "call_check", "type": "function", "function": {"name": "bash", "arguments": _ARGUMENTS}}
_ANSWER = "Fixed: the parser no longer drops the last line."


class RoundTripError(ValueError):
    """A step of the round trip that is not exact."""


@dataclass
class ModelCheck:
    """What `check_model` found: `template` (which one, and whether TRL's training variant replaced it), `layout`,
    `end_tokens` (token, why), the round trip's `steps`; `refused` is the reason the model cannot be served exactly
    (None: it can)."""

    source: str
    template: str = ""
    layout: str = ""
    end_tokens: list[tuple[str, str]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)
    refused: str | None = None

    def lines(self) -> list[str]:
        out = [f"model: {self.source}"]
        if self.template:
            out.append(f"template: {self.template}")
        if self.layout:
            out.append(f"layout: {self.layout}")
        out += [f"end token: {token} ({why})" for token, why in self.end_tokens]
        out += [f"round trip: {step}" for step in self.steps]
        out.append(f"refused: {self.refused}" if self.refused else "served exactly")
        return out


def _trl_template_name(chat_template: str) -> str | None:
    """The name of the TRL-shipped template `chat_template` is, if it is one."""
    import trl

    for path in sorted((Path(trl.__file__).parent / "chat_templates").glob("*.jinja")):
        if path.read_text(encoding="utf-8") == chat_template:
            return path.stem
    return None


def _describe_template(original: str, training: TrainingTemplate) -> str:
    name = _trl_template_name(original)
    what = f"TRL's {name}" if name else "the tokenizer's own (no TRL template is this one)"
    if training.tokenizer.chat_template != original:
        trained = _trl_template_name(training.tokenizer.chat_template)
        return f"{what}, served with TRL's training variant {trained or ''}".rstrip() + " (prefix-preserving)"
    return f"{what}, prefix-preserving as it is"


def _end_token_reasons(template: TrainingTemplate) -> list[tuple[str, str]]:
    """Each token that closes a turn, and which turn (a plain reply, a tool call) it closes and how."""
    user = {"role": "user", "content": "."}
    reasons: dict[str, list[str]] = {}
    for kind, reply in (("a plain reply", {"role": "assistant", "content": "x"}),
                        ("a tool call", {"role": "assistant", "content": "", "tool_calls": [_CALL]})):  # fmt: skip
        try:
            reply, written = _written(template, reply)
            turn = template.render([user, reply], _TOOLS).rstrip()
        except ValueError:
            continue
        token = next((t for t in template.end_tokens if written.endswith(t)), None)
        if token is not None:
            how = "the turn's last token" if turn.endswith(token) else "the next turn's first, which the model writes"
            reasons.setdefault(token, []).append(f"closes {kind}: {how}")
    return [(token, "; ".join(why)) for token, why in reasons.items()]


def _written(template: TrainingTemplate, reply: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`reply` as the model writes it, and its text: with reasoning where the generation prompt opens a think block
    that a reply without reasoning does not (Nemotron 3)."""
    try:
        return reply, template.reply_text(reply, _TOOLS)
    except ValueError:
        reply = {**reply, "reasoning_content": "Checking."}
        return reply, template.reply_text(reply, _TOOLS)


def _round_trip(template: TrainingTemplate, parser: ResponseParser) -> list[str]:
    """Two turns through a chain; raises RoundTripError naming the step that is not exact."""
    chain = TokenChain(template)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the parser."}]
    turn = chain.prepare(messages, _TOOLS)
    ids = template.encode(_written(template, {"role": "assistant", "content": "", "tool_calls": [_CALL]})[1])
    parsed = parser.parse(ids, turn.prompt_ids, "stop", _TOOLS)
    read = [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.message.get("tool_calls", [])
    ]
    if read != [("bash", _ARGUMENTS)]:
        raise RoundTripError(f"the call the template wrote reads back as {read!r}, not {[('bash', _ARGUMENTS)]!r}")
    steps = [f"a call written by the template reads back exactly ({len(ids)} tokens)"]
    chain.commit(turn, ids, [0.0] * len(ids), 0, parsed.message, parsed.finish_reason)
    echoed = json.loads(json.dumps(parsed.message))  # as the agent sends it back
    messages += [echoed, {"role": "tool", "tool_call_id": echoed["tool_calls"][0]["id"], "content": "ok\n"}]
    turn = chain.prepare(messages, _TOOLS)
    fresh = template.prompt_ids(turn.messages, _TOOLS)
    if turn.fork or turn.prompt_ids != fresh:
        raise RoundTripError(
            "the agent's echo of the reply and the tool result do not extend the held tokens exactly "
            f"({'a fork' if turn.fork else 'the bridge differs from a fresh render'})"
        )
    steps.append(f"the next prompt extends the held tokens and equals a fresh render (+{len(turn.new_ids)} tokens)")
    ids = template.encode(_written(template, {"role": "assistant", "content": _ANSWER})[1])
    answer = parser.parse(ids, turn.prompt_ids, "stop", _TOOLS).message
    if answer.get("tool_calls") or answer["content"] != _ANSWER:
        raise RoundTripError(f"a final answer reads back as {answer!r}")
    steps.append("a final answer reads back as its text")
    return steps


def check_model(
    source: str,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
    layout: CallLayout | None = None,
) -> ModelCheck:
    """Check the tokenizer at `source` (see the module docstring); `chat_template` replaces its template. Raises
    OSError (and what `AutoTokenizer` raises) when no tokenizer can be loaded from `source`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    report = ModelCheck(source)
    try:
        template = TrainingTemplate(tokenizer, **(template_kwargs or {}))
        report.template = _describe_template(tokenizer.chat_template, template)
        report.end_tokens = _end_token_reasons(template)
        parser = ResponseParser(tokenizer, template, layout)
        report.layout = parser.layout if layout is None else f"{parser.layout} (a layout of your own)"
        report.steps = _round_trip(template, parser)
    except ValueError as e:  # the template's defect (TemplateNotPrefixPreservingError, UnsupportedTemplateError, a
        # render it refuses) or a round-trip step that is not exact
        report.refused = f"{type(e).__name__}: {e}"
    return report
