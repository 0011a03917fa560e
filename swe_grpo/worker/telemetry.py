"""What a rollout engine reports about its work, as pure functions of the finished trajectories.

`rollout_metrics` turns one finished rollout into the metric dict the engine puts out (counters end in
`_total`; `(sum, count)` pairs are averaged by the trainer). `group_traces` turns one group into the
`trackio.Trace`s logged to the trainer's trackio run: every member's whole conversation with its agent,
its diff, outcome, grade and advantage, so attempts at one task can be read side by side. `round_metrics`
turns one round of the held-out eval (swe_grpo/worker/heldout.py) into its `eval/*` metrics.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from swe_grpo.evaluation.metrics import build_report, pass_at_k
from swe_grpo.evaluation.run import attempt_record
from swe_grpo.rollout import Trajectory
from swe_grpo.worker.groups import group_advantages

Metrics = dict[str, float | tuple[float, float]]


def rollout_metrics(t: Trajectory) -> Metrics:
    """The metrics of one finished rollout: its outcome, turns, tokens, timings and, if it counts, reward."""
    turns = len(t.turns)
    summary = t.summary()
    metrics: Metrics = {
        f"rollout/outcome_{t.outcome}_total": 1.0,
        "rollout/finished_total": 1.0,
        "rollout/turns": float(turns),
        "rollout/prompt_tokens": float(summary["prompt_tokens"]),
        "rollout/completion_tokens": float(summary["completion_tokens"]),
        "rollout/fork_rate": (float(summary["forks"]), float(turns)),
        "rollout/retried_turns_total": float(summary["retried_turns"]),
        "rollout/malformed_tool_calls_total": float(t.malformed_tool_calls),
        "rollout/wall_s": t.timings.get("total", 0.0),
        "rollout/generation_latency_s": (t.timings.get("generation", 0.0), float(turns)),
    }
    if t.reward is not None:
        metrics["rollout/resolved_rate"] = (float(t.outcome == "resolved"), 1.0)
        metrics["rollout/reward"] = t.reward
    for stage in ("sandbox_create", "agent"):
        if stage in t.timings:
            metrics[f"rollout/{stage}_s"] = t.timings[stage]
    if t.agent_name:  # the same per harness, for a mix of agents (WorkerConfig.agent)
        for name in ("finished_total", "turns", "fork_rate", "resolved_rate"):
            if f"rollout/{name}" in metrics:
                metrics[f"rollout/agent_{t.agent_name}/{name}"] = metrics[f"rollout/{name}"]
    return metrics


def group_traces(
    group_id: int,
    trajectories: list[Trajectory],
    dropped: str | None,
    advantage_eps: float,
    masked: Collection[str] = (),
) -> list[Any]:
    """One `trackio.Trace` per member of the group `group_id`; `dropped` is why the group was dropped
    (None: it was trained), `masked` the outcomes its advantages left out. Imports trackio, which only
    tracing needs."""
    import trackio

    advantages, _ = group_advantages(trajectories, advantage_eps, masked)
    return [
        trackio.Trace(
            messages=t.messages,
            metadata={
                "instance_id": t.instance_id,
                "rollout_id": t.rollout_id,
                "group_id": group_id,
                "group": dropped or "trained",
                "outcome": t.outcome,
                "reward": t.reward,
                "advantage": advantages.get(t.rollout_id),
                "model_version": t.oldest_version,
                "turns": len(t.turns),
                "duration_ms": round(t.timings.get("total", 0.0) * 1000),
                "patch": t.patch,
                "error": t.error,
            },
        )
        for t in trajectories
    ]


def round_metrics(trajectories: Sequence[Trajectory], instance_ids: Sequence[str], k: int) -> Metrics:
    """The metrics of one round from its finished attempts (`k` per task of `instance_ids`), computed as
    `swe-grpo eval` reports them (see the module docstring)."""
    by_task: dict[str, int] = {}
    records = []
    for trajectory in trajectories:
        attempt = by_task[trajectory.instance_id] = by_task.get(trajectory.instance_id, -1) + 1
        records.append(attempt_record(trajectory, attempt, None))
    report = build_report(records, k, instance_ids)
    metrics: Metrics = {
        "eval/rounds_total": 1.0,
        "eval/attempts_total": float(report["attempts"]),
        "eval/infra_failures_total": float(report["infra_failures"]),
        "eval/resolved_rate": (float(report["resolved"]), float(report["attempts_scored"])),
    }
    for j in range(1, k + 1):
        values = [pass_at_k(t["scored"], t["resolved"], j) for t in report["per_task"] if t["scored"] >= j]
        metrics[f"eval/pass@{j}"] = (sum(values), float(len(values)))
    for outcome, count in report["outcomes"].items():
        metrics[f"eval/outcome_{outcome}_total"] = float(count)
    return metrics
