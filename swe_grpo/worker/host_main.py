"""The child side of a rollout host: what runs inside the host's process (swe_grpo/worker/hosts.py has the
trainer's side).

`_host_main` is the process's entry point (`ProcessHost` spawns it): it receives its `HostSpec` as the
first message on its command pipe (not as an argument of the spawn: see `ProcessHost.start`), builds the
host's engine (`build_engine`), starts it, and serves the trainer's requests ("policy", "health", "stop")
on that pipe until it asks to stop or is gone; the engine's output (whole groups, metrics, traces) and
this process's log records go to the trainer on another pipe, from a thread of their own (`_Sender`), so
the engine's event loop never waits on the trainer. A host stops its
engine when the trainer dies, even by SIGKILL: it sees its command pipe close, and the kernel signals it
(PR_SET_PDEATHSIG). An exception raised here reaches the trainer with its `__cause__` chain and each
one's traceback (`pack_exception` here, `unpack_exception` on the trainer's side).

A spawned process imports the trainer's main script again (as `__mp_main__`) before it runs anything of
ours: a script without the `if __name__ == "__main__":` guard would build a second trainer and worker in
every host. `refuse_in_a_rollout_host` (called by `SWERolloutWorker`) stops that host at once with the
reason on its stderr and the exit code `UNGUARDED_SCRIPT_EXIT`, which the trainer's side turns into the
same reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import itertools
import linecache
import logging
import logging.handlers
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from transformers import PreTrainedTokenizerBase

from swe_grpo.agents import Agent
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.tasks import Task
from swe_grpo.tokens.template import (
    TemplateKey,
    known_training_chat_templates,
    remember_training_chat_templates,
    training_chat_template,
)
from swe_grpo.types import HostMessage, Policy, RolloutOutlet, RolloutWorkerError
from swe_grpo.worker.config import WorkerConfig
from swe_grpo.worker.engine import RolloutEngine

log = logging.getLogger(__name__)

_SEND_TIMEOUT_S = 60.0  # a host's last messages reach the trainer in milliseconds; past a minute it is gone
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
HOST_PROCESS_PREFIX = "swe-grpo-rollout-host-"  # a host process's name; set by spawn before the script re-runs
UNGUARDED_SCRIPT_EXIT = 86  # a host's exit code for "your script has no __main__ guard": nothing else exits so
UNGUARDED_SCRIPT = (
    'your training script has no `if __name__ == "__main__":` guard. Rollout hosts are spawned processes, and a '
    "spawned process imports the main script again: without the guard, every host would build a second worker "
    "and trainer and train. Put everything that builds the worker and the trainer and calls train() under "
    '`if __name__ == "__main__":` (or in a main() called there), as the README\'s script does; or run the '
    "rollouts in the trainer's process with WorkerConfig(rollout_hosts=0)."
)


def refuse_in_a_rollout_host() -> None:
    """Stop this process if it is a rollout host re-running the trainer's script (see the module docstring):
    the reason and the script's line go to stderr, and the exit code tells the trainer's side. Returns at
    once anywhere else."""
    if not multiprocessing.current_process().name.startswith(HOST_PROCESS_PREFIX):
        return
    # The script's own frame: spawn runs it as `__mp_main__` (`sys.modules["__main__"]` is replaced only after).
    in_script = [(f, n) for f, n in traceback.walk_stack(None) if f.f_globals.get("__name__") == "__mp_main__"]
    where = ""
    if in_script:
        frame, lineno = in_script[0]
        source = linecache.getline(frame.f_code.co_filename, lineno).strip()
        where = f" (at {frame.f_code.co_filename}, line {lineno}: {source})"
    print(f"swe_grpo rollout host: {UNGUARDED_SCRIPT}{where}", file=sys.stderr, flush=True)
    raise SystemExit(UNGUARDED_SCRIPT_EXIT)


@dataclass(frozen=True)
class EngineArgs:
    """What one rollout engine is built from (`SWERolloutWorker`'s arguments); pickled into a host."""

    tasks: list[Task]
    tokenizer: PreTrainedTokenizerBase
    vllm_url: str
    model: str
    sandbox: str | SandboxBackend
    config: WorkerConfig
    agent: Agent | None  # None: the engine builds the config's (`WorkerConfig.agent`, one or a mix)
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
    levels it forwards, an optional `setup` run first (picklable, e.g. logging set-up), and the training
    chat templates the trainer verified (`swe_grpo.tokens.template`: with them the host never imports
    TRL's template utilities, nor torch through them)."""

    engine: EngineArgs
    policy: Policy
    index: int
    count: int
    log_levels: dict[str, int]
    setup: Callable[[], None] | None = None
    chat_templates: dict[TemplateKey, str] = field(default_factory=dict)


def with_verified_templates(spec: HostSpec) -> HostSpec:
    """`spec` with the training chat template of its tokenizer verified here, in the trainer, where TRL is loaded
    already, so the host need not load it (and torch). Whatever fails here fails again in the host, which
    reports it as its start failure."""
    with contextlib.suppress(Exception):
        training_chat_template(spec.engine.tokenizer)
    return dataclasses.replace(spec, chat_templates=known_training_chat_templates())


def build_engine(spec: HostSpec, outlet: RolloutOutlet) -> RolloutEngine:
    """The rollout engine a host runs (`spec.engine`, rollouts in its own thread): its output goes to
    `outlet`, its group ids are its own (host i of N numbers its groups i, i + N, ...), its policy is
    `spec.policy`."""
    remember_training_chat_templates(spec.chat_templates)
    e = spec.engine
    return RolloutEngine(
        e.tasks,
        e.tokenizer,
        vllm_url=e.vllm_url,
        model=e.model,
        outlet=outlet,
        group_ids=itertools.count(spec.index, spec.count),
        sandbox=e.sandbox,
        config=e.config,
        agent=e.agent,
        vllm_api_key=e.vllm_api_key,
        policy=spec.policy,
    )


class _TrainerGone(BaseException):
    """The trainer died, or asked this host to end by a signal."""


def _host_main(
    commands: Connection,
    results: Connection,
    backlog: tuple[ctypes.c_int64, ctypes.c_int64],
    trainer_pid: int,
) -> None:
    """A host process: receive its `HostSpec`, build the engine, start it, then serve the trainer's requests
    until it asks to stop or is gone (its pipe closes, or the kernel's parent-death signal arrives); the
    engine is stopped either way. A failure to start, the spec's unpickling included, is the answer to the
    trainer's wait for the start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the trainer, which stops hosts
    outbox = _Sender(results)
    engine: RolloutEngine | None = None
    try:
        _die_with(trainer_pid)
        try:
            received = commands.recv_bytes()
        except (EOFError, OSError):
            raise _TrainerGone() from None
        try:
            spec: HostSpec = pickle.loads(received)  # fails e.g. on a user's class this process cannot import
            _forward_logs(outbox, spec.log_levels)
            if spec.setup is not None:
                spec.setup()
            engine = build_engine(spec, _HostOutlet(outbox, *backlog))
            engine.start()
        except Exception as e:
            commands.send(("error", pack_exception(e)))
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


def _serve(engine: RolloutEngine, commands: Connection) -> None:
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
            answer = ("error", pack_exception(e))
        commands.send(answer)
        if request == "stop":
            return


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
        self._thread.join(_SEND_TIMEOUT_S)
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

PackedException = list[tuple[bytes | None, str, str]]


def pack_exception(exc: BaseException) -> PackedException:
    """The exception and its `__cause__` chain, outermost first: each pickled (None where it does not
    pickle), summarised, and with its own traceback's text."""
    chain: PackedException = []
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


def unpack_exception(chain: PackedException, where: str) -> BaseException:
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
