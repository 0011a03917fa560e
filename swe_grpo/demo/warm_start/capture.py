"""Capturing the default Pi's real requests for every demo task and candidate (`pi_requests.json`): Pi
runs in a `local` sandbox with its model turns scripted (`swe_grpo.testing.pi_capture`), and every
candidate's diff is graded."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from swe_grpo.demo.warm_start.data import CLOSING_MESSAGE, Candidate, WarmStartError, action_message, load_candidates
from swe_grpo.testing.pi_capture import capture_pi_run
from swe_grpo.tokens.chain import Message

if TYPE_CHECKING:
    from swe_grpo.agents.pi import PiBundle
    from swe_grpo.sandbox.base import SandboxBackend
    from swe_grpo.tasks import Task

# Tool-call ids are random per run; no chat template renders them. Stored canonical so a capture is
# reproducible.
_CALL_ID = "call_0"


async def _capture_one(
    task: Task,
    candidate: Candidate,
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    bundle: PiBundle,
) -> tuple[list[dict[str, Any]], str]:
    """Run Pi on `task` with the first turn scripted to `candidate` and the second to the closing
    message; grade its diff. Returns Pi's chat requests and the grading outcome."""
    from swe_grpo.grading import grade

    run = await capture_pi_run(bundle, tokenizer, backend, task, [action_message(candidate.command), CLOSING_MESSAGE])
    bodies, pi, turns = run.captured.bodies, run.result, [t.kind for t in run.record.turns]
    if pi.exit_code != 0 or len(bodies) != 2 or turns != ["clean", "clean"]:
        raise WarmStartError(
            f"{task.instance_id} / {candidate.command!r}: expected Pi to exit 0 after two clean turns; exit "
            f"{pi.exit_code}, {len(bodies)} requests, turns {turns}; stderr: {pi.stderr_tail[-500:]}"
        )
    result = await grade(task, run.patch, backend)
    return bodies, result.outcome


def _canonical_ids(messages: list[Message]) -> list[Message]:
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "id": _CALL_ID} for call in message["tool_calls"]]
        if "tool_call_id" in message:
            message["tool_call_id"] = _CALL_ID
        out.append(message)
    return out


async def capture_pi_requests(
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    bundle: PiBundle,
    tasks: Sequence[Task] | None = None,
    candidates: dict[str, list[Candidate]] | None = None,
    concurrency: int = 2,
) -> dict[str, Any]:
    """Pi's real requests for every demo task and candidate, in the form `pi_requests.json` stores.

    Per task and candidate, Pi runs in a fresh sandbox of `backend` (at most `concurrency` at a time)
    with its first turn scripted to the candidate's tool call and its second to the closing message;
    each diff is graded, and a candidate whose outcome contradicts its `resolves` flag raises
    WarmStartError. Checked too: Pi makes exactly two requests, the second extends the first by the
    assistant turn and the tool result, the tools and the first request are the same for every
    candidate of a task. Tool-call ids are made canonical (they are random and never rendered).
    `tokenizer` only scripts the replies; the capture does not depend on it.
    """
    from swe_grpo.demo.tasks import demo_tasks

    tasks = list(tasks or demo_tasks())
    candidates = candidates or load_candidates()
    limit = asyncio.Semaphore(concurrency)

    async def capture(task: Task, candidate: Candidate) -> tuple[list[dict[str, Any]], str]:
        async with limit:
            return await _capture_one(task, candidate, tokenizer, backend, bundle)

    async with asyncio.TaskGroup() as group:
        runs = [[group.create_task(capture(t, c)) for c in candidates[t.instance_id]] for t in tasks]
    tools = runs[0][0].result()[0][0]["tools"]
    captured = []
    for task, task_runs in zip(tasks, runs, strict=True):
        first: list[Message] | None = None
        entries = []
        for candidate, run in zip(candidates[task.instance_id], task_runs, strict=True):
            bodies, outcome = run.result()
            where = f"{task.instance_id} / {candidate.command!r}"
            if outcome != ("resolved" if candidate.resolves else "unresolved"):
                raise WarmStartError(f"{where}: graded {outcome}, but the candidate says resolves={candidate.resolves}")
            turn1, turn2 = bodies[0]["messages"], bodies[1]["messages"]
            if any(b["tools"] != tools for b in bodies) or turn2[: len(turn1)] != turn1 or len(turn2) != len(turn1) + 2:
                raise WarmStartError(f"{where}: Pi's second request does not extend its first by two messages")
            if first is not None and turn1 != first:
                raise WarmStartError(f"{where}: Pi's first request differs between candidates of one task")
            first = first or turn1
            entries.append({**asdict(candidate), "outcome": outcome, "then": _canonical_ids(turn2[len(turn1) :])})
        captured.append({"instance_id": task.instance_id, "messages": first, "candidates": entries})
    return {"pi_version": bundle.version, "tools": tools, "tasks": captured}
