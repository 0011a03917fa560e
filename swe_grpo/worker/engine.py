"""RolloutEngine: runs rollouts on its own event loop thread and hands whole graded groups to an outlet.

An engine draws tasks (`TaskSampler`), launches `num_generations` rollouts of each within
`max_concurrent_rollouts`, grades them, assembles each finished group (`GroupAssembler`) and puts it,
whole or not at all, to its outlet (`swe_grpo.types.RolloutOutlet`), with metrics and, with
`log_traces`, agent traces. `SWERolloutWorker` runs one in the trainer's process (`rollout_hosts=0`);
every rollout host runs one (swe_grpo/worker/host_main.py). The guarantees it keeps are the worker's,
listed in swe_grpo/worker/rollout_worker.py; this engine is where they are kept:

- Every rollout started (`rollout/started_total`) ends exactly once: as a named outcome, cancelled as
  stale, or cancelled by `stop()`. An exception inside a rollout is its outcome (`rollout_error`); a
  rollout past `rollout_limit_s` ends as `timeout`; a sandbox that does not start is retried once.
- A rollout whose oldest tokens the policy set by `set_policy` leaves too stale is cancelled, at any stage.
- No group is launched while the outlet reports `queue_maxsize` samples waiting, nor while generation is
  failing for an infrastructure reason (until a probe of the live policy's model works again).
- `check_health` raises when the engine crashed (its own defect, traceback intact), stopped, has its event
  loop blocked, has generation failing, or made no progress with nothing in flight.

Use: `RolloutEngine(tasks, tokenizer, vllm_url=..., model=..., outlet=..., group_ids=...)`, then `start()`
(returns once its InterceptionServer serves), `set_policy` after every weight sync, `check_health`, and
`stop()`. Group ids come from `group_ids`, so engines that feed one trainer can number theirs apart.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from swe_grpo.agents import Agent, AgentConfig, make_agents
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout_within
from swe_grpo.sandbox import make_backend
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.serving.handle import RolloutView
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient, VLLMError
from swe_grpo.tasks import Task
from swe_grpo.types import Policy, RolloutOutlet, RolloutWorkerError
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.groups import GroupAssembler, masked_outcomes
from swe_grpo.worker.heldout import HeldOutEval
from swe_grpo.worker.task_sampling import TaskSampler
from swe_grpo.worker.telemetry import Metrics, group_traces, rollout_metrics

log = logging.getLogger(__name__)

# Request errors that mean generation itself failed (vLLM unreachable, 5xx, or a 4xx such as a 404 for a
# model it no longer serves), as opposed to what the model or the agent did.
_GENERATION_FAILURES = ("server_unavailable", "bad_response")
_UNSAFE_ID_CHARS = re.compile(r"[^A-Za-z0-9_.-]")  # what the InterceptionServer refuses in a rollout id


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


class RolloutEngine:
    """Runs rollouts of `tasks` against the vLLM server at `vllm_url` (base model `model`) in a thread of
    its own, and puts graded whole groups, metrics and traces to `outlet`, numbering groups from `group_ids`.
    `sandbox`: a backend name (`local`, `docker`, `hf`) or a `SandboxBackend`; `agent`: by default `config.agent`
    (a mix: each group the next of `agent_schedule()`, held-out eval the first); `policy`: the first policy."""

    def __init__(
        self,
        tasks: Sequence[Task],
        tokenizer: PreTrainedTokenizerBase,
        *,
        vllm_url: str,
        model: str,
        outlet: RolloutOutlet,
        group_ids: Iterator[int] | None = None,
        sandbox: str | SandboxBackend = "local",
        config: WorkerConfig | None = None,
        agent: Agent | None = None,
        vllm_api_key: str | None = None,
        policy: Policy | None = None,
    ):
        self.tasks = list(tasks)
        if not self.tasks:
            raise ValueError("no tasks")
        self.tokenizer = tokenizer
        self.vllm_url = vllm_url.rstrip("/")
        self.model = model
        self.outlet = outlet
        self.group_ids = group_ids if group_ids is not None else itertools.count()
        self.config = config or WorkerConfig()
        self.backend = make_backend(sandbox, **self.config.sandbox_options) if isinstance(sandbox, str) else sandbox
        schedule = [agent] if agent else make_agents(self.config.agent_schedule())
        self.agent, self._group_agents = schedule[0], itertools.cycle(schedule)
        self._api_key = vllm_api_key
        self._policy = policy or Policy(0, None)
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
        self._sessions: dict[str, RolloutView] = {}  # rollout id -> its handle on the server, open or closed
        self._last_progress = time.monotonic()
        self._loop_tick = time.monotonic()  # the event loop's latest sign of life
        self._generation_failing: _Failing | None = None
        self._traced_version = -1
        self._groups = GroupAssembler(tokenizer, self.config)
        self._heldout = HeldOutEval(self.tasks, self.config, outlet, self.backend, self.agent)  # refuses trained tasks

    # ----------------------------------------------------------------- control, from any thread

    def start(self) -> None:
        """Start the engine's thread; returns once its InterceptionServer is up (raises if it failed)."""
        if self._thread is not None:
            raise RuntimeError("worker already started")
        self._loop_tick = time.monotonic()
        context = contextvars.copy_context()  # carries the caller's trackio run (a ContextVar) into the thread
        self._thread = threading.Thread(
            target=context.run, args=(self._thread_main,), name="swe-rollout-worker", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RolloutWorkerError("rollout worker failed to start") from self._failure

    def stop(self, timeout_s: float = 120.0) -> None:
        """Cancel every rollout (aborting its generation, killing its agent and sandbox) and shut down."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            thread.join(timeout_s)
            if thread.is_alive():
                raise RolloutWorkerError(f"rollout worker did not stop within {timeout_s:.0f}s")

    def set_policy(self, policy: Policy) -> None:
        """Generate with `policy` from now on; cancel the rollouts it leaves too stale to train on."""
        self._policy = policy
        log.info("policy v%d: generations name %s", policy.version, policy.model or self.model)
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._cancel_stale)

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the engine crashed (the cause chained) or exited, if its event loop has been blocked,
        generation has kept failing (with the latest cause) or nothing was in flight and nothing happened
        for `stale_after_s` seconds. A rollout in flight is progress at every stage: the engine bounds
        each one itself (`WorkerConfig.rollout_limit_s`)."""
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
        c, eos = self.config, [self.tokenizer.eos_token_id]
        self._client = client = VLLMClient(
            self.vllm_url, self.model, stop_token_ids=eos, api_key=self._api_key, routing_header=c.routing_header
        )
        await client.start()
        server = InterceptionServer(
            client,
            self.tokenizer,
            model_name=self.model,
            sampling=c.sampling_params(),
            chat_template_kwargs=dict(c.chat_template_kwargs),
            tool_call_layout=c.tool_call_layout,
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
            reward_mode=c.reward_mode,
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
                groups.create_task(self._heldout.run(self._server, rollout_config, lambda: self._policy))
                for task in self._task_stream():
                    await self._wait_for_trainer()
                    await slots.acquire()
                    await self._wait_for_generator()
                    if task.instance_id in self._skipped:  # found unrunnable while we waited
                        slots.release()
                        continue
                    group, agent = _Group(next(self.group_ids), task, []), next(self._group_agents)
                    for index in range(self.config.num_generations):
                        if index:
                            await slots.acquire()
                            await self._wait_for_generator()
                        rollout_id = f"{_UNSAFE_ID_CHARS.sub('_', task.instance_id)[:48]}-g{group.group_id}-{index}"
                        rollout_id += f"-{uuid.uuid4().hex[:6]}"
                        group.rollouts.append(
                            asyncio.create_task(self._rollout(task, agent, rollout_id, rollout_config, slots))
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
        self, task: Task, agent: Agent, rollout_id: str, config: RolloutConfig, slots: asyncio.Semaphore
    ) -> Trajectory | None:
        """One rollout, a sandbox that would not start retried once; None when it was cancelled as stale."""
        self._push_metrics({"rollout/started_total": 1.0})  # ends in one of: an outcome, stale or stop cancelled
        try:
            trajectory = await self._attempt(task, agent, rollout_id, config)
            if trajectory is not None and trajectory.sandbox_failed_to_start:
                log.warning("%s: the sandbox did not start (%s); retrying once", rollout_id, trajectory.error)
                self._push_metrics({"rollout/sandbox_retries_total": 1.0})
                trajectory = await self._attempt(task, agent, f"{rollout_id}-retry", config)
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
        self._push_metrics(rollout_metrics(trajectory))
        return trajectory

    async def _attempt(self, task: Task, agent: Agent, rollout_id: str, config: RolloutConfig) -> Trajectory | None:
        """Run the rollout once, within `rollout_limit_s`. Whatever goes wrong inside it is its outcome
        (`rollout_error`, or `timeout` past the limit); None when it was cancelled as stale."""
        self._in_flight[rollout_id] = asyncio.current_task()  # type: ignore[assignment]
        limit = self.config.rollout_limit_for(task)
        try:
            return await run_rollout_within(
                limit,
                task,
                self._server,
                self.backend,
                agent,
                config,
                rollout_id,
                on_grading=self._on_grading,
                on_session=lambda session: self._sessions.__setitem__(rollout_id, session),
            )
        except asyncio.CancelledError:
            if rollout_id in self._stale and not self._stop.is_set():  # type: ignore[union-attr]
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # handled: the rollout ends here
                self._push_metrics({"rollout/stale_cancelled_total": 1.0})
                return None
            self._push_metrics({"rollout/stop_cancelled_total": 1.0})
            raise
        finally:
            del self._in_flight[rollout_id]
            self._stale.discard(rollout_id)
            self._sessions.pop(rollout_id, None)

    def _on_grading(self, trajectory: Trajectory) -> None:
        """A rollout starts grading, its tokens final: cancel it at once if they are already too stale to train on."""
        self._push_metrics({"rollout/grading_started_total": 1.0})
        self._cancel_if_stale(trajectory.rollout_id)

    def _cancel_stale(self) -> None:
        for rollout_id in list(self._in_flight):
            self._cancel_if_stale(rollout_id)

    def _cancel_if_stale(self, rollout_id: str) -> None:
        """Cancel the rollout, at whatever stage, if its oldest tokens can no longer be trained on."""
        session = self._sessions.get(rollout_id)  # open, or closed with its tokens recorded
        oldest = session.oldest_version() if session else None
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
            t.sandbox_failed_to_start or t.outcome in ("rollout_error", "setup_failed") for t in trajectories
        )
        if unrunnable and group.task.instance_id not in self._skipped:
            cause = trajectories[-1].error or "its sandbox would not start"
            self._skipped[group.task.instance_id] = cause
            self._sampler.remove(group.task.instance_id)
            log.warning("skipping %s from now on: %s", group.task.instance_id, cause)
            self._push_metrics({"tasks/skipped_total": 1.0})
        samples, reason = self._groups.assemble(group.group_id, group.task, trajectories, self._policy.version)
        if masked := sum(t.outcome in masked_outcomes(self.config) for t in trajectories):
            self._push_metrics({"groups/masked_rollouts_total": float(masked)})  # WorkerConfig.mask_truncated
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

    # ----------------------------------------------------------------- traces and metrics

    def _log_traces(self, group: _Group, trajectories: list[Trajectory], dropped: str | None) -> None:
        """Log the group's whole agent conversations to the trainer's trackio run (`group_traces`). Best
        effort: a tracing failure is logged and never stops training."""
        traces = group_traces(
            group.group_id, trajectories, dropped, self.config.advantage_eps, masked_outcomes(self.config)
        )
        self.outlet.put_traces(self._policy.version, traces)

    def _push_metrics(self, metrics: Metrics) -> None:
        self.outlet.put_metrics({**metrics, "rollout/in_flight": float(len(self._in_flight))})
