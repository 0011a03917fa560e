"""SWERolloutWorker: SWE rollouts as training samples for TRL's `AsyncGRPOTrainer`.

It satisfies TRL's `RolloutWorkerProtocol`: the trainer calls `update_model_version(1)` after its first
weight sync, then `start()`, drains `rollout_buffer` (TRL's own `RolloutSample`s) and `metrics_queue`,
calls `update_model_version(v)` after every sync, `check_health()` whenever the buffer stays empty,
and `stop()` at the end.

What it guarantees:
- Groups. Each task drawn is attempted `num_generations` times. Advantages are
  `(r - mean) / (std + eps)` over the group's *valid* members: a rollout that ended in an
  infrastructure outcome (reward None: infra_error, timeout, context_overflow, or cancelled as stale)
  is left out of the baseline and not trained on. A group with fewer than two valid members, or with
  zero reward variance (configurable), or whose oldest tokens are already too stale, is dropped and
  counted. A group is pushed whole or not at all, one `RolloutSample` per training row (a forked
  conversation gives several rows, all with the conversation's advantage).
- Honest versions. A sample's `model_version` is the oldest policy version that produced any of its
  tokens. When the trainer's version moves on, rollouts whose oldest tokens can no longer be consumed
  (`version - oldest > max_staleness`) are cancelled: their vLLM request is aborted, Pi and the
  sandbox are killed.
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
- Nothing lost, nothing hung. Every rollout ends as a named outcome counted in `metrics_queue`; a
  task whose sandbox cannot be created is skipped from then on (counted); after a generation failure
  the worker waits for vLLM's `/health` before launching more work; a crash inside the worker is
  re-raised by `check_health` with its original traceback; `stop()` cancels everything and leaves no
  sandbox, process or mount behind.

Process model: one asyncio event loop in a daemon thread of the trainer's process. Everything the
worker does is I/O (the InterceptionServer, vLLM requests, Pi and sandbox subprocesses, grading), and
the trainer's forward/backward releases the GIL inside torch, so a thread costs the trainer little
while sharing the tokenizer and plain `queue.Queue`s with it, and an exception keeps its traceback.
TRL's default worker is a child process because it scores completions with reward models; ours
scores in sandboxes. The loop's CPU (~6 ms per intercepted request, see the README's P2 benchmark)
is the limit at very high request rates; past it, run several workers' servers in other processes.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import requests
from transformers import PreTrainedTokenizerBase
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from swe_grpo.agents.pi import PiBundle, PiConfig
from swe_grpo.grading import DEFAULT_TIMEOUT_S
from swe_grpo.interception import InterceptionServer, Policy
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox import make_backend
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.tasks import Task, tasks_from_dataset
from swe_grpo.vllm_client import SamplingParams, VLLMClient

if TYPE_CHECKING:
    from trl.experimental.async_grpo import AsyncGRPOConfig

log = logging.getLogger(__name__)

_GENERATOR_DOWN = ("server_unavailable",)


class RolloutWorkerError(RuntimeError):
    """The worker crashed, stalled, or was misconfigured; raised by `check_health` and `start`."""


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker samples, schedules and judges rollouts.

    `max_tokens` caps each model turn; `temperature`/`top_p`/`top_k` must be the trainer's (its
    log-probs assume them). `max_staleness` must be the trainer's. `from_trainer_args` copies those.
    """

    num_generations: int = 8
    max_concurrent_rollouts: int = 8
    max_staleness: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 2048
    drop_zero_variance_groups: bool = True
    advantage_eps: float = 1e-6
    agent_timeout_s: float = 1800.0
    stall_timeout_s: float = 300.0
    grade_timeout_s: float = DEFAULT_TIMEOUT_S
    adapter_prefix: str = "trl-policy"  # what AsyncGRPOTrainer names the adapters it publishes
    host: str = "127.0.0.1"  # the InterceptionServer's bind; sandboxes reach it at public_base_url
    port: int = 0
    public_base_url: str | None = None
    seed: int = 0  # task order: shuffled every pass over the tasks
    queue_maxsize: int = 0  # launch no new group while this many samples wait for the trainer (0: no limit)
    log_traces: bool = False  # one group's agent conversations per policy version to the trainer's trackio run

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError("num_generations must be at least 2: advantages are relative to the group")
        if self.max_concurrent_rollouts < 1 or self.max_staleness < 0:
            raise ValueError("max_concurrent_rollouts must be >= 1 and max_staleness >= 0")

    @classmethod
    def from_trainer_args(cls, args: AsyncGRPOConfig, **overrides: Any) -> WorkerConfig:
        """The fields the trainer and the worker must agree on, taken from the trainer's config."""
        shared = {
            "num_generations": args.num_generations,
            "max_staleness": args.max_staleness,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k is not None else -1,
            "max_tokens": args.max_completion_length,
            "seed": args.seed,
            "queue_maxsize": args.queue_maxsize,
            "log_traces": "trackio" in (args.report_to or []),
        }
        return cls(**{**shared, **overrides})


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
    (`local`, `docker`, `hf`) or a `SandboxBackend`.
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
        pi_bundle: PiBundle | None = None,
        vllm_api_key: str | None = None,
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
        self.bundle = pi_bundle or PiBundle.default()
        self._api_key = vllm_api_key
        self.rollout_buffer: queue.Queue[RolloutSample] = queue.Queue()
        self.metrics_queue: queue.Queue[dict[str, float | tuple[float, float]]] = queue.Queue()

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
        self._last_progress = time.monotonic()
        self._generator_down = asyncio.Event()
        self._traced_version = -1

    # ----------------------------------------------------------------- RolloutWorkerProtocol

    def start(self) -> None:
        """Start the worker's thread; returns once its InterceptionServer is up (raises if it failed)."""
        if self._thread is not None:
            raise RuntimeError("worker already started")
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
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None or loop is None or stop is None:
            return
        if thread.is_alive():
            loop.call_soon_threadsafe(stop.set)
            thread.join(timeout_s)
            if thread.is_alive():
                raise RolloutWorkerError(f"rollout worker did not stop within {timeout_s:.0f}s")

    def update_model_version(self, model_version: int) -> None:
        """Point generations at policy `model_version` (see the module docstring), then cancel the
        rollouts it leaves too stale to train on."""
        self._policy = Policy(model_version, self._served_policy_model(model_version))
        log.info("policy v%d: generations name %s", model_version, self._policy.model or self.model)
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._cancel_stale)

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the worker crashed (the cause chained), exited, or made no progress (no
        intercepted request, no generation, no finished rollout) for `stale_after_s` seconds."""
        if self._failure is not None:
            raise RolloutWorkerError(f"rollout worker crashed: {self._failure!r}") from self._failure
        if self._thread is None:
            raise RolloutWorkerError("rollout worker was never started")
        if not self._thread.is_alive():
            raise RolloutWorkerError("rollout worker has stopped")
        idle = time.monotonic() - self._progress_at()
        if idle > stale_after_s:
            raise RolloutWorkerError(
                f"rollout worker made no progress for {idle:.0f}s (limit {stale_after_s:.0f}s): "
                f"{len(self._in_flight)} rollouts in flight, vLLM "
                f"{'unreachable' if self._generator_down.is_set() else 'reachable'} at {self.vllm_url}"
            )

    # ----------------------------------------------------------------- policy discovery

    def _served_policy_model(self, version: int) -> str | None:
        """The model name generations must use at `version`: the trainer's adapter if it published
        one, None (the base model) if it syncs full weights."""
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        try:
            response = requests.get(f"{self.vllm_url}/v1/models", headers=headers, timeout=30)
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
        sampling = SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_tokens)
        server = InterceptionServer(
            client,
            self.tokenizer,
            model_name=self.model,
            sampling=sampling,
            host=c.host,
            port=c.port,
            public_base_url=c.public_base_url,
            policy=lambda: self._policy,
        )
        pi = PiConfig(
            context_window=client.max_model_len,
            max_tokens=c.max_tokens,
            timeout_s=c.agent_timeout_s,
            stall_timeout_s=c.stall_timeout_s,
        )
        rollout_config = RolloutConfig(pi=pi, grade_timeout_s=c.grade_timeout_s)
        try:
            await self.backend.start()
            async with server:
                self._server = server
                self._ready.set()
                launcher = asyncio.create_task(self._launch(rollout_config))
                stopping = asyncio.create_task(self._stop.wait())
                await asyncio.wait({launcher, stopping}, return_when=asyncio.FIRST_COMPLETED)
                launcher.cancel()
                stopping.cancel()
                await asyncio.gather(launcher, stopping, return_exceptions=True)
                if launcher.done() and not launcher.cancelled() and launcher.exception():
                    raise launcher.exception()  # type: ignore[misc]
        finally:
            await self.backend.close()
            await client.close()

    async def _launch(self, rollout_config: RolloutConfig) -> None:
        """Launch groups while there is room; every group's outcome is awaited in a TaskGroup, so an
        exception anywhere stops the worker (and is what `check_health` re-raises)."""
        slots = asyncio.Semaphore(self.config.max_concurrent_rollouts)
        group_ids = itertools.count()
        try:
            async with asyncio.TaskGroup() as groups:
                for task in self._task_stream():
                    await self._wait_for_generator()
                    await self._wait_for_trainer()
                    await slots.acquire()
                    if task.instance_id in self._skipped:  # found unrunnable while we waited
                        slots.release()
                        continue
                    group = _Group(next(group_ids), task, [])
                    for index in range(self.config.num_generations):
                        if index:
                            await slots.acquire()
                        rollout_id = f"{task.instance_id.replace('/', '_')[:48]}-g{group.group_id}-{index}"
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
        """Tasks, shuffled each pass, without those found unrunnable."""
        rng = random.Random(self.config.seed)
        while True:
            order = list(self.tasks)
            rng.shuffle(order)
            runnable = [t for t in order if t.instance_id not in self._skipped]
            if not runnable:
                last_cause = next(reversed(self._skipped.values()))
                raise RolloutWorkerError(
                    f"no runnable tasks left: all {len(self.tasks)} were skipped; the last because: {last_cause}"
                )
            for task in runnable:
                if task.instance_id not in self._skipped:
                    yield task

    async def _wait_for_generator(self) -> None:
        """After a generation failure, launch nothing until vLLM answers `/health` again."""
        delay = 1.0
        while self._generator_down.is_set():
            if await self._client.healthy():  # type: ignore[union-attr]
                log.info("vLLM at %s is back", self.vllm_url)
                self._generator_down.clear()
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 15.0)

    async def _wait_for_trainer(self) -> None:
        """Backpressure: while `queue_maxsize` samples already wait for the trainer, launch nothing.
        Rollouts the trainer would only drop as stale cost the CPU or GPU it needs itself."""
        limit = self.config.queue_maxsize
        if not limit or self.rollout_buffer.qsize() < limit:
            return
        blocked = time.monotonic()
        while self.rollout_buffer.qsize() >= limit:
            self._last_progress = time.monotonic()  # waiting on the trainer is not a stall
            await asyncio.sleep(0.2)
        self._push_metrics({"rollout/backpressure_s": time.monotonic() - blocked})

    async def _rollout(
        self, task: Task, rollout_id: str, config: RolloutConfig, slots: asyncio.Semaphore
    ) -> Trajectory | None:
        """One rollout; None when it was cancelled as stale."""
        self._in_flight[rollout_id] = asyncio.current_task()  # type: ignore[assignment]
        try:
            trajectory = await run_rollout(task, self._server, self.backend, self.bundle, config, rollout_id)
        except asyncio.CancelledError:
            if rollout_id in self._stale and not self._stop.is_set():  # type: ignore[union-attr]
                self._stale.discard(rollout_id)
                self._push_metrics({"rollout/stale_cancelled_total": 1.0})
                return None
            raise
        finally:
            del self._in_flight[rollout_id]
            slots.release()
        self._last_progress = time.monotonic()
        if any(e.kind in _GENERATOR_DOWN for e in trajectory.request_errors):
            self._generator_down.set()
        self._push_metrics(self._rollout_metrics(trajectory))
        return trajectory

    def _cancel_stale(self) -> None:
        version = self._policy.version
        for rollout_id, rollout in list(self._in_flight.items()):
            oldest = self._server.oldest_version(rollout_id) if self._server else None
            if oldest is not None and version - oldest > self.config.max_staleness:
                log.info("cancelling %s: its tokens from v%d are too stale at v%d", rollout_id, oldest, version)
                self._stale.add(rollout_id)
                rollout.cancel()

    async def _finish_group(self, group: _Group) -> None:
        results = await asyncio.gather(*group.rollouts, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result
        trajectories = [r for r in results if isinstance(r, Trajectory)]
        unrunnable = trajectories and all(t.sandbox_failed_to_start for t in trajectories)
        if unrunnable and group.task.instance_id not in self._skipped:
            cause = trajectories[-1].error or "its sandbox would not start"
            self._skipped[group.task.instance_id] = cause
            log.warning("skipping %s from now on: %s", group.task.instance_id, cause)
            self._push_metrics({"tasks/skipped_total": 1.0})
        samples, reason = self._group_samples(group, trajectories)
        if self.config.log_traces and self._traced_version < self._policy.version:
            self._traced_version = self._policy.version
            await asyncio.to_thread(self._log_traces, group, trajectories, reason)
        if reason:
            self._push_metrics({f"groups/dropped_{reason}_total": 1.0})
            return
        now = time.time()
        for sample in samples:
            sample.enqueued_at = now
            self.rollout_buffer.put(sample)
        self._push_metrics({"groups/pushed_total": 1.0, "groups/samples": float(len(samples))})

    def _advantages(self, trajectories: list[Trajectory]) -> tuple[dict[str, float], float]:
        """Rollout id -> advantage over the group's valid members (a reward and some tokens), and the
        rewards' std."""
        valid = [t for t in trajectories if t.reward is not None and t.rows]
        if not valid:
            return {}, 0.0
        rewards = np.array([t.reward for t in valid], dtype=np.float64)
        std = float(rewards.std())
        advantages = (rewards - rewards.mean()) / (std + self.config.advantage_eps)
        return {t.rollout_id: float(a) for t, a in zip(valid, advantages, strict=True)}, std

    def _group_samples(self, group: _Group, trajectories: list[Trajectory]) -> tuple[list[RolloutSample], str | None]:
        """The group's samples, or the reason it is dropped."""
        advantages, std = self._advantages(trajectories)
        if len(advantages) < 2:
            return [], "too_few_valid"
        if std == 0.0 and self.config.drop_zero_variance_groups:
            return [], "zero_variance"
        valid = [t for t in trajectories if t.rollout_id in advantages]
        oldest = min(v for t in valid if (v := t.oldest_version) is not None)
        if self._policy.version - oldest > self.config.max_staleness:
            return [], "stale"
        prompt = [{"role": "user", "content": group.task.problem_statement}]
        samples = []
        for trajectory in valid:
            metrics = {
                "reward": float(trajectory.reward),  # type: ignore[arg-type]
                "reward_std": std,
                "resolved": float(trajectory.outcome == "resolved"),
                "turns": float(len(trajectory.turns)),
            }
            for row in trajectory.rows:
                if row.model_version is None:  # a row with no generated token trains nothing
                    continue
                mask = np.frombuffer(row.completion_mask, dtype=np.int8).astype(np.int64)
                first = int(mask.argmax())
                completion = [{"role": "assistant", "content": self.tokenizer.decode(row.input_ids[first:].tolist())}]
                samples.append(
                    RolloutSample(
                        prompt=prompt,
                        completion=completion,
                        input_ids=np.asarray(row.input_ids, dtype=np.int64),
                        completion_mask=mask,
                        old_log_probs=np.asarray(row.old_log_probs, dtype=np.float32),
                        advantage=advantages[trajectory.rollout_id],
                        model_version=row.model_version,
                        group_id=group.group_id,
                        metrics=dict(metrics),
                    )
                )
        return samples, None

    # ----------------------------------------------------------------- traces

    def _log_traces(self, group: _Group, trajectories: list[Trajectory], dropped: str | None) -> None:
        """Log the group's whole agent conversations (tool calls, tool results, the diff, the grade and
        each member's advantage) to the trainer's trackio run, so attempts at one task can be read side
        by side. Best effort: a tracing failure is logged and never stops training."""
        import trackio

        advantages, _ = self._advantages(trajectories)
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
        try:
            trackio.log({"rollouts/agent": traces}, step=self._policy.version)
        except Exception as e:  # e.g. no trackio run: the trainer was not given report_to=trackio
            log.warning("agent traces not logged: %s: %s", type(e).__name__, e)

    # ----------------------------------------------------------------- metrics

    def _progress_at(self) -> float:
        server_at = self._server.last_request_at if self._server else 0.0
        return max(self._last_progress, server_at)

    def _push_metrics(self, metrics: dict[str, float | tuple[float, float]]) -> None:
        self.metrics_queue.put({**metrics, "rollout/in_flight": float(len(self._in_flight))})

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
