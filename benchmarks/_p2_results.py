"""P2's records and reports (benchmarks/p2_concurrency.py measures): what a scenario's agents and server processes
recorded (`AgentStats`, `ServerReport`, `Result`), the markdown table the run prints (`report`) and the results JSON it
writes with its provenance, dialect and family (`write_json`)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from _pi_agent import FAMILIES, TOOL_OUTPUTS, markdown_table, percentile
from _provenance import Provenance
from _stages import OUTERMOST

STUB_LATENCY_S = 0.05


@dataclass
class ServerReport:
    """What the server process says about a scenario, after closing every rollout."""

    handler_s: list[float]  # time inside the turn handler (every dialect's), per request
    turns: int
    forks: int
    recorded_errors: int
    gc_full: int  # full (generation 2) collections
    gc_pause_max_s: float  # of any collection
    gc_pause_total_s: float
    gc_full_pause_max_s: float
    gc_pause_max_cpu_s: float  # of any collection, in the collecting thread's CPU time: the collector's own work
    loop_cpu_s: float  # CPU of the thread that runs the event loop, over the traffic (what queues the requests)
    stages_cpu_s: dict[str, float]  # CPU per stage of a request (`_stages`; empty without --stages)

    @classmethod
    def merged(cls, reports: list[ServerReport]) -> ServerReport:
        """All hosts' servers as one: requests and counts summed, the longest GC pause kept."""
        return cls(
            handler_s=[x for r in reports for x in r.handler_s],
            turns=sum(r.turns for r in reports),
            forks=sum(r.forks for r in reports),
            recorded_errors=sum(r.recorded_errors for r in reports),
            gc_full=sum(r.gc_full for r in reports),
            gc_pause_max_s=max(r.gc_pause_max_s for r in reports),
            gc_pause_total_s=sum(r.gc_pause_total_s for r in reports),
            gc_full_pause_max_s=max(r.gc_full_pause_max_s for r in reports),
            gc_pause_max_cpu_s=max(r.gc_pause_max_cpu_s for r in reports),
            loop_cpu_s=sum(r.loop_cpu_s for r in reports),
            stages_cpu_s={k: sum(r.stages_cpu_s[k] for r in reports) for k in reports[0].stages_cpu_s},
        )


@dataclass(frozen=True)
class Scenario:
    name: str
    think_s: tuple[float, float]  # uniform think time between turns; each rollout starts after [0, max]


@dataclass
class AgentStats:
    round_trips: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    unfinished: int = 0
    prompt_tokens_last: list[int] = field(default_factory=list)
    first_send: float = float("inf")
    last_answer: float = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


@dataclass
class Result:
    scenario: Scenario
    hosts: int
    generator: str  # "client" (VLLMClient + stub vLLM) or "stub" (in-process StubGenerator)
    stats: AgentStats
    server: ServerReport  # all hosts' servers merged
    wall_s: float
    rss_mib: tuple[float, float, float]  # before, after, peak: summed over the hosts' servers
    cpu: tuple[float, float, float]  # servers (summed), agents, stub vLLM (0 without): CPU seconds / wall seconds


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _rate(r: Result) -> float:
    return len(r.stats.round_trips) / max(r.stats.last_answer - r.stats.first_send, 1e-9)


def _errors(r: Result) -> int:
    return sum(r.stats.errors.values()) + r.server.recorded_errors + r.server.forks


GENERATORS = {
    "client": "the real VLLMClient against a stub vLLM (50 ms, prompt ids echoed)",
    "stub": "an in-process stub generator (50 ms; no client JSON work)",
}


def report(results: list[Result], args: argparse.Namespace, load_before: float) -> str:
    """The markdown report of one generator's results."""
    out = [
        f"### P2: {args.rollouts} concurrent rollouts x {args.turns} turns over {args.hosts_text} rollout hosts, "
        f"generation through {GENERATORS[results[0].generator]}, {TOOL_OUTPUTS[args.tool_output].note}; "
        f"{args.dialect} dialect, {args.family} family (`{FAMILIES[args.family]}` template)",
        "",
    ]
    rows = []
    for r in results:
        s, think = r.stats, r.scenario.think_s
        added = [x - STUB_LATENCY_S for x in s.round_trips]
        server_added = [x - STUB_LATENCY_S for x in r.server.handler_s]
        rows.append(
            [
                str(r.hosts),
                r.scenario.name,
                f"{think[0]:g}-{think[1]:g} s" if think[1] > 0 else "0",
                f"{len(s.round_trips):,}" + (f" ({s.unfinished:,} unfinished)" if s.unfinished else ""),
                str(_errors(r)),
                _ms(percentile(added, 50)),
                f"**{_ms(percentile(added, 99))}**",
                _ms(percentile(server_added, 99)),
                f"{_rate(r):,.0f}",
                f"{r.cpu[0]:.0%} / {r.cpu[1]:.0%}" + (f" / {r.cpu[2]:.0%}" if r.generator == "client" else ""),
                f"{_per_request_ms(r, r.cpu[0] * r.wall_s):.1f} / {_per_request_ms(r, r.server.loop_cpu_s):.1f}",
                " / ".join(f"{x:,.0f}" for x in r.rss_mib),
                f"{r.server.gc_full} ({_ms(r.server.gc_full_pause_max_s)} ms) / {_ms(r.server.gc_pause_max_s)} ms "
                f"({_ms(r.server.gc_pause_max_cpu_s)} ms CPU)",
            ]
        )
    headers = [
        "hosts",
        "scenario",
        "think time",
        "requests answered",
        "errors",
        "added p50 ms",
        "added p99",
        "added p99 in the server",
        "requests/s",
        "CPU server / agents (/ stub vLLM)",
        "server CPU ms / request (its loop's thread)",
        "server RSS MiB before / after / peak",
        "full GCs (longest) / longest GC pause (longest in CPU time)",
    ]
    out += [markdown_table(headers, rows), ""]
    out += _stages_report(results)
    saturated = {r.hosts: r for r in results if r.scenario.think_s[1] == 0}
    for r in results:
        s = r.stats
        saturation = saturated.get(r.hosts)
        detail = ", ".join(f"{k}: {v}" for k, v in sorted(s.errors.items())) or "none"
        tokens = s.prompt_tokens_last
        out.append(
            f"- {r.hosts} host(s), {r.scenario.name}: wall {r.wall_s:.1f} s; agent-side errors: {detail}; "
            f"server-recorded errors {r.server.recorded_errors}, forks {r.server.forks} of {r.server.turns} turns; "
            f"prompt at the last turn {sum(tokens) / max(len(tokens), 1):,.0f} tokens on average; "
            f"GC pauses in the servers {r.server.gc_pause_total_s:.2f} s in total; RSS growth "
            f"{(r.rss_mib[1] - r.rss_mib[0]) / args.rollouts:.2f} MiB per rollout."
        )
        if r.scenario.think_s[1] == 0:
            continue
        cycle = sum(r.scenario.think_s) / 2 + STUB_LATENCY_S
        if saturation is not None:
            out.append(
                f"- Offered load of {r.scenario.name} at zero added latency: {args.rollouts} rollouts / {cycle:.2f} s "
                f"per turn = {args.rollouts / cycle:,.0f} requests/s, against a ceiling of {_rate(saturation):,.0f} "
                "requests/s measured under saturation."
            )
        errors = _errors(r) + s.unfinished
        p99 = percentile([x - STUB_LATENCY_S for x in s.round_trips], 99)
        out.append(
            f"- Targets (0 errors, added p99 <= 50 ms) with {r.hosts} host(s), think time {r.scenario.think_s[0]:g}-"
            f"{r.scenario.think_s[1]:g} s: **{'met' if errors == 0 and p99 <= 0.050 else 'NOT met'}** ({errors} "
            f"errors, added p99 {_ms(p99)} ms)."
        )
    if 1 in saturated:
        one = _rate(saturated[1])
        one_per_cpu = one / saturated[1].cpu[0]
        cores = os.cpu_count() or 1
        for hosts, r in sorted(saturated.items()):
            if hosts > 1:
                linear = _rate(r) / (hosts * one)
                beyond = f"; more hosts than the {cores} cores" if hosts > cores else ""
                per_cpu = _rate(r) / r.cpu[0]
                out.append(
                    f"- Scaling, saturation: {hosts} hosts serve {_rate(r):,.0f} requests/s = {_rate(r) / one:.2f}x "
                    f"one host ({linear:.0%} of linear{beyond}); per CPU-second the servers got, {per_cpu:,.0f} "
                    f"requests against {one_per_cpu:,.0f} for one host ({per_cpu / one_per_cpu:.0%})."
                )
    out.append(
        f'- Added latency = agent-side round-trip - {STUB_LATENCY_S * 1e3:.0f} ms; "in the server" = time in the '
        "turn handler - 50 ms (no transport, no agent-side scheduling). CPU: CPU seconds / wall "
        "seconds of each process (100% = one core); the server's includes its vLLM client's work."
    )
    out.append(
        "- Servers: one process per host, asyncio loop; agents: this process, "
        f"{args.agent_loop} loop, {args.placement} (the stub vLLM with them); loopback HTTP. "
        f"Machine: {os.cpu_count()} "
        f"CPUs, 1-minute load average {load_before:.2f} before the run, {os.getloadavg()[0]:.2f} after it."
    )
    return "\n".join(out)


def _per_request_ms(r: Result, cpu_s: float) -> float:
    return cpu_s / max(len(r.stats.round_trips), 1) * 1e3


def _stages_report(results: list[Result]) -> list[str]:
    """The servers' CPU per request by stage (`--stages`), one column per result."""
    measured = [r for r in results if r.server.stages_cpu_s]
    if not measured:
        return []
    headers = ["stage (server CPU ms / request)"] + [f"{r.hosts} host(s), {r.scenario.name}" for r in measured]
    rows = [
        [stage] + [f"{_per_request_ms(r, r.server.stages_cpu_s[stage]):.3f}" for r in measured]
        for stage in measured[0].server.stages_cpu_s
    ]
    rest = [r.cpu[0] * r.wall_s - sum(r.server.stages_cpu_s[stage] for stage in OUTERMOST) for r in measured]
    rows.append(
        ["in no stage (aiohttp both sides, event loop, SSE, collector)"]
        + [f"{_per_request_ms(r, x):.3f}" for r, x in zip(measured, rest, strict=True)]
    )
    rows.append(["all (the server process)"] + [f"{_per_request_ms(r, r.cpu[0] * r.wall_s):.3f}" for r in measured])
    return [markdown_table(headers, rows), ""]


def _row(r: Result, rollouts: int) -> dict[str, Any]:
    """One result as a JSON object (times in ms, CPU as a fraction of one core)."""
    s = r.stats
    added = [x - STUB_LATENCY_S for x in s.round_trips]
    return {
        "generator": r.generator,
        "hosts": r.hosts,
        "scenario": r.scenario.name,
        "think_s": list(r.scenario.think_s),
        "requests_answered": len(s.round_trips),
        "unfinished": s.unfinished,
        "errors": _errors(r),
        "agent_errors": s.errors,
        "server_recorded_errors": r.server.recorded_errors,
        "forks": r.server.forks,
        "added_ms": {f"p{q}": percentile(added, q) * 1e3 for q in (50, 90, 99)},
        "added_in_server_p99_ms": percentile([x - STUB_LATENCY_S for x in r.server.handler_s], 99) * 1e3,
        "requests_per_s": _rate(r),
        "cpu_servers": r.cpu[0],
        "cpu_agents": r.cpu[1],
        "cpu_stub_vllm": r.cpu[2],
        "server_cpu_ms_per_request": _per_request_ms(r, r.cpu[0] * r.wall_s),
        "server_loop_thread_cpu_ms_per_request": _per_request_ms(r, r.server.loop_cpu_s),
        "server_stage_cpu_ms_per_request": {k: _per_request_ms(r, v) for k, v in r.server.stages_cpu_s.items()},
        "server_rss_mib": dict(zip(("before", "after", "peak"), r.rss_mib, strict=True)),
        "rss_growth_mib_per_rollout": (r.rss_mib[1] - r.rss_mib[0]) / rollouts,
        "gc_full": r.server.gc_full,
        "gc_pause_max_ms": r.server.gc_pause_max_s * 1e3,
        "gc_full_pause_max_ms": r.server.gc_full_pause_max_s * 1e3,
        "gc_pause_max_cpu_ms": r.server.gc_pause_max_cpu_s * 1e3,
        "prompt_tokens_last_mean": sum(s.prompt_tokens_last) / max(len(s.prompt_tokens_last), 1),
        "wall_s": r.wall_s,
    }


def write_json(args: argparse.Namespace, results: list[Result], provenance: Provenance) -> None:
    """The run so far, with its provenance, to `args.json`."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    options = {
        k: v
        for k, v in vars(args).items()
        if k in ("rollouts", "turns", "think", "tool_output", "max_seconds", "gc_threshold", "dialect", "family")
    }
    args.json.write_text(
        json.dumps(
            {
                "provenance": provenance.record(),
                "dialect": args.dialect,
                "family": args.family,
                "template": FAMILIES[args.family],
                "placement": args.placement,
                "stub_latency_ms": STUB_LATENCY_S * 1e3,
                "options": options,
                "results": [_row(r, args.rollouts) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
