"""GroupAssembler (swe_grpo/groups.py): how a group's graded attempts become the trainer's samples —
advantages over valid members, one sample per training row, the group's honest version on every sample,
and groups that cannot teach dropped whole with the reason — read back through TRL's own staleness filter."""

from __future__ import annotations

import dataclasses
import queue
from collections import defaultdict

import pytest
from accelerate import PartialState
from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset

from swe_grpo.chain import TrainingRow
from swe_grpo.groups import GroupAssembler
from swe_grpo.rollout import Trajectory
from swe_grpo.tasks import demo_tasks
from swe_grpo.worker_config import WorkerConfig

KEEP_ALL = WorkerConfig(num_generations=2, drop_zero_variance_groups=False)


def row(prompt: int, completion: int, version: int | None) -> TrainingRow:
    r = TrainingRow()
    r.extend_prompt(list(range(10, 10 + prompt)))
    if version is not None:
        r.extend_completion(list(range(50, 50 + completion)), [-0.5] * completion, version)
    return r


def trajectory(reward: float | None, rows: list[TrainingRow], outcome: str | None = None) -> Trajectory:
    outcome = outcome or {1.0: "resolved", 0.0: "unresolved", None: "infra_error"}[reward]
    return Trajectory("t", f"r{id(rows)}", outcome, reward, rows=rows, timings={"sandbox_create": 0.1})


def rewarded(*rewards: float | None) -> list[Trajectory]:
    return [trajectory(r, [row(4, 2, 1)]) for r in rewards]


@pytest.fixture
def assemble(tokenizer):
    """Assemble with a fresh `GroupAssembler` (config KEEP_ALL unless given) as group 7 of the first demo
    task, at policy version `version`."""

    def assemble(trajectories: list[Trajectory], *, version: int = 1, config: WorkerConfig = KEEP_ALL):
        return GroupAssembler(tokenizer, config).assemble(7, demo_tasks()[0], trajectories, version)

    return assemble


def test_advantages_use_valid_members_only(assemble) -> None:
    members = [trajectory(1.0, [row(5, 3, 1)]), trajectory(0.0, [row(5, 2, 1)]), trajectory(0.0, [row(5, 4, 1)])]
    infra = trajectory(None, [row(5, 3, 1)])
    samples, reason = assemble([*members, infra])
    assert reason is None
    assert len(samples) == 3  # the infrastructure failure is neither in the baseline nor trained on
    mean, std = 1 / 3, (2 / 9) ** 0.5
    eps = KEEP_ALL.advantage_eps
    assert [s.advantage for s in samples] == pytest.approx([(r - mean) / (std + eps) for r in (1, 0, 0)])
    assert sum(s.advantage for s in samples) == pytest.approx(0.0, abs=1e-9)
    assert {s.group_id for s in samples} == {7}
    first = samples[0]
    assert first.input_ids.tolist() == list(range(10, 15)) + list(range(50, 53))
    assert first.completion_mask.tolist() == [0] * 5 + [1] * 3
    assert first.old_log_probs.tolist() == [0.0] * 5 + [-0.5] * 3
    assert first.metrics["reward"] == 1.0 and first.metrics["reward_std"] == pytest.approx(std)
    assert first.prompt == [{"role": "user", "content": demo_tasks()[0].problem_statement}]


def test_a_forked_rollout_gives_one_sample_per_row_with_its_advantage_and_the_groups_version(assemble) -> None:
    forked = trajectory(1.0, [row(5, 3, 2), row(9, 2, 3)])
    samples, reason = assemble([forked, trajectory(0.0, [row(5, 3, 3)])], version=3)
    assert reason is None
    assert [s.model_version for s in samples] == [2, 2, 2]  # the group's oldest token, on every sample
    assert samples[0].advantage == samples[1].advantage > 0 > samples[2].advantage


def test_a_row_without_generated_tokens_gives_no_sample(assemble) -> None:
    samples, reason = assemble([trajectory(1.0, [row(5, 3, 1), row(9, 0, None)]), trajectory(0.0, [row(5, 3, 1)])])
    assert reason is None and len(samples) == 2


def trainer_keeps(samples: list, trainer_version: int, max_staleness: int) -> list:
    """The samples AsyncGRPOTrainer trains on when it reads them at `trainer_version`: TRL's own
    `RolloutQueueDataset` (the trainer's staleness filter, trl/experimental/async_grpo/async_grpo_trainer.py,
    `__iter__`: `version - sample.model_version > max_staleness` drops the sample) drains a queue of them."""

    class Drained(Exception):
        pass

    def empty(stale_after_s: float) -> None:  # the trainer calls check_health when the queue stays empty
        raise Drained

    PartialState(cpu=True)  # the dataset logs through accelerate, as inside the trainer
    buffer: queue.Queue = queue.Queue()
    for sample in samples:
        buffer.put(sample)
    dataset = RolloutQueueDataset(
        buffer,
        lambda: trainer_version,
        empty,
        300.0,
        defaultdict(list),
        max_staleness=max_staleness,
        poll_interval_s=0.01,
    )
    kept = []
    with pytest.raises(Drained):
        for item in dataset:
            kept.append(item)
    return kept


def test_the_trainers_staleness_filter_keeps_or_drops_a_group_whole(assemble) -> None:
    """Members whose oldest tokens come from v2, v3 and v4 (one of them forked across v2 and v3): pushed
    at v4, read by the trainer at v5 (max_staleness 2), the group must not lose its v2 rows only."""
    members = [
        trajectory(1.0, [row(5, 3, 2), row(9, 2, 3)]),
        trajectory(0.0, [row(5, 3, 3)]),
        trajectory(0.0, [row(5, 2, 4)]),
    ]
    samples, reason = assemble(members, version=4)
    assert reason is None and len(samples) == 4
    for trainer_version in range(4, 8):
        kept = trainer_keeps(samples, trainer_version, KEEP_ALL.max_staleness)
        assert len(kept) in (0, len(samples)), f"part of the group trained at v{trainer_version}"
    assert len(trainer_keeps(samples, 4, 2)) == 4 and trainer_keeps(samples, 5, 2) == []


@pytest.mark.parametrize(
    ("rewards", "reason"),
    [
        ((1.0, None, None), "too_few_valid"),
        ((0.0, 0.0, 0.0), "zero_variance"),
        ((1.0, 1.0), "zero_variance"),
    ],
)
def test_groups_that_cannot_teach_are_dropped_whole(assemble, rewards, reason: str) -> None:
    assert assemble(rewarded(*rewards), config=WorkerConfig()) == ([], reason)


def test_zero_variance_groups_can_be_kept(assemble) -> None:
    samples, reason = assemble(rewarded(0.0, 0.0))
    assert reason is None and [s.advantage for s in samples] == [0.0, 0.0]


def test_after_max_zero_variance_drops_in_a_row_the_next_such_group_is_trained(tokenizer) -> None:
    """A policy that solves every task makes nearly every group all-solved: dropping them all would leave
    the trainer waiting ever longer for a mixed one (a demo step drew 225 rollouts). With the limit set,
    the group after that many drops in a row is pushed with advantage 0; a mixed group resets the count."""
    assembler = GroupAssembler(tokenizer, WorkerConfig(max_zero_variance_drops=2))

    def reasons(*groups: tuple[float, ...]) -> list[str | None]:
        return [assembler.assemble(7, demo_tasks()[0], rewarded(*g), 1)[1] for g in groups]

    solved, mixed = (1.0, 1.0), (1.0, 0.0)
    assert reasons(solved, solved, solved, solved, solved, solved) == ["zero_variance", "zero_variance", None] * 2
    assert reasons(solved, mixed, solved, solved, solved) == [
        "zero_variance",
        None,
        "zero_variance",
        "zero_variance",
        None,
    ]
    reasons(solved, solved)
    samples, reason = assembler.assemble(7, demo_tasks()[0], rewarded(1.0, 1.0), 1)
    assert reason is None and [s.advantage for s in samples] == [0.0, 0.0]
    with pytest.raises(ValueError, match="max_zero_variance_drops"):
        WorkerConfig(max_zero_variance_drops=-1)


def test_a_group_whose_oldest_tokens_are_too_stale_is_dropped(assemble) -> None:
    members = [trajectory(1.0, [row(4, 2, 3)]), trajectory(0.0, [row(4, 2, 2)])]  # max_staleness 2: v2 is out
    assert assemble(members, version=5) == ([], "stale")
    members = [trajectory(1.0, [row(4, 2, 3)]), trajectory(0.0, [row(4, 2, 4)])]
    assert assemble(members, version=5)[1] is None
    assert assemble(members, version=4, config=dataclasses.replace(KEEP_ALL, max_staleness=0)) == ([], "stale")
