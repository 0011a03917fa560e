"""GroupAssembler (swe_grpo/worker/groups.py): how a group's graded attempts become the trainer's samples —
advantages over valid members, one sample per training row, the group's honest version on every sample,
and groups that cannot teach dropped whole with the reason — read back through TRL's own staleness filter."""

from __future__ import annotations

import dataclasses
import http.server
import json
import queue
import threading
from collections import defaultdict
from collections.abc import Iterator

import pytest
from accelerate import PartialState
from trl.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from trl.experimental.async_grpo.async_grpo_trainer import FixedCountBatcher, RolloutQueueDataset, TokenBudgetBatcher

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.rollout import Trajectory
from swe_grpo.tokens.chain import TrainingRow
from swe_grpo.worker import SWERolloutWorker
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.groups import GroupAssembler

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


@pytest.mark.parametrize("outcome", ["agent_stalled", "agent_timeout", "context_overflow"])
def test_the_policys_truncations_are_trained_on_as_0_unless_masked(assemble, outcome: str) -> None:
    """A stall, the wall clock or the context after the policy's first turn earns 0.0 in its group (it cannot
    escape its baseline so); `mask_truncated` (DeepSWE's compact filtering) leaves it out instead, and nothing
    else: a crash or a wrong patch still counts."""
    members = [trajectory(1.0, [row(5, 3, 1)]), trajectory(0.0, [row(5, 2, 1)])]
    cut = trajectory(0.0, [row(5, 4, 1)], outcome)
    crashed = trajectory(0.0, [row(5, 4, 1)], "agent_crashed")
    samples, reason = assemble([*members, cut, crashed])
    assert reason is None and len(samples) == 4
    assert samples[2].advantage == samples[3].advantage < 0
    masked = dataclasses.replace(KEEP_ALL, mask_truncated=True)
    samples, reason = assemble([*members, cut, crashed], config=masked)
    assert reason is None and len(samples) == 3  # the truncated one is neither in the baseline nor trained on
    mean, eps = 1 / 3, KEEP_ALL.advantage_eps
    assert [s.advantage for s in samples] == pytest.approx([(r - mean) / ((2 / 9) ** 0.5 + eps) for r in (1, 0, 0)])


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


class ServedModels(http.server.BaseHTTPRequestHandler):
    """vLLM's `/v1/models` listing the base model only (a FAKE vLLM, for the worker's listing at a weight sync:
    nothing is generated here)."""

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "tiny"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def models_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ServedModels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_group_reaches_the_trainer_whole_when_its_version_moves_mid_group(tokenizer, models_url: str) -> None:
    """The trainer reads the worker's `rollout_buffer` through TRL's own `RolloutQueueDataset` (which checks
    each SAMPLE against the trainer's version when it reads it) and `FixedCountBatcher`, 3 samples a
    micro-batch, and syncs weights after each (weight_sync_steps 1): its version moves between samples of
    one group of 4. Groups from v0 (at the staleness edge when first read at v1), v1, v0 again (too stale
    when read at v3) and v3, each rewarded (1, 1, 0, 0): the first two must not be trained as (+1, +1, -1)
    and (+1, +1) with their last samples dropped; every group is trained whole, or dropped whole."""
    config = WorkerConfig(num_generations=4, max_staleness=1)
    worker = SWERolloutWorker(demo_tasks(), tokenizer, vllm_url=models_url, model="tiny", config=config)
    trainer_version = 1
    worker.update_model_version(trainer_version)  # the trainer's first sync
    assembler = GroupAssembler(tokenizer, config)
    for group_id, version in enumerate((0, 1, 0, 3)):
        members = [trajectory(reward, [row(4, 2, version)]) for reward in (1.0, 1.0, 0.0, 0.0)]
        samples, reason = assembler.assemble(group_id, demo_tasks()[0], members, version)
        assert reason is None
        worker.outlet.put_group(samples)

    class Drained(Exception):
        pass

    def drained(stale_after_s: float) -> None:  # the trainer calls check_health when the queue stays empty
        raise Drained

    PartialState(cpu=True)  # the dataset logs through accelerate, as inside the trainer
    metrics: defaultdict[str, list] = defaultdict(list)
    dataset = RolloutQueueDataset(
        worker.rollout_buffer,
        lambda: trainer_version,
        drained,
        300.0,
        metrics,
        max_staleness=config.max_staleness,
        poll_interval_s=0.01,
    )
    read: list[dict] = []

    def through_the_staleness_filter() -> Iterator[dict]:
        for sample in dataset:
            read.append(sample)
            yield sample

    with pytest.raises(Drained):
        for _micro_batch in FixedCountBatcher(through_the_staleness_filter(), num_processes=1, microbatch_size=3):
            trainer_version += 1  # the micro-batch was one optimizer step; then a weight sync
            worker.update_model_version(trainer_version)
    trained: defaultdict[int, list[float]] = defaultdict(list)
    for sample in read:
        trained[sample["group_id"]].append(sample["advantage"])
    assert {group: len(advantages) for group, advantages in trained.items()} == {0: 4, 1: 4, 3: 4}
    assert all(sum(advantages) == pytest.approx(0.0) for advantages in trained.values())
    assert sum(metrics["sample/dropped_stale_total"]) == 4  # group 2, whole
    moved: defaultdict[str, list[float]] = defaultdict(list)
    while not worker.metrics_queue.empty():
        for key, value in worker.metrics_queue.get_nowait().items():
            moved[key].append(value)
    # Samples read after the version moved within their group (A's last, B's last two, D's last three) were
    # trained with their group; how stale they really were (B's at v3 from v1) is reported, not hidden.
    assert sum(moved["groups/read_after_sync_samples_total"]) == 6
    assert max(moved["groups/read_after_sync_staleness_max"]) == 2


def test_a_group_with_a_row_over_the_trainers_token_budget_is_dropped_whole(assemble, tmp_path) -> None:
    """TRL's `TokenBudgetBatcher` drops a sample longer than `token_budget` alone, leaving the rest of its
    group to be trained; the worker, knowing the trainer's budget, drops such a group whole instead."""
    members = [trajectory(1.0, [row(4, 2, 1), row(30, 4, 1)]), trajectory(0.0, [row(4, 2, 1)])]
    samples, reason = assemble(members)
    assert reason is None and max(len(s.input_ids) for s in samples) == 34
    metrics: defaultdict[str, list] = defaultdict(list)
    fields = ("input_ids", "completion_mask", "old_log_probs", "advantage", "group_id", "metrics")
    unbatched = [{name: getattr(s, name) for name in fields} for s in samples]  # as RolloutQueueDataset yields
    PartialState(cpu=True)  # the batcher warns through accelerate, as inside the trainer
    list(TokenBudgetBatcher(unbatched, num_processes=1, token_budget=20, metrics=metrics))
    assert metrics["batch/dropped_oversize_total"] == [1.0]  # what the trainer would do: part of the group
    budget = WorkerConfig.from_trainer_args(AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget=20))
    assert budget.token_budget == 20
    assert assemble(members, config=dataclasses.replace(KEEP_ALL, token_budget=20)) == ([], "oversize")
    assert assemble(members, config=dataclasses.replace(KEEP_ALL, token_budget=34))[1] is None
    # 0 or less: the trainer batches a fixed count and drops nothing; None: it uses vLLM's max_model_len.
    unbounded = WorkerConfig.from_trainer_args(AsyncGRPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget=0))
    assert unbounded.token_budget is None
