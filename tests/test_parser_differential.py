"""vLLM's own tool parsers as a differential oracle for `ResponseParser`, family by family.

For each served family (`vllm_oracle.VLLM_PARSERS`: the templates, and the parsers a user would name to serve them
with vLLM's OpenAI server), a corpus of outputs a model can write is parsed by ours and by the installed vLLM's
parser. Each case is written by the family's own training template from a reply whose meaning is known (the
template writes the calls, so what the tokens say is that reply), then some are spoiled as a model can spoil them
(cut at max_tokens, a key written twice). Ours must execute exactly what the tokens say, or send the reply back as
plain text with its attempt counted where the tokens say no one call (`REFUSED` cases); never another call.
vLLM's reading is compared with the same expectation and every disagreement is classified (`_difference`): the
observed classes must be exactly `DIFFERENCES` (docs/models.md lists them), so a vLLM upgrade that changes a
reading shows up here. No server, no model: the parser classes on the family's tiny tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from conftest import tiny_tokenizer
from vllm_oracle import VLLM_PARSERS, VllmReading, vllm_read

from swe_grpo.tokens.responses import ResponseParser

TOOLS = [
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
_ODD = "\n  indented\n\ttab \"double\" 'single' \\back\\slash é 😀 \u2028"


@dataclass(frozen=True)
class Case:
    """A reply the template writes (`calls` as (name, arguments), optional content and reasoning) and how the
    written text is then spoiled: `cut` (the output stops at max_tokens two thirds in), `duplicate` (the second
    argument's key is written as the first's)."""

    calls: tuple[tuple[str, dict[str, Any]], ...]
    content: str = ""
    reasoning: str = ""
    cut: bool = False
    duplicate: bool = False
    call_in_reasoning: bool = False  # the reasoning is the text the template writes for `calls`: a thought


def _bash(command: str, **more: Any) -> tuple[str, dict[str, Any]]:
    return ("bash", {"command": command, **more})


CASES: dict[str, Case] = {
    "ordinary": Case((_bash("ls -la"),)),
    "several calls": Case((_bash("ls"), _bash("cat setup.py"))),
    "text before the call": Case((_bash("ls"),), content="Let me look."),
    "newlines tabs quotes unicode backslashes": Case((_bash(_ODD),)),
    "CRLF": Case((_bash("printf 'a'\r\nprintf 'b'\r\n"),)),
    "digits stay a string": Case((_bash("007"),)),
    "a string that reads as JSON": Case((_bash("42"),)),
    "integer": Case((_bash("sleep 1", timeout=30),)),
    "integer past 2^53": Case((_bash("sleep 1", timeout=2**53 + 1),)),
    "integer past a double": Case((_bash("sleep 1", timeout=10**400),)),
    "duplicate key": Case((_bash("ls", path="rm -rf build"),), duplicate=True),
    "cut call": Case((_bash("python -m pytest -x tests/test_parse.py"),), cut=True),
    "call after reasoning": Case((_bash("ls"),), reasoning="Look first."),
    "call inside reasoning": Case((_bash("rm -rf /tmp/x"),), call_in_reasoning=True),
    "special token as text": Case((_bash("SPECIAL"),)),
}
# Cases whose tokens say no one call (ours must send the reply back as plain text, the attempt counted), and what a
# parser that executes a call there does.
REFUSED = {
    "integer past 2^53": "passes an integer the agent reads as another value",
    "integer past a double": "passes an integer the agent reads as another value",
    "duplicate key": "executes a call with a repeated key",
    "cut call": "executes a cut call",
}


def _message(case: Case, calls: tuple[tuple[str, dict[str, Any]], ...]) -> dict[str, Any]:
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
        for i, (name, arguments) in enumerate(calls)
    ]
    message: dict[str, Any] = {"role": "assistant", "content": case.content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if case.reasoning:
        message["reasoning_content"] = case.reasoning
    return message


@cache
def _family(template: str) -> tuple[Any, ResponseParser]:
    tokenizer = tiny_tokenizer(template)
    return tokenizer, ResponseParser(tokenizer)


def _written(parser: ResponseParser, message: dict[str, Any]) -> str | None:
    """The text a model writes for `message` (None: the template cannot write it in one reply, as Llama 3.x two
    calls). A generation prompt that opens a think block needs reasoning (Nemotron 3)."""
    template = parser.template
    for attempt in (message, {**message, "reasoning_content": message.get("reasoning_content") or "Go."}):
        try:
            return template.reply_text(attempt, TOOLS)
        except ValueError:
            continue
    return None


def _special(template: str) -> str:
    """A special token the model can write inside an argument: one that does not end its turn (generation stops
    there) and is no quote of the layout (Gemma 4's `<|"|>` would end the string)."""
    tokenizer, parser = _family(template)
    stops = parser.template.stop_token_ids
    return next(
        t for t in tokenizer.all_special_tokens if tokenizer.convert_tokens_to_ids(t) not in stops and '"' not in t
    )


def _output(template: str, name: str) -> tuple[list[int], str, list | None] | None:
    """The case's output ids, its finish reason and the calls they say (None: no one call; the whole: the family
    cannot write the case)."""
    _, parser = _family(template)
    case = CASES[name]
    special = _special(template)
    calls = tuple((n, {k: v.replace("SPECIAL", f"echo {special}") if isinstance(v, str) else v
                       for k, v in a.items()}) for n, a in case.calls)  # fmt: skip
    if case.call_in_reasoning:
        written = _written(parser, {"role": "assistant", "content": "Not now.", "reasoning_content": "THOUGHT"})
        if written is None or "THOUGHT" not in written:
            return None  # the template writes no reasoning (Qwen2.5, Llama 3.x, LFM2 v2)
        call = _written(parser, _message(Case(()), calls)) or ""
        for end in parser.template.end_tokens:
            call = call.removesuffix(end)
        thought = call.rpartition("</think>")[2].strip()  # the call's own text, not the empty think block before it
        return parser.template.encode(written.replace("THOUGHT", thought)), "stop", []
    written = _written(parser, _message(case, calls))
    if written is None or calls[-1][1]["command"] not in written:
        return None  # no reply of these calls (Llama 3.x, gpt-oss: the template writes one call a turn)
    if case.duplicate:
        first, second = list(calls[0][1])[:2]
        written = written.replace(second, first)
    ids = parser.template.encode(written)
    if case.cut:
        return ids[: len(ids) * 2 // 3], "length", None
    return ids, "stop", None if name in REFUSED else [list(c) for c in calls]


def _ours(template: str, ids: list[int], stop: str) -> list[list[Any]] | None:
    """What the agent executes from our reply: the calls (None: the reply went back as text, attempts counted)."""
    _, parser = _family(template)
    prompt = parser.template.prompt_ids([{"role": "user", "content": "."}], TOOLS)
    parsed = parser.parse(ids, prompt, stop, TOOLS)
    if parsed.malformed_tool_calls:
        assert "tool_calls" not in parsed.message
        return None
    return [
        [c["function"]["name"], json.loads(c["function"]["arguments"])] for c in parsed.message.get("tool_calls", [])
    ]


def _difference(name: str, expected: list | None, vllm: VllmReading | Exception, special: str) -> str | None:
    """How vLLM's reading of case `name` differs from what the tokens say (None: it agrees)."""
    if isinstance(vllm, Exception):
        return f"raises {type(vllm).__name__}"
    got = [list(c) for c in vllm.calls]
    if got == (expected or []):
        return None
    if expected is None and got:
        return REFUSED[name]
    if expected == [] and got:
        return "executes a call written in reasoning"
    dropped = json.loads(json.dumps(expected).replace(special, ""))
    if got == dropped:
        return "drops special tokens inside arguments"
    return "misses the calls" if not got else "reads other calls"


def _observed() -> dict[tuple[str, str], str]:
    observed: dict[tuple[str, str], str] = {}
    for template in VLLM_PARSERS:
        tokenizer, parser = _family(template)
        prompt = parser.template.prompt_ids([{"role": "user", "content": "."}], TOOLS)
        for name in CASES:
            output = _output(template, name)
            if output is None:
                continue
            ids, stop, want = output
            ours = _ours(template, ids, stop)
            assert ours == want, (template, name, ours)
            try:
                vllm: VllmReading | Exception = vllm_read(template, tokenizer, ids, prompt, TOOLS)
            except Exception as e:  # a reading vLLM's server would answer with an error
                vllm = e
            if (difference := _difference(name, want, vllm, _special(template))) is not None:
                observed[(template, name)] = difference
    return observed


_EVERY = frozenset(VLLM_PARSERS)
# case -> (how vLLM's reading differs, the templates it differs for), as observed with the installed vLLM; each class
# is explained in docs/models.md. Every other case and template agrees.
DIFFERENCES: dict[str, tuple[str, frozenset[str]]] = {
    "integer past 2^53": (REFUSED["integer past 2^53"], _EVERY),
    "integer past a double": (REFUSED["integer past a double"], _EVERY),
    "duplicate key": (REFUSED["duplicate key"], _EVERY),
    # Hermes JSON, pythonic and Llama's bare JSON fail to parse a cut call and send it as text, as ours does.
    "cut call": (
        REFUSED["cut call"],
        frozenset({"gemma4", "gemma4_v5", "glm4moe", "gptoss", "nemotron_3_nano", "qwen3_5_think"}),
    ),
    # Only gpt-oss keeps a call-shaped thought as reasoning (Qwen2.5, Llama 3.x, LFM2 v2 and Gemma 4 v1 write none).
    "call inside reasoning": (
        "executes a call written in reasoning",
        frozenset({"gemma4_v5", "glm4moe", "lfm2_2_5_vl", "nemotron_3_nano", "qwen3", "qwen3_5_think"}),
    ),
    # vLLM's ATEM parser reads every value with `json.loads`, whatever the schema: the command "42" becomes 42.
    "a string that reads as JSON": ("reads other calls", frozenset({"muse_glimmer"})),
    # The detokenizer drops special tokens before the parser reads the text, unless the parsers composed for the
    # family ask for them (Hermes and LFM2 alone do, and harmony reads token ids).
    "special token as text": (
        "drops special tokens inside arguments",
        frozenset({"gemma4", "gemma4_v5", "glm4moe", "llama3_1", "nemotron_3_nano", "qwen3", "qwen3_5_think"}),
    ),
}


def test_ours_executes_what_the_tokens_say_and_every_difference_from_vllm_is_known() -> None:
    expected = {(t, case): how for case, (how, templates) in DIFFERENCES.items() for t in templates}
    assert _observed() == expected
