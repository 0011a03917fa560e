"""P8: how many real rollouts this box holds: ramp the concurrency until errors, latency or memory stop it.

What. The real `SWERolloutWorker` with one rollout host (`rollout_hosts=1`: the InterceptionServer, the
real `VLLMClient` and the rollout engine in a child process), real Pi agents (or another harness: `--agent
mini-swe-agent|opencode|codex|claude-code`, each in its own wire dialect) in real `local` sandboxes behind their
doors, graded in fresh sandboxes by the bundled demo tasks' tests. Only generation is a STUB (`scripted_vllm`, no
model: the box has no GPU): vLLM's `/v1/completions` answering after `--latency` seconds with the token ids of a
Qwen3 tool call (the tiny model's chat template, so the InterceptionServer parses it into a real call of the
agent's shell tool, `AGENTS`):
`sleep S` with S uniform in `--sleep` (2-5 s: tools that take seconds), `--turns` times per rollout,
then a last answer (no tool call; mini-swe-agent: its submit command) that ends the agent's run; the
rollout is graded and the worker starts the next. The stub knows each rollout by a marker in its tool calls
(`# p8 s<session>`), which it finds in the next prompt.

Ramp: for each concurrency in `--steps` (4, 8, 16, ...) a fresh worker with `max_concurrent_rollouts` = N;
once N rollouts have started and `--settle-s` passed, a `--window-s` window is measured. The ramp stops at
the first limit hit: errors (a rollout that finished in the window with an outcome other than
resolved/unresolved, or a retried turn), latency (the added p99 over `LATENCY_LIMIT_MS` more than at the
first step; with `--latency-record-only` only recorded, for a box whose other jobs set the latency), CPU
(requests/s per rollout in flight under `THROUGHPUT_FLOOR` of the first step's: rollouts wait for CPU and
add no throughput), memory (the next step's projected memory would leave less than `--reserve-gib` of
MemAvailable), or time (N rollouts not started within `--ramp-s`).

Measured per step, in the window:
- added latency per turn: from the stub's answer to the rollout's next request, less the tool's own
  `sleep S`: the InterceptionServer's parse and SSE, the door, the agent's handling and its tool's start and
  end, its next request through the door, and the server's prepare; the whole host-side loop around one
  generation. p50/p99 over every turn in the window.
- memory by component, summed over process trees (RSS, and PSS from /proc/PID/smaps_rollup, which splits
  shared pages such as Node's binary between the processes mapping them), mean over samples every 5 s:
  agent (the Pi / mini-swe-agent process: the door's child), tools (what the agent ran: bash, sleep),
  door (the sandbox's forwarder, found by its argv naming the door's mount, whatever program it is),
  sandbox (bwrap, its pid-1 reaper and the cgroup-joining shell), commands (what the worker runs in
  sandboxes besides the agent: git, grading's test runs), host (the rollout host process: InterceptionServer,
  VLLMClient, engine), trainer (this process: the worker's queues, the sampler). The stub vLLM stands in
  for the GPU box and is left out. Also the sandboxes' memory cgroups' usage (their processes plus the
  files they wrote, which live in RAM).
- CPU per component (utime + stime of each process, sampled every second; a process that exits loses its
  last second), and CPU per request = all of it but the stub's and this process's / completions served.

`summary` gives the figures to publish: memory per live agent, CPU per rollout in flight, rollouts per GiB
and per core. Every result names its box (CPU model, cores, memory), load averages, date and commit.
This module's top level imports only what a rollout host imports anyway (a spawned host re-imports it).

Run: `SWE_GRPO_CACHE=/tmp/swecache .venv/bin/python benchmarks/p8_capacity.py --json
benchmarks/results/p8_capacity.json` (about 3 minutes a step); `--summarize FILE` re-applies the limits
and the summary to a result file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import Provenance
from _provenance import machine as provenance_machine

# Only what a rollout host imports anyway: the host and the stub are spawned, and a spawned child imports this
# module again, so what is imported here (the worker's TRL and torch, by `run_step`) would count as theirs.
from swe_grpo.agents.claude_code import CLAUDE_CODE_MOUNT
from swe_grpo.agents.codex import CODEX_MOUNT
from swe_grpo.agents.mini_swe import MINI_MOUNT
from swe_grpo.agents.opencode import OPENCODE_MOUNT
from swe_grpo.agents.pi import PI_MOUNT
from swe_grpo.sandbox.door import DOOR_MOUNT
from swe_grpo.sandbox.local import CGROUP_PARENT, LocalBackend
from swe_grpo.sandbox.process import CgroupLayout
from swe_grpo.worker.config import WorkerConfig

if TYPE_CHECKING:
    from swe_grpo.worker import SWERolloutWorker

log = logging.getLogger("p8")
GIB = 1 << 30
MIB = 1 << 20
LATENCY_LIMIT_MS = 50.0
THROUGHPUT_FLOOR = 0.5  # requests/s per rollout in flight, as a share of the first step's: below it, CPU ran out
NORMAL_OUTCOMES = ("resolved", "unresolved")
COMPONENTS = ("agent", "tools", "door", "sandbox", "commands", "host", "trainer")
HOST_SIDE = ("door", "sandbox", "commands", "host", "trainer")  # per rollout, without the agent and its tools
HOST_NAME = "swe-grpo-rollout-host"  # what swe_grpo.worker.hosts names its processes
_MARKER = re.compile(r"# p8 s(\d+)")


@dataclass(frozen=True)
class AgentShape:
    """What the stub must write for one agent: its shell tool and that tool's command argument, whether a run ends
    on a submit command (mini-swe-agent) rather than on an answer without tool calls, and where its bundle is
    mounted (an argv under it is the agent's)."""

    tool: str
    argument: str
    mount: str
    submit: bool = False


AGENTS = {
    "pi": AgentShape("bash", "command", PI_MOUNT),
    "mini-swe-agent": AgentShape("bash", "command", MINI_MOUNT, submit=True),
    "opencode": AgentShape("bash", "command", OPENCODE_MOUNT),
    "codex": AgentShape("exec_command", "cmd", CODEX_MOUNT),
    "claude-code": AgentShape("Bash", "command", CLAUDE_CODE_MOUNT),
}

# --------------------------------------------------------------------------- the stub vLLM


def _answer(session: int | None, sleep_s: float | None, shape: AgentShape) -> str:
    """A Qwen3 answer in thinking mode: one call of the agent's shell tool running `sleep`, or (sleep_s None) the
    last answer: plain text (Pi and the others end their run on an answer without tool calls) or, for an agent
    that `submit`s, mini-swe-agent's submit command (mini ends its run on it)."""
    if sleep_s is None and not shape.submit:
        return "<think>\nThe change is in place.\n</think>\n\nI made the change and the tests pass.<|im_end|>"
    command = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" if sleep_s is None else f"sleep {sleep_s:.1f}"
    call = {"name": shape.tool, "arguments": {shape.argument: f"{command} # p8 s{session}"}}
    return f"<think>\nRun the next check.\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"


def scripted_vllm(
    conn: Connection,
    cpus: set[int],
    turns: int,
    latency: tuple[float, float],
    sleep: tuple[float, float],
    shape: AgentShape,
) -> None:
    """Process entry: a STUB of vLLM's OpenAI server scripted as above, until `conn` receives anything.
    `GET /stats` returns (and with `?reset=1` clears) the completions served, the added latency of each
    turn whose previous answer it knows (seconds), and the sessions begun and finished."""
    from _agent_farm import STUB_MODEL, _serve_forever
    from _pi_agent import load_tokenizer

    tokenizer = load_tokenizer()
    eos = tokenizer.eos_token_id
    rng = random.Random(0)
    state: dict[str, Any] = {"next": 0, "turns": {}, "answered": {}}
    stats: dict[str, Any] = {"completions": 0, "added_s": [], "begun": 0, "finished": 0, "unknown": 0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": STUB_MODEL, "max_model_len": 131072, "root": STUB_MODEL}]})

    async def completions(request: web.Request) -> web.Response:
        arrived = time.monotonic()
        body = await request.json()
        prompt: list[int] = body["prompt"]
        if body.get("max_tokens", 0) <= 1:  # the worker's probe: one token
            ids = [eos]
        else:
            found = _MARKER.findall(tokenizer.decode(prompt[-400:]))
            if found:
                session = int(found[-1])
                if (previous := state["answered"].pop(session, None)) is not None:
                    stats["added_s"].append(arrived - previous[0] - previous[1])
            else:
                session = state["next"]
                state["next"] += 1
                stats["begun"] += 1
            turn = state["turns"][session] = state["turns"].get(session, 0) + 1
            sleep_s = round(rng.uniform(*sleep), 1) if turn <= turns else None
            await asyncio.sleep(rng.uniform(*latency))
            ids = tokenizer.encode(_answer(session, sleep_s, shape), add_special_tokens=False)
            if sleep_s is None:
                stats["finished"] += 1
                state["turns"].pop(session, None)
            else:
                state["answered"][session] = (time.monotonic(), sleep_s)
        stats["completions"] += 1
        choice = {"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)}, "finish_reason": "stop"}
        return web.json_response({"choices": [choice], "model": body.get("model", STUB_MODEL)})

    async def report(request: web.Request) -> web.Response:
        answer = web.json_response(stats)
        if request.query.get("reset"):
            stats.update(completions=0, added_s=[], begun=0, finished=0)
        return answer

    app = web.Application(client_max_size=256 << 20)
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions), web.get("/stats", report)])
    _serve_forever(conn, cpus, app)


def stub_stats(url: str, reset: bool = False) -> dict[str, Any]:
    import requests

    return requests.get(f"{url}/stats", params={"reset": "1"} if reset else {}, timeout=30).json()


# --------------------------------------------------------------------------- the process census


@dataclass
class Census:
    """Who is who among this process's descendants: the rollout host(s) and the stub by pid, the rest by argv."""

    me: int
    stub: int
    agent_marks: tuple[str, ...]  # an argv containing one of these is the agent
    hosts: set[int] = field(default_factory=set)

    def classify(self, procs: dict[int, tuple[int, list[str]]]) -> dict[int, str]:
        """pid -> component, for `procs` (pid -> (ppid, argv))."""
        out: dict[int, str] = {}

        def kind(pid: int) -> str:
            if pid in out:
                return out[pid]
            ppid, argv = procs[pid]
            text = " ".join(argv)
            parent = kind(ppid) if ppid in procs else "other"
            if pid == self.me:
                k = "trainer"
            elif pid == self.stub or parent == "stub":
                k = "stub"
            elif pid in self.hosts or (parent in ("trainer", "host") and "multiprocessing" in text):
                k = "host" if pid in self.hosts or parent == "host" else "trainer"  # and their resource trackers
            elif parent in ("agent", "tools"):
                k = "tools"
            elif argv[:2] == ["sh", "-c"] or (argv and Path(argv[0]).name in ("bwrap", "prlimit", "setpriv")):
                k = "sandbox"  # the cgroup-joining shell (then prlimit, setpriv, bwrap) and bwrap's pid-1 reaper
            elif DOOR_MOUNT in text:  # the forwarder runs from the door's mount, whatever program it is
                k = "door"
            elif parent == "door" or any(mark in text for mark in self.agent_marks):
                k = "agent"  # the forwarder starts the agent (Pi retitles itself "pi")
            else:
                k = "commands"
            out[pid] = k
            return k

        for pid in procs:
            kind(pid)
        return out


def _descendants(root: int) -> dict[int, tuple[int, list[str], float]]:
    """pid -> (ppid, argv, create_time) of `root` and all its descendants, read from /proc."""
    found: dict[int, tuple[int, list[str], float]] = {}
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        with contextlib.suppress(psutil.Error):
            found[p.pid] = (p.ppid(), p.cmdline(), p.create_time())
    return found


def _pss_rss(pid: int) -> tuple[int, int]:
    """(PSS, RSS) in bytes from smaps_rollup; zeros for a process gone meanwhile."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, rss


_CGROUPS = CgroupLayout.detect()
_CGROUP_MEMORY = "memory.current" if _CGROUPS.version == 2 else "memory.usage_in_bytes"


def _sandbox_cgroup(pid: int) -> Path | None:
    """The memory cgroup of a sandbox process (`swe_grpo.sandbox.local.limits`), or None."""
    try:
        memory = _CGROUPS.of_process(pid)[0]
    except (OSError, ValueError, KeyError):
        return None
    return memory if memory.parent.name == CGROUP_PARENT else None


class Sampler(threading.Thread):
    """Samples the census: CPU every `cpu_every_s` (per process, keyed by pid and start time), memory every
    `mem_every_s` (per component sums), while `window` is open."""

    def __init__(self, census: Census, cpu_every_s: float = 1.0, mem_every_s: float = 5.0):
        super().__init__(name="p8-sampler", daemon=True)
        self.census, self.cpu_every_s, self.mem_every_s = census, cpu_every_s, mem_every_s
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.window_start: float | None = None
        self.cpu: dict[tuple[int, float], tuple[str, float, float]] = {}  # key -> (kind, base, last)
        self.mem: list[dict[str, Any]] = []
        self.sampling_cpu_s = 0.0

    def open_window(self) -> None:
        with self.lock:
            self.window_start = time.time()
            self.cpu.clear()
            self.mem.clear()

    def run(self) -> None:
        last_mem = 0.0
        while not self.stopping.wait(self.cpu_every_s):
            t0 = time.thread_time()
            procs = _descendants(self.census.me)
            kinds = self.census.classify({pid: (pp, argv) for pid, (pp, argv, _) in procs.items()})
            with self.lock:
                if self.window_start is not None:
                    self._cpu(procs, kinds)
                    if time.monotonic() - last_mem >= self.mem_every_s:
                        last_mem = time.monotonic()
                        self.mem.append(self._memory(procs, kinds))
            self.sampling_cpu_s += time.thread_time() - t0

    def _cpu(self, procs: dict[int, tuple[int, list[str], float]], kinds: dict[int, str]) -> None:
        assert self.window_start is not None
        for pid, (_, _, created) in procs.items():
            try:
                t = psutil.Process(pid).cpu_times()
            except psutil.Error:
                continue
            used = t.user + t.system
            key = (pid, created)
            if key in self.cpu:
                _, base, _ = self.cpu[key]
                self.cpu[key] = (kinds[pid], base, used)
            else:  # born in the window: all its CPU counts; else only what it uses from now on
                self.cpu[key] = (kinds[pid], 0.0 if created >= self.window_start else used, used)

    def _memory(self, procs: dict[int, tuple[int, list[str], float]], kinds: dict[int, str]) -> dict[str, Any]:
        pss: Counter[str] = Counter()
        rss: Counter[str] = Counter()
        count: Counter[str] = Counter()
        cgroups: set[Path] = set()
        for pid in procs:
            p, r = _pss_rss(pid)
            pss[kinds[pid]] += p
            rss[kinds[pid]] += r
            count[kinds[pid]] += 1
            if kinds[pid] == "sandbox" and (cg := _sandbox_cgroup(pid)):
                cgroups.add(cg)
        cgroup_bytes = 0
        for cg in cgroups:
            with contextlib.suppress(OSError, ValueError):
                cgroup_bytes += int((cg / _CGROUP_MEMORY).read_text())
        available = psutil.virtual_memory().available
        return {
            "pss": dict(pss),
            "rss": dict(rss),
            "processes": dict(count),
            "sandbox_cgroups": len(cgroups),
            "sandbox_cgroup_bytes": cgroup_bytes,
            "mem_available": available,
        }

    def close_window(self) -> dict[str, Any]:
        with self.lock:
            start, self.window_start = self.window_start, None
            cpu: Counter[str] = Counter()
            for kind, base, last in self.cpu.values():
                cpu[kind] += last - base
            return {"cpu_s": dict(cpu), "memory": list(self.mem), "since": start}


# --------------------------------------------------------------------------- one step


@dataclass
class Step:
    concurrency: int
    window_s: float = 0.0
    in_flight_mean: float = 0.0
    agents_mean: float = 0.0
    completions: int = 0
    turns_measured: int = 0
    added_ms_p50: float = float("nan")
    added_ms_p99: float = float("nan")
    added_ms_max: float = float("nan")
    cpu_s: dict[str, float] = field(default_factory=dict)
    cpu_ms_per_request: float = float("nan")
    host_cpu_ms_per_request: float = float("nan")
    pss_mib: dict[str, float] = field(default_factory=dict)
    rss_mib: dict[str, float] = field(default_factory=dict)
    sandbox_cgroup_mib: float = 0.0
    mem_available_min_gib: float = 0.0
    outcomes: dict[str, int] = field(default_factory=dict)
    errors: int = 0
    error_detail: list[str] = field(default_factory=list)
    rollouts_finished: int = 0
    ramp_s: float = 0.0
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    stopped_by: str | None = None
    latency_limit: bool = False  # added p99 over LATENCY_LIMIT_MS more than at the first step


class Totals:
    """The worker's metrics, drained from its queue as TRL's trainer would: counters summed, gauges kept."""

    def __init__(self, worker: SWERolloutWorker):
        self.worker = worker
        self.values: dict[str, float] = {}

    def drain(self) -> None:
        while not self.worker.rollout_buffer.empty():
            self.worker.rollout_buffer.get()
        while not self.worker.metrics_queue.empty():
            for key, value in self.worker.metrics_queue.get().items():
                if isinstance(value, int | float):
                    self.values[key] = self.values.get(key, 0.0) + value if key.endswith("_total") else value

    def counters(self) -> dict[str, float]:
        return {k: v for k, v in self.values.items() if k.endswith("_total")}


def run_step(n: int, args: argparse.Namespace, stub: str, sampler: Sampler) -> Step:
    from _agent_farm import STUB_MODEL
    from _pi_agent import load_tokenizer, percentile

    from swe_grpo.demo.tasks import demo_tasks
    from swe_grpo.worker import SWERolloutWorker

    step = Step(n, load_before=os.getloadavg())
    tokenizer = load_tokenizer()
    config = WorkerConfig(
        num_generations=4,
        max_concurrent_rollouts=n,
        max_tokens=512,
        rollout_hosts=1,
        drop_zero_variance_groups=False,
        agent=args.agent,
        agent_timeout_s=900,
        stall_timeout_s=300,
        seed=n,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="p8-", dir="/tmp"))
    run_dir.chmod(0o711)
    worker = SWERolloutWorker(
        demo_tasks(), tokenizer, vllm_url=stub, model=STUB_MODEL, sandbox=LocalBackend(run_dir=run_dir), config=config
    )
    totals = Totals(worker)
    t0 = time.monotonic()
    worker.update_model_version(0)
    worker.start()
    try:
        sampler.census.hosts = {
            p.pid for p in multiprocessing.active_children() if p.name.startswith(HOST_NAME) and p.pid
        }
        while totals.values.get("rollout/started_total", 0.0) < n:
            if time.monotonic() - t0 > args.ramp_s:
                step.stopped_by = f"time: {n} rollouts not started within {args.ramp_s:.0f} s"
                break
            totals.drain()
            time.sleep(0.5)
        step.ramp_s = time.monotonic() - t0
        settle_end = time.monotonic() + args.settle_s
        while time.monotonic() < settle_end:
            totals.drain()
            time.sleep(0.5)
        before = totals.counters()
        stub_stats(stub, reset=True)
        sampler.open_window()
        w0 = time.monotonic()
        in_flight: list[float] = []
        while time.monotonic() - w0 < args.window_s:
            totals.drain()
            in_flight.append(totals.values.get("rollout/in_flight", 0.0))
            worker.check_health(stale_after_s=600)
            time.sleep(1.0)
        window = sampler.close_window()
        step.window_s = time.monotonic() - w0
        served = stub_stats(stub, reset=True)
        after = totals.counters()
    finally:
        worker.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    step.load_after = os.getloadavg()
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    step.outcomes = {
        k.removeprefix("rollout/outcome_").removesuffix("_total"): int(v)
        for k, v in delta.items()
        if k.startswith("rollout/outcome_") and v
    }
    step.rollouts_finished = sum(step.outcomes.values())
    bad = {k: v for k, v in step.outcomes.items() if k not in NORMAL_OUTCOMES}
    step.errors = sum(bad.values()) + int(delta.get("rollout/retried_turns_total", 0))
    step.error_detail = [f"{k}: {v}" for k, v in bad.items()]
    if delta.get("rollout/retried_turns_total"):
        step.error_detail.append(f"retried turns: {int(delta['rollout/retried_turns_total'])}")
    step.in_flight_mean = sum(in_flight) / max(len(in_flight), 1)
    step.completions = served["completions"]
    added = served["added_s"]
    step.turns_measured = len(added)
    if added:
        step.added_ms_p50 = percentile(added, 50) * 1e3
        step.added_ms_p99 = percentile(added, 99) * 1e3
        step.added_ms_max = max(added) * 1e3
    step.cpu_s = {k: round(v, 2) for k, v in window["cpu_s"].items()}
    rollout_cpu = sum(v for k, v in window["cpu_s"].items() if k in COMPONENTS and k != "trainer")
    host_cpu = sum(v for k, v in window["cpu_s"].items() if k in ("door", "sandbox", "commands", "host"))
    if step.completions:
        step.cpu_ms_per_request = rollout_cpu / step.completions * 1e3
        step.host_cpu_ms_per_request = host_cpu / step.completions * 1e3
    samples = window["memory"]
    if samples:
        for key, target in (("pss", step.pss_mib), ("rss", step.rss_mib)):
            for kind in {k for s in samples for k in s[key]}:
                target[kind] = round(sum(s[key].get(kind, 0) for s in samples) / len(samples) / MIB, 1)
        step.agents_mean = sum(s["processes"].get("agent", 0) for s in samples) / len(samples)
        step.sandbox_cgroup_mib = round(sum(s["sandbox_cgroup_bytes"] for s in samples) / len(samples) / MIB, 1)
        step.mem_available_min_gib = round(min(s["mem_available"] for s in samples) / GIB, 2)
    return step


# --------------------------------------------------------------------------- the ramp and the report


def _rate(step: Step) -> float:
    return step.completions / step.window_s / step.in_flight_mean if step.window_s and step.in_flight_mean else 0.0


def limit_hit(step: Step, first: Step, next_n: int | None, args: argparse.Namespace) -> str | None:
    """Which limit this step hit (None: go on to `next_n`). The latency limit is recorded on the step in any
    case (`latency_limit`); it stops the ramp unless `--latency-record-only`."""
    if step.stopped_by:
        return step.stopped_by
    if step.errors:
        return f"errors: {', '.join(step.error_detail)}"
    if step.added_ms_p99 - first.added_ms_p99 > LATENCY_LIMIT_MS:
        step.latency_limit = True
        if not args.latency_record_only:
            return f"latency: added p99 {step.added_ms_p99:.0f} ms, {LATENCY_LIMIT_MS:.0f}+ ms over the first step's"
    rate, first_rate = _rate(step), _rate(first)
    if first_rate and rate < THROUGHPUT_FLOOR * first_rate:
        return (
            f"cpu: {rate:.3f} requests/s per rollout in flight, under {THROUGHPUT_FLOOR:.0%} of the first step's "
            f"{first_rate:.3f} (the box's CPU is saturated: the rollouts wait, they no longer add throughput)"
        )
    reserve_gib = args.reserve_gib
    if next_n is not None and step.agents_mean:
        # the processes' PSS, or the sandboxes' cgroups where more (they hold the sandboxes' files, in RAM, too)
        processes = sum(v for k, v in step.pss_mib.items() if k in COMPONENTS and k not in ("host", "trainer"))
        per_rollout = max(processes, step.sandbox_cgroup_mib) / step.agents_mean / 1024
        left = step.mem_available_min_gib - per_rollout * (next_n - step.concurrency)
        if left < reserve_gib:
            return f"memory: {next_n} rollouts would leave {left:.1f} GiB available (< {reserve_gib} GiB reserve)"
    return None


def summary(steps: list[Step], machine: dict[str, Any]) -> dict[str, Any]:
    """The figures to publish. Memory from the largest step that hit no limit but the latency's (recorded
    only) or memory's projection (its own measurement was clean): PSS per live agent by component, and the
    host process's growth per rollout (its PSS slope from the first step). CPU from the largest such step
    in which rollouts also finished (so its window holds agents starting and grading, not only turns), per
    rollout in flight. From them: rollouts per GiB and per core."""
    clean = [
        s for s in steps if not s.errors and (s.stopped_by is None or s.stopped_by.startswith(("memory", "latency")))
    ]
    if not clean or not clean[-1].agents_mean:
        return {}
    top, first = clean[-1], steps[0]
    agents = top.agents_mean
    per = {k: round(top.pss_mib.get(k, 0.0) / agents, 1) for k in ("agent", "tools", "door", "sandbox", "commands")}
    growth = (top.pss_mib.get("host", 0.0) - first.pss_mib.get("host", 0.0)) / max(agents - first.agents_mean, 1e-9)
    growth = growth if top is not first else 0.0
    per["host_growth"] = round(max(growth, 0.0), 2)  # within sampling noise at small steps: not below 0
    total_mib = sum(per.values())
    host_side = sum(per[k] for k in ("door", "sandbox", "commands", "host_growth"))
    cycling = [s for s in clean if s.rollouts_finished and s.in_flight_mean] or [top]
    cpu_step = cycling[-1]
    busy = sum(v for k, v in cpu_step.cpu_s.items() if k in COMPONENTS and k != "trainer")
    cores_per_rollout = busy / cpu_step.window_s / cpu_step.in_flight_mean
    return {
        "memory_from_step": top.concurrency,
        "agents_live": round(agents, 1),
        "pss_mib_per_rollout": per,
        "pss_mib_per_rollout_total": round(total_mib, 1),
        "host_side_pss_mib_per_rollout_excluding_agent": round(host_side, 1),
        "fixed_pss_mib": {"host": top.pss_mib.get("host", 0.0), "trainer": top.pss_mib.get("trainer", 0.0)},
        "host_growth_measured_mib": round(growth, 2),
        "rollouts_per_gib": round(1024 / total_mib, 1),
        "cpu_from_step": cpu_step.concurrency,
        "cpu_ms_per_request": round(cpu_step.cpu_ms_per_request, 1),
        "cpu_cores_per_rollout": round(cores_per_rollout, 4),
        "rollouts_per_core": round(1 / cores_per_rollout, 1) if cores_per_rollout else None,
        "box": f"{machine['cores']} x {machine['cpu']}, {machine['memory_gib']} GiB",
    }


def resummarize(path: Path, args: argparse.Namespace) -> None:
    """Apply the current limits and summary to a result file's steps (both are functions of the steps)."""
    result = json.loads(path.read_text())
    steps = [Step(**s) for s in result["steps"]]
    result["stopped_by"] = "all steps ran"
    for i, step in enumerate(steps):
        step.latency_limit = False
        next_n = steps[i + 1].concurrency if i + 1 < len(steps) else None
        if hit := limit_hit(step, steps[0], next_n, args):
            step.stopped_by = result["stopped_by"] = hit
            steps = steps[: i + 1]
            break
    result["steps"] = [asdict(s) for s in steps] + result["steps"][len(steps) :]
    result["summary"] = summary(steps, result["provenance"]["machine"])
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))


def report(steps: list[Step], args: argparse.Namespace, machine: dict[str, Any]) -> str:
    from _pi_agent import markdown_table

    rows = []
    for s in steps:
        pss = s.pss_mib
        per = max(s.agents_mean, 1e-9)
        host_side = sum(pss.get(k, 0.0) for k in HOST_SIDE)
        rows.append(
            [
                str(s.concurrency),
                f"{s.agents_mean:.1f}",
                str(s.rollouts_finished),
                str(s.errors),
                f"{s.added_ms_p50:.0f} / {s.added_ms_p99:.0f}{' (over)' if s.latency_limit else ''}",
                f"{s.completions / max(s.window_s, 1e-9):.1f}",
                f"{s.cpu_ms_per_request:.0f} ({s.host_cpu_ms_per_request:.0f})",
                " / ".join(f"{pss.get(k, 0.0) / per:.1f}" for k in ("agent", "tools", "door", "sandbox", "commands")),
                f"{pss.get('host', 0.0):.0f} / {pss.get('trainer', 0.0):.0f}",
                f"{host_side / per:.1f}",
                f"{s.sandbox_cgroup_mib / per:.0f}",
                f"{s.load_before[0]:.1f} / {s.load_after[0]:.1f}",
            ]
        )
    headers = [
        "concurrency",
        "agents live",
        "rollouts done",
        "errors",
        "added ms p50 / p99",
        "requests/s",
        "CPU ms/request (host side)",
        "PSS MiB per rollout: agent / tools / door / sandbox / commands",
        "PSS MiB host / trainer",
        "host-side PSS MiB per rollout",
        "sandbox cgroup MiB per rollout",
        "load before / after",
    ]
    return "\n".join(
        [
            f"### P8 ({args.agent}): {args.turns} turns a rollout, generation {args.latency} s, tools {args.sleep} s; "
            f"{machine['cores']} x {machine['cpu']}, {machine['memory_gib']} GiB",
            "",
            markdown_table(headers, rows),
        ]
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does: every `finally` stops what it started


def _pair(text: str) -> tuple[float, float]:
    low, high = (float(x) for x in text.split(","))
    return low, high


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agent", default="pi", choices=tuple(AGENTS))
    parser.add_argument("--steps", default="4,8,16,32,64,128")
    parser.add_argument("--turns", type=int, default=15, help="tool calls per rollout before the final answer")
    parser.add_argument("--latency", type=_pair, default=(1.0, 3.0), help="stub generation time, s (low,high)")
    parser.add_argument("--sleep", type=_pair, default=(2.0, 5.0), help="each tool call's run time, s (low,high)")
    parser.add_argument("--settle-s", type=float, default=30.0)
    parser.add_argument("--window-s", type=float, default=90.0)
    parser.add_argument("--ramp-s", type=float, default=180.0, help="time bound to get N rollouts in flight")
    parser.add_argument("--reserve-gib", type=float, default=4.0, help="MemAvailable to leave to the box's others")
    parser.add_argument(
        "--latency-record-only",
        action="store_true",
        help="record the latency limit on each step but go on (on a box whose other jobs set the latency)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--summarize", type=Path, help="only re-apply the limits and the summary to this result file")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.summarize:
        resummarize(args.summarize, args)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    provenance = Provenance()
    machine = provenance_machine()
    cpus = set(os.sched_getaffinity(0))
    steps: list[Step] = []
    stopped = "all steps ran"
    shape = AGENTS[args.agent]
    from _agent_farm import serving_process

    with serving_process(scripted_vllm, cpus, args.turns, args.latency, args.sleep, shape) as (stub, stub_pid):
        sampler = Sampler(Census(os.getpid(), stub_pid, (f"{shape.mount}/",)))
        sampler.start()
        try:
            levels = [int(x) for x in args.steps.split(",")]
            for i, n in enumerate(levels):
                print(f"step {n} ...", file=sys.stderr, flush=True)
                step = run_step(n, args, stub, sampler)
                steps.append(step)
                print(json.dumps(asdict(step)), file=sys.stderr, flush=True)
                hit = limit_hit(step, steps[0], levels[i + 1] if i + 1 < len(levels) else None, args)
                if hit:
                    step.stopped_by = stopped = hit
                    break
        finally:
            sampler.stopping.set()
    leftovers = [
        p.pid for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())
    ]  # multiprocessing's resource tracker ends with this process
    result = {
        "provenance": provenance.record(),
        "benchmark": "p8_capacity",
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "stopped_by": stopped,
        "sampler_cpu_s": round(sampler.sampling_cpu_s, 1),
        "leftover_processes": leftovers,
        "summary": summary(steps, machine),
        "steps": [asdict(s) for s in steps],
    }
    print(report(steps, args, machine))
    print(json.dumps(result["summary"], indent=1))
    load = result["provenance"]["load"]
    print(f"\nstopped by: {stopped}; load {load['before'][0]:.2f} at the start, {load['after'][0]:.2f} at the end")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
