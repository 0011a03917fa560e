"""Rollout hosts: where rollouts run when they run outside the trainer's process.

With `WorkerConfig.rollout_hosts = N > 0` (the default is 1) the `SWERolloutWorker` the trainer holds
runs no rollout itself. Each of N rollout hosts runs a whole rollout engine (its own InterceptionServer,
agents, sandboxes, grading, groups and advantages) on its share of `max_concurrent_rollouts`, and the
trainer's side only moves what crosses the boundary: whole groups of samples, metric dicts, agent traces
and log records come out; the policy (its version and the model vLLM serves it under) goes in; health
checks and `stop` are requests with answers.

A host is anything that implements `RolloutHost` (start, wait until serving, set the policy, drain its
output, health, stop). `ProcessHost` is a spawned child process of the trainer (not forked: the trainer
has threads and CUDA state a fork would copy), whose side of the boundary is swe_grpo/worker/host_main.py;
a Ray actor on another node implements the same calls (swe_grpo/worker/ray_hosts.py). `RolloutHosts`
is the trainer's side of a set of hosts.

What holds across the boundary (on top of everything `swe_grpo.worker` guarantees inside a host, where a
`RolloutEngine` runs):
- Groups stay whole: a group crosses as one message and enters the trainer's buffer at once; a host that
  dies mid-message loses that group whole, never part of it.
- Group ids are unique over all hosts (host i of N numbers its groups i, i + N, ...).
- Backpressure is the trainer's: every host sees how many samples wait in the trainer's buffer, and
  counts its own still on their way there.
- Health keeps the original cause: an exception raised in a host is re-raised in the trainer with its
  type, message and `__cause__` chain, each carrying the host's traceback as a note; a host process that
  died is reported with its exit code or signal as soon as it has died, while starting too (its process is
  watched beside its pipes, which a process it started may hold open); one that does not answer within a
  minute is reported. A host that re-ran a training script without the `__main__` guard is
  reported as such (swe_grpo/worker/host_main.py).
- Nothing lost: a host's metrics up to its exit, `stop()`'s cancellations included, reach the trainer's
  `metrics_queue` before `stop()` returns.
- Nothing leaked: `stop()` stops every host's engine (cancelling every rollout, destroying its
  sandboxes) and joins its process, killing it after the timeout. A host stops the same way when the
  trainer dies, even by SIGKILL: it sees its command pipe close, and the kernel signals it
  (PR_SET_PDEATHSIG). What a host that died left (killed, or frozen and then killed by `stop()`): its
  agents die with it (bubblewrap's --die-with-parent), and `stop()` then removes its sandboxes'
  directories, mounts and cgroups and its doors; after a SIGKILLed trainer, the next start does.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Protocol

from swe_grpo.types import HostMessage, Policy, RolloutOutlet, RolloutWorkerError
from swe_grpo.worker.host_main import (
    HOST_PROCESS_PREFIX,
    UNGUARDED_SCRIPT,
    UNGUARDED_SCRIPT_EXIT,
    EngineArgs,
    HostSpec,
    _host_main,
    build_engine,
    unpack_exception,
    with_verified_templates,
)

__all__ = ["EngineArgs", "HostMessage", "HostSpec", "ProcessHost", "RolloutHost", "RolloutHosts", "build_engine"]

log = logging.getLogger(__name__)

_ANSWER_TIMEOUT_S = 60.0  # a host answers a request in milliseconds; a minute without an answer is a wedged host
_KILL_AFTER_S = 10.0  # after stop's own timeout: SIGTERM, then this long, then SIGKILL


class RolloutHost(Protocol):
    """One place rollouts run, as the trainer's side sees it."""

    name: str

    def start(self) -> None:
        """Begin starting the host's engine; returns at once (see `wait_started`)."""
        ...

    def wait_started(self, timeout_s: float) -> None:
        """Return once the engine serves; raise `RolloutWorkerError` with the cause if it cannot start."""
        ...

    def set_policy(self, policy: Policy) -> None:
        """Generate with `policy` from now on and cancel the rollouts it leaves too stale."""
        ...

    def drain(self, waiting: int, timeout_s: float) -> list[HostMessage] | None:
        """What the host produced since the last call, waiting up to `timeout_s` for the first message;
        None once the host has ended and all it produced was drained. `waiting`: the samples waiting in
        the trainer's buffer now (the host launches no group while `queue_maxsize` do)."""
        ...

    def health(self, stale_after_s: float) -> None:
        """Raise `RolloutWorkerError` (the original cause chained) if the host's engine or the host is unwell."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Stop the engine (nothing left behind) and end the host; kill it if it takes longer than `timeout_s`."""
        ...


# --------------------------------------------------------------------------- the trainer's side


class RolloutHosts:
    """The trainer's side of a set of rollout hosts: moves their output into the trainer's queues (one
    thread per host), fans the policy out to all, asks each for its health, and stops them."""

    def __init__(self, hosts: Sequence[RolloutHost], outlet: RolloutOutlet, ready_timeout_s: float = 600.0):
        self.hosts = list(hosts)
        self.outlet = outlet
        self.ready_timeout_s = ready_timeout_s
        self._pumps: list[threading.Thread] = []
        self._failure: BaseException | None = None

    def start(self) -> None:
        """Start every host (they import and start in parallel) and return once all serve."""
        try:
            for host in self.hosts:
                host.start()
                # Each pump runs in a copy of the caller's context: the trainer's trackio run is a ContextVar.
                context = contextvars.copy_context()
                pump = threading.Thread(target=context.run, args=(self._pump, host), name="swe-grpo-pump", daemon=True)
                pump.start()
                self._pumps.append(pump)
            for host in self.hosts:
                host.wait_started(self.ready_timeout_s)
        except BaseException:
            try:
                self.stop(timeout_s=60.0)
            except Exception as e:  # the start failure is the one to report
                log.warning("stopping the rollout hosts after a failed start: %s", e)
            raise

    def set_policy(self, policy: Policy) -> None:
        for host in self.hosts:
            host.set_policy(policy)

    def check_health(self, stale_after_s: float) -> None:

        if self._failure is not None:
            raise RolloutWorkerError("moving the rollout hosts' output failed") from self._failure
        for host in self.hosts:
            host.health(stale_after_s)

    def stop(self, timeout_s: float) -> None:
        """Stop every host (in parallel); returns once each has ended and all it produced was delivered."""
        with ThreadPoolExecutor(len(self.hosts)) as pool:
            results = [pool.submit(host.stop, timeout_s) for host in self.hosts]
        for pump in self._pumps:
            pump.join(_ANSWER_TIMEOUT_S)
        for result in results:
            result.result()  # the first host that did not stop cleanly raises

    def _pump(self, host: RolloutHost) -> None:
        try:
            while (messages := host.drain(self.outlet.waiting(), timeout_s=0.5)) is not None:
                for kind, payload in messages:
                    self._deliver(kind, payload)
        except BaseException as e:  # re-raised by check_health
            self._failure = e
            log.error("moving %s's output failed", host.name, exc_info=e)

    def _deliver(self, kind: str, payload: Any) -> None:
        if kind == "group":
            self.outlet.put_group(payload)
        elif kind == "metrics":
            self.outlet.put_metrics(payload)
        elif kind == "traces":
            self.outlet.put_traces(*payload)
        elif kind == "log":
            logger = logging.getLogger(payload.name)
            if logger.isEnabledFor(payload.levelno):
                logger.handle(payload)
        else:
            raise ValueError(f"unknown message from a rollout host: {kind!r}")


class ProcessHost:
    """A rollout host in a spawned child process of this one.

    Requests and their answers travel on one duplex pipe, the host's output on another; this side closes
    its copies of the child's ends, so each side sees the other's death as end-of-file."""

    def __init__(self, spec: HostSpec):
        self.spec = spec
        self.name = f"rollout host {spec.index}"
        self._context = multiprocessing.get_context("spawn")
        # Backpressure, written by this host's pump only: the trainer's buffer size, and how many of the host's
        # samples had been delivered to it when that size was read (the host adds those still in transit).
        self._waiting: ctypes.c_int64 = self._context.RawValue("q", 0)
        self._delivered: ctypes.c_int64 = self._context.RawValue("q", 0)
        self._received = 0  # samples received so far; delivered by the pump before its next drain
        self._process: multiprocessing.process.BaseProcess | None = None
        self._ended = -1  # a descriptor readable once the process has ended (`_end_watch`)
        self._commands: Connection | None = None
        self._results: Connection | None = None
        self._lock = threading.Lock()  # one request and its answer at a time
        self._wedged: str | None = None  # a request went unanswered: answers can no longer be matched
        self._serving = False  # it answered its start: the spec was received, requests may be sent

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Spawn the host's process and send it its spec; returns at once (see `wait_started`).

        The spec (tasks, tokenizer: often megabytes) goes as the first message on the command pipe, from a
        thread, and not as an argument of the spawn: multiprocessing writes those into a pipe whose reading
        end it holds open itself, before the child reads it, and the child reads it only after re-running the
        trainer's main script. A child that dies in that script (one without the `__main__` guard) would
        leave `process.start()` blocked in that write for good."""
        self.spec = with_verified_templates(self.spec)
        try:
            spec = pickle.dumps(self.spec)
        except Exception as e:  # said plainly here, not as a pickling traceback from inside multiprocessing
            raise TypeError(
                f"what runs in {self.name} must pickle, and this does not: {e}. Pass the sandbox backend by name "
                "(or a picklable backend), host_setup as a module-level function or a functools.partial of one, "
                "or run the rollouts in the trainer's process (WorkerConfig.rollout_hosts=0)."
            ) from e
        commands, host_commands = self._context.Pipe()
        results, host_results = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_host_main,
            args=(host_commands, host_results, (self._waiting, self._delivered), os.getpid()),
            name=f"{HOST_PROCESS_PREFIX}{self.spec.index}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            host_commands.close()
            host_results.close()
        self._process, self._commands, self._results = process, commands, results
        self._ended = self._end_watch(process)
        self.name = f"rollout host {self.spec.index} (pid {process.pid})"
        threading.Thread(target=self._send_spec, args=(spec,), name="swe-grpo-host-spec", daemon=True).start()

    def _send_spec(self, spec: bytes) -> None:
        assert self._commands is not None
        with contextlib.suppress(OSError):  # the host died first: `wait_started` reports how
            self._commands.send_bytes(spec)

    def wait_started(self, timeout_s: float) -> None:

        if (failure := self._answer(timeout_s, "start")) is not None:
            raise RolloutWorkerError(f"{self.name} failed to start") from failure
        self._serving = True

    def set_policy(self, policy: Policy) -> None:
        self._ask("policy", policy)

    def drain(self, waiting: int, timeout_s: float) -> list[HostMessage] | None:
        assert self._results is not None
        self._waiting.value = waiting  # before `delivered`: a host reading between the two counts some twice, not never
        self._delivered.value = self._received
        messages: list[HostMessage] = []
        try:
            self._wait_for(self._results, timeout_s)
            exited = self._exited()  # before reading: all it sent before it ended is then readable
            while len(messages) < 1000 and self._results.poll(0):
                messages.append(self._results.recv())
            if exited and not messages:  # ended, its pipe held open by a process it started
                return None
        except EOFError:  # the host has ended (a message cut off by its death is dropped whole)
            return messages or None
        finally:
            self._received += sum(len(payload) for kind, payload in messages if kind == "group")
        return messages

    def health(self, stale_after_s: float) -> None:
        self._ask("health", stale_after_s)

    def stop(self, timeout_s: float) -> None:

        process = self._process
        if process is None:
            return
        cause: BaseException | None = None
        if process.is_alive() and self._wedged is None and self._serving:
            try:
                self._ask("stop", timeout_s, answer_s=timeout_s + _KILL_AFTER_S)
            except RolloutWorkerError as e:
                cause = e
            process.join(_KILL_AFTER_S)
        # One that never served is still starting or re-running the trainer's script: SIGTERM stops its engine.
        for kill in (process.terminate, process.kill):
            if process.exitcode is None:
                log.warning("%s did not exit; %s", self.name, kill.__name__)
                kill()
                process.join(_KILL_AFTER_S)
        if cause is not None and process.exitcode != 0:  # a host that had already ended cleanly cannot answer
            raise cause

    def _ask(self, request: str, argument: Any, answer_s: float | None = None) -> None:
        """Send a request and wait for its answer; `RolloutWorkerError` (the host's exception chained) if
        the host raised, died or did not answer."""

        assert self._commands is not None
        with self._lock:
            if self._wedged is not None:
                raise RolloutWorkerError(self._wedged)
            try:
                self._commands.send((request, argument))
            except OSError as e:
                raise RolloutWorkerError(f"{self.name} {self._death()}") from e
            failure = self._answer(_ANSWER_TIMEOUT_S if answer_s is None else answer_s, request)
        if failure is not None:
            raise failure  # the host's own exception, its chain rebuilt

    def _answer(self, timeout_s: float, request: str) -> BaseException | None:
        """Wait for the answer to `request`: None, or the exception the host raised; RolloutWorkerError if
        no answer came."""

        assert self._commands is not None and self._process is not None
        try:
            if not self._wait_for(self._commands, timeout_s):
                self._wedged = f"{self.name} did not answer {request!r} within {timeout_s:.0f}s"
                raise RolloutWorkerError(self._wedged)
            if not self._commands.poll(0):  # it ended without answering, its pipe held open by a process it started
                raise RolloutWorkerError(f"{self.name} {self._death()}")
            status, payload = self._commands.recv()
        except (EOFError, OSError) as e:
            raise RolloutWorkerError(f"{self.name} {self._death()}") from e
        return unpack_exception(payload, self.name) if status == "error" else None

    def _end_watch(self, process: multiprocessing.process.BaseProcess) -> int:
        """A descriptor that becomes readable when `process` ends: a pidfd, which no process the host started
        can hold open (multiprocessing's sentinel is a pipe that a process it forked inherits), or that
        sentinel where the kernel has no pidfds (before Linux 5.3)."""
        assert process.pid is not None
        try:
            pidfd = os.pidfd_open(process.pid)
        except OSError:
            return process.sentinel
        weakref.finalize(self, os.close, pidfd)
        return pidfd

    def _wait_for(self, pipe: Connection, timeout_s: float) -> bool:
        """Wait until `pipe` can be read or the host's process has ended; False after `timeout_s`."""
        return bool(multiprocessing.connection.wait([pipe, self._ended], timeout_s))

    def _exited(self) -> bool:
        return bool(multiprocessing.connection.wait([self._ended], 0))

    def _death(self) -> str:
        """How the host's process ended, for an error message."""
        assert self._process is not None
        self._process.join(5.0)
        code = self._process.exitcode
        if code is None:
            return "closed its pipe but is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        if code == UNGUARDED_SCRIPT_EXIT:
            return f"exited at once (code {code}): {UNGUARDED_SCRIPT}"
        return f"exited with code {code} (its stderr, which is the trainer's, has the reason)"
