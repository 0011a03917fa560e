"""The captured traffic of the real Pi replayed through every chat template the project serves
(`test_template_matrix.MATRIX`), each with a tokenizer of its own family: the requests pinned per supported Pi version
(tests/pi_requests/VERSION.json: a `bash` call, then `Done.`) and the demo warm start's capture (three tasks, four
candidate commands each, with quotes and backslashes, then `Done.`).

Under each template the model's
turns are SCRIPTED as that template writes them (`completion_ids`: with reasoning where the template's generation
prompt opens a think block), parsed by the family's parser, and echoed back the way Pi echoes a reply
(`pi_shapes.echo_assistant`): the captured assistant message, with the reasoning the family's reply carried and the
call id the server gave. No model and no vLLM: what is checked is the token path a rollout under the family takes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

import pytest
from chain_driver import as_written
from conftest import tiny_tokenizer
from pi_shapes import PINNED_DIR, SHAPE_REPLIES, echo_assistant, pinned_shapes
from test_template_matrix import MATRIX, SERVED

from swe_grpo.demo.warm_start import CLOSING_MESSAGE, load_capture
from swe_grpo.extras.tiny_model import chat_template_text
from swe_grpo.testing.pi_capture import completion_ids
from swe_grpo.tokens.chain import TokenChain, TrainingTemplate, normalize_message
from swe_grpo.tokens.responses import ResponseParser

SERVED_TEMPLATES = sorted(name for name, verdict in MATRIX.items() if verdict == SERVED)
PINNED_VERSIONS = sorted(path.stem for path in PINNED_DIR.glob("*.json"))
# Each template as served by default, and with thinking off where the template reads `enable_thinking`.
CASES = [(name, {}) for name in SERVED_TEMPLATES] + [
    (name, {"enable_thinking": False}) for name in SERVED_TEMPLATES if "enable_thinking" in chat_template_text(name)
]


def _calls(message: dict[str, Any]) -> list[tuple[str, Any]]:
    """(name, arguments) of each call of a wire-form message (arguments as JSON text)."""
    calls = message.get("tool_calls") or []
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@dataclass(frozen=True)
class Capture:
    """One conversation Pi had: the requests it sent (each `{"messages", "tools"}`), and the final reply (the model's
    answer to the last request, which Pi never echoed)."""

    bodies: list[dict[str, Any]]
    final: dict[str, Any]


def _captures(source: str) -> list[Capture]:
    """The conversations of a capture: `pi-VERSION` (tests/pi_requests/VERSION.json: a `bash` call, then `Done.`),
    or `warm-start` (the demo's capture: three tasks, four candidate `sed`/`python` commands each, then `Done.`)."""
    if source.startswith("pi-"):
        return [Capture(pinned_shapes(source.removeprefix("pi-"))["bodies"], SHAPE_REPLIES[-1])]
    capture, tools = load_capture(), load_capture()["tools"]
    return [
        Capture(
            [
                {"messages": task["messages"], "tools": tools},
                {"messages": task["messages"] + c["then"], "tools": tools},
            ],
            CLOSING_MESSAGE,
        )
        for task in capture["tasks"]
        for c in task["candidates"]
    ]


def _with_reply(body: dict[str, Any], index: int, echoed: dict[str, Any], old_id: str) -> dict[str, Any]:
    """`body` with its message at `index` (the captured assistant reply) replaced by `echoed`, and the results of
    the call `old_id` answering the echoed call's id."""
    body = copy.deepcopy(body)
    messages = body["messages"]
    messages[index] = echoed
    new_id = echoed["tool_calls"][0]["id"] if echoed.get("tool_calls") else old_id
    for message in messages[index + 1 :]:
        if message.get("tool_call_id") == old_id:
            message["tool_call_id"] = new_id
    return body


def _replay(training: TrainingTemplate, parser: ResponseParser, capture: Capture) -> None:
    """Replay `capture` through a fresh chain as the InterceptionServer serves it, checking every turn and the row."""
    tokenizer, bodies = training.tokenizer, capture.bodies
    chain = TokenChain(training)
    # What the model answered at each turn: the reply Pi echoed in the next request, then the final answer.
    replies = [bodies[k + 1]["messages"][len(body["messages"])] for k, body in enumerate(bodies[:-1])]
    replies.append(capture.final)
    sent: list[tuple[list[int], list[int]]] = []
    body = bodies[0]
    for k, reply in enumerate(replies):
        prepared = chain.prepare(body["messages"], body["tools"])
        messages = [normalize_message(m, i) for i, m in enumerate(body["messages"])]
        # The prompt is exactly the template's render of Pi's history, and extends every earlier token untouched.
        assert tokenizer.decode(prepared.prompt_ids) == training.render(messages, body["tools"], generation_prompt=True)
        if sent:
            held = sent[-1][0] + sent[-1][1]
            assert not prepared.fork and prepared.prompt_ids[: len(held)] == held
        output = completion_ids(training, as_written(training, normalize_message(reply)))
        parsed = parser.parse(output, prepared.prompt_ids, "stop", body["tools"])
        assert parsed.malformed_tool_calls == 0
        assert _calls(parsed.message) == _calls(reply)
        assert parsed.finish_reason == ("tool_calls" if reply.get("tool_calls") else "stop")
        log_probs = [-0.01 * (i + 1) for i in range(len(output))]
        record = chain.commit(prepared, output, log_probs, 0, parsed.message, parsed.finish_reason)
        assert record.kind == "clean" and record.drift_tokens == 0
        sent.append((prepared.prompt_ids, output))
        if k + 1 < len(bodies):
            echoed = echo_assistant(parsed.message)
            # Pi's echo differs from the captured one only by the family's reasoning and the call id it was given.
            stripped = {key: v for key, v in echoed.items() if key != "reasoning_content"}
            assert json.loads(json.dumps(stripped).replace(echoed["tool_calls"][0]["id"], "call_0")) == reply
            body = _with_reply(bodies[k + 1], len(body["messages"]), echoed, "call_0")

    assert len(chain.rows) == 1
    row = chain.rows[0]
    assert row.input_ids.tolist() == sent[-1][0] + sent[-1][1]
    trained = [i for i, m in enumerate(row.completion_mask) if m]
    assert trained == [i for prompt, output in sent for i in range(len(prompt), len(prompt) + len(output))]
    # The token that closed each turn is trained (the model wrote it); what follows it is not.
    for prompt, output in sent[:-1]:
        closer = len(prompt) + len(output) - 1
        assert output[-1] in training.end_token_ids and row.completion_mask[closer] == 1
        assert row.completion_mask[closer + 1] == 0


@pytest.mark.parametrize("source", [f"pi-{v}" for v in PINNED_VERSIONS] + ["warm-start"])
@pytest.mark.parametrize(("template", "kwargs"), CASES, ids=[f"{n}{'-nothink' if k else ''}" for n, k in CASES])
def test_captured_pi_traffic_replays_exactly_under_every_served_template(
    template: str, kwargs: dict[str, Any], source: str
) -> None:
    """`kwargs` (the template's own, e.g. `enable_thinking`) reach the parser's probe, every render and every
    interstitial: the prompts are the template's render of the history with them."""
    tokenizer = tiny_tokenizer(template)
    training = TrainingTemplate(tokenizer, **kwargs)
    parser = ResponseParser(tokenizer, training)
    for capture in _captures(source):
        _replay(training, parser, capture)
