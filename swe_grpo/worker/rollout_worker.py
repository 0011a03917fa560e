"""SWERolloutWorker: SWE rollouts as training samples for TRL's `AsyncGRPOTrainer`.

It satisfies TRL's `RolloutWorkerProtocol`: the trainer calls `update_model_version(1)` after its first
weight sync, then `start()`, drains `rollout_buffer` (TRL's own `RolloutSample`s) and `metrics_queue`,
calls `update_model_version(v)` after every sync, `check_health()` whenever the buffer stays empty,
and `stop()` at the end.

What it guarantees:
- Sampling is the trainer's. `WorkerConfig.from_trainer_args` takes every sampling setting TRL's own
  worker sends to vLLM (temperature, top_p, top_k, min_p, repetition_penalty, max_completion_length)
  and the `chat_template_kwargs` it renders prompts with (e.g. `enable_thinking`); each reaches every
  vLLM request or the rendered prompt. A setting the worker cannot honour (`max_tool_calling_iterations`:
  Pi runs its own tool loop) is refused with the reason.
- Groups (assembled by swe_grpo/worker/groups.py). Each task drawn is attempted `num_generations` times.
  Advantages are `(r - mean) / (std + eps)` over the group's *valid* members: a rollout that ended in an
  infrastructure outcome (reward None: infra_error, rollout_error, timeout, context_overflow, or
  cancelled as stale) is left out of the baseline and not trained on. A group with fewer than two
  valid members, with zero reward variance (configurable, and boundable: `max_zero_variance_drops`), whose
  oldest tokens are too stale, or a row over the trainer's `token_budget`, is dropped and counted. A group
  is pushed whole or not at all, one `RolloutSample` per training row (a forked conversation gives several
  rows, all with the conversation's advantage).
- One honest version per group. Every sample of a group carries the group's `model_version`: the oldest
  policy version that produced any token of any member. The trainer's per-sample staleness filter keeps or
  drops a group whole, even across a sync mid-group: `rollout_buffer` is a GroupQueue (group_queue.py).
  When the trainer's version moves on, rollouts whose oldest tokens can no longer be consumed are
  cancelled at any stage, grading included: their vLLM request is aborted, Pi and the sandboxes are
  killed.
- The served policy is discovered, never assumed. On `update_model_version(v)` the worker lists vLLM's
  models: if the trainer published the adapter `{adapter_prefix}-v{v}` (PEFT model + a server with
  `--enable-lora`), every later generation names it; if the server holds no such adapters at all, the
  trainer syncs full weights and generations name the base model. A server that holds older adapters
  but not `v` is an error, never a silently stale policy.
- Backpressure. No group is launched while `queue_maxsize` samples wait for the trainer (the
  trainer's setting of that name; 0 or TRL's default 1024 leave it effectively unbounded): work the
  trainer would only drop as stale would take the compute it needs. `rollout/backpressure_s` counts it.
- Traces. With `log_traces` (on when the trainer reports to trackio), the first group finished at
  each policy version goes to the trainer's trackio run: every member's whole conversation with Pi,
  its diff, outcome and advantage, side by side.
- Generation failures that persist are raised. A rollout whose generation failed for an
  infrastructure reason (any status: vLLM down, 5xx, a 404 for a model it no longer serves) stops all
  new launches until a probe (one token from the live policy's model) succeeds again. An adapter vLLM
  no longer lists (a restart loses the adapters loaded at runtime) is re-loaded from the trainer's
  copy (`adapter_dir`, which `from_trainer_args` sets to where TRL writes them) when it is there.
  Generation failing for longer than the trainer's `stale_after_s` makes `check_health` raise with the
  latest cause and what to do.
- Health that matches the work. A rollout in flight is progress at every stage (sandbox creation,
  agent turns, generation, grading), because the worker bounds each rollout itself
  (`rollout_limit_s`, then outcome `timeout`): rollouts that are all grading for longer than the
  trainer's heartbeat never trip it. `check_health` raises when the worker crashed or exited, when
  its event loop is blocked, when generation keeps failing (above), or when nothing is in flight and
  nothing happened for `stale_after_s`.
- One rollout's failure is that rollout's outcome. Any exception inside a rollout becomes its outcome
  `rollout_error` with the cause (logged with its traceback); instance ids are made safe for rollout
  ids. A sandbox that fails to start is retried once before it counts against the group; a task
  whose every member could not run is skipped from then on (counted), and when no task is left
  `check_health` raises with the last cause. Only a defect in the worker's own loop is re-raised by
  `check_health`, with its original traceback.
- Nothing lost, nothing hung. Every rollout started (`rollout/started_total`) ends exactly once as a
  named outcome counted in `metrics_queue` (`rollout/outcome_<outcome>_total`), or cancelled as stale
  (`rollout/stale_cancelled_total`) or by `stop()` (`rollout/stop_cancelled_total`); `stop()` cancels
  everything and leaves no sandbox, process or mount behind.

Process model: the trainer's process only trains. With `WorkerConfig.rollout_hosts = N` (default 1) the
worker the trainer holds spawns N rollout hosts (swe_grpo/worker/hosts.py), child processes that each run
this same engine (its own InterceptionServer, Pi, sandboxes, grading) on a share of
`max_concurrent_rollouts`; the trainer's side only moves groups of samples, metrics, traces and log
records out of them and the policy into them, asks each for its health and stops them. Every guarantee
above holds across that boundary (rollout_hosts.py says how), and a host stops its engine when the
trainer dies, even by SIGKILL. In one process, the InterceptionServer, Pi's traffic and grading would
share the GIL with the training loop, and one event loop tops out at ~170 requests/s. A host is spawned,
not forked, so a script that builds the worker needs the `if __name__ == "__main__":` guard, as with
TRL's own worker; `host_setup` (picklable) runs first in each host. `rollout_hosts=0` runs the engine in
a daemon thread of the trainer's process instead (the engine's own mode, which every host uses inside).
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from transformers import PreTrainedTokenizerBase
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from urllib3.util.retry import Retry

from swe_grpo.agents import Agent, AgentConfig, make_agent
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox import make_backend
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.serving.door import remove_orphaned_doors
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient, VLLMError
from swe_grpo.tasks import Task, tasks_from_dataset
from swe_grpo.types import Policy, RolloutWorkerError
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.group_queue import GroupQueue
from swe_grpo.worker.groups import GroupAssembler, group_advantages
from swe_grpo.worker.hosts import EngineArgs, HostSpec, ProcessHost, RolloutHost, RolloutHosts
from swe_grpo.worker.task_sampling import TaskSampler

log = logging.getLogger(__name__)

# Request errors that mean generation itself failed (vLLM unreachable, 5xx, or a 4xx such as a 404 for a
# model it no longer serves), as opposed to what the model or the agent did.
_GENERATION_FAILURES = ("server_unavailable", "bad_response")
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]")  # what the InterceptionServer refuses in a rollout id
# Listing vLLM's models at a weight sync: a vLLM unreachable or answering 5xx for a while (a restart, a burst)
# is waited for, about a minute (backoff 0, 2, 4 ... 32 s), instead of stopping training with an exception.
_LIST_RETRIES = Retry(total=6, backoff_factor=1.0, status_forcelist=(500, 502, 503, 504), raise_on_status=False)


class QueueOutlet:
    """Where a rollout engine's output goes in the trainer's process: its `rollout_buffer` (a group at a
    time) and `metrics_queue`, and its trackio run for traces. A rollout host has its own outlet, which
    sends the same to the trainer's side, where this one delivers it."""

    def __init__(self, buffer: GroupQueue, metrics: queue.Queue[dict[str, float | tuple[float, float]]]) -> None:
        self.buffer = buffer
        self.metrics = metrics

    def put_group(self, samples: list[RolloutSample]) -> None:
        now = time.time()
        for sample in samples:
            sample.enqueued_at = now
        self.buffer.put_group(samples)

    def put_metrics(self, metrics: dict[str, float | tuple[float, float]]) -> None:
        self.metrics.put(metrics)

    def put_traces(self, step: int, traces: list[Any]) -> None:
        """Log agent traces to the trainer's trackio run; best effort: a failure is logged, never raised."""
        import trackio

        try:
            trackio.log({"rollouts/agent": traces}, step=step)
        except Exception as e:  # e.g. no trackio run: the trainer was not given report_to=trackio
            log.warning("agent traces not logged: %s: %s", type(e).__name__, e)

    def waiting(self) -> int:
        """Samples waiting for the trainer."""
        return self.buffer.qsize()


@dataclass(frozen=True)
class _Failing:
    """Generation has failed since `since` (`time.monotonic()`); `cause` is the latest reason."""

    since: float
    cause: str


@dataclass
class _Group:
    group_id: int
    task: Task
    rollouts: list[asyncio.Task]


class SWERolloutWorker:
    """Runs Pi on SWE tasks against a vLLM server and feeds the graded rollouts to the trainer.

    `tasks`: `Task`s, or rows in SWE-Gym's shape (a `datasets.Dataset`, a list of dicts).
    `tokenizer`: the policy's tokenizer (its chat template becomes TRL's training template).
    `vllm_url`/`model`: the server and its base model's served name. `sandbox`: a backend name
    (`local`, `docker`, `hf`) or a `SandboxBackend` (pickled into each rollout host: a backend built there
    by name needs no pickling). `host_setup`: called first where the rollouts run (each rollout host, or
    this process with `rollout_hosts=0`), e.g. to configure logging; a module-level function or a
    `functools.partial` of one, since it is pickled into the hosts.
    """

    def __init__(
        self,
        tasks: Sequence[Task] | Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        *,
        vllm_url: str,
        model: str,
        sandbox: str | SandboxBackend = "local",
        config: WorkerConfig | None = None,
        agent: Agent | None = None,
        vllm_api_key: str | None = None,
        host_setup: Callable[[], None] | None = None,
    ):
        rows = list(tasks)
        self.tasks = rows if all(isinstance(t, Task) for t in rows) else tasks_from_dataset(rows, source="tasks")
        if not self.tasks:
            raise ValueError("no tasks")
        self.tokenizer = tokenizer
        self.vllm_url = vllm_url.rstrip("/")
        self.model = model
        self.backend = make_backend(sandbox) if isinstance(sandbox, str) else sandbox
        self.config = config or WorkerConfig()
        self.agent = agent or make_agent(self.config.agent)
        self._api_key = vllm_api_key
        self.metrics_queue: queue.Queue[dict[str, float | tuple[float, float]]] = queue.Queue()
        self.rollout_buffer = GroupQueue(self.metrics_queue)  # keeps TRL from training part of a group
        self.outlet: Any = QueueOutlet(self.rollout_buffer, self.metrics_queue)  # a rollout host sets its own
        self.group_ids: Iterator[int] = itertools.count()  # a rollout host numbers its groups apart from the others'
        self._sandbox = sandbox
        self._host_setup = host_setup
        self._hosts: RolloutHosts | None = None

        self._policy = Policy(0, None)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._server: InterceptionServer | None = None
        self._client: VLLMClient | None = None
        self._in_flight: dict[str, asyncio.Task] = {}
        self._stale: set[str] = set()
        self._skipped: dict[str, str] = {}  # instance id -> why its sandbox would not start
        self._sampler = TaskSampler(
            self.tasks, self.config.task_sampling, seed=self.config.seed, group_size=self.config.num_generations
        )
        self._grading: dict[str, int | None] = {}  # rollout id -> its oldest version, while it is graded
        self._last_progress = time.monotonic()
        self._loop_tick = time.monotonic()  # the event loop's latest sign of life
        self._generation_failing: _Failing | None = None
        self._traced_version = -1
        self._groups = GroupAssembler(tokenizer, self.config)

    # ----------------------------------------------------------------- RolloutWorkerProtocol

    def start(self) -> None:
        """Start the rollout hosts, or with `rollout_hosts=0` the worker's thread; returns once their
        InterceptionServers are up (raises if one failed)."""
        if self._thread is not None or self._hosts is not None:
            raise RuntimeError("worker already started")
        if self.config.rollout_hosts:
            specs = self._host_specs()
            if self.config.ray_resources is None:
                hosts: list[RolloutHost] = [ProcessHost(spec) for spec in specs]
            else:
                from swe_grpo.worker.ray_hosts import RayHost  # the optional extra swe_grpo[ray]

                hosts = [RayHost(spec, self.config.ray_resources) for spec in specs]
            self._hosts = RolloutHosts(hosts, self.outlet)
            self._hosts.start()
            return
        if self._host_setup is not None:
            self._host_setup()
        self._loop_tick = time.monotonic()
        context = contextvars.copy_context()  # carries the trainer's trackio run (a ContextVar) into the thread
        self._thread = threading.Thread(
            target=context.run, args=(self._thread_main,), name="swe-rollout-worker", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RolloutWorkerError("rollout worker failed to start") from self._failure

    def stop(self, timeout_s: float = 120.0) -> None:
        """Cancel every rollout (aborting its generation, killing Pi and the sandbox) and shut down."""
        if self._hosts is not None:
            try:
                self._hosts.stop(timeout_s)
            finally:
                if self.config.ray_resources is None:  # a Ray host's sandboxes are on its node, reaped there
                    asyncio.run(self._reap_leftovers())
            return
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            thread.join(timeout_s)
            if thread.is_alive():
                raise RolloutWorkerError(f"rollout worker did not stop within {timeout_s:.0f}s")

    async def _reap_leftovers(self) -> None:
        """Remove what a host that died (SIGKILL, the OOM killer) left of its sandboxes and doors: with the
        hosts ended, the backend's start-up reaper and `remove_orphaned_doors` remove what dead processes
        owned, and nothing of live ones."""
        try:
            await asyncio.to_thread(remove_orphaned_doors)
            await self.backend.start()
            await self.backend.close()
        except Exception as e:  # stopping goes on; the next start reaps them too
            log.warning("could not remove what the rollout hosts left: %s", e)

    def update_model_version(self, model_version: int) -> None:
        """Point generations at policy `model_version` (see the module docstring), then cancel the
        rollouts it leaves too stale to train on."""
        self.rollout_buffer.set_version(model_version)  # first: the trainer reads its next sample at this version
        policy = Policy(model_version, self._served_policy_model(model_version))
        if self._hosts is not None:
            self._policy = policy
            self._hosts.set_policy(policy)
        else:
            self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        """Generate with `policy` from now on; cancel the rollouts it leaves too stale to train on."""
        self._policy = policy
        log.info("policy v%d: generations name %s", policy.version, policy.model or self.model)
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._cancel_stale)

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the worker crashed (the cause chained) or exited, if its event loop has been blocked,
        generation has kept failing (with the latest cause) or nothing was in flight and nothing happened
        for `stale_after_s` seconds. A rollout in flight is progress at every stage: the worker bounds
        each one itself (`WorkerConfig.rollout_limit_s`). With rollout hosts: the same, asked of each host,
        and raised with the host's exception chain; also if a host died (with how) or does not answer."""
        if self._hosts is not None:
            self._hosts.check_health(stale_after_s)
            return
        if self._failure is not None:
            raise RolloutWorkerError(f"rollout worker crashed: {self._failure!r}") from self._failure
        if self._thread is None:
            raise RolloutWorkerError("rollout worker was never started")
        if not self._thread.is_alive():
            raise RolloutWorkerError("rollout worker has stopped")
        now = time.monotonic()
        if now - self._loop_tick > stale_after_s:
            raise RolloutWorkerError(
                f"the rollout worker's event loop has been blocked for {now - self._loop_tick:.0f}s"
            )
        failing = self._generation_failing
        if failing is not None and now - failing.since > stale_after_s:
            raise RolloutWorkerError(
                f"generation has been failing for {now - failing.since:.0f}s (limit {stale_after_s:.0f}s); no "
                f"rollout is launched until it works again. Latest cause: {failing.cause}"
            )
        if self._in_flight:
            return
        idle = now - max(self._last_progress, self._server.last_request_at if self._server else 0.0)
        if idle > stale_after_s:
            raise RolloutWorkerError(
                f"rollout worker made no progress for {idle:.0f}s (limit {stale_after_s:.0f}s) with nothing in flight"
            )

    def _host_specs(self) -> list[HostSpec]:
        engine = EngineArgs(
            list(self.tasks),
            self.tokenizer,
            self.vllm_url,
            self.model,
            self._sandbox,
            self.config,
            self.agent,
            self._api_key,
        )
        levels = {name: logging.getLogger(name).getEffectiveLevel() for name in ("", "swe_grpo")}
        count = self.config.rollout_hosts
        return [
            HostSpec(share, self._policy, index, count, levels, self._host_setup)
            for index, share in enumerate(engine.shares(count))
        ]

    # ----------------------------------------------------------------- policy discovery

    def _served_policy_model(self, version: int) -> str | None:
        """The model name generations must use at `version`: the trainer's adapter if it published
        one, None (the base model) if it syncs full weights."""
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            with requests.Session() as session:
                for scheme in ("http://", "https://"):
                    session.mount(scheme, HTTPAdapter(max_retries=_LIST_RETRIES))
                response = session.get(f"{self.vllm_url}/v1/models", headers=headers, timeout=30)
            response.raise_for_status()
            served = [m["id"] for m in response.json()["data"]]
        except (requests.RequestException, KeyError, TypeError, ValueError) as e:
            raise RolloutWorkerError(f"cannot list the models vLLM serves at {self.vllm_url}: {e}") from e
        adapter = f"{self.config.adapter_prefix}-v{version}"
        if adapter in served:
            return adapter
        published = sorted(m for m in served if m.startswith(f"{self.config.adapter_prefix}-v"))
        if published:
            raise RolloutWorkerError(
                f"policy v{version}: vLLM serves the adapters {published} but not {adapter}; refusing to "
                "generate with a stale policy"
            )
        return None

    # ----------------------------------------------------------------- the loop thread

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # re-raised by check_health, traceback intact
            if isinstance(e, BaseExceptionGroup) and len(e.exceptions) == 1:
                e = e.exceptions[0]
            self._failure = e
            log.error("rollout worker crashed", exc_info=e)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._client = client = VLLMClient(
            self.vllm_url, self.model, stop_token_ids=[self.tokenizer.eos_token_id], api_key=self._api_key
        )
        await client.start()
        c = self.config
        server = InterceptionServer(
            client,
            self.tokenizer,
            model_name=self.model,
            sampling=c.sampling_params(),
            chat_template_kwargs=dict(c.chat_template_kwargs),
            host=c.host,
            port=c.port,
            public_base_url=c.public_base_url,
            policy=lambda: self._policy,
        )
        agent_config = AgentConfig(
            context_window=client.max_model_len,
            max_tokens=c.max_tokens,
            timeout_s=c.agent_timeout_s,
            stall_timeout_s=c.stall_timeout_s,
        )
        rollout_config = RolloutConfig(
            agent=agent_config,
            grade_timeout_s=c.grade_timeout_s,
            plugin_autoload=c.plugin_autoload,
            max_patch_bytes=c.max_patch_bytes,
            door=c.door,
            allow=c.allow,
        )
        try:
            await self.backend.start()
            async with server:
                self._server = server
                self._ready.set()
                launcher = asyncio.create_task(self._launch(rollout_config))
                stopping = asyncio.create_task(self._stop.wait())
                ticker = asyncio.create_task(self._tick())
                await asyncio.wait({launcher, stopping}, return_when=asyncio.FIRST_COMPLETED)
                for task in (launcher, stopping, ticker):
                    task.cancel()
                await asyncio.gather(launcher, stopping, ticker, return_exceptions=True)
                if launcher.done() and not launcher.cancelled() and launcher.exception():
                    raise launcher.exception()  # type: ignore[misc]
        finally:
            await self.backend.close()
            await client.close()

    async def _launch(self, rollout_config: RolloutConfig) -> None:
        """Launch groups while there is room and generation works; every group's outcome is awaited in a
        TaskGroup, so an exception in the worker's own code stops the worker (and is what `check_health`
        re-raises). Rollouts never raise: whatever goes wrong inside one is its outcome."""
        slots = asyncio.Semaphore(self.config.max_concurrent_rollouts)
        try:
            async with asyncio.TaskGroup() as groups:
                for task in self._task_stream():
                    await self._wait_for_trainer()
                    await slots.acquire()
                    await self._wait_for_generator()
                    if task.instance_id in self._skipped:  # found unrunnable while we waited
                        slots.release()
                        continue
                    group = _Group(next(self.group_ids), task, [])
                    for index in range(self.config.num_generations):
                        if index:
                            await slots.acquire()
                            await self._wait_for_generator()
                        rollout_id = f"{_UNSAFE_ID_CHARS.sub('_', task.instance_id)[:48]}-g{group.group_id}-{index}"
                        rollout_id += f"-{uuid.uuid4().hex[:6]}"
                        group.rollouts.append(
                            asyncio.create_task(self._rollout(task, rollout_id, rollout_config, slots))
                        )
                    groups.create_task(self._finish_group(group))
        finally:
            for rollout in list(self._in_flight.values()):
                rollout.cancel()
            await asyncio.gather(*self._in_flight.values(), return_exceptions=True)

    def _task_stream(self) -> Iterator[Task]:
        """The sampler's tasks (`WorkerConfig.task_sampling`), until every one was found unrunnable."""
        yield from self._sampler.stream()
        last_cause = next(reversed(self._skipped.values()))
        raise RolloutWorkerError(
            f"no runnable tasks left: all {len(self.tasks)} were skipped; the last because: {last_cause}"
        )

    async def _tick(self) -> None:
        """The event loop's sign of life, once a second (a blocked loop is a hung worker)."""
        while True:
            self._loop_tick = time.monotonic()
            await asyncio.sleep(1.0)

    def _generation_failed(self, cause: str) -> None:
        """A rollout's generation failed for an infrastructure reason: launch nothing until a probe works."""
        failing = self._generation_failing
        if failing is None:
            log.warning("generation failed; launching nothing until it works again: %s", cause)
        self._generation_failing = _Failing(failing.since if failing else time.monotonic(), cause)

    async def _wait_for_generator(self) -> None:
        """While generation is failing, launch nothing: probe it, with backoff, until it works again."""
        delay = 1.0
        while (failing := self._generation_failing) is not None:
            cause = await self._probe_generation()
            if cause is None:
                log.info("generation works again after %.0fs", time.monotonic() - failing.since)
                self._generation_failing = None
                return
            self._generation_failing = _Failing(failing.since, cause)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 15.0)

    async def _probe_generation(self) -> str | None:
        """None if the live policy's model generates a token now; otherwise why not. An adapter vLLM no
        longer serves is re-loaded from the trainer's copy first, if there is one."""
        client = self._client
        assert client is not None
        model = self._policy.model
        try:
            served = await client.served_models()
            if model is None and self.model not in served:
                return (
                    f"vLLM at {self.vllm_url} does not serve the model {self.model!r} (it serves {served}); serve it "
                    "under that name (--served-model-name) or pass the name it serves"
                )
            if model is not None and model not in served and (lost := await self._restore_adapter(model)):
                return lost
            await client.generate([self.tokenizer.eos_token_id], SamplingParams(max_tokens=1), model)
        except VLLMError as e:
            return f"{type(e).__name__}: {e}"
        return None

    async def _restore_adapter(self, name: str) -> str | None:
        """Re-load the policy adapter `name`, which vLLM no longer serves, from `adapter_dir`. None when it
        is back; otherwise what happened and what to do."""
        lost = (
            f"vLLM at {self.vllm_url} no longer serves the policy's adapter {name} (a vLLM restart loses the "
            "adapters loaded at runtime)"
        )
        if self.config.adapter_dir is None or not (path := Path(self.config.adapter_dir, name)).is_dir():
            where = (
                "WorkerConfig.adapter_dir is not set"
                if self.config.adapter_dir is None
                else f"the trainer's adapter directory {self.config.adapter_dir} has no {name}"
            )
            return (
                f"{lost}, and the worker cannot re-load it: {where}. Load the trainer's copy of {name} into vLLM "
                "(POST /v1/load_lora_adapter; the server needs --enable-lora), or set WorkerConfig.adapter_dir to "
                "the directory the trainer writes its adapters to, or restart training from a checkpoint."
            )
        try:
            await self._client.load_lora_adapter(name, str(path))  # type: ignore[union-attr]
        except VLLMError as e:
            return f"{lost}; re-loading it from {path} failed (is vLLM running with --enable-lora?): {e}"
        log.warning("%s: re-loaded it from %s", lost, path)
        self._push_metrics({"rollout/adapter_reloads_total": 1.0})
        return None

    async def _wait_for_trainer(self) -> None:
        """Backpressure: while `queue_maxsize` samples already wait for the trainer, launch nothing.
        Rollouts the trainer would only drop as stale cost the CPU or GPU it needs itself."""
        limit = self.config.queue_maxsize
        if not limit or self.outlet.waiting() < limit:
            return
        blocked = time.monotonic()
        while self.outlet.waiting() >= limit:
            self._last_progress = time.monotonic()  # waiting on the trainer is not a stall
            await asyncio.sleep(0.2)
        self._push_metrics({"rollout/backpressure_s": time.monotonic() - blocked})

    async def _rollout(
        self, task: Task, rollout_id: str, config: RolloutConfig, slots: asyncio.Semaphore
    ) -> Trajectory | None:
        """One rollout, a sandbox that would not start retried once; None when it was cancelled as stale."""
        self._push_metrics({"rollout/started_total": 1.0})  # ends in one of: an outcome, stale or stop cancelled
        try:
            trajectory = await self._attempt(task, rollout_id, config)
            if trajectory is not None and trajectory.sandbox_failed_to_start:
                log.warning("%s: the sandbox did not start (%s); retrying once", rollout_id, trajectory.error)
                self._push_metrics({"rollout/sandbox_retries_total": 1.0})
                trajectory = await self._attempt(task, f"{rollout_id}-retry", config)
        finally:
            slots.release()
        if trajectory is None:
            return None
        self._last_progress = time.monotonic()
        if trajectory.reward is not None:
            self._sampler.record(task.instance_id, trajectory.reward)
        failed = [e for e in trajectory.request_errors if e.kind in _GENERATION_FAILURES]
        if failed:
            self._generation_failed(f"{failed[-1].kind}: {failed[-1].message}")
        self._push_metrics(self._rollout_metrics(trajectory))
        return trajectory

    async def _attempt(self, task: Task, rollout_id: str, config: RolloutConfig) -> Trajectory | None:
        """Run the rollout once, within `rollout_limit_s`. Whatever goes wrong inside it is its outcome
        (`rollout_error`, or `timeout` past the limit); None when it was cancelled as stale."""
        self._in_flight[rollout_id] = asyncio.current_task()  # type: ignore[assignment]
        limit = self.config.rollout_limit_s
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await run_rollout(
                    task, self._server, self.backend, self.agent, config, rollout_id, on_grading=self._on_grading
                )
        except asyncio.CancelledError:
            if rollout_id in self._stale and not self._stop.is_set():  # type: ignore[union-attr]
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # handled: the rollout ends here
                self._push_metrics({"rollout/stale_cancelled_total": 1.0})
                return None
            self._push_metrics({"rollout/stop_cancelled_total": 1.0})
            raise
        except Exception as e:
            if isinstance(e, TimeoutError) and deadline.expired():
                outcome, error = "timeout", f"the rollout exceeded the worker's limit of {limit:.0f}s"
            else:
                outcome, error = "rollout_error", f"{type(e).__name__}: {e}"
            log.warning("rollout %s of %s ended as %s: %s", rollout_id, task.instance_id, outcome, error, exc_info=e)
            return Trajectory(
                instance_id=task.instance_id, rollout_id=rollout_id, outcome=outcome, reward=None, error=error
            )
        finally:
            del self._in_flight[rollout_id]
            self._stale.discard(rollout_id)
            self._grading.pop(rollout_id, None)

    def _on_grading(self, trajectory: Trajectory) -> None:
        """A rollout starts grading, its tokens final: remember their version, and cancel it at once if
        they are already too stale to train on."""
        self._grading[trajectory.rollout_id] = trajectory.oldest_version
        self._push_metrics({"rollout/grading_started_total": 1.0})
        self._cancel_if_stale(trajectory.rollout_id)

    def _cancel_stale(self) -> None:
        for rollout_id in list(self._in_flight):
            self._cancel_if_stale(rollout_id)

    def _cancel_if_stale(self, rollout_id: str) -> None:
        """Cancel the rollout, at whatever stage, if its oldest tokens can no longer be trained on."""
        if rollout_id in self._grading:  # its agent session is closed; its tokens were recorded
            oldest = self._grading[rollout_id]
        else:
            oldest = self._server.oldest_version(rollout_id) if self._server else None
        version = self._policy.version
        if oldest is not None and version - oldest > self.config.max_staleness and rollout_id not in self._stale:
            log.info("cancelling %s: its tokens from v%d are too stale at v%d", rollout_id, oldest, version)
            self._stale.add(rollout_id)
            self._in_flight[rollout_id].cancel()

    async def _finish_group(self, group: _Group) -> None:
        results = await asyncio.gather(*group.rollouts, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
        trajectories = [r for r in results if isinstance(r, Trajectory)]
        unrunnable = trajectories and all(
            t.sandbox_failed_to_start or t.outcome == "rollout_error" for t in trajectories
        )
        if unrunnable and group.task.instance_id not in self._skipped:
            cause = trajectories[-1].error or "its sandbox would not start"
            self._skipped[group.task.instance_id] = cause
            self._sampler.remove(group.task.instance_id)
            log.warning("skipping %s from now on: %s", group.task.instance_id, cause)
            self._push_metrics({"tasks/skipped_total": 1.0})
        samples, reason = self._groups.assemble(group.group_id, group.task, trajectories, self._policy.version)
        if self.config.log_traces and self._traced_version < self._policy.version:
            self._traced_version = self._policy.version
            await asyncio.to_thread(self._log_traces, group, trajectories, reason)
        if reason:
            self._push_metrics({f"groups/dropped_{reason}_total": 1.0})
            return
        self.outlet.put_group(samples)
        pushed = {"groups/pushed_total": 1.0, "groups/samples": float(len(samples))}
        if samples and samples[0].metrics["reward_std"] == 0.0:
            pushed["groups/pushed_zero_variance_total"] = 1.0
        self._push_metrics(pushed)

    # ----------------------------------------------------------------- traces

    def _log_traces(self, group: _Group, trajectories: list[Trajectory], dropped: str | None) -> None:
        """Log the group's whole agent conversations (tool calls, tool results, the diff, the grade and
        each member's advantage) to the trainer's trackio run, so attempts at one task can be read side
        by side. Best effort: a tracing failure is logged and never stops training."""
        import trackio

        advantages, _ = group_advantages(trajectories, self.config.advantage_eps)
        traces = [
            trackio.Trace(
                messages=t.messages,
                metadata={
                    "instance_id": t.instance_id,
                    "rollout_id": t.rollout_id,
                    "group_id": group.group_id,
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
        self.outlet.put_traces(self._policy.version, traces)

    # ----------------------------------------------------------------- metrics

    def _push_metrics(self, metrics: dict[str, float | tuple[float, float]]) -> None:
        self.outlet.put_metrics({**metrics, "rollout/in_flight": float(len(self._in_flight))})

    @staticmethod
    def _rollout_metrics(t: Trajectory) -> dict[str, float | tuple[float, float]]:
        turns = len(t.turns)
        summary = t.summary()
        metrics: dict[str, float | tuple[float, float]] = {
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
