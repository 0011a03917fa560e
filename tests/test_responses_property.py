"""Property, per supported template: for any output the model can write, what the agent executes is what the
trained tokens say, and the agent's echo of the reply extends the held tokens on the next turn.

Seeded random outputs interleave a leading think block (reasoning, which may itself contain calls), later think
blocks, tool-call blocks in every layout the parser reads, text, and special tokens anywhere, some cut at a random
token (max_tokens).
Each is generated from segments whose meaning is known, so the expected reply is computed from the segments
(`_expected`), not by a second parser: only a leading think block is reasoning, every complete call after it is
executed exactly as written, and a reply with a cut call is plain text. The reply then goes to the agent as JSON
on the wire, is echoed back the way Pi echoes it (`pi_shapes.PiConversation`), and the next request must extend
the held tokens without a fork.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from conftest import TEMPLATES, tiny_tokenizer
from pi_shapes import TOOLS, PiConversation

from swe_grpo.tokens.chain import TokenChain, TrainingTemplate
from swe_grpo.tokens.responses import ResponseParser

OPENER = "<tool_call>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CASES = 300  # per template, each a conversation of TURNS replies
TURNS = 3
# What arguments are made of: text that also occurs in think blocks and in text (removing reasoning by its
# text once changed a command), markup of every layout, whitespace the template's own framing could swallow,
# and values that look like other JSON types.
ARGUMENT_PARTS = [
    *("pytest", "python -m pytest -x tests", "ok", "42", "true", "null", "007", "é", "😀", "x", "<tool_call>"),
    *("\n", "  ", "\t", '"', "\\", "{", "}", "<think>", "</think>", "<parameter=path>", "</function>", "<function=x>"),
]
# Only in a JSON string: Qwen3.5+ XML writes values raw, where these end the value or the block as they stand.
JSON_ONLY_PARTS = ["</tool_call>", "</parameter>"]
NUMBERS = [0, 7, 30, -3, 2.5, 0.25]  # values JSON.stringify writes as Python does (30.0 would come back as 30)
# Text around the calls: anything but a call opener (it opens an attempted call) or a leading `{"name":`.
TEXT_PARTS = [*(p for p in ARGUMENT_PARTS if p not in ("{", OPENER)), "</tool_call>", "Let me look.", "</parameter>"]


@dataclass
class Segment:
    """A piece of a generated output: text, or a call (`call` is its name and arguments)."""

    text: str
    call: tuple[str, dict[str, Any]] | None = None
    attempt: int = len(OPENER)  # how much of a call's text makes it an attempted call
    start: int = 0  # offset in the whole output


@dataclass
class Output:
    """A generated output: an optional leading think block (the reasoning's offsets in `text`, and where its
    closer ends; `closer_end` is None when the model never closed it), then the segments after it."""

    text: str
    segments: list[Segment]
    reasoning: tuple[int, int] | None
    closer_end: int | None


class Model:
    """Writes outputs as a model under one template could. `specials` are its tokenizer's special tokens but the
    end of turn (vLLM stops at that one): a model can write them anywhere."""

    def __init__(self, rng: random.Random, specials: list[str], prompt_opens_think: bool, thinks: bool, one_call: bool):
        """`prompt_opens_think` when the generation prompt opened the think block, `thinks` when the template
        writes reasoning at all, `one_call` when it allows one call a reply (Llama 3.x)."""
        self.rng, self.specials = rng, specials
        self.prompt_opens_think, self.thinks, self.one_call = prompt_opens_think, thinks, one_call

    def string(self, parts: list[str]) -> str:
        return "".join(self.rng.choice([*parts, *self.specials]) for _ in range(self.rng.randint(0, 6)))

    def arguments(self, tool: dict[str, Any], parts: list[str]) -> dict[str, Any]:
        properties = tool["function"]["parameters"]["properties"]
        return {
            key: self.rng.choice(NUMBERS) if schema["type"] == "number" else self.string(parts)
            for key, schema in properties.items()
            if self.rng.random() < 0.7
        }

    def call(self, bare: bool = False) -> Segment:
        """A call as a model may write it: Hermes JSON (any separators, escaped or raw non-ASCII), Qwen3.5+ XML,
        or, for Llama 3.x, the bare JSON reply."""
        rng = self.rng
        tool = rng.choice(TOOLS)
        xml = not bare and rng.random() < 0.5
        parts = ARGUMENT_PARTS if xml else [*ARGUMENT_PARTS, *JSON_ONLY_PARTS]
        name, arguments = tool["function"]["name"], self.arguments(tool, parts)
        dump = {"ensure_ascii": rng.random() < 0.3, "separators": rng.choice([(", ", ": "), (",", ":")])}
        if bare:
            body = json.dumps({"name": name, "parameters": arguments}, **dump)
            return Segment(body, (name, arguments), len('{"name":'))
        if not xml:
            body = json.dumps({"name": name, "arguments": arguments}, **dump)
            pad = rng.choice(["\n", "", " "])
            return Segment(f"{OPENER}{pad}{body}{pad}</tool_call>", (name, arguments))
        parameters = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in arguments.items()
        )
        return Segment(f"{OPENER}\n<function={name}>\n{parameters}</function>\n</tool_call>", (name, arguments))

    def text(self, said: list[str]) -> Segment:
        """Text, often repeating an argument already written (`said`), as a model thinking a command over does."""
        rng = self.rng
        text = rng.choice(said) if said and rng.random() < 0.5 else ""
        text = text or "".join(rng.choice([*TEXT_PARTS, *self.specials]) for _ in range(rng.randint(1, 4)))
        # Think blocks after the leading one are text: the model's, sent to the agent as content.
        return Segment(f"{THINK_OPEN}\n{text}\n{THINK_CLOSE}\n\n" if rng.random() < 0.3 else text)

    def reasoning(self) -> str:
        """Reasoning: text, calls the model only thought about, even an opener it never closed; no think closer."""
        parts = [p for p in TEXT_PARTS if p != THINK_CLOSE]
        pieces = [self.rng.choice([self.call().text, OPENER, *parts]) for _ in range(self.rng.randint(0, 4))]
        return "".join(pieces).replace(THINK_CLOSE, "")  # an argument's `</think>` would close the block

    def output(self) -> Output:
        rng = self.rng
        head, reasoning, closer_end = "", None, None
        if self.prompt_opens_think or (self.thinks and rng.random() < 0.7):
            head = "" if self.prompt_opens_think else rng.choice(["", "\n"]) + THINK_OPEN + rng.choice(["\n", ""])
            thought = self.reasoning()
            reasoning = (len(head), len(head) + len(thought))
            if rng.random() < 0.1:  # never closed: all of it is reasoning
                return Output(head + thought, [], reasoning, None)
            head += thought + THINK_CLOSE
            closer_end = len(head)
            head += rng.choice(["\n\n", "", "\n"])
        if self.one_call and rng.random() < 0.4:  # the call is the whole reply, special tokens around it aside
            edges = ["", " ", "\n", *self.specials]
            segments = [Segment(rng.choice(edges)), self.call(bare=True), Segment(rng.choice(edges))]
        else:
            segments = []
            for _ in range(rng.randint(0, 5)):
                said = [v for s in segments if s.call for v in s.call[1].values() if isinstance(v, str) and v.strip()]
                said = [v for v in said if OPENER not in v]  # as text, it would open a call
                segments.append(self.text(said) if rng.random() < 0.5 else self.call())
            if self.one_call:
                calls = [s for s in segments if s.call]
                segments = [s for s in segments if not s.call or s is calls[0]]
        if self.thinks and reasoning is None and "".join(s.text for s in segments).lstrip().startswith(THINK_OPEN):
            segments.insert(0, Segment("ok"))  # a reply that starts with a think block has a leading one
        text = head
        for segment in segments:
            segment.start = len(text)
            text += segment.text
        return Output(text, segments, reasoning, closer_end)


def _expected(output: Output, decoded: str, specials: re.Pattern[str]) -> tuple[dict[str, Any], bool]:
    """The reply the tokens say, and whether it counts malformed calls, for `decoded`: the output's (possibly
    cut) tokens decoded. Calls are (name, arguments) pairs, not OpenAI calls. Text for the agent to
    read (content, reasoning) comes without special tokens (`specials` matches them); arguments keep them."""
    # How much of the output `decoded` holds intact: a cut inside a character garbles that character.
    pairs = enumerate(zip(decoded, output.text, strict=False))
    n = next((i for i, (a, b) in pairs if a != b), min(len(decoded), len(output.text)))
    message: dict[str, Any] = {"role": "assistant"}
    if output.reasoning is not None and output.reasoning[0] <= n:
        start, end = output.reasoning
        closed = output.closer_end is not None and output.closer_end <= n
        reasoning = specials.sub("", decoded[start:end] if closed else decoded[start:]).strip()
        if reasoning:
            message["reasoning_content"] = reasoning
        if not closed:
            return {**message, "content": ""}, False
    calls, content, cut_call = [], "", False
    for segment in output.segments:
        if segment.start >= len(decoded):
            break
        end = segment.start + len(segment.text)
        if segment.call is None or segment.start + segment.attempt > n:
            content += decoded[segment.start : end]
        elif end <= n:
            calls.append(segment.call)
        else:
            cut_call = True
    if cut_call:  # the whole output goes back as text, its attempts counted (how many a cut string holds varies)
        return {"role": "assistant", "content": specials.sub("", decoded)}, True
    content = specials.sub("", content).strip()
    if calls:
        return {**message, "content": content or None, "tool_calls": calls}, False
    return {**message, "content": content}, False


def _executed(message: dict[str, Any]) -> dict[str, Any]:
    """The reply as the agent acts on it: each call's arguments parsed as its JSON.parse would."""
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    return {k: v for k, v in message.items() if k != "tool_calls"} | ({"tool_calls": calls} if calls else {})


@pytest.mark.parametrize("template", TEMPLATES)
def test_what_the_agent_executes_is_what_the_tokens_say(template: str) -> None:
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer)
    parser = ResponseParser(tokenizer)
    eos = training.eos_token
    user = {"role": "user", "content": "."}
    opens_think = training.render([user], generation_prompt=True).rstrip().endswith(THINK_OPEN)
    thinks = THINK_CLOSE in training.render([user, {"role": "assistant", "content": "", "reasoning_content": "r"}])
    specials = [t for t in tokenizer.all_special_tokens if t != eos]
    model = Model(random.Random(f"responses-{template}"), specials, opens_think, thinks, template.startswith("llama3"))
    special_tokens = re.compile("|".join(re.escape(t) for t in tokenizer.all_special_tokens))
    for case in range(CASES):
        chain, convo = TokenChain(training), PiConversation()
        held: list[int] = []
        for turn in range(TURNS):
            request = convo.request()
            prepared = chain.prepare(request["messages"], request["tools"])
            where = f"case {case} turn {turn}"
            # The echo of every earlier reply renders back as exactly the tokens held: no fork, no drift.
            assert not prepared.fork and prepared.prompt_ids[: len(held)] == held, where
            output = model.output()
            ids = training.encode(output.text + eos)
            assert training.tokenizer.decode(ids) == output.text + eos  # the tokens say exactly this text
            cut = len(ids) > 1 and model.rng.random() < 0.3
            if cut:
                ids = ids[: model.rng.randint(1, len(ids) - 1)]
            parsed = parser.parse(ids, prepared.prompt_ids, "length" if cut else "stop", request["tools"])
            chain.commit(prepared, ids, [-1.0] * len(ids), 0, parsed.message, parsed.finish_reason)
            wire = orjson.loads(orjson.dumps(parsed.message))  # what the agent receives
            expected, malformed = _expected(output, training.tokenizer.decode(ids), special_tokens)
            where += f": {output.text!r} cut to {training.tokenizer.decode(ids)!r}"
            assert _executed(wire) == expected and (parsed.malformed_tool_calls > 0) == malformed, where
            finish = "tool_calls" if "tool_calls" in expected else "length" if cut else "stop"
            assert parsed.finish_reason == finish, where
            held = prepared.prompt_ids + ids
            convo.add_reply(wire)
            if "tool_calls" not in wire:  # Pi would stop here; a user message goes on
                convo.messages.append({"role": "user", "content": [{"type": "text", "text": "Go on."}]})
        request = convo.request()
        prepared = chain.prepare(request["messages"], request["tools"])
        assert not prepared.fork and prepared.prompt_ids[: len(held)] == held, f"case {case}, after the last turn"
