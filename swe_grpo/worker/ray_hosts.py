"""Rollout hosts as Ray actors, for rollouts on more machines than the trainer's (the extra `swe_grpo[ray]`).

`RayHost` is a `RolloutHost` (swe_grpo/worker/hosts.py) whose engine runs in a Ray actor, placed by Ray on
a node that offers the host's resources: the user gives the nodes that hold sandboxes a custom resource
(`ray start --resources '{"swe_grpo_sandboxes": 1}'`, one unit per host the node takes) and the worker
asks for it (`WorkerConfig(rollout_hosts=N, ray_resources={"swe_grpo_sandboxes": 1})`). The actor builds
the same engine a `ProcessHost` runs (`build_engine`, swe_grpo/worker/host_main.py): its
InterceptionServer binds on the actor's own node, where its own sandboxes reach it (the local backend's
door is a unix socket there), so only whole groups of samples, metrics and the policy cross nodes. The
trainer stays what it is (a TRL/accelerate job) and joins the cluster as a Ray driver (`ray.init()`
connects to the cluster the node belongs to, or to `RAY_ADDRESS`). Every node needs swe_grpo installed and
must reach `vllm_url`.

What holds beyond what `RolloutHost` promises:
- A host lost with its node (or any death of its actor: `RayActorError`) is replaced. The rollouts it had
  in flight, by the accounting of what reached the trainer (`rollout/started_total` less the rollouts
  ended), are counted as infrastructure outcomes (`rollout/outcome_infra_error_total`, with
  `rollout/finished_total` and `rollout/host_lost_total`), so every started rollout still ends exactly
  once; whole groups it had not yet handed over are lost whole. A new actor with the latest policy is
  placed wherever the resources are free again (`rollout/hosts_replaced_total`); its group ids continue
  after the last one delivered. `health` raises if no node takes it within the trainer's `stale_after_s`.
- Leftovers are reaped: a node's sandboxes belong to the host's process, which dies with the node
  (bubblewrap's --die-with-parent takes the agents with it); the next engine to start on that node, a
  replacement or a host placed there when the node rejoins, removes their directories, mounts and cgroups
  (the backends' reapers remove what a dead process owned). Likewise after a trainer killed outright,
  whose actors Ray kills with it.
- Log records from the actor reach the trainer's console through Ray's own log forwarding
  (`log_to_driver`), at the trainer's levels.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from swe_grpo.types import HostMessage, Policy, RolloutWorkerError
from swe_grpo.worker.host_main import HostSpec, build_engine, with_verified_templates

log = logging.getLogger(__name__)

SANDBOX_RESOURCE = "swe_grpo_sandboxes"
"""The custom resource the docs suggest for nodes that hold sandboxes."""

_ANSWER_TIMEOUT_S = 60.0  # an actor answers in milliseconds once it serves; a minute without an answer is wedged
_KILL_AFTER_S = 10.0  # after stop's own timeout, the actor is killed
# Metrics that end a started rollout (swe_grpo/worker/engine.py): what a lost host had started less these was in flight.
_ENDED = ("rollout/finished_total", "rollout/stale_cancelled_total", "rollout/stop_cancelled_total")


class _HostActor:
    """The actor: runs one engine and is that engine's outlet (its output waits here for the trainer's drain)."""

    def __init__(self, spec: HostSpec):
        self._spec = spec
        self._engine: Any = None  # a RolloutEngine once started
        self._output: queue.SimpleQueue[HostMessage | None] = queue.SimpleQueue()  # None: the engine has stopped
        self._lock = threading.Lock()
        self._waiting = 0  # samples in the trainer's buffer at its latest drain
        self._queued = 0  # samples here, not yet drained
        self._in_transit = 0  # samples handed to the latest drain (delivered once the next one comes)

    def start(self) -> tuple[str, int]:
        """Build and start the engine; returns where it runs: its node's id and its pid."""
        logging.basicConfig()
        for name, level in self._spec.log_levels.items():
            logging.getLogger(name or None).setLevel(level)
        if self._spec.setup is not None:
            self._spec.setup()
        self._engine = build_engine(self._spec, self)
        self._engine.start()
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def drain(self, waiting: int, timeout_s: float) -> list[HostMessage] | None:
        with self._lock:
            self._waiting, self._in_transit = waiting, 0
        messages: list[HostMessage] = []
        while len(messages) < 1000:
            try:
                message = self._output.get(timeout=timeout_s) if not messages else self._output.get_nowait()
            except queue.Empty:
                break
            if message is None:  # stopped: this is the end of what the engine produced
                self._output.put(None)
                if not messages:
                    return None
                break
            messages.append(message)
        samples = sum(len(payload) for kind, payload in messages if kind == "group")
        with self._lock:
            self._queued -= samples
            self._in_transit = samples
        return messages

    def set_policy(self, policy: Policy) -> None:
        self._engine.set_policy(policy)

    def health(self, stale_after_s: float) -> None:
        self._engine.check_health(stale_after_s)

    def stop(self, timeout_s: float) -> None:
        try:
            if self._engine is not None:
                self._engine.stop(timeout_s)
        finally:
            self._output.put(None)

    # the engine's outlet

    def put_group(self, samples: list[Any]) -> None:
        with self._lock:
            self._queued += len(samples)
        self._output.put(("group", samples))

    def put_metrics(self, metrics: dict[str, Any]) -> None:
        self._output.put(("metrics", metrics))

    def put_traces(self, step: int, traces: list[Any]) -> None:
        self._output.put(("traces", (step, traces)))

    def waiting(self) -> int:
        """The samples waiting in the trainer's buffer, and this host's on their way there."""
        with self._lock:
            return self._waiting + self._in_transit + self._queued


_RemoteHostActor = ray.remote(_HostActor)


class RayHost:
    """A rollout host in a Ray actor that needs `resources` (e.g. `{SANDBOX_RESOURCE: 1}`; no CPU is
    reserved for it), replaced when it dies. Connects to the Ray cluster (`ray.init()`) if this process
    has not yet."""

    def __init__(self, spec: HostSpec, resources: Mapping[str, float]):
        self.spec = spec
        self.resources = dict(resources)
        self.name = f"ray rollout host {spec.index}"
        self.node_id: str | None = None  # where the actor that serves now runs
        self.pid: int | None = None
        self.replacements = 0
        self._lock = threading.RLock()  # the actor and its start, swapped by the pump on a replacement
        self._actor: Any = None
        self._started: Any = None  # the ObjectRef of the actor's start()
        self._serving = False
        self._launched_at = 0.0
        self._policy = spec.policy  # the latest, for a replacement
        self._in_flight = 0.0  # started less ended, as delivered
        self._next_group = spec.index  # a replacement numbers its groups from here
        self._failure: BaseException | None = None
        self._stopping = False
        self._ended = threading.Event()  # the pump has taken all this host will produce

    def start(self) -> None:
        if not ray.is_initialized():
            ray.init()
        self.spec = with_verified_templates(self.spec)
        self._launch(self.spec)

    def wait_started(self, timeout_s: float) -> None:

        try:
            self._serves_on(ray.get(self._started, timeout=timeout_s))
        except GetTimeoutError as e:
            raise RolloutWorkerError(
                f"{self.name} did not start within {timeout_s:.0f}s: does a live node offer {self.resources}?"
            ) from e
        except Exception as e:
            raise RolloutWorkerError(f"{self.name} failed to start") from e

    def set_policy(self, policy: Policy) -> None:
        with self._lock:
            self._policy = policy
            if not self._serving:  # the pump hands it over once the actor serves
                return
            actor = self._actor
        with contextlib.suppress(RayActorError):  # lost: its replacement starts with this policy
            _ask(actor.set_policy, policy)

    def drain(self, waiting: int, timeout_s: float) -> list[HostMessage] | None:
        if self._ended.is_set():
            return None
        if not self._serving:
            return self._await_start(timeout_s)
        try:
            messages = _ask(self._actor.drain, waiting, timeout_s, answer_s=timeout_s + _ANSWER_TIMEOUT_S)
        except RayActorError as e:
            return self._lost(e)
        except BaseException:  # the pump ends with it (check_health re-raises it)
            self._ended.set()
            raise
        if messages is None:
            self._ended.set()
            return None
        for kind, payload in messages:
            if kind == "metrics":
                self._in_flight += payload.get("rollout/started_total", 0.0) - sum(payload.get(k, 0.0) for k in _ENDED)
            elif kind == "group":
                self._next_group = max(self._next_group, payload[0].group_id + self.spec.count)
        return messages

    def health(self, stale_after_s: float) -> None:

        if self._failure is not None:
            raise RolloutWorkerError(f"{self.name} is gone") from self._failure
        with self._lock:
            serving, actor, waited = self._serving, self._actor, time.monotonic() - self._launched_at
        if not serving:
            if self.replacements and waited > stale_after_s:
                raise RolloutWorkerError(
                    f"{self.name} lost its actor and no node has taken its replacement for {waited:.0f}s: "
                    f"does a live node offer {self.resources}?"
                )
            return
        try:
            _ask(actor.health, stale_after_s)
        except RayActorError:  # lost with its node: the pump replaces it
            pass
        except GetTimeoutError as e:
            raise RolloutWorkerError(f"{self.name} did not answer within {_ANSWER_TIMEOUT_S:.0f}s") from e

    def stop(self, timeout_s: float) -> None:

        with self._lock:
            self._stopping = True  # from now on a lost actor is not replaced
            actor, started = self._actor, self._started
        if actor is None:
            return
        cause: BaseException | None = None
        try:
            ray.get(started, timeout=timeout_s)  # a starting engine is stopped once it serves
            _ask(actor.stop, timeout_s, answer_s=timeout_s + _KILL_AFTER_S)
            self._ended.wait(_ANSWER_TIMEOUT_S)  # the pump takes the rest
        except RayActorError:  # lost meanwhile: nothing to stop
            pass
        except GetTimeoutError as e:
            cause = RolloutWorkerError(f"{self.name} did not stop within {timeout_s:.0f}s; killed")
            cause.__cause__ = e
        except Exception as e:  # its start failed (reported by wait_started or health) or its stop raised
            cause = e
        finally:
            ray.kill(actor)
            self._ended.set()
        if cause is not None and self._serving:
            raise cause

    def _launch(self, spec: HostSpec) -> None:
        actor = _RemoteHostActor.options(num_cpus=0, resources=self.resources, max_concurrency=4).remote(spec)
        with self._lock:
            self._actor, self._started, self._serving = actor, actor.start.remote(), False
            self._launched_at = time.monotonic()

    def _await_start(self, timeout_s: float) -> list[HostMessage] | None:
        """The pump's part while the actor starts: once it serves, hand over a policy that came meanwhile."""
        ready, _ = ray.wait([self._started], timeout=timeout_s)
        if not ready:
            return []
        try:
            self._serves_on(ray.get(self._started))
        except RayActorError as e:
            return self._lost(e)
        except Exception as e:  # reported by wait_started, or for a replacement by health
            self._failure = e
            self._ended.set()
            return None
        with self._lock:  # held while sending: a policy the trainer sets now follows this one
            self._serving = True
            if self._policy != self.spec.policy:
                with contextlib.suppress(RayActorError):  # lost already: the next drain replaces it
                    _ask(self._actor.set_policy, self._policy)
        return []

    def _lost(self, error: RayActorError) -> list[HostMessage] | None:
        """The actor died: count its rollouts in flight as infrastructure outcomes, and replace it."""
        with self._lock:
            if self._stopping:
                self._ended.set()
                return None
            lost = max(self._in_flight, 0.0)
            log.warning(
                "%s (node %s, pid %s) was lost with %d rollouts in flight; replacing it: %s",
                self.name,
                self.node_id,
                self.pid,
                lost,
                str(error).strip().splitlines()[-1],
            )
            ray.kill(self._actor)  # dead, or out of reach for a minute: gone either way
            self._in_flight = 0.0
            self.replacements += 1
            self.node_id = self.pid = None
            self.spec = dataclasses.replace(self.spec, index=self._next_group, policy=self._policy)
            self._launch(self.spec)
        metrics = {"rollout/hosts_replaced_total": 1.0}
        if lost:
            metrics |= {
                "rollout/outcome_infra_error_total": lost,
                "rollout/finished_total": lost,
                "rollout/host_lost_total": lost,
            }
        return [("metrics", metrics)]

    def _serves_on(self, where: tuple[str, int]) -> None:
        if (self.node_id, self.pid) == where:  # told by wait_started and by the pump
            return
        self.node_id, self.pid = where
        log.info("%s serves on node %s (pid %d)", self.name, self.node_id, self.pid)


def _ask(method: Any, *args: Any, answer_s: float = _ANSWER_TIMEOUT_S) -> Any:
    """Call an actor's method and return its answer within `answer_s`. A transient loss of contact
    (`ActorUnavailableError`) is retried meanwhile (every request is idempotent); `RayActorError` once the
    actor is dead or out of reach for longer, `GetTimeoutError` if it does not answer."""
    deadline = time.monotonic() + answer_s
    while True:
        try:
            return ray.get(method.remote(*args), timeout=max(deadline - time.monotonic(), 0.0))
        except ActorUnavailableError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(1.0)
