"""Which task the worker's next group works on.

GRPO learns only from a group whose rewards differ: a group of a task the policy always solves, or never
solves, is dropped (`WorkerConfig.drop_zero_variance_groups`) after paying for all its rollouts. Two ways
to pick tasks:

- `"shuffle"` (the default): every task once per pass, in a new random order each pass, as a trainer walks
  its dataset.
- `"informative"`: each group's task is drawn with probability proportional to the chance that a group of
  it has mixed rewards, `1 - p^n - (1 - p)^n`, where `n` is the group size and `p` the task's recent
  resolved rate: the mean of its last `window` rewards with one success and one failure of prior. An
  unseen task counts as a coin flip, the most informative kind; a task whose last `window` rewards were
  all 1 (or all 0) keeps about a quarter of that weight (the prior), so a regression or a first success
  is still noticed. With a few tasks, the rollouts go where the policy is still undecided; with a large
  dataset of unseen tasks it is uniform sampling with replacement. This is sampling by pass rate, as in
  the curricula of SWE and math RL runs that filter groups by difficulty.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Literal, get_args

from swe_grpo.tasks import Task

TaskSampling = Literal["shuffle", "informative"]
TASK_SAMPLING: tuple[TaskSampling, ...] = get_args(TaskSampling)


class TaskSampler:
    """An endless stream of tasks (`stream`), told every graded reward (`record`). Deterministic for a seed
    and a sequence of records. Not thread-safe: the worker's event loop alone uses it."""

    def __init__(
        self,
        tasks: Sequence[Task],
        mode: TaskSampling = "shuffle",
        *,
        seed: int = 0,
        group_size: int = 8,
        window: int = 24,
    ):
        if mode not in TASK_SAMPLING:
            raise ValueError(f"unknown task sampling {mode!r}: choose one of {', '.join(TASK_SAMPLING)}")
        self.tasks = list(tasks)
        self.mode = mode
        self.group_size = group_size
        self._rng = random.Random(seed)
        self._rewards: dict[str, deque[float]] = {t.instance_id: deque(maxlen=window) for t in self.tasks}

    def record(self, instance_id: str, reward: float) -> None:
        """A graded rollout of `instance_id` earned `reward` (0.0 to 1.0)."""
        if instance_id in self._rewards:
            self._rewards[instance_id].append(min(1.0, max(0.0, reward)))

    def resolved_rate(self, instance_id: str) -> float:
        """The task's recent resolved rate, with one success and one failure of prior."""
        rewards = self._rewards[instance_id]
        return (sum(rewards) + 1.0) / (len(rewards) + 2.0)

    def weight(self, instance_id: str) -> float:
        """How likely a group of the task is to have mixed rewards, relative to a coin-flip task (1.0)."""
        p, n = self.resolved_rate(instance_id), self.group_size
        return (1.0 - p**n - (1.0 - p) ** n) / (1.0 - 2.0 * 0.5**n)

    def remove(self, instance_id: str) -> None:
        """Never draw `instance_id` again (the worker found it unrunnable)."""
        self.tasks = [t for t in self.tasks if t.instance_id != instance_id]

    def stream(self) -> Iterator[Task]:
        """Tasks, until every task is removed."""
        while self.tasks:
            if self.mode == "informative":
                yield self._rng.choices(self.tasks, weights=[self.weight(t.instance_id) for t in self.tasks])[0]
                continue
            order = list(self.tasks)
            self._rng.shuffle(order)
            yield from (task for task in order if task in self.tasks)
