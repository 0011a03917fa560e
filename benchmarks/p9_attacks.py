"""P9: one rollout attacks the InterceptionServer with its own token; what does it cost the other rollouts?

What. `--rollouts` (default 32) simulated Pi agents run against one `InterceptionServer` whose generator is a STUB
that sleeps 50 ms and returns a fixed, valid Qwen3 tool call (`_pi_agent.StubGenerator`; a real vLLM would only
add the same generation time to every request); the tokenizer is the real tiny one. Each agent re-sends its whole
history every turn, with a think pause of 0.5-1.5 s. After a baseline phase, each attack of issue 23 (section 3)
runs for `--attack-s` seconds from a real `local` sandbox (`_p9_attacker.py`, run there as a script), against its
own rollout's door (the unix socket a sandbox reaches the server by), with that rollout's token:

- idle_flood: 1,100 connections that never send a byte (they exhausted the server's descriptors before);
- slowloris: 200 connections that send a request head one byte a second and never finish it;
- big_bodies: 3 connections at a time, each streaming 150 MiB of a chunked body (no length to refuse it by),
  over and over (three raised the server's RSS by 450 MiB before);
- churn: connections opened and closed as fast as one process can;
- request_flood: 16 valid requests at once, over and over, each on a new connection (each supersedes the one before);
- keepalive_flood: valid requests back to back on 8 kept-alive connections (no accept rate holds them);
- get_flood: `GET /models` back to back on 8 kept-alive connections (issue 35: 197,154 answers in 12 s before
  every route had a rate);
- fork_flood: processes until a fork is refused (the sandbox's pids limit), held;
- file_flood: processes until a fork is refused, each holding eventfds until refused (its open-files limit): at
  most `pids` x `open_files` of the host's file table;
- kernel_counters: what the kernel counts per user (inotify instances, pipe buffers), taken and held.

Reported per phase: the others' added latency (round-trip - 50 ms) p50 / p99 / max, their errors (non-200,
transport errors, answers without tool calls), the server's RSS peak over its RSS before the attacks, its open
descriptors at peak, the share of one core the server used, and what the attacker did (its own counts). Targets:
0 errors for the others, their added p99 <= 50 ms, and the server's RSS within `RSS_BOUND_MIB` of where it started.

How. The server runs in its own process (as P2/P5), the agents in this process; all on this machine over 127.0.0.1
and the door sockets, competing for its CPUs. The attacker runs as a rollout's agent would: in a `local` sandbox
with the default `LocalLimits` (its CPU quota, its open-files limit, no network) and the rollout's door mounted,
its token in its environment; it connects to the door's socket directly (the stronger attack: the forwarder in
between would only slow it). `--attacker host` runs it instead in an unconfined process of the host's (at
`--attacker-nice`), as the first runs of this benchmark did.

Run: `SWE_GRPO_CACHE=/tmp/swecache .venv/bin/python benchmarks/p9_attacks.py` (about 2 minutes; options
`--rollouts`, `--attack-s`, `--baseline-s`, `--attacks`, `--json PATH`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import random
import runpy
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from transformers import PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _p9_attacker import ATTACKS
from _pi_agent import (
    TOOL_OUTPUTS,
    PiConversation,
    StubGenerator,
    load_tokenizer,
    markdown_table,
    parse_sse,
    percentile,
    post,
    server_process,
)
from _provenance import Provenance

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.sandbox import make_backend
from swe_grpo.sandbox.door import DOOR_MOUNT, Door
from swe_grpo.sandbox.local.limits import LocalLimits
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.tokens.template import (
    TemplateKey,
    known_training_chat_templates,
    remember_training_chat_templates,
    training_chat_template,
)
from swe_grpo.types import RolloutEndpoint

STUB_LATENCY_S = 0.05
MIB = 1024 * 1024
RSS_BOUND_MIB = 160  # 32 MiB of body, its decoding, and the allocator's slack: see the module docstring
ATTACKER = Path(__file__).resolve().parent / "_p9_attacker.py"


# --------------------------------------------------------------------------- the server process


def serve(
    conn: Connection,
    tokenizer: PreTrainedTokenizerBase,
    templates: dict[TemplateKey, str],
    rollouts: int,
    attackers: int,
) -> None:
    """The server's process: torch-free, as a rollout host is (the tokenizer comes pickled, its training template
    verified in the parent, as the trainer verifies a host's), so that it serves as one does
    (`return_big_buffers` pins glibc's threshold only in a process without torch)."""
    logging.basicConfig(level=logging.ERROR)
    remember_training_chat_templates(templates)
    asyncio.run(_serve(conn, tokenizer, rollouts, attackers))


async def _serve(conn: Connection, tokenizer: PreTrainedTokenizerBase, rollouts: int, attackers: int) -> None:
    server = await InterceptionServer(StubGenerator(tokenizer, 1, STUB_LATENCY_S), tokenizer).start()
    doors = [Door.make(f"attacker-{i}") for i in range(attackers)]
    good_open, bad_open = AsyncExitStack(), AsyncExitStack()
    good_handles = [await good_open.enter_async_context(server.rollout()) for _ in range(rollouts)]
    good = [handle.endpoint for handle in good_handles]
    bad = [
        (await bad_open.enter_async_context(server.rollout(f"attacker-{i}", socket=door.socket))).endpoint
        for i, door in enumerate(doors)
    ]
    process = psutil.Process()
    peak = {"rss": 0, "fds": 0, "cpu_s": 0.0}

    async def sample() -> None:
        while True:
            peak["rss"] = max(peak["rss"], process.memory_info().rss)
            peak["fds"] = max(peak["fds"], process.num_fds())
            await asyncio.sleep(0.02)

    sampling = asyncio.create_task(sample())
    conn.send((good, bad, doors, "torch" in sys.modules))
    loop = asyncio.get_running_loop()
    while (command := await loop.run_in_executor(None, conn.recv)) != "stop":
        if command == "peak":  # the peak since the last ask, then start again from now (and the CPU time used)
            cpu = process.cpu_times()
            conn.send({**peak, "cpu_s": cpu.user + cpu.system - peak["cpu_s"]})
            peak.update(rss=process.memory_info().rss, fds=process.num_fds(), cpu_s=cpu.user + cpu.system)
        elif command == "report":
            await good_open.aclose()
            records = [handle.record for handle in good_handles]
            conn.send(
                {
                    "recorded_errors": sum(len(r.errors) for r in records),
                    "forks": sum(t.kind == "fork" for r in records for t in r.turns),
                }
            )
    sampling.cancel()
    await bad_open.aclose()
    await server.stop()
    for door in doors:
        door.remove()


# --------------------------------------------------------------------------- the attacker


async def attack_from_sandbox(name: str, door: Door, endpoint: RolloutEndpoint, seconds: float) -> dict[str, Any]:
    """Run the attack inside a real `local` sandbox (default limits: its CPU quota, open-files limit, no network)
    that has the rollout's door mounted, as the rollout's agent would have it."""
    backend = make_backend("local")
    await backend.start()
    try:
        async with await backend.create(demo_tasks()[0], mounts=[door.mount()], network=False) as sandbox:
            await sandbox.put_file("/tmp/p9_attacker.py", ATTACKER.read_bytes())
            argv = ["python3", "/tmp/p9_attacker.py", name, f"{DOOR_MOUNT}/{door.socket.name}", endpoint.rollout_id]
            result = await sandbox.exec([*argv, str(seconds)], timeout_s=seconds + 60, env={"P9_TOKEN": endpoint.token})
    finally:
        await backend.close()
    if result.exit_code != 0:
        raise RuntimeError(f"the attacker failed in its sandbox (exit {result.exit_code}): {result.stderr[-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def attack_from_host(name: str, path: str, endpoint: RolloutEndpoint, seconds: float, nice: int) -> None:
    """The attack from a process of the host's, unconfined (`--attacker host`), at nice `nice`."""
    os.nice(nice)
    os.environ["P9_TOKEN"] = endpoint.token
    sys.argv = [str(ATTACKER), name, path, endpoint.rollout_id, str(seconds)]
    runpy.run_path(str(ATTACKER), run_name="__main__")


# --------------------------------------------------------------------------- the well-behaved agents


@dataclass
class Timeline:
    requests: list[tuple[float, float]] = field(default_factory=list)  # (sent, answered)
    errors: list[tuple[float, str]] = field(default_factory=list)


async def agent(
    session: aiohttp.ClientSession, endpoint: RolloutEndpoint, rng: random.Random, stop: asyncio.Event, tl: Timeline
) -> None:
    conversation = PiConversation(endpoint.model, rng, TOOL_OUTPUTS["small"].chars)
    await asyncio.sleep(rng.uniform(0, 1.5))
    while not stop.is_set():
        sent = time.perf_counter()
        try:
            status, payload, _ = await post(session, endpoint, conversation.body())
            if status != 200:
                raise ValueError(f"HTTP {status}")
            conversation.absorb(parse_sse(payload))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as e:
            tl.errors.append((sent, f"{type(e).__name__}: {e}"[:120]))
            conversation = PiConversation(endpoint.model, rng, TOOL_OUTPUTS["small"].chars)
        else:
            tl.requests.append((sent, time.perf_counter()))
        await asyncio.sleep(rng.uniform(0.5, 1.5))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    tokenizer = load_tokenizer()
    training_chat_template(tokenizer)
    templates = known_training_chat_templates()
    async with server_process(serve, tokenizer, templates, args.rollouts, len(args.attacks)) as running:
        good, bad, doors, server_has_torch = running.endpoints
        tl, stop = Timeline(), asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            agents = [asyncio.create_task(agent(session, e, random.Random(i), stop, tl)) for i, e in enumerate(good)]
            phases: list[tuple[str, float, float, dict[str, int], dict[str, Any]]] = []
            await asyncio.sleep(args.baseline_s / 2)  # warm up
            running.conn.send("peak")
            start_peak = running.conn.recv()
            started = time.perf_counter()
            await asyncio.sleep(args.baseline_s / 2)
            running.conn.send("peak")
            phases.append(("baseline", started, time.perf_counter(), running.conn.recv(), {}))
            ctx = multiprocessing.get_context("spawn")
            for name, endpoint, door in zip(args.attacks, bad, doors, strict=False):
                started = time.perf_counter()
                did: dict[str, Any] = {}
                if args.attacker == "sandbox":
                    did = await attack_from_sandbox(name, door, endpoint, args.attack_s)
                else:
                    process = ctx.Process(
                        target=attack_from_host,
                        args=(name, str(door.socket), endpoint, args.attack_s, args.attacker_nice),
                        daemon=True,
                    )
                    process.start()
                    await loop.run_in_executor(None, process.join, args.attack_s + 60)
                    if process.is_alive():
                        process.kill()
                running.conn.send("peak")
                phases.append((name, started, time.perf_counter(), running.conn.recv(), did))
                await asyncio.sleep(2.0)  # let what the attack left be cleaned up before the next
            stop.set()
            await asyncio.gather(*agents)
        server = running.finish()
    rows = []
    for name, t0, t1, peak, did in phases:
        added = [b - a - STUB_LATENCY_S for a, b in tl.requests if t0 <= a < t1]
        errors = [e for t, e in tl.errors if t0 <= t < t1]
        rows.append(
            {
                "phase": name,
                "requests": len(added),
                "errors": len(errors),
                "error_examples": sorted(set(errors))[:3],
                "added_ms_p50": round(percentile(added, 50) * 1e3, 1),
                "added_ms_p99": round(percentile(added, 99) * 1e3, 1),
                "added_ms_max": round(max(added, default=float("nan")) * 1e3, 1),
                "rss_peak_over_start_mib": round((peak["rss"] - start_peak["rss"]) / MIB, 1),
                "fds_peak": peak["fds"],
                "server_cpu_share": round(peak["cpu_s"] / (t1 - t0), 2),  # of one core, over the phase
                "attacker": did,
            }
        )
    return {
        "phases": rows,
        "server": server,
        "server_has_torch": server_has_torch,
        "rss_start_mib": round(start_peak["rss"] / MIB, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--attack-s", type=float, default=15.0)
    parser.add_argument("--baseline-s", type=float, default=15.0)
    parser.add_argument("--attacks", type=lambda s: s.split(","), default=list(ATTACKS))
    parser.add_argument(
        "--attacker",
        choices=("sandbox", "host"),
        default="sandbox",
        help="run each attack in a real `local` sandbox with the door (default), or in an unconfined host process",
    )
    parser.add_argument("--attacker-nice", type=int, default=0, help="with --attacker host: its nice value")
    parser.add_argument("--json", type=Path, help="write the results here as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    provenance = Provenance()
    t0 = time.perf_counter()
    result = asyncio.run(run(args))
    others_errors = sum(r["errors"] for r in result["phases"]) + result["server"]["recorded_errors"]
    met = (
        others_errors == 0
        and all(r["added_ms_p99"] <= 50 for r in result["phases"])
        and all(r["rss_peak_over_start_mib"] <= RSS_BOUND_MIB for r in result["phases"])
    )
    result.update(
        rollouts=args.rollouts,
        attack_s=args.attack_s,
        attacker=args.attacker,
        attacker_nice=args.attacker_nice if args.attacker == "host" else None,
        sandbox_limits=asdict(LocalLimits()) if args.attacker == "sandbox" else None,
        stub_latency_ms=STUB_LATENCY_S * 1e3,
        rss_bound_mib=RSS_BOUND_MIB,
        targets_met=met,
        run_s=round(time.perf_counter() - t0, 1),
    )
    result = {"provenance": provenance.record()} | result
    load = result["provenance"]["load"]
    headers = ["phase", "others' requests", "errors", "added p50 ms", "added p99 ms", "max ms", "RSS peak +MiB"]
    headers += ["fds", "server CPU"]
    keys = ["phase", "requests", "errors", "added_ms_p50", "added_ms_p99", "added_ms_max", "rss_peak_over_start_mib"]
    table = [[str(r[k]) for k in [*keys, "fds_peak", "server_cpu_share"]] for r in result["phases"]]
    print(markdown_table(headers, table))
    print(
        f"\nserver-recorded errors/forks of the others: {result['server']}; targets (0 errors, p99 <= 50 ms, RSS "
        f"<= +{RSS_BOUND_MIB} MiB): {'met' if met else 'NOT met'}; load {load['before']} -> {load['after']} "
        f"on {result['provenance']['machine']['cores']} CPUs; {result['run_s']} s"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
