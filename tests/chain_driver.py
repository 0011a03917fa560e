"""Drives a TokenChain the way the InterceptionServer does, with Pi-shaped requests and SCRIPTED model outputs
(the template's own rendering of each reply), and checks a whole conversation for exactness: shared by the chain
tests and the template matrix."""

from __future__ import annotations

import copy
import json
from typing import Any

from conftest import tiny_tokenizer
from pi_shapes import PiConversation, scripted_output, tool_call

from swe_grpo.tokens.chain import TokenChain, TrainingTemplate, normalize_message
from swe_grpo.tokens.responses import ResponseParser

REPLIES = [
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Look first.",
        "tool_calls": [tool_call("bash", command="ls -la")],
    },
    {
        "role": "assistant",
        "content": "Reading both files.",
        "tool_calls": [tool_call("read", path="src/parse.py"), tool_call("read", path="tests/test_parse.py", offset=1)],
    },
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [tool_call("edit", path="src/parse.py", oldText="if s:", newText="if s is not None:")],
    },
    {"role": "assistant", "content": "Fixed: empty input no longer raises."},
]


def _writable(training: TrainingTemplate, reply: dict[str, Any]) -> bool:
    """Whether a model can write `reply` in one generation after the generation prompt, and, for a call, the template
    goes on to its results from the token that closed it."""
    message = normalize_message(reply)
    try:
        ids = training.encode(training.reply_text(message))
    except ValueError:
        return False
    # What follows a call is its results; a final answer is the conversation's last turn.
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "."} for c in message.get("tool_calls") or []]
    return not results or training.interstitial_ids(message, results, None, ids[-1]) is not None


def replies_for(template: str, training: TrainingTemplate | None = None) -> list[dict[str, Any]]:
    """REPLIES as a model under `template` can write them: one tool call a turn where the template allows no
    more (Llama 3.x, gpt-oss); no reasoning where the generation prompt has already closed the think block (Qwen3.5
    "nothink"), and some where it opens one that a reply without reasoning does not (Nemotron 3: `<think>\n`, against
    `<think></think>`); no text beside calls where the template writes that text after the calls' results (Gemma 4).
    A reply the model cannot write in one generation is not one to script."""
    replies = copy.deepcopy(REPLIES)
    if template.startswith(("llama3", "gptoss")):
        replies[1]["tool_calls"] = replies[1]["tool_calls"][:1]
    if training is None:
        return replies
    return [as_written(training, reply) for reply in replies]


def as_written(training: TrainingTemplate, reply: dict[str, Any]) -> dict[str, Any]:
    """`reply` as a model under `training` can write it in one generation: as it is, without its reasoning, with
    some, or without text beside its calls (see `replies_for`); `reply` itself when none of these is writable."""
    without = {key: value for key, value in reply.items() if key != "reasoning_content"}
    thinking = {**reply, "reasoning_content": reply.get("reasoning_content", "Thinking.")}
    silent = {**reply, "content": ""} if reply.get("tool_calls") else reply
    return next((c for c in (reply, without, thinking, silent) if _writable(training, c)), reply)


class Driver:
    """Plays an agent (Pi-shaped requests) against a chain, with scripted model outputs."""

    def __init__(self, template_name: str, **template_kwargs: Any):
        tokenizer = tiny_tokenizer(template_name)
        self.template = TrainingTemplate(tokenizer, **template_kwargs)
        self.parser = ResponseParser(tokenizer, self.template)
        self.chain = TokenChain(self.template)
        self.convo = PiConversation()
        self.sent: list[list[int]] = []  # prompt ids of each turn
        self.outputs: list[tuple[list[int], list[float]]] = []

    def turn(self, reply: dict, version: int = 0, truncate_to: int | None = None):
        request = self.convo.request()
        prepared = self.chain.prepare(request["messages"], request["tools"])
        output = scripted_output(self.template, normalize_message(reply))
        if truncate_to is not None:
            output = output[:truncate_to]
        log_probs = [-0.001 * (i + 1) - len(self.sent) for i in range(len(output))]
        parsed = self.parser.parse(output, prepared.prompt_ids, "length" if truncate_to else "stop", request["tools"])
        record = self.chain.commit(prepared, output, log_probs, version, parsed.message, parsed.finish_reason)
        self.sent.append(prepared.prompt_ids)
        self.outputs.append((output, log_probs))
        self.convo.add_reply(parsed.message)
        return prepared, record, parsed

    def full_render_text(self) -> str:
        request = self.convo.request()
        messages = [normalize_message(m) for m in request["messages"]]
        return self.template.render(messages, request["tools"], generation_prompt=True)


def assert_conversation_exact(template: str, **template_kwargs: Any) -> None:
    """A Pi conversation of tool calls (reasoning, parallel calls, an edit) and a final answer under `template`:
    every turn clean, every prompt exactly the template's render of the whole history and an extension of the
    earlier prompts and outputs, the calls the agent gets exactly the replies' calls, and one training row whose
    mask and log-probs cover exactly the generated tokens. `template_kwargs` reach every render and the parser."""
    d = Driver(template, **template_kwargs)
    replies = replies_for(template, d.template)
    for k, reply in enumerate(replies):
        expected_text = d.full_render_text()
        prepared, record, parsed = d.turn(reply, version=10 - k)
        assert record.kind == "clean" and record.drift_tokens == 0 and not prepared.fork
        # The prompt decodes to exactly what the template renders for the whole history...
        assert d.template.tokenizer.decode(prepared.prompt_ids) == expected_text
        if k:
            # ...and its ids start with every earlier prompt and output token, untouched.
            previous = d.sent[k - 1] + d.outputs[k - 1][0]
            assert prepared.prompt_ids[: len(previous)] == previous
            assert record.new_prompt_tokens == len(prepared.prompt_ids) - len(previous)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.message.get("tool_calls") or []]
        want = [(c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls") or []]
        assert [(name, json.loads(arguments)) for name, arguments in calls] == want

    assert len(d.chain.rows) == 1
    row = d.chain.rows[0]
    assert row.input_ids.tolist() == d.sent[-1] + d.outputs[-1][0]
    assert len(row.completion_mask) == len(row.old_log_probs) == len(row.input_ids)
    trained = [i for i, m in enumerate(row.completion_mask) if m]
    expected_positions, expected_log_probs = [], []
    for prompt, (output, log_probs) in zip(d.sent, d.outputs, strict=True):
        expected_positions += range(len(prompt), len(prompt) + len(output))
        expected_log_probs += log_probs
    assert trained == expected_positions
    assert [row.old_log_probs[i] for i in trained] == expected_log_probs
    assert all(row.old_log_probs[i] == 0.0 for i, m in enumerate(row.completion_mask) if not m)
    assert row.model_version == 10 - (len(replies) - 1)  # the oldest policy that produced a token
    assert row.num_turns == len(replies)
