"""Rollout hosts: where rollouts run when they run outside the trainer's process.

With `WorkerConfig.rollout_hosts = N > 0` (the default is 1) the `SWERolloutWorker` the trainer holds
runs no rollout itself. Each of N rollout hosts runs a whole rollout engine (its own InterceptionServer,
agents, sandboxes, grading, groups and advantages) on its share of `max_concurrent_rollouts`, and the
trainer's side only moves what crosses the boundary: whole groups of samples, metric dicts, agent traces
and log records come out; the policy (its version and the model vLLM serves it under) goes in; health
checks and `stop` are requests with answers.

A host is anything that implements `RolloutHost` (start, wait until serving, set the policy, drain its
output, health, stop). `ProcessHost` is a spawned child process of the trainer (not forked: the trainer
has threads and CUDA state a fork would copy); a Ray actor on another node can implement the same calls.

What holds across the boundary (on top of everything `swe_grpo.worker` guarantees inside a host):
- Groups stay whole: a group crosses as one message and enters the trainer's buffer at once; a host that
  dies mid-message loses that group whole, never part of it.
- Group ids are unique over all hosts (host i of N numbers its groups i, i + N, ...).
- Backpressure is the trainer's: every host sees how many samples wait in the trainer's buffer, and
  counts its own still on their way there.
- Health keeps the original cause: an exception raised in a host is re-raised in the trainer with its
  type, message and `__cause__` chain, each carrying the host's traceback as a note; a host process that
  died is reported with its exit code or signal; one that does not answer within a minute is reported.
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

import contextvars
import ctypes
import dataclasses
import itertools
import logging
import logging.handlers
import multiprocessing
import os
import pickle
import queue
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

from swe_grpo.agents import Agent
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.tasks import Task
from swe_grpo.types import Policy, RolloutWorkerError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from swe_grpo.worker import QueueOutlet
    from swe_grpo.worker.config import WorkerConfig

log = logging.getLogger(__name__)

_ANSWER_TIMEOUT_S = 60.0  # a host answers a request in milliseconds; a minute without an answer is a wedged host
_KILL_AFTER_S = 10.0  # after stop's own timeout: SIGTERM, then this long, then SIGKILL
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

HostMessage = tuple[str, Any]
"""A host's output, in order: ("group", [RolloutSample, ...]), a whole group; ("metrics", {key: value});
("traces", (step, [trackio.Trace, ...])); ("log", logging.LogRecord)."""


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


@dataclass(frozen=True)
class EngineArgs:
    """What one rollout engine is built from (`SWERolloutWorker`'s arguments); pickled into a host."""

    tasks: list[Task]
    tokenizer: PreTrainedTokenizerBase
    vllm_url: str
    model: str
    sandbox: str | SandboxBackend
    config: WorkerConfig
    agent: Agent
    vllm_api_key: str | None

    def shares(self, hosts: int) -> list[EngineArgs]:
        """The engines of `hosts` hosts: each runs in its host's own process (`rollout_hosts=0`) on its share
        of `max_concurrent_rollouts`, drawing all tasks in its own order (seed + host index)."""
        base, extra = divmod(self.config.max_concurrent_rollouts, hosts)
        return [
            dataclasses.replace(
                self,
                config=dataclasses.replace(
                    self.config,
                    rollout_hosts=0,
                    max_concurrent_rollouts=base + (index < extra),
                    seed=self.config.seed + index,
                ),
            )
            for index in range(hosts)
        ]


@dataclass(frozen=True)
class HostSpec:
    """One host: its engine, the policy it starts with, its place among the hosts (group ids), the log
    levels it forwards, and an optional `setup` run first (picklable, e.g. logging set-up)."""

    engine: EngineArgs
    policy: Policy
    index: int
    count: int
    log_levels: dict[str, int]
    setup: Callable[[], None] | None = None


# --------------------------------------------------------------------------- the trainer's side


class RolloutHosts:
    """The trainer's side of a set of rollout hosts: moves their output into the trainer's queues (one
    thread per host), fans the policy out to all, asks each for its health, and stops them."""

    def __init__(self, hosts: Sequence[RolloutHost], outlet: QueueOutlet, ready_timeout_s: float = 600.0):
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
        self._commands: Connection | None = None
        self._results: Connection | None = None
        self._lock = threading.Lock()  # one request and its answer at a time
        self._wedged: str | None = None  # a request went unanswered: answers can no longer be matched

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        try:
            pickle.dumps(self.spec)
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
            args=(self.spec, host_commands, host_results, (self._waiting, self._delivered), os.getpid()),
            name=f"swe-grpo-rollout-host-{self.spec.index}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            host_commands.close()
            host_results.close()
        self._process, self._commands, self._results = process, commands, results
        self.name = f"rollout host {self.spec.index} (pid {process.pid})"

    def wait_started(self, timeout_s: float) -> None:

        if (failure := self._answer(timeout_s, "start")) is not None:
            raise RolloutWorkerError(f"{self.name} failed to start") from failure

    def set_policy(self, policy: Policy) -> None:
        self._ask("policy", policy)

    def drain(self, waiting: int, timeout_s: float) -> list[HostMessage] | None:
        assert self._results is not None
        self._waiting.value = waiting  # before `delivered`: a host reading between the two counts some twice, not never
        self._delivered.value = self._received
        messages: list[HostMessage] = []
        try:
            if self._results.poll(timeout_s):
                messages.append(self._results.recv())
                while len(messages) < 1000 and self._results.poll(0):
                    messages.append(self._results.recv())
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
        if process.is_alive() and self._wedged is None:
            try:
                self._ask("stop", timeout_s, answer_s=timeout_s + _KILL_AFTER_S)
            except RolloutWorkerError as e:
                cause = e
        process.join(_KILL_AFTER_S)
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
            if not self._commands.poll(timeout_s):
                self._wedged = f"{self.name} did not answer {request!r} within {timeout_s:.0f}s"
                raise RolloutWorkerError(self._wedged)
            status, payload = self._commands.recv()
        except (EOFError, OSError) as e:
            raise RolloutWorkerError(f"{self.name} {self._death()}") from e
        return _unpack(payload, self.name) if status == "error" else None

    def _death(self) -> str:
        """How the host's process ended, for an error message."""
        assert self._process is not None
        self._process.join(5.0)
        code = self._process.exitcode
        if code is None:
            return "closed its pipe but is still running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code} (its stderr has the reason)"


# --------------------------------------------------------------------------- the host's side


class _TrainerGone(BaseException):
    """The trainer died, or asked this host to end by a signal."""


def _host_main(
    spec: HostSpec,
    commands: Connection,
    results: Connection,
    backlog: tuple[ctypes.c_int64, ctypes.c_int64],
    trainer_pid: int,
) -> None:
    """A host process: build the engine, start it, then serve the trainer's requests until it asks to stop
    or is gone (its pipe closes, or the kernel's parent-death signal arrives); the engine is stopped either
    way."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the trainer, which stops hosts
    outbox = _Sender(results)
    _forward_logs(outbox, spec.log_levels)
    engine = None
    try:
        _die_with(trainer_pid)
        try:
            if spec.setup is not None:
                spec.setup()
            engine = build_engine(spec, _HostOutlet(outbox, *backlog))
            engine.start()
        except Exception as e:
            commands.send(("error", _pack(e)))
            return
        commands.send(("ok", None))
        _serve(engine, commands)
    except _TrainerGone:
        log.warning("%s: the trainer is gone; stopping", multiprocessing.current_process().name)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping now: a second signal must not cut it short
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        try:
            if engine is not None:
                engine.stop()  # a no-op after a "stop" request
        finally:
            outbox.close()


def _serve(engine: Any, commands: Connection) -> None:
    """Answer the trainer's requests until it asks to stop (answered once the engine has stopped) or its
    pipe closes."""
    while True:
        try:
            request, argument = commands.recv()
        except (EOFError, OSError):
            raise _TrainerGone() from None
        answer: tuple[str, Any] = ("ok", None)
        try:
            if request == "policy":
                engine.set_policy(argument)
            elif request == "health":
                engine.check_health(argument)
            elif request == "stop":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                engine.stop(argument)
            else:
                raise ValueError(f"unknown request {request!r}")
        except Exception as e:
            answer = ("error", _pack(e))
        commands.send(answer)
        if request == "stop":
            return


def build_engine(spec: HostSpec, outlet: Any) -> Any:
    """The rollout engine a host runs (`spec.engine` with rollouts in its own thread): its output goes to
    `outlet` (put_group, put_metrics, put_traces, waiting), its group ids are its own, its policy `spec.policy`."""
    from swe_grpo.worker import SWERolloutWorker

    e = spec.engine
    engine = SWERolloutWorker(
        e.tasks,
        e.tokenizer,
        vllm_url=e.vllm_url,
        model=e.model,
        sandbox=e.sandbox,
        config=e.config,
        agent=e.agent,
        vllm_api_key=e.vllm_api_key,
    )
    engine.outlet = outlet
    engine.group_ids = itertools.count(spec.index, spec.count)
    engine.set_policy(spec.policy)
    return engine


class _HostOutlet:
    """The engine's outlet inside a host: everything goes to the trainer through the output pipe."""

    def __init__(self, outbox: _Sender, waiting: ctypes.c_int64, delivered: ctypes.c_int64):
        self._outbox = outbox
        self._waiting = waiting
        self._delivered = delivered
        self._sent = 0

    def put_group(self, samples: list[Any]) -> None:
        self._sent += len(samples)
        self._outbox.put(("group", samples))

    def put_metrics(self, metrics: dict[str, Any]) -> None:
        self._outbox.put(("metrics", metrics))

    def put_traces(self, step: int, traces: list[Any]) -> None:
        self._outbox.put(("traces", (step, traces)))

    def waiting(self) -> int:
        """The samples waiting in the trainer's buffer, and this host's on their way there."""
        delivered = int(self._delivered.value)  # read first: see ProcessHost.drain
        return int(self._waiting.value) + self._sent - delivered


class _Sender:
    """Sends messages to the trainer from a thread of its own, so the engine's event loop never waits on
    the pipe. Once the trainer is gone, messages are dropped."""

    def __init__(self, connection: Connection):
        self._connection = connection
        self._queue: queue.SimpleQueue[HostMessage | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send, name="swe-grpo-host-sender", daemon=True)
        self._thread.start()

    def put(self, message: HostMessage) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then close the pipe (the trainer sees end-of-file)."""
        self._queue.put(None)
        self._thread.join(_ANSWER_TIMEOUT_S)
        self._connection.close()

    def _send(self) -> None:
        gone = False
        while (message := self._queue.get()) is not None:
            if gone:
                continue
            try:
                self._connection.send(message)
            except OSError:
                gone = True
            except Exception as e:  # a message that does not pickle: say so, keep the others going
                print(f"swe_grpo rollout host: cannot send a {message[0]!r} message: {e!r}", flush=True)


def _forward_logs(outbox: _Sender, levels: dict[str, int]) -> None:
    """Send this process's log records to the trainer, which handles them as its own."""

    class Forward(logging.handlers.QueueHandler):
        def enqueue(self, record: logging.LogRecord) -> None:
            outbox.put(("log", record))

    root = logging.getLogger()
    root.handlers[:] = [Forward(queue.SimpleQueue())]
    for name, level in levels.items():
        logging.getLogger(name or None).setLevel(level)


def _die_with(trainer_pid: int) -> None:
    """Be signalled when the trainer dies (the pipe's end-of-file is the other way we learn of it)."""

    def trainer_gone(signum: int, frame: Any) -> None:
        # The kernel also sends the parent-death signal when the *thread* that spawned us ends while the
        # trainer lives on; then our parent is unchanged, and we carry on.
        if signum == signal.SIGTERM or os.getppid() != trainer_pid:
            raise _TrainerGone()

    signal.signal(signal.SIGTERM, trainer_gone)
    signal.signal(signal.SIGUSR1, trainer_gone)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1) != 0:
        log.warning("PR_SET_PDEATHSIG failed (errno %d): only the pipe tells the trainer died", ctypes.get_errno())
    if os.getppid() != trainer_pid:  # it died before the signal was armed
        raise _TrainerGone()


# --------------------------------------------------------------------------- exceptions across the boundary

_PackedException = list[tuple[bytes | None, str, str]]


def _pack(exc: BaseException) -> _PackedException:
    """The exception and its `__cause__` chain, outermost first: each pickled (None where it does not
    pickle), summarised, and with its own traceback's text."""
    chain: _PackedException = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        try:
            blob: bytes | None = pickle.dumps(e)
            pickle.loads(blob)  # an exception whose __init__ does not take its args back fails only here
        except Exception:
            blob = None
        text = "".join(traceback.format_exception(e, chain=False))
        chain.append((blob, f"{type(e).__module__}.{type(e).__qualname__}: {e}", text))
        e = e.__cause__
    return chain


def _unpack(chain: _PackedException, where: str) -> BaseException:
    """The exception chain rebuilt on this side, each with the host's traceback as a note."""

    rebuilt: list[BaseException] = []
    for blob, summary, text in chain:
        try:
            exception = pickle.loads(blob) if blob is not None else RolloutWorkerError(summary)
        except Exception:  # e.g. its class cannot be imported here
            exception = RolloutWorkerError(summary)
        exception.add_note(f"raised in {where}:\n{text.rstrip()}")
        rebuilt.append(exception)
    for outer, inner in itertools.pairwise(rebuilt):
        outer.__cause__ = inner
    return rebuilt[0]
