"""P1: host overhead of the InterceptionServer per agent turn, at 4k, 32k and 128k tokens of history.

What. Host overhead = the round-trip of one chat completion through the real `InterceptionServer` over
loopback HTTP with an instant stub generator: body read + JSON decode, `TokenChain.prepare`, parse,
`TokenChain.commit`, the SSE answer, aiohttp. It is measured for two amounts of new content per turn
(`--tool-output`): small (one tool result of 200-600 chars, ~100-200 new tokens: `ls`, `grep`, a short
command) and large (1 or 2 results of 300-2000 chars: file reads, test runs), so that a reader sees
overhead = fixed cost + cost per new token, and how each grows with the history.

How. Per case, one simulated Pi session (`_pi_agent.py`) is grown over HTTP until its prompt reaches each
size, and its history is snapshotted there. Each timed sample opens a fresh rollout on a connection of its
own (as an agent has: the server paces a connection to 20 requests a second, which back-to-back samples on
one would measure), primes it with the snapshot (a full render, as on a rollout's first turn or after a fork:
"full-render turn"), then times the next turn, which must be served by the bridge (held chain +
interstitial). Stages are timed by wrapping, in this process only, `openai_wire.read_body`, a dialect's
`to_chat`, `TokenChain.prepare` (and in it the template's render + encode), `ResponseParser.parse`,
`TokenChain.commit` and the SSE writer; the rest is HTTP + aiohttp.
"HTTP floor": the same bytes through a bare aiohttp handler. Measured on the same data:
the approach to beat (re-render + re-tokenise the whole history every turn), and what `VLLMClient` does
per turn that the stub skips (the request's JSON with every prompt id, written from the packed prompt; a reply
that echoes them, its echo compared as bytes and the rest decoded, `_generation`).

Dialects and families. `--dialect responses|messages` sends the same session as Codex (OpenAI Responses) or
Claude Code (Anthropic Messages) would (`_agent_dialects.py`); the translation onto the chat request is then a stage
of its own (`to_chat`). `--family harmony|glm` serves a gpt-oss or GLM tiny model's template (its tokenizer, and the
stub's answer as that template writes it) in place of Qwen3. Every timed request's CPU time is counted too (this
process's, from sending the body to the answer's last byte: the server's work and the client's HTTP), the figure
that reads through a loaded box. The figures go to `--json` (benchmarks/results/p1_host_overhead.json by default)
with their provenance (the run's date, commit, machine and load).

Run: `SWE_GRPO_CACHE=/tmp/swecache .venv/bin/python benchmarks/p1_host_overhead.py` (about a minute;
options `--turns`, `--sizes`, `--tool-output`, `--dialect`, `--family`, `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import random
import sys
import time
from array import array
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from transformers import PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _agent_dialects import WIRES
from _p1_results import Sample, SizeResult, report, results_json
from _pi_agent import (
    FAMILIES,
    TOOL_OUTPUTS,
    TOOLS,
    ClientWire,
    PiConversation,
    StubGenerator,
    ToolOutput,
    load_tokenizer,
    post,
)
from _provenance import Provenance

from swe_grpo.serving import dialects, interception, openai_wire
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient, ids_json
from swe_grpo.tokens.chain import TokenChain, normalize_message
from swe_grpo.types import RolloutEndpoint


class Probe:
    """Adds the durations of wrapped calls, and GC pauses, to the sample being recorded (if any)."""

    def __init__(self) -> None:
        self.current: dict[str, float] | None = None
        self.inside: Counter[str] = Counter()  # the wrapped synchronous calls under way, by key
        self._gc_start = 0.0
        gc.callbacks.append(self._on_gc)

    def add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.current[key] = self.current.get(key, 0.0) + seconds

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        self.add("gc", time.perf_counter() - self._gc_start)
        self.add("gc_full", float(info.get("generation") == 2))

    def timed(self, key: str, fn: Callable[..., Any], within: str | None = None) -> Callable[..., Any]:
        """`fn`, its duration added to `key`; with `within`, only the calls made inside the call timed as that."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if within is not None and not self.inside[within]:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            self.inside[key] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.inside[key] -= 1
                self.add(key, time.perf_counter() - t0)

        return wrapper

    def timed_async(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - t0)

        return wrapper


def instrument(probe: Probe, server: InterceptionServer) -> None:
    """Wrap the stages of a request, in this process only."""
    # `read_body` is looked up in the interception module when a request is served: wrap it there.
    interception.read_body = probe.timed_async("json_body", interception.read_body)
    # The turn plans a request (normalise, compare) before it prepares it: both are counted as `prepare`.
    TokenChain.plan = probe.timed("prepare", TokenChain.plan)  # type: ignore[method-assign]
    TokenChain.prepare = probe.timed("prepare", TokenChain.prepare)  # type: ignore[method-assign]
    TokenChain.commit = probe.timed("commit", TokenChain.commit)  # type: ignore[method-assign]
    # The interstitial's render + encode: those made inside `prepare` (the reply check renders the reply too).
    server.template.render = probe.timed("render", server.template.render, "prepare")  # type: ignore[method-assign]
    server.template.encode = probe.timed("encode", server.template.encode, "prepare")  # type: ignore[method-assign]
    TokenChain.reply_message = probe.timed("reply_check", TokenChain.reply_message)  # type: ignore[method-assign]
    server.parser.parse = probe.timed("parse", server.parser.parse)  # type: ignore[method-assign]
    openai_wire.Answer.send = probe.timed_async("sse", openai_wire.Answer.send)  # type: ignore[method-assign]
    for dialect in (dialects.RESPONSES, dialects.MESSAGES):  # frozen; the routes hold these very objects
        object.__setattr__(dialect, "to_chat", probe.timed("to_chat", dialect.to_chat))


async def turn(
    session: aiohttp.ClientSession, endpoint: RolloutEndpoint, conversation: PiConversation, probe: Probe
) -> Sample:
    body = conversation.body()  # serialising is the agent's cost, not the host's
    probe.current = stages = {}
    cpu = time.process_time()
    status, payload, round_trip = await post(session, endpoint, body, conversation.wire)
    cpu = time.process_time() - cpu
    probe.current = None
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {payload[:500]!r}")
    answer = conversation.wire.parse(payload)
    messages = len(conversation.messages)
    conversation.absorb(answer)
    prompt_tokens = (answer.usage or {}).get("prompt_tokens", 0)
    return Sample(round_trip, cpu, stages, prompt_tokens, messages, body, payload)


class HttpFloor:
    """A bare aiohttp endpoint that reads the body and answers with given SSE bytes: transport only."""

    def __init__(self, wire: ClientWire) -> None:
        self.wire = wire
        self.answer = b""
        self.url = ""
        self.runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(self.answer)
        await response.write_eof()
        return response

    async def start(self) -> None:
        app = web.Application(client_max_size=256 * 1024**2)
        app.router.add_post("/floor", self._handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/floor"

    async def time(self, session: aiohttp.ClientSession, sample: Sample) -> float:
        self.answer = sample.payload
        t0 = time.perf_counter()
        async with session.post(self.url, data=sample.body, headers=self.wire.headers("floor")) as resp:
            await resp.read()
        return time.perf_counter() - t0


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_offline(
    result: SizeResult, server: InterceptionServer, body: bytes, ids: list[int], wire: ClientWire
) -> None:
    """On a timed turn's request `body` (on `wire`) and prompt `ids`: the approach to beat, and VLLMClient's work."""
    dialect = {"chat": dialects.CHAT, "responses": dialects.RESPONSES, "messages": dialects.MESSAGES}[wire.name]
    chat = dialect.to_chat(orjson.loads(body))
    messages = [normalize_message(m, i) for i, m in enumerate(chat["messages"])]
    template = server.template
    result.rerender_s = _timed(lambda: template.encode(template.render(messages, TOOLS, generation_prompt=True)), 3)

    # vLLM's /v1/completions reply with return_token_ids and logprobs=0 echoes the prompt ids.
    client = VLLMClient("http://127.0.0.1:9", "policy", stop_token_ids=[2], max_model_len=1 << 20)
    out = list(range(1000, 1060))
    reply = orjson.dumps(
        {
            "id": "cmpl-0",
            "object": "text_completion",
            "model": "policy",
            "choices": [
                {
                    "index": 0,
                    "text": "x" * 240,
                    "token_ids": out,
                    "prompt_token_ids": ids,
                    "logprobs": {"tokens": ["x"] * len(out), "token_logprobs": [-0.5] * len(out)},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out)},
        }
    )
    prompt = array("i", ids)  # as the server hands it (`PreparedTurn.prompt`)
    sent = ids_json(prompt)
    result.prompt_ids = len(ids)

    def encode() -> bytes:  # what `VLLMClient.generate` does before sending
        body = client.request_body(orjson.Fragment(ids_json(prompt)), SamplingParams(), None, max_tokens=4096)
        return orjson.dumps(body)

    result.vllm = {
        "encode": _timed(encode, 15),
        "check": _timed(lambda: client._generation(reply, sent), 15),
    }


async def run_case(
    case: ToolOutput,
    sizes: list[int],
    turns: int,
    server: InterceptionServer,
    tokenizer: PreTrainedTokenizerBase,
    session: aiohttp.ClientSession,
    probe: Probe,
    floor: HttpFloor,
) -> list[SizeResult]:
    server.generator = StubGenerator(tokenizer, case.calls)
    t0 = time.perf_counter()
    async with server.rollout() as handle:
        endpoint = handle.endpoint
        conversation = PiConversation(endpoint.model, random.Random(0), case.chars, floor.wire)
        snapshots: dict[int, PiConversation] = {}
        while len(snapshots) < len(sizes):
            sample = await turn(session, endpoint, conversation, probe)
            for size in sizes:
                if size not in snapshots and sample.prompt_tokens >= size:
                    snapshots[size] = conversation.copy(random.Random())
    record = handle.record
    if forks := [f"turn {i}: {t.fork_cause}" for i, t in enumerate(record.turns) if t.kind == "fork"]:
        raise RuntimeError(f"forks while growing the conversation (the translation lost something): {forks}")
    log(f"{case.name}: grew to {record.turns[-1].prompt_tokens:,} tokens in {len(record.turns)} turns, {_s(t0)}")
    # The snapshots are the agent's data (another process, in reality): keep them out of the server's GC.
    gc.collect()
    gc.freeze()

    results = []
    for size in sizes:
        result = SizeResult(size)
        t0 = time.perf_counter()
        for i in range(turns):
            conversation = snapshots[size].copy(random.Random(i))  # sample i: same new messages at every size
            # A connection of its own, as each agent process has: the server paces a connection's requests (20 a
            # second, `ServingLimits`), which back-to-back samples on one kept-alive connection would measure.
            async with aiohttp.ClientSession() as own, server.rollout() as handle:
                prime = await turn(own, handle.endpoint, conversation, probe)
                timed = await turn(own, handle.endpoint, conversation, probe)
            record = handle.record
            result.turn_kinds.update(t.kind for t in record.turns)
            result.server_errors += len(record.errors)
            if [t.kind for t in record.turns] != ["clean", "clean"]:
                raise RuntimeError(f"the timed turn was not served by the bridge: {record.turns}")
            timed.new_tokens = record.turns[1].new_prompt_tokens
            result.full_render_s.append(prime.round_trip)
            result.bridge.append(timed)
            result.floor_s.append(await floor.time(session, timed))
        ids = record.rows[-1].input_ids[: record.turns[1].prompt_tokens].tolist()
        measure_offline(result, server, result.bridge[-1].body, ids, floor.wire)
        results.append(result)
        log(f"{case.name} {size:,}: {turns} timed turns, {_s(t0)}")
    return results


async def run(
    cases: list[ToolOutput], sizes: list[int], turns: int, wire: ClientWire, family: str
) -> dict[str, list[SizeResult]]:
    tokenizer = load_tokenizer(family)
    server = InterceptionServer(StubGenerator(tokenizer, 1), tokenizer)
    probe = Probe()
    instrument(probe, server)
    floor = HttpFloor(wire)
    await floor.start()
    try:
        async with server, aiohttp.ClientSession() as session:
            return {c.name: await run_case(c, sizes, turns, server, tokenizer, session, probe, floor) for c in cases}
    finally:
        await floor.runner.cleanup()  # type: ignore[union-attr]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _s(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=30, help="timed turns per history size (default 30)")
    parser.add_argument("--sizes", default="4096,32768,131072", help="history sizes in prompt tokens")
    parser.add_argument("--tool-output", default="small,large", help="cases: small, large or both (default)")
    parser.add_argument("--dialect", choices=sorted(WIRES), default="chat", help="the agent's wire (default chat)")
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen", help="the template family (default qwen)")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(__file__).parent / "results" / "p1_host_overhead.json",
        help="where the figures go, with their provenance (default benchmarks/results/p1_host_overhead.json)",
    )
    args = parser.parse_args()
    cases = [TOOL_OUTPUTS[name] for name in args.tool_output.split(",")]
    sizes = sorted(int(x) for x in args.sizes.split(","))
    run_provenance = Provenance()
    load_before = run_provenance.load_before[0]
    t0 = time.perf_counter()
    results = asyncio.run(run(cases, sizes, args.turns, WIRES[args.dialect], args.family))
    print(report(results, args, load_before))
    print(f"\n(run time {_s(t0)})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results_json(results, args, run_provenance), indent=1) + "\n")
    gc.unfreeze()  # let interpreter shutdown free what the server froze (else nanobind reports leaks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
