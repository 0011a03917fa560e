"""Generated tokens -> the OpenAI assistant message an agent expects.

The model's output is parsed, never trusted: TRL's response schema for the tokenizer's template
(`add_response_schema` / `parse_response`) turns it into content, reasoning and tool calls; when that
finds no calls, a hermes-style `<tool_call>{json}</tool_call>` fallback is tried. A call that cannot be
parsed is returned to the agent as plain text and counted, never raised.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase
from trl.chat_template_utils import add_response_schema, parse_response

log = logging.getLogger(__name__)

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_CALL_OPENER = "<tool_call>"
# How much of the prompt's end the schema parser needs to see (the assistant header and any opener the
# template writes, such as `<think>\n`).
_PREFIX_TOKENS = 32


@dataclass(frozen=True)
class ParsedResponse:
    """`message` is an OpenAI assistant message (`content`, optional `reasoning_content`, optional
    `tool_calls` with ids and JSON-string `arguments`); `finish_reason` is "tool_calls", "stop" or
    "length"; `malformed_tool_calls` counts attempted calls that could not be parsed."""

    message: dict[str, Any]
    finish_reason: str
    malformed_tool_calls: int = 0


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _openai_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes_calls(text: str) -> tuple[list[dict[str, Any]], int]:
    """Parse `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; (calls, malformed)."""
    calls, malformed = [], 0
    for body in _HERMES_CALL.findall(text):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            malformed += 1
            continue
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            malformed += 1
            continue
        calls.append(_openai_tool_call(obj["name"], args))
    return calls, malformed


class ResponseParser:
    """Parses generations for one tokenizer. Works on its own copy of the tokenizer, with TRL's response
    schema attached when the tokenizer has none and TRL knows its (original, unpatched) chat template;
    without a schema only the hermes fallback is used."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = copy.deepcopy(tokenizer)
        self.has_schema = any(getattr(self.tokenizer, a, None) for a in ("response_template", "response_schema"))
        if not self.has_schema:
            try:
                add_response_schema(self.tokenizer)
                self.has_schema = True
            except ValueError:
                log.warning("no response schema for this chat template; parsing hermes-style tool calls only")
        self._specials = re.compile("|".join(re.escape(t) for t in tokenizer.all_special_tokens))

    def parse(
        self,
        output_ids: list[int],
        prompt_ids: list[int],
        stop_reason: str = "stop",
        tools: list | None = None,
    ) -> ParsedResponse:
        """`stop_reason` is vLLM's finish reason ("stop" or "length")."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        attempted = text.count(_CALL_OPENER)
        message = self._schema_parse(output_ids, prompt_ids, tools) if self.has_schema and output_ids else None
        if message is None:
            message = self.plain_text(output_ids, stop_reason, 0).message
        calls = message.pop("tool_calls", [])
        if not calls and attempted:
            calls, _ = _hermes_calls(text)
            if calls:
                message.pop("reasoning_content", None)
                message["content"] = self._specials.sub("", _HERMES_CALL.sub("", text)).strip()
        malformed = max(attempted - len(calls), 0)
        if calls:
            message["tool_calls"] = calls
            message["content"] = message["content"] or None
        finish = "tool_calls" if calls else ("length" if stop_reason == "length" else "stop")
        return ParsedResponse(message, finish, malformed)

    def plain_text(self, output_ids: list[int], stop_reason: str, malformed: int) -> ParsedResponse:
        """The whole generation as plain text content (special tokens stripped, no tool calls), with
        `malformed` attempted calls counted: the reply for output that must not reach the agent as calls."""
        message = {"role": "assistant", "content": self.tokenizer.decode(output_ids, skip_special_tokens=True)}
        return ParsedResponse(message, "length" if stop_reason == "length" else "stop", malformed)

    def _schema_parse(self, output_ids: list[int], prompt_ids: list[int], tools: list | None) -> dict | None:
        """TRL's schema parse as an OpenAI message, or None when it fails (then the caller decodes text)."""
        try:
            parsed = parse_response(self.tokenizer, output_ids, prefix=prompt_ids[-_PREFIX_TOKENS:], tools=tools)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.get("content") or ""}
            reasoning = parsed.get("reasoning_content") or parsed.get("thinking")
            if reasoning:
                message["reasoning_content"] = reasoning
            calls = [call.get("function", call) for call in parsed.get("tool_calls") or []]
            message["tool_calls"] = [_openai_tool_call(fn["name"], fn.get("arguments")) for fn in calls]
            return message
        except Exception:  # the model's output is untrusted: any parser failure means "plain text"
            log.debug("response schema parse failed", exc_info=True)
            return None
