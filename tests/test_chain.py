"""TokenChain: bridge-exact prompts, clean vs fork, training rows, across TRL's shipped templates."""

from __future__ import annotations

import copy
import json

import pytest
from chain_driver import REPLIES, Driver, assert_conversation_exact, replies_for
from conftest import TEMPLATES, tiny_tokenizer
from pi_shapes import scripted_output, tool_call

from swe_grpo.tokens.chain import (
    MessageFormatError,
    TemplateNotPrefixPreservingError,
    TemplateRefusedError,
    TokenChain,
    TrainingTemplate,
    normalize_message,
)


@pytest.mark.parametrize("template", TEMPLATES)
def test_tool_call_conversation_is_clean_and_bridge_exact(template: str) -> None:
    assert_conversation_exact(template)  # every other template TRL ships: tests/test_template_matrix.py


def test_bridge_keeps_model_tokens_where_a_rerender_drifts() -> None:
    """Llama 3's generation prompt ends in "\\n\\n", which tokenises differently when content follows:
    a re-render of the history would differ from what vLLM saw; the chain keeps what vLLM saw."""
    d = Driver("llama3_2")
    d.turn(REPLIES[0])
    prepared, record, _ = d.turn(replies_for("llama3_2")[1])
    assert record.kind == "clean"
    rerendered = d.template.encode(d.template.tokenizer.decode(prepared.prompt_ids))
    assert rerendered != prepared.prompt_ids
    assert prepared.prompt_ids[: len(d.sent[0])] == d.sent[0]


def test_truncated_history_forks_into_a_new_row() -> None:
    d = Driver("qwen3")
    for reply in REPLIES[:3]:
        d.turn(reply)
    first_row = copy.deepcopy(d.chain.rows[0])
    # The agent compacts: drops the first exchange from its history.
    d.convo.messages = d.convo.messages[:2] + d.convo.messages[5:]
    expected_text = d.full_render_text()
    prepared, record, _ = d.turn(REPLIES[3])
    assert record.kind == "fork" and prepared.fork
    assert record.drift_tokens > 0
    assert record.fork_cause == "message_replaced at messages[2]"  # the first reply's place holds a user message
    assert d.template.tokenizer.decode(prepared.prompt_ids) == expected_text
    assert len(d.chain.rows) == 2
    assert d.chain.rows[0] == first_row  # the closed row is untouched
    assert d.chain.rows[1].input_ids.tolist() == prepared.prompt_ids + d.outputs[-1][0]
    assert d.chain.rows[1].completion_mask.tolist() == [0] * len(prepared.prompt_ids) + [1] * len(d.outputs[-1][0])
    # The conversation goes on cleanly from the new row.
    d.convo.messages.append({"role": "user", "content": [{"type": "text", "text": "Thanks. Run the tests."}]})
    _, record, _ = d.turn(REPLIES[0])
    assert record.kind == "clean" and record.row == 1
    assert [t.kind for t in d.chain.turns] == ["clean", "clean", "clean", "fork", "clean"]


@pytest.mark.parametrize(
    ("edit", "cause"),
    [
        pytest.param(
            lambda msgs: msgs[3].update(content="edited tool output"),
            "tool_output_changed at messages[3]",
            id="edited-tool-result",
        ),
        pytest.param(
            lambda msgs: msgs[3].update(content="out"), "tool_output_cut at messages[3]", id="cut-tool-result"
        ),
        pytest.param(lambda msgs: msgs[2].pop("reasoning_content"), "reasoning_dropped at messages[2]", id="reasoning"),
        pytest.param(
            lambda msgs: msgs[2]["tool_calls"][0]["function"].update(arguments='{"command":"pwd"}'),
            "tool_calls_changed at messages[2]",
            id="changed-arguments",
        ),
        pytest.param(
            lambda msgs: msgs[0].update(content="Another system prompt."),
            "system_prompt_changed at messages[0]",
            id="system-prompt",
        ),
        pytest.param(
            lambda msgs: msgs[1]["content"].append({"type": "text", "text": "!"}),
            "user_message_changed at messages[1]",
            id="user",
        ),
        pytest.param(
            lambda msgs: msgs.__delitem__(slice(3, None)), "history_dropped: 3 of 5 held messages re-sent", id="dropped"
        ),
    ],
)
def test_edited_history_forks_with_its_cause_named(edit, cause: str) -> None:
    d = Driver("qwen3")
    d.turn(REPLIES[0])
    d.turn(REPLIES[1])  # messages[3], the first tool result, is now held history
    edit(d.convo.messages)
    _, record, _ = d.turn(REPLIES[2])
    assert record.kind == "fork" and record.fork_cause == cause
    assert len(d.chain.rows) == 2
    assert [t.fork_cause for t in d.chain.turns] == ["", "", cause]


def test_reserialised_arguments_and_null_content_stay_clean() -> None:
    d = Driver("qwen3")
    d.turn(REPLIES[2])
    echoed = d.convo.messages[2]
    assert echoed["content"] is None and "," not in echoed["tool_calls"][0]["function"]["arguments"].split('"')[2]
    # The agent's JSON differs from ours byte for byte but is the same JSON: still clean.
    _, record, _ = d.turn(REPLIES[3])
    assert record.kind == "clean"


def test_changed_tools_fork() -> None:
    d = Driver("qwen3")
    d.turn(REPLIES[0])
    request = d.convo.request()
    prepared = d.chain.prepare(request["messages"], request["tools"][:2])
    assert prepared.fork and prepared.fork_cause == "tools_changed"


def test_output_cut_at_max_tokens_is_closed_by_the_interstitial() -> None:
    d = Driver("qwen3")
    d.turn(REPLIES[3], truncate_to=3)
    assert d.chain.rows[0].input_ids[-1] != d.template.eos_token_id
    prepared, record, _ = d.turn(REPLIES[3])
    assert record.kind == "clean"
    first = len(d.sent[0]) + 3
    assert prepared.prompt_ids[first] == d.template.eos_token_id  # a prompt token, not trained
    assert d.chain.rows[0].completion_mask[first] == 0


def test_first_turn_is_a_full_render() -> None:
    d = Driver("qwen3_6")
    expected = d.full_render_text()
    prepared, record, _ = d.turn(REPLIES[0])
    assert d.template.tokenizer.decode(prepared.prompt_ids) == expected
    assert record.kind == "clean" and record.new_prompt_tokens == record.prompt_tokens


def test_prepare_does_not_change_the_chain_until_commit() -> None:
    d = Driver("qwen3")
    d.turn(REPLIES[0])
    before = copy.deepcopy(d.chain.rows)
    request = d.convo.request()
    d.chain.prepare(request["messages"], request["tools"])
    d.chain.prepare(request["messages"][:2], request["tools"])  # a fork, never committed
    assert d.chain.rows == before and len(d.chain.turns) == 1


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([], "non-empty list"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "image_url"),
        ([{"role": "wizard", "content": "hi"}], "unsupported role"),
        ([{"role": "user", "content": 42}], "content must be"),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{oops"}}],
                },
            ],
            "not valid JSON",
        ),
        ([{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}], "'function'"),
        (["not a dict"], "must be an object"),
    ],
)  # fmt: skip
def test_malformed_messages_are_rejected_with_the_cause(messages: list, fragment: str) -> None:
    chain = TokenChain(TrainingTemplate(tiny_tokenizer("qwen3")))
    with pytest.raises(MessageFormatError, match=fragment):
        chain.prepare(messages, None)


def test_template_that_is_not_prefix_preserving_is_refused() -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer("qwen3"))
    # Renders an assistant's reasoning only on the last assistant turn: earlier turns change later.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and loop.last and m.reasoning_content %}{{ m.reasoning_content }}{% endif %}"
        "{% if m.role == 'assistant' and loop.last %}[last]{% endif %}"
        "{{ m.content if m.content is string else '' }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateNotPrefixPreservingError, match="not prefix-preserving"):
        TrainingTemplate(tokenizer)


def test_training_template_does_not_modify_the_callers_tokenizer() -> None:
    tokenizer = tiny_tokenizer("qwen3")
    original = tokenizer.chat_template
    template = TrainingTemplate(tokenizer)
    assert tokenizer.chat_template == original
    assert template.tokenizer.chat_template != original  # TRL's training variant


def test_echo_with_other_ids_and_whitespace_stays_clean() -> None:
    """A replayed conversation echoes the recorded reply: other tool-call ids, other whitespace."""
    d = Driver("qwen3")
    d.turn(REPLIES[1])
    echoed = d.convo.messages[2]
    echoed["content"] = "\n" + echoed["content"] + "  "
    for i, call in enumerate(echoed["tool_calls"]):
        call["id"] = f"toolu_{i}"
        d.convo.messages[3 + i]["tool_call_id"] = f"toolu_{i}"
    _, record, _ = d.turn(REPLIES[2])
    assert record.kind == "clean"


def _state(chain: TokenChain) -> tuple:
    return copy.deepcopy((chain.rows, chain.turns, chain.messages))


@pytest.mark.parametrize("retried_turn", [0, 1])
def test_a_retried_request_replaces_the_turn_it_repeats(retried_turn: int) -> None:
    """The agent sends the same request again (it never received the reply): the same prompt is generated
    from again and the new output REPLACES the old one in the row, instead of forking."""
    d = Driver("qwen3")
    for k, reply in enumerate(REPLIES[: retried_turn + 1]):
        d.turn(reply, version=8 if k == 0 else 2)
    before_retried = d.chain.turns[-1]
    mask_before = d.chain.rows[0].completion_mask.tolist()[: len(d.sent[-1])]
    d.convo.messages = d.convo.messages[: -1 - len(REPLIES[retried_turn].get("tool_calls", []))]  # un-receive
    request = d.convo.request()
    prepared = d.chain.prepare(request["messages"], request["tools"])
    assert prepared.replaces and prepared.prompt_ids == d.sent[-1]
    assert prepared.fork == (before_retried.kind == "fork")
    assert d.chain.size_after(prepared) == (1, len(d.sent[-1]))  # what the chain holds once the turn is replaced
    output = scripted_output(d.template, normalize_message(REPLIES[3]))
    record = d.chain.commit(prepared, output, [-0.5] * len(output), 9, {"role": "assistant", "content": "x"}, "stop")
    assert record.retries == 1 and record.turn == retried_turn and record.kind == before_retried.kind
    assert len(d.chain.turns) == retried_turn + 1 and d.chain.turns[-1] == record
    (row,) = d.chain.rows
    assert row.input_ids.tolist() == d.sent[-1] + output
    assert row.old_log_probs.tolist()[len(d.sent[-1]) :] == [-0.5] * len(output)
    assert row.completion_mask.tolist() == mask_before + [1] * len(output)
    assert row.num_turns == retried_turn + 1
    assert row.model_version == (8 if retried_turn else 9)  # the replaced output's version 2 is gone
    assert d.chain.messages[-1] == {"role": "assistant", "content": "x"}
    # A second retry replaces again; the conversation then goes on cleanly from the delivered reply.
    again = d.chain.prepare(request["messages"], request["tools"])
    record = d.chain.commit(again, output, [-0.5] * len(output), 9, {"role": "assistant", "content": "x"}, "stop")
    assert record.retries == 2 and len(d.chain.turns) == retried_turn + 1
    d.convo.add_reply({"role": "assistant", "content": "x"})
    d.convo.messages.append({"role": "user", "content": "go on"})
    _, record, _ = d.turn(REPLIES[3])
    assert record.kind == "clean" and record.retries == 0 and len(d.chain.rows) == 1


def test_a_retried_fork_replaces_the_forked_row() -> None:
    d = Driver("qwen3")
    d.turn(REPLIES[0])
    d.turn(REPLIES[1])
    first_row = copy.deepcopy(d.chain.rows[0])
    d.convo.messages = d.convo.messages[:2]  # the agent drops its history: a fork
    d.turn(REPLIES[2])
    request = d.convo.request()
    request["messages"] = request["messages"][:2]
    prepared = d.chain.prepare(request["messages"], request["tools"])
    assert prepared.replaces and prepared.fork
    assert d.chain.size_after(prepared) == (2, len(first_row.input_ids) + len(prepared.prompt_ids))
    d.chain.commit(prepared, [1, 2], [-1.0, -1.0], 0, {"role": "assistant", "content": "y"}, "stop")
    assert len(d.chain.rows) == 2 and d.chain.rows[0] == first_row
    assert d.chain.rows[1].input_ids.tolist() == [*prepared.prompt_ids, 1, 2]
    assert [t.kind for t in d.chain.turns] == ["clean", "clean", "fork"]


def test_commit_validates_before_it_touches_the_chain() -> None:
    """A reply that cannot be held (arguments that are not a JSON object) is refused by commit with the
    chain exactly as it was."""
    d = Driver("qwen3")
    d.turn(REPLIES[0])
    before = _state(d.chain)
    request = d.convo.request()
    prepared = d.chain.prepare(request["messages"], request["tools"])
    bad = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": "ls -la"}}],
    }
    with pytest.raises(MessageFormatError, match="not valid JSON"):
        d.chain.reply_message(prepared, bad)
    with pytest.raises(MessageFormatError, match="not valid JSON"):
        d.chain.commit(prepared, [5, 6], [-1.0, -1.0], 0, bad, "tool_calls")
    assert _state(d.chain) == before


def test_a_conversation_the_template_refuses_is_a_named_error() -> None:
    """Llama 3.2's template raises on an assistant message with two tool calls: a reply like that is
    refused by `reply_message` (and by commit, chain unchanged), a request holding one by `prepare`."""
    d = Driver("llama3_2")
    d.turn(REPLIES[0])
    before = _state(d.chain)
    request = d.convo.request()
    prepared = d.chain.prepare(request["messages"], request["tools"])
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in REPLIES[1]["tool_calls"]
    ]
    two_calls = {"role": "assistant", "content": "", "tool_calls": calls}
    with pytest.raises(TemplateRefusedError, match="single tool-calls"):
        d.chain.reply_message(prepared, two_calls)
    with pytest.raises(TemplateRefusedError):
        d.chain.commit(prepared, [5], [-1.0], 0, two_calls, "tool_calls")
    assert _state(d.chain) == before
    d.convo.add_reply(two_calls)
    request = d.convo.request()
    with pytest.raises(TemplateRefusedError, match="single tool-calls") as refused:
        d.chain.prepare(request["messages"], request["tools"])
    assert isinstance(refused.value, MessageFormatError)
    assert _state(d.chain) == before


@pytest.mark.parametrize(
    ("template", "ends"),
    [
        ("qwen3", ("<|im_end|>",)),
        ("llama3_2", ("<|eot_id|>",)),
        ("glm4moe", ("<|user|>", "<|observation|>")),  # the next turn's opener: GLM writes no closer of its own
        ("gptoss", ("<|return|>", "<|call|>")),
        ("gemma4", ("<turn|>", "<|tool_response>")),
    ],
)
def test_end_of_turn_tokens_are_the_set_the_template_closes_turns_with(template: str, ends: tuple[str, ...]) -> None:
    training = TrainingTemplate(tiny_tokenizer(template))
    assert training.end_tokens == ends
    ids = training.tokenizer.convert_tokens_to_ids([*ends, training.eos_token])
    assert set(training.stop_token_ids) == set(ids)  # what generation stops at (vllm_client's stop_token_ids)


GLM_CALL = {"role": "assistant", "content": "", "tool_calls": [tool_call("bash", command="ls")]}
GLM_RESULT = {"role": "tool", "tool_call_id": "call_bash", "content": "a.py"}


def _glm_turn() -> tuple[TrainingTemplate, list[dict], list[int]]:
    """A GLM-4-MoE conversation up to a tool call, and the ids a model writes for the call (through the
    `<|observation|>` that ends a call turn)."""
    training = TrainingTemplate(tiny_tokenizer("glm4moe"))
    history = [{"role": "user", "content": "list"}]
    reply = training.encode(training.reply_text(normalize_message(GLM_CALL)))
    return training, history, reply


def test_a_turn_the_model_closes_with_the_next_turns_opener_is_bridged_exactly() -> None:
    """GLM writes no closer for its own turn: the model ends a call turn with `<|observation|>`, which the
    template renders as the start of the tool result. The interstitial starts after it: prompt + output +
    interstitial is the template's render of the whole conversation."""
    training, history, reply = _glm_turn()
    assert training.tokenizer.convert_ids_to_tokens(reply[-1]) == "<|observation|>"
    prompt = training.prompt_ids(history)
    interstitial = training.interstitial_ids(normalize_message(GLM_CALL), [GLM_RESULT], None, reply[-1])
    whole = training.render([*history, normalize_message(GLM_CALL), GLM_RESULT], generation_prompt=True)
    assert interstitial is not None and training.tokenizer.decode(prompt + reply + interstitial) == whole


def test_a_cut_turn_gets_the_end_token_its_template_writes() -> None:
    """Cut at max_tokens, a GLM call turn is closed with `<|observation|>` (the template's, for a call turn),
    a plain one with `<|user|>`."""
    training, _, reply = _glm_turn()
    interstitial = training.interstitial_ids(normalize_message(GLM_CALL), [GLM_RESULT], None, reply[-2])
    assert interstitial is not None
    assert training.tokenizer.convert_ids_to_tokens(interstitial[0]) == "<|observation|>"
    plain = {"role": "assistant", "content": "Done."}
    cut = training.encode("Don")[-1]
    interstitial = training.interstitial_ids(plain, [{"role": "user", "content": "more"}], None, cut)
    assert interstitial is not None and training.tokenizer.convert_ids_to_tokens(interstitial[0]) == "<|user|>"


def test_a_turn_closed_with_another_end_token_than_the_templates_forks() -> None:
    """A model that ends its GLM call turn with `<|user|>` wrote what the template never renders after a call:
    no interstitial can bridge it (the chain forks)."""
    training, _, _ = _glm_turn()
    user = training.tokenizer.convert_tokens_to_ids("<|user|>")
    assert training.interstitial_ids(normalize_message(GLM_CALL), [GLM_RESULT], None, user) is None


def test_a_clean_turn_renders_twice_and_stays_exact() -> None:
    """The serving path's render work: a clean turn renders the template twice (the interstitial, from the rendering
    of the last reply kept since its check, and the check of the new reply, which `commit` reuses), not four times;
    the conversation's tokens are unchanged by it (the exactness tests above)."""
    d = Driver("qwen3")
    d.turn(REPLIES[0])
    renders = 0
    render = d.template.render

    def counted(*args: object, **kwargs: object) -> str:
        nonlocal renders
        renders += 1
        return render(*args, **kwargs)

    request = d.convo.request()
    output = scripted_output(d.template, normalize_message(REPLIES[1]))  # the model's part: not counted
    d.template.render = counted  # type: ignore[method-assign]
    prepared = d.chain.prepare(request["messages"], request["tools"])
    parsed = d.parser.parse(output, prepared.prompt_ids, "stop", request["tools"])
    d.chain.reply_message(prepared, parsed.message)
    record = d.chain.commit(prepared, output, [-0.1] * len(output), 0, parsed.message, parsed.finish_reason)
    assert record.kind == "clean" and renders == 2


def test_a_plan_is_good_only_for_its_request_until_the_next_commit() -> None:
    """`prepare` takes the plan a caller asked for first (`TokenChain.plan`), and refuses one made for another
    request or before a commit."""
    d = Driver("qwen3")
    request = d.convo.request()
    plan = d.chain.plan(request["messages"], request["tools"])
    assert plan.kind == "fresh" and plan.renders_whole_history
    assert d.chain.prepare(request["messages"], request["tools"], plan) == d.chain.prepare(
        request["messages"], request["tools"]
    )
    with pytest.raises(ValueError, match="not this chain's plan"):
        d.chain.prepare(list(request["messages"]), request["tools"], plan)
    d.turn(REPLIES[0])
    with pytest.raises(ValueError, match="not this chain's plan"):
        d.chain.prepare(request["messages"], request["tools"], plan)


def test_an_interstitial_from_a_stale_rendering_of_the_last_reply_is_the_same() -> None:
    """A kept rendering of the last reply that is not a prefix of this turn's (a template that writes today's date,
    rendered on another day) is rendered again: the interstitial is what a fresh render gives."""
    training, _, reply = _glm_turn()
    fresh = training.interstitial_ids(normalize_message(GLM_CALL), [GLM_RESULT], None, reply[-1])
    stale = training.interstitial_ids(normalize_message(GLM_CALL), [GLM_RESULT], None, reply[-1], "another day")
    assert fresh is not None and stale == fresh
