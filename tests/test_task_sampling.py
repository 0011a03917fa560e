"""Which task a group works on: every task once per pass, or drawn by how likely its group is to teach."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.task_sampling import TaskSampler

TASKS = demo_tasks()
SOLVED, MIXED, FAILED = (t.instance_id for t in TASKS)


def draws(sampler: TaskSampler, n: int) -> Counter[str]:
    return Counter(t.instance_id for t in itertools.islice(sampler.stream(), n))


def test_shuffle_visits_every_task_once_per_pass_in_a_seeded_order() -> None:
    stream = TaskSampler(TASKS, "shuffle", seed=3).stream()
    passes = [[next(stream).instance_id for _ in TASKS] for _ in range(6)]
    assert all(sorted(p) == sorted(t.instance_id for t in TASKS) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # a new order each pass
    again = TaskSampler(TASKS, "shuffle", seed=3).stream()
    assert [next(again).instance_id for _ in range(len(TASKS) * 6)] == list(itertools.chain(*passes))


def test_informative_draws_the_undecided_task_most_and_never_drops_the_others() -> None:
    sampler = TaskSampler(TASKS, "informative", seed=0, group_size=8)
    unseen = draws(sampler, 3000)
    assert min(unseen.values()) > 800  # unseen tasks are coin flips: all equally likely
    for _ in range(24):
        sampler.record(SOLVED, 1.0)
        sampler.record(FAILED, 0.0)
    for reward in [1.0, 0.0, 1.0, 1.0] * 6:
        sampler.record(MIXED, reward)
    counts = draws(sampler, 3000)
    assert counts[MIXED] > 0.55 * 3000
    # The prior: a solved or hopeless task is still drawn now and then, so a change in it is seen.
    assert counts[SOLVED] > 0.1 * 3000 and counts[FAILED] > 0.1 * 3000


def test_informative_follows_the_recent_window_not_the_whole_history() -> None:
    sampler = TaskSampler(TASKS, "informative", group_size=8, window=24)
    for _ in range(100):
        sampler.record(SOLVED, 1.0)
    low = sampler.weight(SOLVED)
    for reward in [0.0, 1.0] * 8:  # the policy regressed on it: 16 of the last 24 rewards are mixed
        sampler.record(SOLVED, reward)
    assert low < 0.3
    assert sampler.weight(SOLVED) > 0.9


def test_a_removed_task_is_never_drawn_and_the_stream_ends_with_the_last() -> None:
    for mode in ("shuffle", "informative"):
        sampler = TaskSampler(TASKS, mode)
        stream = sampler.stream()
        next(stream)
        sampler.remove(SOLVED)
        assert SOLVED not in {next(stream).instance_id for _ in range(50)}
        sampler.remove(MIXED)
        sampler.remove(FAILED)
        assert list(stream) == []


def test_an_unknown_sampling_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="shuffle, informative"):
        WorkerConfig(task_sampling="hardest-first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shuffle, informative"):
        TaskSampler(TASKS, "hardest-first")  # type: ignore[arg-type]
