"""GRPO groups: one task's graded attempts, as the samples `AsyncGRPOTrainer` trains on.

`GroupAssembler.assemble` takes a finished group's trajectories and returns either its samples or the reason
the whole group is dropped (`DropReason`). A sample is a `Sample`: TRL's `RolloutSample` field for field,
built without importing TRL's trainer (which pulls in torch), so a rollout host never loads it; the trainer's
`rollout_buffer` (`GroupQueue.put_group`) turns each into TRL's own class. It keeps the worker's "Groups" and
"One honest version per group" guarantees, stated once in swe_grpo/worker/rollout_worker.py's docstring:
advantages over the valid members only, a group pushed or dropped whole, one sample per training row, the
group's oldest version on each, and no row the trainer's `token_budget` would drop alone.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from transformers import PreTrainedTokenizerBase

from swe_grpo.rollout import TRUNCATED_OUTCOMES, Trajectory
from swe_grpo.tasks import Task
from swe_grpo.worker.config import WorkerConfig

DropReason = Literal["too_few_valid", "zero_variance", "stale", "oversize"]


@dataclass(slots=True)
class Sample:
    """One training row, with the fields of TRL's `RolloutSample` in its order (tests/test_groups.py keeps
    them equal): what crosses from a rollout host to the trainer, where `GroupQueue` makes it a
    `RolloutSample`."""

    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    input_ids: np.ndarray
    completion_mask: np.ndarray
    old_log_probs: np.ndarray
    advantage: float
    model_version: int
    group_id: int
    metrics: dict[str, float]
    enqueued_at: float | None = None


def group_advantages(
    trajectories: Sequence[Trajectory], eps: float, masked: Collection[str] = ()
) -> tuple[dict[str, float], float]:
    """Rollout id -> advantage over the group's valid members (a reward, some tokens and an outcome not in
    `masked`), and the rewards' std."""
    valid = [t for t in trajectories if t.reward is not None and t.rows and t.outcome not in masked]
    if not valid:
        return {}, 0.0
    rewards = np.array([t.reward for t in valid], dtype=np.float64)
    std = float(rewards.std())
    advantages = (rewards - rewards.mean()) / (std + eps)
    return {t.rollout_id: float(a) for t, a in zip(valid, advantages, strict=True)}, std


def masked_outcomes(config: WorkerConfig) -> frozenset[str]:
    """The outcomes kept out of every group under `config` (`WorkerConfig.mask_truncated`)."""
    return TRUNCATED_OUTCOMES if config.mask_truncated else frozenset()


class GroupAssembler:
    """Judges and assembles groups in the order they finish (the zero-variance limit counts drops in a row)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, config: WorkerConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self._zero_variance_drops = 0  # groups dropped for zero variance since the last one assembled

    def assemble(
        self, group_id: int, task: Task, trajectories: Sequence[Trajectory], policy_version: int
    ) -> tuple[list[Sample], DropReason | None]:
        """The group's samples at the trainer's `policy_version`, or the reason it is dropped."""
        c = self.config
        advantages, std = group_advantages(trajectories, c.advantage_eps, masked_outcomes(c))
        if len(advantages) < 2:
            return [], "too_few_valid"
        limit = c.max_zero_variance_drops
        if std == 0.0 and c.drop_zero_variance_groups and (limit is None or self._zero_variance_drops < limit):
            self._zero_variance_drops += 1
            return [], "zero_variance"
        valid = [t for t in trajectories if t.rollout_id in advantages]
        oldest = min(v for t in valid if (v := t.oldest_version) is not None)
        if policy_version - oldest > c.max_staleness:
            return [], "stale"
        prompt = [{"role": "user", "content": task.problem_statement}]
        samples = []
        for trajectory in valid:
            metrics = {
                "reward": float(trajectory.reward),  # type: ignore[arg-type]
                "reward_std": std,
                "resolved": float(trajectory.outcome == "resolved"),
                "turns": float(len(trajectory.turns)),
            }
            if trajectory.agent_name:  # which harness ran it: TRL averages each key over the samples that carry it
                metrics[f"agent_{trajectory.agent_name}/resolved"] = metrics["resolved"]
                metrics[f"agent_{trajectory.agent_name}/turns"] = metrics["turns"]
            for row in trajectory.rows:
                if row.model_version is None:  # a row with no generated token trains nothing
                    continue
                mask = np.frombuffer(row.completion_mask, dtype=np.int8).astype(np.int64)
                first = int(mask.argmax())
                completion = [{"role": "assistant", "content": self.tokenizer.decode(row.input_ids[first:].tolist())}]
                samples.append(
                    Sample(
                        prompt=prompt,
                        completion=completion,
                        input_ids=np.asarray(row.input_ids, dtype=np.int64),
                        completion_mask=mask,
                        old_log_probs=np.asarray(row.old_log_probs, dtype=np.float32),
                        advantage=advantages[trajectory.rollout_id],
                        model_version=oldest,  # the group's: the trainer keeps or drops the group whole
                        group_id=group_id,
                        metrics=dict(metrics),
                    )
                )
        if c.token_budget is not None and any(len(s.input_ids) > c.token_budget for s in samples):
            return [], "oversize"  # the trainer would drop that row alone and train the rest of the group
        self._zero_variance_drops = 0
        return samples, None
