"""Running an evaluation's attempts.

The attempts are served by `swe_grpo.serving.stack.token_exact_server`, the stack `swe-grpo rollout` and
training use. `run_attempts` runs (task, attempt) jobs through `run_rollout` (agent in a sandbox,
grading in a fresh one), `concurrency` at a time, and appends one record per finished attempt to the
`AttemptLog`, so a run killed at any point keeps every attempt it finished.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swe_grpo.agents.base import Agent
from swe_grpo.evaluation.metrics import is_infra
from swe_grpo.evaluation.store import TRAJECTORIES, AttemptLog
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.tasks import Task


def attempt_record(trajectory: Trajectory, attempt: int, trajectory_path: str | None) -> dict[str, Any]:
    """The attempts.jsonl line of one finished attempt: the rollout's summary (outcome, reward, turns,
    tokens, wall time, test counts, error), which attempt it was, whether it is an infra failure, the
    sandbox-seconds it cost, its patch and where its trajectory was saved."""
    summary = trajectory.summary()
    # One sandbox at a time is alive from the agent's sandbox's creation through grading (the agent's, then
    # the grader's); an attempt whose sandbox was never created held none.
    sandbox_s = summary["wall_s"] if "sandbox_create" in trajectory.timings else 0.0
    if not trajectory.rows and trajectory.turns:  # --passthrough: no token ids, the endpoint's usage counts
        summary["prompt_tokens"] = sum(t.prompt_tokens for t in trajectory.turns)
        summary["completion_tokens"] = sum(t.output_tokens for t in trajectory.turns)
    record = {"instance_id": trajectory.instance_id, "attempt": attempt, **summary}
    record.update(
        infra=is_infra(summary),
        sandbox_s=sandbox_s,
        trajectory=trajectory_path,
        model_patch=trajectory.patch,
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    return record


async def run_attempts(
    jobs: Sequence[tuple[Task, int]],
    *,
    server: InterceptionServer,
    backend: SandboxBackend,
    agent: Agent,
    config: RolloutConfig,
    attempts: AttemptLog,
    concurrency: int,
    save_dir: Path | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Run every (task, attempt) job, `concurrency` at a time; each finished attempt is appended to
    `attempts` (its trajectory saved first under `save_dir`), then reported to `on_done`."""
    semaphore = asyncio.Semaphore(concurrency)
    if save_dir is not None:
        save_dir.mkdir(parents=True, exist_ok=True)

    async def one(task: Task, attempt: int) -> None:
        async with semaphore:
            trajectory = await run_rollout(task, server, backend, agent, config)
        saved = None
        if save_dir is not None:
            path = save_dir / f"{trajectory.rollout_id}.json"
            path.write_text(json.dumps(trajectory.to_json()), encoding="utf-8")
            saved = f"{TRAJECTORIES}/{path.name}" if save_dir.name == TRAJECTORIES else str(path)
        record = attempt_record(trajectory, attempt, saved)
        attempts.append(record)
        if on_done is not None:
            on_done(record)

    async with asyncio.TaskGroup() as group:
        for task, attempt in jobs:
            group.create_task(one(task, attempt))
