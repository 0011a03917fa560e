"""Held-out evaluation while training: the policy being trained, attempted on tasks it is never trained on.

With `WorkerConfig.eval_every = N > 0` a rollout engine (the one of `rollout_hosts=0`, or rollout host 0)
runs a round of `HeldOutEval` at the policy it starts with and then every N policy versions (weight
syncs): each of `eval_tasks` attempted `eval_k` times through the same path as training (its
InterceptionServer, agent, sandboxes, fresh-sandbox grading), at `eval_temperature`. What it guarantees:

- Never trained on: an eval task that is also a training task (same instance_id) is refused when the
  engine is built; eval rollouts never become samples (nothing of theirs reaches the outlet's groups,
  only the round's metrics), and they are not counted in the training rollouts' `rollout/*` metrics.
- Training does not stall: eval rollouts run on `eval_concurrency` slots of their own, on top of
  `max_concurrent_rollouts`, so training rollouts keep all of theirs; a weight sync never cancels an eval
  rollout (they are not trained on, so staleness does not apply to them).
- One round at a time, each finished: a round due while one still runs is skipped and counted
  (`eval/rounds_skipped_busy_total`), because cancelling the running one would throw away the attempts it
  has made, and with rounds that outlast N syncs no round would ever report. Generation always uses the
  live policy (a full-weight sync leaves no other choice), so `eval/policy_version` is the version a round
  started at and `eval/policy_version_max` the newest that produced any of its tokens.
- The numbers are `swe-grpo eval`'s (`telemetry.round_metrics`): each attempt becomes the record
  `swe-grpo eval` writes (`attempt_record`), a round the report it builds (`build_report`): infra failures
  (`is_infra`) are counted by outcome but kept out of `eval/resolved_rate` and `eval/pass@j`; pass@j is the
  unbiased estimator, averaged over the tasks with at least j scored attempts.

The round's metrics go to the engine's outlet, and from there to the trainer's `metrics_queue` and its
trackio run beside `rollout/*`: `eval/resolved_rate` and `eval/pass@j` (j = 1..eval_k) as (sum, count)
pairs (the trainer averages them over a logging window), `eval/outcome_<outcome>_total`,
`eval/rounds_total`, `eval/attempts_total`, `eval/infra_failures_total`, `eval/policy_version`,
`eval/policy_version_max` and `eval/wall_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Sequence

from swe_grpo.agents import Agent
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout_within
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.serving.handle import RolloutHandle, RolloutServer, Socket
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams
from swe_grpo.tasks import Task
from swe_grpo.types import Policy, RolloutOutlet
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.telemetry import round_metrics

log = logging.getLogger(__name__)

_POLL_S = 0.5  # how often the policy version is looked at: a round waits at most this long to start


class HeldOutTaskTrainedOn(ValueError):
    """An eval task is also a training task: it would be trained on, and its eval would measure memory."""


def check_held_out(eval_tasks: Sequence[Task], train_tasks: Sequence[Task]) -> None:
    """Raise `HeldOutTaskTrainedOn` naming every eval task that is also a training task (same instance_id)."""
    trained = {task.instance_id for task in train_tasks}
    overlap = sorted(task.instance_id for task in eval_tasks if task.instance_id in trained)
    if overlap:
        raise HeldOutTaskTrainedOn(
            f"{len(overlap)} eval task(s) are also training tasks, so they would be trained on: {overlap[:10]}. "
            "Hold them out of the training tasks (e.g. split='train[:200]' for training, 'train[200:]' for eval)."
        )


class _EvalServer:
    """The engine's InterceptionServer as `run_rollout` sees it, except that every rollout it opens samples
    at the eval's settings (the server's own sampling is the trainer's, which the trainer's log-probs need)."""

    def __init__(self, server: InterceptionServer, sampling: SamplingParams):
        self._server = server
        self._sampling = sampling

    def rollout(self, rollout_id: str | None = None, *, socket: Socket | None = None) -> RolloutHandle:
        return self._server.rollout(rollout_id, socket=socket, sampling=self._sampling)


class HeldOutEval:
    """The held-out eval of one rollout engine (see the module docstring): its rounds run in `run`, with the
    engine's `backend` and `agent`, and their metrics go to `outlet`. `train_tasks`, the tasks the engine
    trains on, are refused as eval tasks (`HeldOutTaskTrainedOn`)."""

    def __init__(
        self,
        train_tasks: Sequence[Task],
        config: WorkerConfig,
        outlet: RolloutOutlet,
        backend: SandboxBackend,
        agent: Agent,
    ):
        check_held_out(config.eval_tasks, train_tasks)
        self.tasks = list(config.eval_tasks)
        self.config = config
        self.outlet = outlet
        self.backend = backend
        self.agent = agent

    async def run(
        self, server: InterceptionServer, rollout_config: RolloutConfig, policy: Callable[[], Policy]
    ) -> None:
        """Run rounds on `server` until cancelled (at once without `eval_every`): one at `policy()`'s version
        now, then one every `eval_every` versions; one at a time, a round due while one runs skipped and counted."""
        every = self.config.eval_every
        if not every:
            return
        view = _EvalServer(server, self.config.eval_sampling_params())
        next_due = policy().version
        while True:
            version = policy().version
            if version < next_due:
                await asyncio.sleep(_POLL_S)
                continue
            await self._round(version, view, rollout_config)
            # The due versions that passed while the round ran are skipped; the next is the first one after now.
            passed = (policy().version - version) // every
            next_due = version + (passed + 1) * every
            if passed:
                log.info("held-out eval: %d round(s) due during the round of v%d skipped", passed, version)
                self.outlet.put_metrics({"eval/rounds_skipped_busy_total": float(passed)})

    async def _round(self, version: int, server: RolloutServer, rollout_config: RolloutConfig) -> None:
        """Attempt every eval task `eval_k` times, `eval_concurrency` at a time, and put out the round's metrics."""
        started = time.monotonic()
        slots = asyncio.Semaphore(self.config.eval_concurrency)
        jobs = [(task, attempt) for attempt in range(self.config.eval_k) for task in self.tasks]
        log.info("held-out eval of policy v%d: %d attempts", version, len(jobs))

        async def attempt(task: Task, index: int) -> Trajectory:
            async with slots:
                rollout_id = f"eval-v{version}-{index}-{uuid.uuid4().hex[:6]}"
                limit = self.config.rollout_limit_for(task)
                return await run_rollout_within(
                    limit, task, server, self.backend, self.agent, rollout_config, rollout_id
                )

        trajectories = await asyncio.gather(*(attempt(task, i) for i, (task, _) in enumerate(jobs)))
        metrics = round_metrics(trajectories, [task.instance_id for task in self.tasks], self.config.eval_k)
        versions = [turn.model_version for t in trajectories for turn in t.turns]
        metrics["eval/policy_version"] = float(version)
        metrics["eval/policy_version_max"] = float(max(versions, default=version))
        metrics["eval/wall_s"] = time.monotonic() - started
        log.info("held-out eval of policy v%d: resolved %s of %s scored", version, *metrics["eval/resolved_rate"])
        self.outlet.put_metrics(metrics)
