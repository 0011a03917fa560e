"""GroupQueue: the worker's `rollout_buffer`, which makes TRL's per-sample staleness check keep or drop a group whole.

TRL 1.16's `RolloutQueueDataset.__iter__` gets ONE sample at a time and drops it when
`trainer_version - sample.model_version > max_staleness`, reading the trainer's version anew for each sample.
Every sample of a group carries the group's version, but the trainer's version can move between two samples
of one group: its batcher closes a micro-batch in the middle of a group, the trainer steps, syncs weights
(`model_version += 1`, then `update_model_version`), and only then reads the rest of the group. At the
staleness edge a plain queue lets TRL drop the rest: a group with advantages (+1, +1, -1, -1) would be
trained as (+1, +1).

No honest stamp chosen when the group is pushed can prevent that: how many syncs fall inside a group depends on
the trainer's batching. So the decision is made once per group, when the trainer reads the group's first
sample, exactly as TRL makes it then (this queue's version is the trainer's: both move in the same call on
the trainer's thread, before its next read). A sample of the group read after the version moved by `k` is
handed over with `model_version + k`: TRL then sees the staleness the group had when its first sample was
read, and keeps or drops it as it did that one. The true staleness of such samples is reported in metrics
(`groups/read_after_sync_*`), so what was trained past `max_staleness` is counted, never hidden.

Groups are handed over whole and in order, so an optimizer step trains a run of consecutive groups. Where
that run ends is TRL's batchers' choice, not this queue's: a group can be trained in two consecutive steps
(then only the first and last group of a step are partial), unless micro-batches hold a fixed count and
every group has `num_generations` samples (tests/test_group_steps.py).

Groups arrive as `swe_grpo.worker.groups.Sample`s (what a rollout host can build without TRL) and are
stored as TRL's own `RolloutSample`s, the class its `RolloutQueueDataset` reads.
"""

from __future__ import annotations

import dataclasses
import queue
from collections import deque
from collections.abc import Sequence

from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from swe_grpo.worker.groups import Sample

Metrics = dict[str, float | tuple[float, float]]


_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))  # RolloutSample's, in its order


def _trl_sample(sample: Sample | RolloutSample) -> RolloutSample:
    if isinstance(sample, RolloutSample):
        return sample
    return RolloutSample(*(getattr(sample, name) for name in _FIELDS))


class GroupQueue(queue.Queue):
    """A `queue.Queue` of `RolloutSample`s that is filled a whole group at a time (`put_group`), and read one
    sample at a time by the trainer (`get`), each sample restamped as the module docstring says. `qsize()`
    counts samples, as TRL's `sample/rollout_queue_size` and the worker's backpressure expect."""

    def __init__(self, metrics: queue.Queue[Metrics]) -> None:
        self._metrics = metrics
        self._version = 0  # the trainer's, as of its latest `update_model_version` (0 before the first, like its own)
        super().__init__()

    # queue.Queue's storage hooks (the ones its own LifoQueue and PriorityQueue override), called under its lock.
    def _init(self, maxsize: int) -> None:
        self._groups: deque[deque[RolloutSample]] = deque()
        self._samples = 0
        self._first_read_at: int | None = None  # the trainer's version when it read the open group's first sample

    def _qsize(self) -> int:
        return self._samples

    def _put(self, group: Sequence[RolloutSample]) -> None:
        self._groups.append(deque(group))
        self._samples += len(group)

    def _get(self) -> RolloutSample:
        group = self._groups[0]
        sample = group.popleft()
        self._samples -= 1
        if self._first_read_at is None:
            self._first_read_at = self._version
        moved = self._version - self._first_read_at
        if not group:
            self._groups.popleft()
            self._first_read_at = None
        if not moved:
            return sample
        self._metrics.put(
            {
                "groups/read_after_sync_samples_total": 1.0,
                "groups/read_after_sync_staleness_max": float(self._version - sample.model_version),
            }
        )
        return dataclasses.replace(sample, model_version=sample.model_version + moved)

    def put_group(self, samples: Sequence[Sample | RolloutSample]) -> None:
        """Enqueue a group's samples as one item, as `RolloutSample`s: the trainer reads them one after
        another, never interleaved with another group's."""
        if samples:
            self.put([_trl_sample(s) for s in samples])

    def set_version(self, version: int) -> None:
        """The trainer's version moved to `version` (call it before anything else at a weight sync)."""
        with self.mutex:
            self._version = version
