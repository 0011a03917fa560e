"""P5: one rollout sends a request carrying a 2 MB tool output; what does it cost the other rollouts?

What. `--rollouts` (default 32) simulated Pi agents run against one `InterceptionServer` whose generator is
a STUB that sleeps 50 ms and returns a fixed, valid Qwen3 tool call (`_pi_agent.StubGenerator`); the
tokenizer is the real tiny one (`swe_grpo.extras.tiny_model`). Each agent re-sends its whole history every turn,
with one small tool result (200-600 chars) per turn and a think pause of `--think` seconds between turns.
After a baseline phase, a separate "big" rollout makes `--big` requests one after another, each on a fresh
rollout: one ordinary first turn, then a turn whose tool result is `--big-mb` MB of Python source (new
content the server must render and tokenise: about 540k tokens for 2 MB). Added latency = an agent's
round-trip (sending the body to the last byte of the SSE answer) - 50 ms. Reported: the other agents'
added latency over the baseline phase, and over the requests whose round-trip overlapped a big
request; the big requests' own round-trips; errors (non-200, transport errors, answers without tool calls,
server-recorded errors and forks). Target: added p99 while a big request is in flight <= 50 ms.

How. As P2: the server runs in its own process (`p2_concurrency.serve`), the agents in this process pinned
to the last CPU when there are 2+, over 127.0.0.1. The big request body is serialised before it is timed.

Run: `SWE_GRPO_CACHE=/tmp/swecache .venv/bin/python benchmarks/p5_big_requests.py` (about a minute;
options `--rollouts`, `--big`, `--big-mb`, `--think`, `--baseline-s`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _pi_agent import (
    _CORPUS,
    TOOL_OUTPUTS,
    PiConversation,
    markdown_table,
    parse_sse,
    percentile,
    post,
    server_process,
)
from p2_concurrency import STUB_LATENCY_S, ServerReport, serve

from swe_grpo.types import RolloutEndpoint

MB = 1_000_000


@dataclass
class Timeline:
    """Every small request as (sent, answered) and every big request's window, on one clock."""

    small: list[tuple[float, float]] = field(default_factory=list)
    big: list[tuple[float, float]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def turn(
    session: aiohttp.ClientSession, endpoint: RolloutEndpoint, body: bytes, timeline: Timeline
) -> tuple[float, float, object] | None:
    """One request; (sent, answered, answer) or None after recording what went wrong."""
    sent = time.perf_counter()
    try:
        status, payload, _ = await post(session, endpoint, body)
    except (aiohttp.ClientError, TimeoutError) as e:
        timeline.error(type(e).__name__)
        return None
    if status != 200:
        timeline.error(f"HTTP {status}")
        return None
    try:
        answer = parse_sse(payload)
    except (ValueError, KeyError) as e:
        timeline.error(f"bad answer: {e}")
        return None
    return sent, time.perf_counter(), answer


async def small_agent(
    session: aiohttp.ClientSession,
    endpoint: RolloutEndpoint,
    think: tuple[float, float],
    rng: random.Random,
    stop: asyncio.Event,
    timeline: Timeline,
) -> None:
    conversation = PiConversation(endpoint.model, rng, TOOL_OUTPUTS["small"].chars)
    await asyncio.sleep(rng.uniform(0, think[1]))
    while not stop.is_set():
        result = await turn(session, endpoint, conversation.body(), timeline)
        if result is None:
            return
        sent, answered, answer = result
        timeline.small.append((sent, answered))
        try:
            conversation.absorb(answer)
        except ValueError as e:
            timeline.error(f"bad answer: {e}")
            return
        await asyncio.sleep(rng.uniform(*think))


def big_output(size: int, rng: random.Random) -> str:
    """`size` characters of Python source, from a random place in the corpus."""
    start = rng.randrange(len(_CORPUS))
    return (_CORPUS[start:] + _CORPUS * (size // len(_CORPUS) + 1))[:size]


async def big_agent(
    session: aiohttp.ClientSession, endpoints: list[RolloutEndpoint], size: int, gap_s: float, timeline: Timeline
) -> None:
    rng = random.Random(1)
    for endpoint in endpoints:
        conversation = PiConversation(endpoint.model, rng, TOOL_OUTPUTS["small"].chars)
        first = await turn(session, endpoint, conversation.body(), timeline)
        if first is None:
            return
        conversation.absorb(first[2])
        conversation.messages[-1] = {**conversation.messages[-1], "content": big_output(size, rng)}
        body = orjson.dumps(orjson.loads(conversation.body()))
        result = await turn(session, endpoint, body, timeline)
        if result is None:
            return
        timeline.big.append(result[:2])
        await asyncio.sleep(gap_s)


async def run(args: argparse.Namespace) -> tuple[Timeline, ServerReport, float]:
    cpus = set(os.sched_getaffinity(0))
    async with server_process(serve, args.rollouts + args.big, 1, cpus, None, None, None) as running:
        small, big = running.endpoints[: args.rollouts], running.endpoints[args.rollouts :]
        timeline, stop, rng = Timeline(), asyncio.Event(), random.Random(0)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            agents = [
                asyncio.create_task(small_agent(session, e, args.think, random.Random(rng.random()), stop, timeline))
                for e in small
            ]
            await asyncio.sleep(args.baseline_s)
            big_started = time.perf_counter()
            await big_agent(session, big, int(args.big_mb * MB), args.think[1], timeline)
            stop.set()
            await asyncio.gather(*agents)
        report: ServerReport = running.finish()
        return timeline, report, big_started


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def report(timeline: Timeline, server: ServerReport, big_started: float, args: argparse.Namespace) -> str:
    def overlaps(sent: float, answered: float) -> bool:
        return any(sent < end and answered > start for start, end in timeline.big)

    baseline = [b - a - STUB_LATENCY_S for a, b in timeline.small if b < big_started]
    during = [b - a - STUB_LATENCY_S for a, b in timeline.small if overlaps(a, b)]
    big = [b - a for a, b in timeline.big]
    errors = sum(timeline.errors.values()) + server.recorded_errors + server.forks
    rows = [
        [name, str(len(xs)), _ms(percentile(xs, 50)), f"**{_ms(percentile(xs, 99))}**", _ms(max(xs, default=0))]
        for name, xs in [("baseline (no big request)", baseline), ("while a big request is in flight", during)]
    ]
    p99 = percentile(during, 99)
    met = errors == 0 and len(big) == args.big and p99 <= 0.050
    detail = ", ".join(f"{k}: {v}" for k, v in sorted(timeline.errors.items())) or "none"
    return "\n".join(
        [
            f"### P5: {args.rollouts} rollouts (think {args.think[0]:g}-{args.think[1]:g} s) while one rollout sends "
            f"{args.big} requests with a {args.big_mb:g} MB tool output; stub generation {STUB_LATENCY_S * 1e3:.0f} ms",
            "",
            markdown_table(["other rollouts' requests", "n", "added p50 ms", "added p99 ms", "added max ms"], rows),
            "",
            f"- Big requests: {len(big)} of {args.big} answered; round-trip p50 {_ms(percentile(big, 50))} ms, "
            f"max {_ms(max(big, default=0))} ms.",
            f"- Errors: {errors} (agent-side: {detail}; server-recorded {server.recorded_errors}, forks "
            f"{server.forks} of {server.turns} turns).",
            "- Target (0 errors, added p99 while a big request is in flight <= 50 ms): "
            f"**{'met' if met else 'NOT met'}**.",
            f"- Machine: {os.cpu_count()} CPUs; load average (1, 5, 15 min) before the run "
            + ", ".join(f"{x:.2f}" for x in args.load_before)
            + ", after it "
            + ", ".join(f"{x:.2f}" for x in os.getloadavg())
            + f"; {args.placement}.",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=32)
    parser.add_argument("--big", type=int, default=5, help="how many big requests (default 5)")
    parser.add_argument("--big-mb", type=float, default=2.0, help="size of the big tool output in MB (default 2)")
    parser.add_argument(
        "--think",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=(0.5, 1.5),
        help="think time between turns, 'low,high' seconds (default 0.5,1.5)",
    )
    parser.add_argument("--baseline-s", type=float, default=10.0, help="seconds before the first big request")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    args.load_before = os.getloadavg()
    cpus = sorted(os.sched_getaffinity(0))
    args.placement = "no CPU pinning"
    if len(cpus) >= 2:  # the agents never take more than one core from the server
        os.sched_setaffinity(0, {cpus[-1]})
        args.placement = f"agents pinned to CPU {cpus[-1]}, server on CPUs {','.join(map(str, cpus))}"
    t0 = time.perf_counter()
    timeline, server, big_started = asyncio.run(run(args))
    print(report(timeline, server, big_started, args))
    print(f"\n(run time {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
