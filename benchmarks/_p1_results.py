"""P1's records and reports (benchmarks/p1_host_overhead.py measures): what one timed request and one history size
recorded (`Sample`, `SizeResult`), the markdown tables the run prints (`report`), and the results JSON it writes with
its provenance, dialect and family (`results_json`)."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _pi_agent import FAMILIES, TOOL_OUTPUTS, markdown_table, percentile
from _provenance import Provenance

# Rows of the breakdown: (label, key in Sample.stage); "- " marks a part of the row above.
STAGES = [
    ("body read + JSON decode (`read_body`)", "json_body"),
    ("dialect -> chat request (`to_chat`)", "to_chat"),
    ("chain.prepare", "prepare"),
    ("- render + tokenise the interstitial", "interstitial"),
    ("- normalise, compare, concatenate", "prepare_rest"),
    ("parse", "parse"),
    ("reply check (`reply_message`: the reply rendered)", "reply_check"),
    ("chain.commit", "commit"),
    ("SSE answer", "sse"),
    ("rest: HTTP, aiohttp, routing, auth, stub", "rest"),
]


@dataclass
class Sample:
    """One timed request: its round-trip, the time in each wrapped stage, its sizes and bytes."""

    round_trip: float
    cpu: float  # this process's CPU time during the round-trip
    stages: dict[str, float]
    prompt_tokens: int
    messages: int
    body: bytes
    payload: bytes
    new_tokens: int = 0

    def stage(self, key: str) -> float:
        s = self.stages
        interstitial = s.get("render", 0.0) + s.get("encode", 0.0)
        if key == "interstitial":
            return interstitial
        if key == "prepare_rest":
            return s.get("prepare", 0.0) - interstitial
        if key == "rest":
            return self.round_trip - sum(
                s.get(k, 0.0) for k in ("json_body", "to_chat", "prepare", "parse", "reply_check", "commit", "sse")
            )
        return s.get(key, 0.0)


@dataclass
class SizeResult:
    target: int
    bridge: list[Sample] = field(default_factory=list)  # the timed turns
    full_render_s: list[float] = field(default_factory=list)  # the priming turns
    floor_s: list[float] = field(default_factory=list)  # bare aiohttp, same bytes
    rerender_s: list[float] = field(default_factory=list)  # the approach to beat
    turn_kinds: Counter[str] = field(default_factory=Counter)  # of every turn the server recorded (priming, timed)
    server_errors: int = 0  # errors the server recorded in those rollouts
    prompt_ids: int = 0
    vllm: dict[str, list[float]] = field(default_factory=dict)  # VLLMClient per-turn work, by step


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _p(samples: list[Sample], q: float, key: str | None = None) -> float:
    return percentile([s.round_trip if key is None else s.stage(key) for s in samples], q)


def _size(r: SizeResult) -> str:
    return f"{r.target // 1024}k"


def _new(r: SizeResult) -> float:
    return _mean([float(s.new_tokens) for s in r.bridge])


def case_table(results: list[SizeResult]) -> str:
    rows = []
    for r in results:
        prepare, rerender = _p(r.bridge, 50, "prepare"), percentile(r.rerender_s, 50)
        rows.append(
            [
                f"{_size(r)} ({_mean([float(s.prompt_tokens) for s in r.bridge]):,.0f})",
                f"{_mean([float(s.messages) for s in r.bridge]):,.0f}",
                f"{_mean([float(len(s.body)) for s in r.bridge]) / 1024:,.0f}",
                f"{_new(r):,.0f}",
                f"**{_ms(_p(r.bridge, 50))}**",
                _ms(_p(r.bridge, 90)),
                _ms(_p(r.bridge, 50, "json_body")),
                _ms(prepare),
                _ms(rerender),
                f"{rerender / prepare:.0f}x",
                _ms(percentile(r.full_render_s, 50)),
            ]
        )
    headers = [
        "history (prompt tokens)",
        "messages",
        "body KiB",
        "new tokens",
        "overhead p50 ms",
        "p90",
        "body read + JSON decode p50",
        "chain.prepare p50",
        "approach to beat: re-render + re-tokenise p50",
        "approach / prepare",
        "full-render turn p50",
    ]
    return markdown_table(headers, rows)


def report(results: dict[str, list[SizeResult]], args: argparse.Namespace, load_before: float) -> str:
    turns = args.turns
    out = [
        f"### P1: host overhead per turn ({turns} timed turns per size, instant stub, loopback HTTP; "
        f"{args.dialect} dialect, {args.family} family: `{FAMILIES[args.family]}` template)"
    ]
    for name, rs in results.items():
        out += ["", f"#### {name}: {TOOL_OUTPUTS[name].note}; ms", "", case_table(rs)]

    # The breakdown, at the size closest to 32k, one column per case.
    at = {name: min(rs, key=lambda r: abs(r.target - 32768)) for name, rs in results.items()}
    size = _size(next(iter(at.values())))
    out += ["", f"#### Where a bridge turn's time goes at {size} (mean ms; share of the mean round-trip)", ""]
    rows = []
    for label, key in STAGES:
        row = [label]
        for r in at.values():
            value, total = _mean([s.stage(key) for s in r.bridge]), _mean([s.round_trip for s in r.bridge])
            row.append(f"{_ms(value)} ({value / total:.0%})")
        rows.append(row)
    rows.append(["**round-trip**", *[f"**{_ms(_mean([s.round_trip for s in r.bridge]))}**" for r in at.values()]])
    rows.append(["HTTP floor: bare aiohttp, same bytes", *[_ms(_mean(r.floor_s)) for r in at.values()]])
    rows.append(["CPU time of the round-trip (server + client HTTP)", *[_ms(_cpu(r)) for r in at.values()]])
    rows.append(["new prompt tokens", *[f"{_new(r):,.0f}" for r in at.values()]])
    out.append(markdown_table(["stage", *at], rows))
    gc_ms = ", ".join(f"{n} {_ms(_mean([s.stage('gc') for s in r.bridge]))} ms" for n, r in at.items())
    gc_full = sum(s.stage("gc_full") for r in at.values() for s in r.bridge)
    out.append(
        f"\nGarbage-collector pauses during the round-trip (server or in-process agent), mean per turn: {gc_ms}; "
        f"{gc_full:.0f} full collections."
    )

    last = list(results.values())[-1]
    out += ["", "#### Not in the overhead above (the stub skips it): VLLMClient's work per turn, p50 ms", ""]
    rows = []
    for r in last:
        steps = [percentile(r.vllm[k], 50) for k in ("encode", "check")]
        rows.append([_size(r), f"{r.prompt_ids:,}", *map(_ms, steps), _ms(sum(steps))])
    headers = [
        "history",
        "prompt ids",
        "ids_json + orjson.dumps(request_body)",
        "_generation (the echo compared as bytes, the rest decoded)",
        "total",
    ]
    out.append(markdown_table(headers, rows))

    out.append("")
    if {"small", "large"} <= results.keys():
        fits = []
        for small, large in zip(results["small"], results["large"], strict=True):
            per_token = (_p(large.bridge, 50) - _p(small.bridge, 50)) / (_new(large) - _new(small))
            fixed = _p(small.bridge, 50) - per_token * _new(small)
            fits.append(f"{_size(small)}: {_ms(fixed)} ms + {per_token * 1e6:.1f} us/token")
        out.append(
            f"- Overhead ~ fixed + per new token, fitted to the two cases' p50s: {'; '.join(fits)} (the small case's "
            "history has more, shorter messages for the same tokens, which the fit puts in its fixed part)."
        )
    for name, rs in results.items():
        line = f"- {name}: p50 {_ms(_p(rs[0].bridge, 50))} ms at {_size(rs[0])} -> {_ms(_p(rs[-1].bridge, 50))} ms"
        line += f" at {_size(rs[-1])}"
        at_32k = [r for r in rs if r.target == 32768]
        if at_32k:
            p50 = _p(at_32k[0].bridge, 50)
            line += f"; target p50 <= 5 ms at 32k: **{'met' if p50 <= 0.005 else 'NOT met'}**"
        out.append(line + ".")
    out.append(
        f"- Server, agent and offline measurements share one process and asyncio loop. Machine: {os.cpu_count()} "
        f"CPUs, 1-minute load average {load_before:.2f} before the run, {os.getloadavg()[0]:.2f} after it."
    )
    tokens = "- Token counts are the tiny Qwen3 tokenizer's (~3.1-3.7 chars per token on code; a real Qwen3: ~4)."
    if args.family != "qwen":
        tokens = f"- Token counts are the tiny `{FAMILIES[args.family]}` tokenizer's (a 2,048-token vocabulary)."
    out.append(tokens)
    return "\n".join(out)


def _cpu(r: SizeResult) -> float:
    return _mean([s.cpu for s in r.bridge])


def results_json(results: dict[str, list[SizeResult]], args: argparse.Namespace, run: Provenance) -> dict[str, Any]:
    """The run's figures (times in ms) with its provenance, dialect and family."""
    sizes = []
    for case, rs in results.items():
        for r in rs:
            trips = [s.round_trip for s in r.bridge]
            sizes.append(
                {
                    "tool_output": case,
                    "target_tokens": r.target,
                    "prompt_tokens_mean": _mean([float(s.prompt_tokens) for s in r.bridge]),
                    "history_items_mean": _mean([float(s.messages) for s in r.bridge]),
                    "body_kib_mean": _mean([float(len(s.body)) for s in r.bridge]) / 1024,
                    "new_tokens_mean": _new(r),
                    "requests": len(r.bridge),
                    "overhead_ms": {f"p{q}": percentile(trips, q) * 1e3 for q in (50, 90, 99)},
                    "cpu_ms_per_request": _cpu(r) * 1e3,
                    "stages_mean_ms": {key: _mean([s.stage(key) for s in r.bridge]) * 1e3 for _, key in STAGES},
                    "full_render_turn_p50_ms": percentile(r.full_render_s, 50) * 1e3,
                    "rerender_p50_ms": percentile(r.rerender_s, 50) * 1e3,
                    "http_floor_mean_ms": _mean(r.floor_s) * 1e3,
                    "gc_full": sum(s.stage("gc_full") for s in r.bridge),
                }
            )
    return {
        "provenance": run.record(),
        "dialect": args.dialect,
        "family": args.family,
        "template": FAMILIES[args.family],
        # Of the timed rollouts' turns (`run_case` stops the run at a fork, naming its cause).
        "requests": sum(sum(r.turn_kinds.values()) for rs in results.values() for r in rs),
        "errors": sum(r.server_errors for rs in results.values() for r in rs),
        "forks": sum(r.turn_kinds["fork"] for rs in results.values() for r in rs),
        "options": {"turns": args.turns, "sizes": args.sizes, "tool_output": args.tool_output},
        "sizes": sizes,
    }
