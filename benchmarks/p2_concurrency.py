"""P2: many concurrent rollouts over 1, 2, 4 rollout hosts: errors, added latency, throughput, memory.

What. 512 simulated Pi agents (default) each run one rollout of 20 turns against one `InterceptionServer`
whose generator is a stub that sleeps 50 ms and returns a fixed, valid Qwen3 tool call. Each agent
records every round-trip (sending the body to the last byte of the SSE answer); added latency =
round-trip - 50 ms, what the host adds to a generation. Reported: errors (non-200, transport errors,
answers without tool calls, turns the server recorded as errors or forks), added-latency percentiles,
requests/s, CPU of both sides, the server's resident memory before the traffic (rollouts opened), after
it (every rollout still holding its chain) and at its peak, and its garbage collections: the full ones, and the
longest pause in wall time and in the collecting thread's CPU time (the collector's work, which load does not inflate).

Generation (`--generator`): `client` (the default) is the request path of a real rollout host: each
server generates through the real `VLLMClient` (orjson request with every prompt id, the reply's
echoed prompt ids parsed and checked) against `_agent_farm.stub_vllm`, a STUB of vLLM's OpenAI server in
a process of its own (pinned with the agents) that parses each request, waits 50 ms and answers as vLLM
does to `return_token_ids` and `logprobs: 0` (prompt ids echoed, the answer's ids, log-probs, tokens and
text). `stub` is the older measurement: a `StubGenerator` inside the server answers after 50 ms, so the
client's JSON work is missing from the server's CPU. `--generator client,stub` runs both.

Rollout hosts (`--hosts 1,2,4`, default): a rollout host is a process with its own InterceptionServer, and
a rollout's requests all go to its host's server (its chain lives there), so H hosts are H server
processes, each owning 1/H of the rollouts; this is the request path of `WorkerConfig.rollout_hosts = H`
without the agents' sandboxes and grading (which run in other processes either way). Each scenario runs
once per host count; scaling = saturation requests/s with H hosts / (H x with one host).

How. Each server runs in its own process (fresh ones per scenario); the agents run in this process on
uvloop (if installed), pinned to the last CPU when there are 2+, and talk to it over 127.0.0.1. Agents behave like Pi
(`_pi_agent.py`): the whole history re-sent every turn, one request at a time per rollout, and between
turns a think pause standing in for running the tools. One extra rollout warms the server up first.
Two scenarios, each stopped after `--max-seconds` (what is unfinished is cancelled and counted):

- realistic: think time uniform in 2-5 s (`--think 2,5`; `--think 1,2` for a faster agent). An agent's
  turn on a real repository runs commands between generations (tests, greps, file reads), which take
  seconds; rollouts start after a uniform delay of up to the longest think time, not in lock-step.
- saturation: no think time, no start delay: the ceiling (requests/s) and the latency at that load.

Real generations take seconds, so real rollouts send far fewer requests per second than these do.

Dialects and families: `--dialect responses|messages` has the agents send the same sessions as Codex (OpenAI
Responses) or Claude Code (Anthropic Messages) would (`_agent_dialects.py`: their request shapes, headers and
streams); `--family harmony|glm` serves a gpt-oss or GLM tiny model's template, the stub's answer written as that
template writes it. Both go into the results JSON (`dialect`, `family`).

Run: `SWE_GRPO_CACHE=/tmp/swecache .venv/bin/python benchmarks/p2_concurrency.py` (~6 minutes a
generator; options `--generator`, `--hosts`, `--rollouts`, `--turns`, `--think`, `--tool-output`,
`--dialect`, `--family`, `--no-saturation`, `--max-seconds`, `--json`; `--stages` adds the servers' CPU per request
by stage, from `_stages.py`). Each row also goes to `--json`
(benchmarks/results/p2_concurrency.json by default), with the date, the machine and its load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import logging
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import psutil

try:
    import uvloop
except ImportError:  # not a declared dependency: the agents then use asyncio's own loop
    uvloop = None  # type: ignore[assignment]

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _agent_dialects import WIRES
from _agent_farm import STUB_MODEL, serving_process, stub_vllm
from _p2_results import GENERATORS, STUB_LATENCY_S, AgentStats, Result, Scenario, ServerReport, report, write_json
from _pi_agent import (
    FAMILIES,
    TOOL_OUTPUTS,
    ClientWire,
    PiConversation,
    StubGenerator,
    load_tokenizer,
    post,
    server_process,
)
from _provenance import Provenance
from _stages import StageClock

from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import VLLMClient
from swe_grpo.types import RolloutEndpoint

WARMUP_TURNS = 5
MIB = 1024 * 1024


# --------------------------------------------------------------------------- the server process


def serve(
    conn: Connection,
    rollouts: int,
    calls: int,
    cpus: set[int],
    vllm_url: str | None,
    profile: Path | None,
    gc_threshold: tuple[int, ...] | None,
    family: str = "qwen",
    stages: bool = False,
) -> None:
    """Entry point of the server process: generation through `VLLMClient` at `vllm_url`, or (None) the
    in-process `StubGenerator`. `profile`: a folder to write the server's cProfile of the traffic to;
    `gc_threshold`: the collector's thresholds to serve with (an experiment; None: the server's own);
    `family`: whose template it serves (`FAMILIES`); `stages`: clock the CPU of each stage of a request (`_stages`)."""
    os.sched_setaffinity(0, cpus)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(conn, rollouts, calls, vllm_url, profile, gc_threshold, family, stages))


async def _serve(
    conn: Connection,
    rollouts: int,
    calls: int,
    vllm_url: str | None,
    profile: Path | None,
    gc_threshold: tuple[int, ...] | None,
    family: str,
    stages: bool,
) -> None:
    clock = StageClock().install() if stages else None
    tokenizer = load_tokenizer(family)
    client = None
    if vllm_url is not None:
        client = await VLLMClient(vllm_url, STUB_MODEL, stop_token_ids=[tokenizer.eos_token_id]).start()
    generator = client or StubGenerator(tokenizer, calls, STUB_LATENCY_S)
    server = InterceptionServer(generator, tokenizer)
    handler_s: list[float] = []
    handler = server._turn

    async def timed(request: Any, dialect: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await handler(request, dialect)
        finally:
            handler_s.append(time.perf_counter() - t0)

    server._turn = timed  # type: ignore[method-assign]  # app() routes every dialect's turns to it at start()
    gc_stats = {
        "full": 0,
        "max": 0.0,
        "total": 0.0,
        "started": 0.0,
        "full_max": 0.0,
        "cpu_started": 0.0,
        "cpu_max": 0.0,
    }

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_stats["started"], gc_stats["cpu_started"] = time.perf_counter(), time.thread_time()
            return
        pause = time.perf_counter() - gc_stats["started"]
        # A pause in wall time includes the waits for a core on a loaded box; its CPU time is the collector's work.
        gc_stats["cpu_max"] = max(gc_stats["cpu_max"], time.thread_time() - gc_stats["cpu_started"])
        gc_stats["total"] += pause
        gc_stats["max"] = max(gc_stats["max"], pause)
        if info.get("generation") == 2:
            gc_stats["full"] += 1
            gc_stats["full_max"] = max(gc_stats["full_max"], pause)

    await server.start()
    if gc_threshold:
        gc.set_threshold(*gc_threshold)
    rollouts_open = AsyncExitStack()
    handles = [await rollouts_open.enter_async_context(server.rollout()) for _ in range(rollouts)]
    endpoints = [handle.endpoint for handle in handles]
    gc.callbacks.append(on_gc)
    # CPU time, not wall time: on a loaded box the process's waits for a core would read as the work of whatever ran
    profiler = cProfile.Profile(time.process_time) if profile else None
    if profiler:
        profiler.enable()
    if clock:
        clock.reset()  # the traffic only: not the template's probes
    loop_cpu = time.thread_time()  # this thread runs the loop
    conn.send(endpoints)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, conn.recv) != "stop":  # "report"
        loop_cpu = time.thread_time() - loop_cpu
        if profiler and profile:  # the traffic only: not the rollouts' closing
            profiler.disable()
            profile.mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(profile / f"server-{os.getpid()}.prof")
        await rollouts_open.aclose()
        records = [handle.record for handle in handles]
        conn.send(
            ServerReport(
                handler_s=handler_s,
                turns=sum(len(r.turns) for r in records),
                forks=sum(t.kind == "fork" for r in records for t in r.turns),
                recorded_errors=sum(len(r.errors) for r in records),
                gc_full=int(gc_stats["full"]),
                gc_pause_max_s=gc_stats["max"],
                gc_pause_total_s=gc_stats["total"],
                gc_full_pause_max_s=gc_stats["full_max"],
                gc_pause_max_cpu_s=gc_stats["cpu_max"],
                loop_cpu_s=loop_cpu,
                stages_cpu_s=clock.cpu_s if clock else {},
            )
        )
    await server.stop()
    if client is not None:
        await client.close()
    gc.unfreeze()  # let interpreter shutdown free what the server froze (else nanobind reports leaks)


# --------------------------------------------------------------------------- the agents


async def agent(
    session: aiohttp.ClientSession,
    endpoint: RolloutEndpoint,
    turns: int,
    think_s: tuple[float, float],
    chars: tuple[int, int],
    rng: random.Random,
    stats: AgentStats,
    wire: ClientWire,
) -> None:
    conversation = PiConversation(endpoint.model, rng, chars, wire)
    done = 0
    try:
        await asyncio.sleep(rng.uniform(0, think_s[1]))
        for _ in range(turns):
            body = conversation.body()
            stats.first_send = min(stats.first_send, time.perf_counter())
            try:
                status, payload, round_trip = await post(session, endpoint, body, wire)
            except (aiohttp.ClientError, TimeoutError) as e:
                stats.error(type(e).__name__)
                return
            done += 1
            if status != 200:
                stats.error(f"HTTP {status}")
                return
            stats.round_trips.append(round_trip)
            stats.last_answer = time.perf_counter()
            try:
                answer = wire.parse(payload)
                conversation.absorb(answer)
            except (ValueError, KeyError) as e:
                stats.error(f"bad answer: {e}")
                return
            if done == turns:
                stats.prompt_tokens_last.append((answer.usage or {}).get("prompt_tokens", 0))
            await asyncio.sleep(rng.uniform(*think_s))
    finally:
        stats.unfinished += turns - done


@dataclass
class StubVLLM:
    """The stub vLLM's process and its base URL."""

    url: str
    process: psutil.Process


@contextmanager
def stub_vllm_process(calls: int, cpus: set[int], family: str) -> Iterator[StubVLLM]:
    """`_agent_farm.stub_vllm` (prompt ids echoed, as vLLM does) in a spawned process on `cpus`, answering as
    `family`'s template writes."""
    with serving_process(stub_vllm, cpus, calls, STUB_LATENCY_S, True, family) as (url, pid):
        yield StubVLLM(url, psutil.Process(pid))


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def run_scenario(
    args: argparse.Namespace, scenario: Scenario, hosts: int, server_cpus: set[int], vllm: StubVLLM | None
) -> Result:
    """One scenario over `hosts` server processes; rollout i belongs to host i % hosts. `vllm`: the stub
    vLLM the servers' `VLLMClient`s talk to, or None for the in-process stub generator."""
    case = TOOL_OUTPUTS[args.tool_output]
    wire = WIRES[args.dialect]
    shares = [len(range(i, args.rollouts, hosts)) for i in range(hosts)]
    async with AsyncExitStack() as stack:
        running = [
            await stack.enter_async_context(
                server_process(
                    serve,
                    share + 1,
                    case.calls,
                    server_cpus,
                    vllm and vllm.url,
                    args.profile,
                    args.gc_threshold,
                    args.family,
                    args.stages,
                )
            )
            for share in shares
        ]
        endpoints = [e for r in running for e in r.endpoints[:-1]]
        servers = [psutil.Process(r.process.pid) for r in running]
        me = psutil.Process()

        def rss() -> int:
            return sum(p.memory_info().rss for p in servers)

        def cpu_servers() -> float:
            return sum(_cpu(p) for p in servers)

        def cpu_vllm() -> float:
            return _cpu(vllm.process) if vllm else 0.0

        rss_before = rss_peak = rss()
        stats = AgentStats()
        rng = random.Random(0)
        timeout = aiohttp.ClientTimeout(total=args.max_seconds)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            for r in running:  # one warm-up rollout per server
                warm = AgentStats()
                await agent(session, r.endpoints[-1], WARMUP_TURNS, (0.0, 0.0), case.chars, rng, warm, wire)
                if warm.errors or warm.unfinished:
                    raise RuntimeError(f"warm-up rollout failed: {warm.errors}")
            cpu0 = cpu_servers(), _cpu(me), cpu_vllm()
            t0 = time.perf_counter()
            tasks = [
                asyncio.create_task(
                    agent(
                        session, e, args.turns, scenario.think_s, case.chars, random.Random(rng.random()), stats, wire
                    )
                )
                for e in endpoints
            ]
            pending = set(tasks)
            while pending and time.perf_counter() < t0 + args.max_seconds:
                _, pending = await asyncio.wait(pending, timeout=0.25)
                rss_peak = max(rss_peak, rss())
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - t0
        cpu = ((cpu_servers() - cpu0[0]) / wall, (_cpu(me) - cpu0[1]) / wall, (cpu_vllm() - cpu0[2]) / wall)
        rss_after = rss()
        # Each server's own high-water mark, summed: an upper bound of the peak they held together.
        rss_peak = max(rss_peak, rss_after, sum(_vm_hwm(r.process.pid) for r in running))

        reports: list[ServerReport] = [r.finish() for r in running]
        for report in reports:
            report.handler_s = report.handler_s[WARMUP_TURNS:]
            report.turns -= WARMUP_TURNS
        return Result(
            scenario,
            hosts,
            "client" if vllm else "stub",
            stats,
            ServerReport.merged(reports),
            wall,
            (rss_before / MIB, rss_after / MIB, rss_peak / MIB),
            cpu,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--generator", default="client", help="comma-separated: client (VLLMClient + stub vLLM), stub (in-process)"
    )
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "p2_concurrency.json")
    parser.add_argument("--hosts", default="1,2,4", help="rollout host counts to run, comma-separated")
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument(
        "--think",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=(2.0, 5.0),
        help="think time of the realistic scenario, 'low,high' seconds (default 2,5)",
    )
    parser.add_argument("--tool-output", choices=sorted(TOOL_OUTPUTS), default="large")
    parser.add_argument("--dialect", choices=sorted(WIRES), default="chat", help="the agents' wire (default chat)")
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen", help="the template family (default qwen)")
    parser.add_argument("--no-saturation", action="store_true", help="skip the zero-think-time scenario")
    parser.add_argument("--max-seconds", type=float, default=150.0, help="time limit of each scenario")
    parser.add_argument(
        "--gc-threshold",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        help="the servers' gc.set_threshold, 'gen0[,gen1[,gen2]]' (an experiment; default: the server's own)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="folder for each server's cProfile of the traffic, in CPU time (server-PID.prof; slows it)",
    )
    parser.add_argument(
        "--stages", action="store_true", help="the servers' CPU per stage of a request (benchmarks/_stages.py)"
    )
    args = parser.parse_args()
    args.hosts_text = args.hosts.replace(",", "/")
    generators = args.generator.split(",")
    if unknown := set(generators) - set(GENERATORS):
        parser.error(f"unknown generator(s) {sorted(unknown)}; choose from {sorted(GENERATORS)}")
    logging.basicConfig(level=logging.WARNING)

    provenance = Provenance()
    load_before = provenance.load_before[0]
    cpus = sorted(os.sched_getaffinity(0))
    args.placement = "no CPU pinning"
    args.agent_loop = "uvloop" if uvloop else "asyncio"
    if len(cpus) >= 2:  # the load generator never takes more than one core from the server
        os.sched_setaffinity(0, {cpus[-1]})
        args.placement = f"agents pinned to CPU {cpus[-1]}"
    scenarios = [Scenario("realistic", args.think)]
    if not args.no_saturation:
        scenarios.append(Scenario("saturation", (0.0, 0.0)))

    t0 = time.perf_counter()
    results: list[Result] = []
    for generator in generators:
        with contextlib.ExitStack() as stack:
            vllm = None
            if generator == "client":  # with the agents: it stands in for GPUs elsewhere, not the host's cores
                calls = TOOL_OUTPUTS[args.tool_output].calls
                vllm = stack.enter_context(stub_vllm_process(calls, {cpus[-1]}, args.family))
            for hosts in (int(h) for h in args.hosts.split(",")):
                for scenario in scenarios:
                    print(f"running {scenario.name} over {hosts} host(s), {generator} ...", file=sys.stderr, flush=True)
                    with asyncio.Runner(loop_factory=uvloop and uvloop.new_event_loop) as runner:
                        results.append(runner.run(run_scenario(args, scenario, hosts, set(cpus), vllm)))
                    write_json(args, results, provenance)  # after each scenario: a cut-short run keeps its rows
        print(report([r for r in results if r.generator == generator], args, load_before), "\n", flush=True)
    print(f"(run time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
