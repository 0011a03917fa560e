"""P1 and P2 (benchmarks/p1_host_overhead.py, p2_concurrency.py) in the other dialects and families, shortened: the
simulated agents send Codex's (Responses) and Claude Code's (Messages) request shapes to the real InterceptionServer,
which serves a gpt-oss (harmony) or GLM template, and every turn must be served without an error or a fork (a fork
in a dialect run means its translation onto the chat request lost something). Each run's results JSON must name its
dialect and family beside a whole provenance. The default (chat, Qwen) requests must stay byte for byte what they
were, so that P1's and P2's earlier results still compare.

Each run is a subprocess of the script, as a reader would run it (about 10 s for P1, 30 s for P2 here); run the
module under `heavy`."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from test_benchmark_results import problems

from swe_grpo.serving import dialects
from swe_grpo.tokens.chain import normalize_message

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from _agent_dialects import WIRES  # noqa: E402
from _pi_agent import Answer, PiConversation  # noqa: E402


def _run(script: str, *args: str, json_path: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args, "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(json_path.read_text())


@pytest.mark.parametrize(("dialect", "family"), [("responses", "harmony"), ("messages", "glm"), ("chat", "harmony")])
def test_p1_runs_in_a_dialect_and_family_and_says_which(dialect: str, family: str, tmp_path: Path) -> None:
    samples = 30
    result = _run(
        "p1_host_overhead.py",
        *(
            "--turns",
            str(samples),
            "--sizes",
            "2048",
            "--tool-output",
            "large",
            "--dialect",
            dialect,
            "--family",
            family,
        ),
        json_path=tmp_path / "p1.json",
    )
    assert not problems(result["provenance"]), problems(result["provenance"])
    assert (result["dialect"], result["family"]) == (dialect, family)
    assert (result["requests"], result["errors"], result["forks"]) == (2 * samples, 0, 0)  # priming + timed turn
    [size] = result["sizes"]
    assert size["requests"] == samples and size["cpu_ms_per_request"] > 0
    # Each sample on a connection of its own: 60 back-to-back requests on one would pass the server's burst of 20 a
    # connection and be paced to 20 a second, the timed turns then reading ~40 ms (P1's 4k rows did so).
    assert size["overhead_ms"]["p50"] < 25
    stages = size["stages_mean_ms"]
    assert stages["to_chat"] > 0 if dialect != "chat" else stages["to_chat"] == 0  # the dialect's own route served it
    # The interstitial's render + encode are those inside `prepare`: the reply check's render is a stage of its own.
    assert stages["reply_check"] > 0 and 0 <= stages["interstitial"] <= stages["prepare"]


@pytest.mark.parametrize("dialect", ["responses", "messages"])
def test_p2_runs_rollouts_in_a_dialect_without_an_error_or_a_fork(dialect: str, tmp_path: Path) -> None:
    rollouts, turns = 4, 3
    result = _run(
        "p2_concurrency.py",
        *("--hosts", "1", "--rollouts", str(rollouts), "--turns", str(turns), "--think", "0.05,0.2"),
        *("--no-saturation", "--max-seconds", "120", "--dialect", dialect, "--family", "harmony"),
        json_path=tmp_path / "p2.json",
    )
    assert not problems(result["provenance"]), problems(result["provenance"])
    assert (result["dialect"], result["family"]) == (dialect, "harmony")
    [row] = result["results"]
    assert row["requests_answered"] == rollouts * turns and row["unfinished"] == 0
    assert (row["errors"], row["forks"], row["agent_errors"]) == (0, 0, {})
    assert row["server_cpu_ms_per_request"] > 0


def _grown(dialect: str, turns: int) -> PiConversation:
    """A session on `dialect`'s wire grown by `turns` answers as the server writes them (reasoning, one call)."""
    conversation = PiConversation("policy", random.Random(7), (200, 600), WIRES[dialect])
    for k in range(turns):
        conversation.body()
        call = {"id": f"call_{k}", "name": "bash", "arguments": '{"command": "ls"}'}
        echo = {
            "chat": [],
            "responses": [
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "r"}],
                },
                {
                    "type": "function_call",
                    "id": "fc_1",
                    "call_id": call["id"],
                    "name": "bash",
                    "arguments": '{"command": "ls"}',
                },
            ],
            "messages": [
                {"type": "thinking", "thinking": "r", "signature": "swe_grpo"},
                {"type": "tool_use", "id": call["id"], "name": "bash", "input": {"command": "ls"}},
            ],
        }[dialect]
        conversation.absorb(Answer(reasoning="r", tool_calls=[call], echo=echo))
    return conversation


def test_the_three_wires_carry_one_conversation() -> None:
    """The server's translation of a Responses and a Messages session gives the chat session Pi sends: the same
    messages (system prompt, task, reasoning, calls, results) and the same tools (Anthropic's have no `strict`), so
    the dialects' runs differ by the wire alone."""

    def chat_of(dialect: str) -> tuple[list[Any], list[Any]]:
        body = orjson.loads(_grown(dialect, 3).body())
        chat = {"chat": dialects.CHAT, "responses": dialects.RESPONSES, "messages": dialects.MESSAGES}[dialect]
        chat = chat.to_chat(body)
        messages = [normalize_message(m, i) for i, m in enumerate(chat["messages"])]
        tools = [{k: v for k, v in t["function"].items() if k != "strict"} for t in chat["tools"]]
        return messages, tools

    pi = chat_of("chat")
    assert len(pi[0]) == 2 + 3 * 2 and len(pi[1]) == 4  # system, task, then an answer and its result per turn
    assert chat_of("responses") == pi
    assert chat_of("messages") == pi


def test_the_default_chat_request_is_unchanged() -> None:
    """Pi's request after three answers, byte for byte as P1 and P2 sent it before the dialects came (pinned by its
    hash, taken with the code of commit 28c9139)."""
    body = _grown("chat", 3).body()
    assert hashlib.sha256(body).hexdigest()[:16] == "1b908cad56f02b64"
