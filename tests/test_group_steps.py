"""Which samples each optimizer step trains: groups from the worker's `GroupQueue`, read by TRL's own
training dataloader (`AsyncGRPOTrainer.get_train_dataloader`: its `RolloutQueueDataset`, `FixedCountBatcher`
or `TokenBudgetBatcher`, `DataCollatorForRollout`, and accelerate's dispatcher, which collates one micro-batch
ahead), stepped as transformers' `Trainer` steps (`gradient_accumulation_steps` micro-batches per optimizer
step) with TRL's weight sync after every `weight_sync_steps` steps, so the policy version moves mid-group.

What holds (docs/training.md, groups): a group's samples are read whole and in order, so a step is a run of
consecutive groups. With fixed-count micro-batches whose per-step count is a multiple of `num_generations`
(`WorkerConfig.from_trainer_args` refuses any other), every step holds whole groups while every group has
`num_generations` samples. Token-budgeted micro-batches, and groups of another size (a forked rollout adds a
sample, a failed member takes one away), can put one group into two steps: then only the first and last
group of a step are partial, and every sample is trained once, with its group's advantage."""

from __future__ import annotations

import queue
import types
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.group_queue import GroupQueue
from swe_grpo.worker.groups import Sample

TOKENS = 6  # per sample: 2 prompt tokens, 4 completion tokens, none shared with another sample


@dataclass
class Group:
    version: int  # the policy version the group was generated at
    advantages: Sequence[float]  # one per sample


@dataclass
class Trained:
    """What the steps trained: per optimizer step, (group id, sample index) of each sample."""

    steps: list[list[tuple[int, int]]]
    sizes: dict[int, int]  # group id -> its number of samples
    advantages: dict[tuple[int, int], float] = field(default_factory=dict)  # as trained
    read_after_sync: float = 0.0  # GroupQueue: samples read after the version moved within their group
    dropped_stale: float = 0.0  # TRL's staleness filter: samples dropped

    def partial(self, step: int) -> list[int]:
        """The groups of which `step` holds only a part."""
        counts = Counter(group for group, _ in self.steps[step])
        return sorted(group for group, n in counts.items() if n != self.sizes[group])


def trainer_args(tmp_path: Path, **settings: Any) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **settings)


def sample(group: int, index: int, advantage: float, version: int) -> Sample:
    first = 1000 * (group + 1) + 10 * index  # identifies the sample in what the collator is given
    return Sample(
        prompt=[],
        completion=[],
        input_ids=np.arange(first, first + TOKENS, dtype=np.int64),
        completion_mask=np.array([0, 0] + [1] * (TOKENS - 2), dtype=np.int64),
        old_log_probs=np.zeros(TOKENS, dtype=np.float32),
        advantage=advantage,
        model_version=version,
        group_id=group,
        metrics={},
    )


def train(groups: Sequence[Group], args: AsyncGRPOConfig, steps: int, tokenizer: Any, *, version: int) -> Trained:
    """Push `groups` (group id = index) into a `GroupQueue`, then take `steps` optimizer steps through TRL's
    training dataloader, starting at policy `version`; what each step trained. `groups` must hold more
    samples than the steps take: the dispatcher reads one micro-batch ahead."""
    metrics: queue.Queue[dict[str, Any]] = queue.Queue()
    buffer = GroupQueue(metrics)
    buffer.set_version(version)
    for group_id, group in enumerate(groups):
        buffer.put_group([sample(group_id, i, a, group.version) for i, a in enumerate(group.advantages)])

    def queue_ran_dry(stale_after_s: float) -> None:
        raise AssertionError("the steps took more samples than the test gave")

    # The attributes of AsyncGRPOTrainer its get_train_dataloader reads, with the accelerator it configures
    # (AsyncGRPOConfig sets split_batches and dispatch_batches).
    trainer = types.SimpleNamespace(
        accelerator=Accelerator(
            cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True, dispatch_batches=True)
        ),
        rollout_queue=buffer,
        model_version=version,
        rollout_worker=types.SimpleNamespace(check_health=queue_ran_dry),
        args=args,
        _metrics={"train": defaultdict(list)},
        processing_class=tokenizer,
        _trained_groups=set(),
    )
    loader = AsyncGRPOTrainer.get_train_dataloader(trainer)  # type: ignore[arg-type]
    collated: list[list[dict[str, Any]]] = []  # in the order the micro-batches are yielded
    collate = loader.base_dataloader.collate_fn

    def recording(examples: list[Any]) -> Any:
        (rows,) = examples
        collated.append([s for row in rows for s in row.samples])
        return collate(examples)

    loader.base_dataloader.collate_fn = recording
    micro_batches = iter(loader)
    for step in range(steps):
        # transformers' Trainer._inner_training_loop: gradient_accumulation_steps micro-batches per step.
        for _ in range(args.gradient_accumulation_steps):
            next(micro_batches)
        if (step + 1) % args.weight_sync_steps == 0:  # TRL's sync, on_step_end: its version, then the worker's
            trainer.model_version += 1
            buffer.set_version(trainer.model_version)

    trained = Trained(steps=[], sizes={i: len(g.advantages) for i, g in enumerate(groups)})
    per_step = args.gradient_accumulation_steps
    for step in range(steps):
        samples = [s for batch in collated[step * per_step : (step + 1) * per_step] for s in batch]
        ids = [(int(s["input_ids"][0]) // 1000 - 1, int(s["input_ids"][0]) % 1000 // 10) for s in samples]
        trained.steps.append(ids)
        trained.advantages.update(zip(ids, (float(s["advantage"]) for s in samples), strict=True))
    while not metrics.empty():
        trained.read_after_sync += metrics.get_nowait().get("groups/read_after_sync_samples_total", 0.0)
    trained.dropped_stale = sum(trainer._metrics["train"]["sample/dropped_stale_total"])
    return trained


def test_fixed_count_steps_hold_whole_groups_while_the_version_moves_mid_group(tmp_path: Path, tokenizer) -> None:
    """Micro-batches of 3, 4 per step: 12 samples, 3 groups of 4 a step, each micro-batch ending inside a
    group, and the one read ahead belonging to the next step, whose rest is read after the sync. Groups are
    generated one version behind the trainer (the staleness edge, max_staleness 1), and one (group 4) two
    behind: it is dropped whole. Every step trains whole groups only, with zero-mean advantages."""
    args = trainer_args(
        tmp_path,
        token_budget=0,
        per_device_train_batch_size=3,
        gradient_accumulation_steps=4,
        num_generations=4,
        max_staleness=1,
    )
    WorkerConfig.from_trainer_args(args)  # a configuration the worker accepts
    start, steps = 2, 4
    # 3 groups a step from step 0 on, each at the edge when its first sample is read; group 4 too stale.
    versions = [start - 1] * 4 + [start - 2] + [start - 1 + (g - 1) // 3 for g in range(5, 16)]
    groups = [Group(v, (1.0, 1.0, -1.0, -1.0)) for v in versions]
    trained = train(groups, args, steps, tokenizer, version=start)
    for step in range(steps):
        assert trained.partial(step) == [], f"step {step} trains part of a group"
        assert sum(trained.advantages[s] for s in trained.steps[step]) == pytest.approx(0.0)
    assert [sorted({g for g, _ in s}) for s in trained.steps] == [[0, 1, 2], [3, 5, 6], [7, 8, 9], [10, 11, 12]]
    assert trained.dropped_stale == 4  # group 4, whole
    assert trained.read_after_sync > 0  # the version did move within groups that were trained


def test_a_fixed_count_step_that_is_not_a_multiple_of_the_group_splits_groups_and_is_refused(
    tmp_path: Path, tokenizer
) -> None:
    """3 samples a step, groups of 4: every step ends inside a group, so each trains a part of one
    (advantages +1 +1 -1: not zero-mean) and the next step, with new weights, the rest. The worker's
    configuration refuses it; per-step counts that are multiples of the group are accepted."""
    args = trainer_args(tmp_path, token_budget=0, per_device_train_batch_size=3, num_generations=4, max_staleness=9)
    trained = train([Group(0, (1.0, 1.0, -1.0, -1.0)) for _ in range(5)], args, 4, tokenizer, version=0)
    assert [trained.partial(step) for step in range(4)] == [[0], [0, 1], [1, 2], [2]]
    with pytest.raises(ValueError, match="num_generations=4"):
        WorkerConfig.from_trainer_args(args)
    for per_device, accumulation in ((2, 2), (4, 1), (8, 3)):
        accepted = trainer_args(
            tmp_path,
            token_budget=0,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            num_generations=4,
        )
        assert WorkerConfig.from_trainer_args(accepted).num_generations == 4
    # Token-budgeted micro-batches have no fixed count: nothing to check (their steps: the test below).
    budgeted = trainer_args(tmp_path, token_budget=20, per_device_train_batch_size=3, num_generations=4)
    assert WorkerConfig.from_trainer_args(budgeted).token_budget == 20


@pytest.mark.parametrize(
    ("settings", "sizes"),
    [
        # Token budget 20: 3 samples a micro-batch, 2 per step, groups of 4.
        ({"token_budget": 20, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 1}, (4,) * 12),
        # 8 samples a step, a multiple of 4, but a forked rollout makes a group of 5, a failed member one of 3.
        ({"token_budget": 0, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}, (4, 5, 4, 3) * 3),
    ],
    ids=["token-budget", "fixed-count-uneven-groups"],
)
def test_when_a_group_spans_two_steps_only_the_first_and_last_group_of_a_step_are_partial(
    tmp_path: Path, tokenizer, settings: dict[str, Any], sizes: tuple[int, ...]
) -> None:
    """TRL's batchers close micro-batches without regard to groups, so one group can be trained in two
    optimizer steps (TRL's synchronous GRPOTrainer does the same when steps_per_generation exceeds
    gradient_accumulation_steps). Because GroupQueue hands groups over whole and in order, a step is a run of
    consecutive groups: only its first and last group can be partial, a group spans consecutive steps, and
    every sample is trained once with the advantage its group gave it."""
    args = trainer_args(tmp_path, num_generations=4, max_staleness=9, **settings)
    WorkerConfig.from_trainer_args(args)
    groups = [Group(0, [(-1.0) ** i for i in range(n)]) for n in sizes]
    steps = 4
    trained = train(groups, args, steps, tokenizer, version=0)
    split = 0
    for step in range(steps):
        present = sorted({g for g, _ in trained.steps[step]})
        assert present == list(range(present[0], present[-1] + 1)), f"step {step} skips a group"
        assert set(trained.partial(step)) <= {present[0], present[-1]}
        split += len(trained.partial(step))
    assert split > 0  # the case this test is about happens (TRL's batchers as of 1.16)
    seen = [s for step in trained.steps for s in step]
    assert len(seen) == len(set(seen))  # no sample twice
    first, last = seen[0][0], seen[-1][0]
    inner = {(g, i) for g in range(first + 1, last) for i in range(sizes[g])}
    assert inner <= set(seen)  # nothing of a group inside the run is missing
    assert all(trained.advantages[(g, i)] == groups[g].advantages[i] for g, i in seen)
    assert trained.dropped_stale == 0
