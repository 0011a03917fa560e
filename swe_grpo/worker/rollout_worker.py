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
  infrastructure outcome (reward None: infra_error, rollout_error, timeout, setup_failed, a context_overflow
  before the policy's first turn, or cancelled as stale) is left out of the baseline and not trained on; what
  the policy's run chose after its first turn (a stall, its wall clock, the context, its exit status) earns
  0.0 (swe_grpo/rollout.py), unless `mask_truncated` leaves the truncations out. A group with fewer than two
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
- Held-out eval while training (swe_grpo/worker/heldout.py). With `eval_every` and `eval_tasks`, the
  policy attempts the held-out tasks every `eval_every` versions, on slots of its own; those rollouts are
  never trained on (a task also trained on is refused), and `eval/*` metrics join `rollout/*` in
  `metrics_queue`.
- Nothing lost, nothing hung. Every rollout started (`rollout/started_total`) ends exactly once as a
  named outcome counted in `metrics_queue` (`rollout/outcome_<outcome>_total`), or cancelled as stale
  (`rollout/stale_cancelled_total`) or by `stop()` (`rollout/stop_cancelled_total`); `stop()` cancels
  everything and leaves no sandbox, process or mount behind.

Process model: the trainer's process only trains. The rollouts run in a `RolloutEngine`
(swe_grpo/worker/engine.py). With `WorkerConfig.rollout_hosts = N` (default 1) the worker the trainer
holds spawns N rollout hosts (swe_grpo/worker/hosts.py), child processes that each run one engine (its
own InterceptionServer, Pi, sandboxes, grading) on a share of `max_concurrent_rollouts`; the trainer's
side only moves groups of samples, metrics, traces and log records out of them and the policy into them,
asks each for its health and stops them. Every guarantee above holds across that boundary (hosts.py says
how), and a host stops its engine when the trainer dies, even by SIGKILL. The InterceptionServer, Pi's
traffic and grading thus never share the GIL with the training loop. A host is spawned, not forked, so a
script that builds the worker needs the `if __name__ == "__main__":` guard, as with TRL's own worker
(without it, `start()` raises and says so); `host_setup` (picklable) runs first in each host.
`rollout_hosts=0` runs the engine in a daemon thread of the trainer's process instead (the engine's own
mode, which every host uses inside).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import requests
from requests.adapters import HTTPAdapter
from transformers import PreTrainedTokenizerBase
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample
from urllib3.util.retry import Retry

from swe_grpo.agents import Agent
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.sandbox.door import remove_orphaned_doors
from swe_grpo.tasks import Task, tasks_from_dataset
from swe_grpo.types import Policy, RolloutWorkerError
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.engine import RolloutEngine
from swe_grpo.worker.group_queue import GroupQueue
from swe_grpo.worker.host_main import refuse_in_a_rollout_host
from swe_grpo.worker.hosts import EngineArgs, HostSpec, ProcessHost, RolloutHost, RolloutHosts

log = logging.getLogger(__name__)

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


class SWERolloutWorker:
    """Runs Pi on SWE tasks against a vLLM server and feeds the graded rollouts to the trainer.

    `tasks`: `Task`s, or rows in SWE-Gym's shape (a `datasets.Dataset`, a list of dicts).
    `tokenizer`: the policy's tokenizer (its chat template becomes TRL's training template).
    `vllm_url`/`model`: the server and its base model's served name. `sandbox`: a backend name
    (`local`, `docker`, `hf`) or a `SandboxBackend` (pickled into each rollout host: a backend built there
    by name needs no pickling). `host_setup`: called first where the rollouts run (each rollout host, or
    this process with `rollout_hosts=0`), e.g. to configure logging; a module-level function or a
    `functools.partial` of one, since it is pickled into the hosts.

    Built in a rollout host, i.e. by a training script without the `if __name__ == "__main__":` guard that
    a spawned host re-ran, it ends that host at once, and the trainer's `start()` raises with the reason.
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
        refuse_in_a_rollout_host()
        rows = list(tasks)
        self.tasks = rows if all(isinstance(t, Task) for t in rows) else tasks_from_dataset(rows, source="tasks")
        if not self.tasks:
            raise ValueError("no tasks")
        self.tokenizer = tokenizer
        self.vllm_url = vllm_url.rstrip("/")
        self.model = model
        self.config = config or WorkerConfig()
        self._api_key = vllm_api_key
        self.metrics_queue: queue.Queue[dict[str, float | tuple[float, float]]] = queue.Queue()
        self.rollout_buffer = GroupQueue(self.metrics_queue)  # keeps TRL from training part of a group
        self.outlet = QueueOutlet(self.rollout_buffer, self.metrics_queue)
        self._sandbox = sandbox
        self._host_setup = host_setup
        self._hosts: RolloutHosts | None = None
        self._started = False
        self._policy = Policy(0, None)
        # The engine of `rollout_hosts=0`; built in any case, so a configuration it refuses fails here.
        self._engine = RolloutEngine(
            self.tasks,
            tokenizer,
            vllm_url=self.vllm_url,
            model=model,
            outlet=self.outlet,
            group_ids=itertools.count(),
            sandbox=sandbox,
            config=self.config,
            agent=agent,
            vllm_api_key=vllm_api_key,
        )
        self.backend = self._engine.backend
        self.agent = self._engine.agent  # the given one, or the first of the config's (held-out eval runs it)
        self._given_agent = agent  # None: each host builds the config's

    # ----------------------------------------------------------------- RolloutWorkerProtocol

    def start(self) -> None:
        """Start the rollout hosts, or with `rollout_hosts=0` the engine's thread; returns once their
        InterceptionServers are up (raises if one failed)."""
        if self._started:
            raise RuntimeError("worker already started")
        self._started = True
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
        self._engine.start()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Cancel every rollout (aborting its generation, killing Pi and the sandbox) and shut down."""
        if self._hosts is None:
            self._engine.stop(timeout_s)
            return
        try:
            self._hosts.stop(timeout_s)
        finally:
            if self.config.ray_resources is None:  # a Ray host's sandboxes are on its node, reaped there
                asyncio.run(self._reap_leftovers())

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
        self.set_policy(Policy(model_version, self._served_policy_model(model_version)))

    def set_policy(self, policy: Policy) -> None:
        """Generate with `policy` from now on (every host, or the engine); cancel the rollouts it leaves
        too stale to train on."""
        self._policy = policy
        if self._hosts is not None:
            self._hosts.set_policy(policy)
        else:
            self._engine.set_policy(policy)

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the worker crashed (the cause chained) or exited, if its event loop has been blocked,
        generation has kept failing (with the latest cause) or nothing was in flight and nothing happened
        for `stale_after_s` seconds. A rollout in flight is progress at every stage: the worker bounds
        each one itself (`WorkerConfig.rollout_limit_s`). With rollout hosts: the same, asked of each host,
        and raised with the host's exception chain; also if a host died (with how) or does not answer."""
        if self._hosts is not None:
            self._hosts.check_health(stale_after_s)
        else:
            self._engine.check_health(stale_after_s)

    def _host_specs(self) -> list[HostSpec]:
        engine = EngineArgs(
            list(self.tasks),
            self.tokenizer,
            self.vllm_url,
            self.model,
            self._sandbox,
            self.config,
            self._given_agent,
            self._api_key,
        )
        levels = {name: logging.getLogger(name).getEffectiveLevel() for name in ("", "swe_grpo")}
        count = self.config.rollout_hosts
        shares = engine.shares(count)
        # Host 0 alone runs the held-out eval (one report a round), on eval slots beyond its share of the rollouts.
        shares[1:] = [replace(s, config=replace(s.config, eval_every=0, eval_tasks=())) for s in shares[1:]]
        return [
            HostSpec(share, self._policy, index, count, levels, self._host_setup) for index, share in enumerate(shares)
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
