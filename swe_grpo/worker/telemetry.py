"""What a rollout engine reports about its work, as pure functions of the finished trajectories.

`rollout_metrics` turns one finished rollout into the metric dict the engine puts out (counters end in
`_total`; `(sum, count)` pairs are averaged by the trainer). `group_traces` turns one group into the
`trackio.Trace`s logged to the trainer's trackio run: every member's whole conversation with its agent,
its diff, outcome, grade and advantage, so attempts at one task can be read side by side.
"""

from __future__ import annotations

from typing import Any

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
    return metrics


def group_traces(group_id: int, trajectories: list[Trajectory], dropped: str | None, advantage_eps: float) -> list[Any]:
    """One `trackio.Trace` per member of the group `group_id`; `dropped` is why the group was dropped
    (None: it was trained). Imports trackio, which only tracing needs."""
    import trackio

    advantages, _ = group_advantages(trajectories, advantage_eps)
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
