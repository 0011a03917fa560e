"""Generated tokens -> the OpenAI assistant message an agent expects.

The model's output is parsed, never trusted. Only a leading think block is reasoning (see
`ResponseParser._split_reasoning`); tool calls are read from what follows it, in the layout the tokenizer's chat
template writes, so that the arguments the agent executes are exactly what the tokens say (no whitespace stripped, no
value retyped, no text elsewhere in the reply taken out of them). The layouts, one module each:

- `<tool_call>` blocks (`calls_tagged`): Hermes JSON (Qwen3, and a fallback for every tagged template), Qwen3.5+ XML
  (and Nemotron 3), GLM-4-MoE `<arg_key>`/`<arg_value>` pairs;
- gpt-oss harmony (`calls_harmony`): channels and `to=functions.NAME` recipients, the analysis channel as reasoning;
- Muse Glimmer ATEM (`calls_atem`): `to=NAME` recipients, `<atem:invoke>` bodies of raw-text values, the `self`
  channel as reasoning;
- Gemma 4 (`calls_gemma`): `<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>`, the thought channel as reasoning;
- LFM2 pythonic (`calls_pythonic`): `<|tool_call_start|>[NAME(k='v')]<|tool_call_end|>`, strings escaped or raw as
  the template writes them (an ambiguous raw one is malformed);
- a bare `{"name": ..., "parameters": {...}}` reply (Llama 3.x).

Every value goes through `call_values` (JSON as an agent reads it, typing by the tool's schema). A reply with any
malformed call attempt goes back to the agent as plain text, all attempted calls counted: never raised, never half
passed on. A call to a tool the request did not list is a call (as vLLM's parsers return it): the agent's "tool not
found" is feedback. At construction the parser renders a probe call through the training template (with the
template's own kwargs, as prompts are rendered) and refuses (`UnsupportedTemplateError`) a template whose calls no
layout reads back exactly.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from swe_grpo.tokens.call_values import Reading, ToolTypes, openai_call, parameter_types
from swe_grpo.tokens.calls_atem import read_atem
from swe_grpo.tokens.calls_gemma import REASONING as GEMMA_REASONING
from swe_grpo.tokens.calls_gemma import read_gemma
from swe_grpo.tokens.calls_harmony import read_harmony
from swe_grpo.tokens.calls_pythonic import read_pythonic
from swe_grpo.tokens.calls_tagged import json_call, read_tagged
from swe_grpo.tokens.layouts import CallLayout
from swe_grpo.tokens.template import TemplateNotPrefixPreservingError, TemplateRefusedError, TrainingTemplate

_BARE_CALL = re.compile(r'\s*\{\s*"name"\s*:')
_THINK = ("<think>", "</think>")
# How much of the prompt's end holds its generation prompt's think opener, where the template writes one.
_PROMPT_TAIL_TOKENS = 8
# The layouts a probe call is tried in, in this order; the first that reads it back exactly is the template's.
_LAYOUTS = ("tagged", "glm", "harmony", "atem", "gemma4", "pythonic", "pythonic_raw", "bare")

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


@dataclass(frozen=True)
class ParsedResponse:
    """`message` is an OpenAI assistant message (`content`, optional `reasoning_content`, optional
    `tool_calls` with ids and JSON-object-string `arguments`); `finish_reason` is "tool_calls", "stop" or
    "length"; `malformed_tool_calls` counts attempted calls when any of them was malformed."""

    message: dict[str, Any]
    finish_reason: str
    malformed_tool_calls: int = 0


class ResponseParser:
    """Parses generations for one tokenizer (its chat template as the model writes replies). `template` is the
    training template prompts are rendered with (built from `tokenizer` when not given); its kwargs (`enable_thinking`
    and the like) reach the probe. `layout` is a family's own (`swe_grpo.tokens.layouts`), tried alone instead of the
    built-in ones. Raises UnsupportedTemplateError for a chat template whose tool calls do not parse back exactly."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        template: TrainingTemplate | None = None,
        layout: CallLayout | None = None,
    ):
        self.tokenizer = tokenizer
        try:
            self.template = template or TrainingTemplate(tokenizer)
        except TemplateNotPrefixPreservingError as e:
            raise UnsupportedTemplateError(f"the chat template cannot be served exactly: {e}") from e
        self._specials = re.compile("|".join(re.escape(t) for t in tokenizer.all_special_tokens))
        # Set by the probe: the opener and closer of the template's reasoning block (None: it writes none), and
        # its call layout.
        self._reasoning: tuple[str, str] | None = None
        self._own_layout = layout
        self.layout = _LAYOUTS[0] if layout is None else type(layout).__qualname__
        self._check_round_trip()

    def parse(
        self,
        output_ids: list[int],
        prompt_ids: Sequence[int],
        stop_reason: str = "stop",
        tools: list | None = None,
    ) -> ParsedResponse:
        """`stop_reason` is vLLM's finish reason ("stop" or "length"); `tools` the request's tools (they type
        values written as raw text). Never raises for any token sequence."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=False)
        thought, acted = self._split_reasoning(text, prompt_ids)
        reading = self._read(acted, parameter_types(tools))
        if len(reading.calls) != reading.attempted:
            return self.plain_text(output_ids, stop_reason, reading.attempted)
        content = self._specials.sub("", reading.content).strip()
        message: dict[str, Any] = {"role": "assistant", "content": content}
        # A think block the model never closed runs to the end of the text, end-of-turn token included.
        reasoning = self._specials.sub("", thought + reading.reasoning).strip()
        if reasoning:
            message["reasoning_content"] = reasoning
        if not reading.calls:
            return ParsedResponse(message, "length" if stop_reason == "length" else "stop")
        return ParsedResponse({**message, "content": content or None, "tool_calls": reading.calls}, "tool_calls")

    def _read(self, text: str, types: ToolTypes | None) -> Reading:
        """The calls in `text` (the reply after any leading reasoning), read in the template's layout."""
        if self._own_layout is not None:
            return self._own_layout.read(text, types)
        if self.layout == "harmony":
            return read_harmony(text, self._specials)
        if self.layout == "atem":
            return read_atem(text, types, self._specials)
        if self.layout == "gemma4":
            return read_gemma(text)
        if self.layout.startswith("pythonic"):
            return read_pythonic(text, escaped=self.layout == "pythonic")
        whole = self._without_outer_specials(text) if self.layout == "bare" else ""
        if _BARE_CALL.match(whole) is None:  # a bare call is the whole reply; tagged blocks are read anywhere
            return read_tagged(text, types, glm=self.layout == "glm")
        try:
            return Reading([openai_call(*json_call(whole))], 1, "")
        except (ValueError, RecursionError):
            return Reading([], 1, "")

    def _split_reasoning(self, text: str, prompt_ids: Sequence[int]) -> tuple[str, str]:
        """(reasoning, the rest of `text`). Only a reasoning block (`<think>`, Gemma 4's thought channel) that leads
        the reply is reasoning: one the generation prompt opened (Qwen3.5+) or one the reply opens before anything
        else (Qwen3). It ends at its first closer, or with the text when the model never closed it. What follows is
        the reply, taken as the tokens say it: a later block is text, and a call in it is a call (as vLLM's
        reasoning parsers split at the first closer). A call written in the leading block is a thought, never
        executed."""
        if self._reasoning is None:
            return "", text
        opener, closer = self._reasoning
        prompt_end = self.tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        if not prompt_end.rstrip().endswith(opener):
            opened = text.lstrip()
            if not opened.startswith(opener):
                return "", text
            text = opened[len(opener) :]
        thought, _, rest = text.partition(closer)
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

    def _written(self, reply: dict[str, Any], tools: list) -> str:
        """What a model writes for the probe `reply` after the generation prompt: as it is, or with reasoning where
        the generation prompt opens a think block that a reply without reasoning does not (Nemotron 3 with thinking
        on: `<think>\n`, against `<think></think>`). `TrainingTemplate` has refused a template where neither fits."""
        try:
            return self.template.reply_text(reply, tools)
        except TemplateRefusedError:
            raise
        except ValueError:
            return self.template.reply_text({**reply, "reasoning_content": "Call the probe."}, tools)

    def _written_thought(self) -> str:
        """What a model writes for a reply with reasoning ("" where it cannot: the generation prompt closed it)."""
        try:
            return self.template.reply_text({"role": "assistant", "content": "x", "reasoning_content": "y"})
        except ValueError:
            return ""

    def _check_round_trip(self) -> None:
        """Render a probe call with the training template, as the model would write it after the generation prompt,
        and require that one layout parses it back to exactly the probe's name and arguments."""
        user = {"role": "user", "content": "Call the probe."}
        call = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": _PROBE_ARGUMENTS}}
        tools = [_PROBE_TOOL]
        template = self.template
        reply = {"role": "assistant", "content": "", "tool_calls": [call]}
        try:
            prompt = template.render([user], tools, generation_prompt=True)
            written = self._written(reply, tools)
        except ValueError as e:  # a template that cannot write a tool call at all (TemplateRefusedError), or so
            raise UnsupportedTemplateError(
                f"the chat template cannot render a tool call to read back exactly: {e}"
            ) from e
        # The probe's reasoning may be empty, its block still written; or the template writes one only for reasoning.
        think = _THINK if _THINK[1] in written or _THINK[1] in self._written_thought() else None
        ids, prompt_ids = template.encode(written), template.encode(prompt)
        want = json.dumps([("probe", _PROBE_ARGUMENTS)], sort_keys=True)
        read: dict[str, list] = {}
        own = self._own_layout
        for layout in _LAYOUTS if own is None else (self.layout,):
            self.layout = layout
            self._reasoning = own.reasoning if own else GEMMA_REASONING if layout == "gemma4" else think
            parsed = self.parse(ids, prompt_ids, "stop", tools)
            got = [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in parsed.message.get("tool_calls", [])
            ]
            if json.dumps(got, sort_keys=True) == want:
                return
            read[layout] = got
        raise UnsupportedTemplateError(
            f"tool calls written by this chat template do not parse back exactly: it wrote {written!r}, which no "
            f"layout reads back ({read!r})"
        )
