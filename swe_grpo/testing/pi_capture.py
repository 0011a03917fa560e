"""Driving the real Pi with SCRIPTED model turns, for where a model cannot be trusted to act: the tests
pin the shape of Pi's requests with it, and the demo's warm start captures the conversations it
fine-tunes on with it.

`capture_agent_run` (`capture_pi_run` for Pi) runs an agent in a sandbox behind the InterceptionServer,
answering its model calls with scripted assistant messages (`ScriptedGenerator`, fed the ids
`completion_ids` renders), and records every chat request the agent sends on the way (`recording_hop`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import ClientSession, web
from transformers import PreTrainedTokenizerBase

from swe_grpo.serving.vllm_client import Generation, SamplingParams
from swe_grpo.tokens.chain import Message, TrainingTemplate

if TYPE_CHECKING:
    from swe_grpo.agents.base import Agent, AgentResult
    from swe_grpo.agents.pi import PiBundle
    from swe_grpo.sandbox.base import SandboxBackend
    from swe_grpo.serving.interception import RolloutRecord
    from swe_grpo.tasks import Task

__all__ = [
    "CapturedRequests",
    "PiRun",
    "ScriptedGenerator",
    "capture_agent_run",
    "capture_pi_run",
    "completion_ids",
    "recording_hop",
]


def completion_ids(template: TrainingTemplate, message: Message) -> list[int]:
    """The ids a model emits for the assistant `message`: the training template's own rendering of the
    turn after the generation prompt, through the token that closes it (`TrainingTemplate.reply_text`)."""
    return template.encode(template.reply_text(message))


class ScriptedGenerator:
    """A SCRIPTED generation backend (no model): request k is answered with `outputs[k]`, requests past the
    script with the last one (a caller that needs an exact count checks `requests`). For driving the real
    Pi where a model cannot be trusted to act: capturing its requests, pinning their shapes in tests."""

    def __init__(self, outputs: list[list[int]], max_model_len: int = 32768):
        self.outputs = outputs
        self.max_model_len = max_model_len
        self.requests = 0

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, model: str | None = None) -> Generation:
        ids = self.outputs[min(self.requests, len(self.outputs) - 1)]
        self.requests += 1
        return Generation(list(ids), [0.0] * len(ids), "stop", model or "")


@dataclass
class CapturedRequests:
    """The model requests an agent sent (chat, Responses or Messages), as they left it: each one's headers (names
    lower-cased) and JSON body."""

    url: str = ""
    requests: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.requests]


# The model calls a hop records, in each dialect the server speaks, and the headers it forwards (auth and dialect).
_MODEL_CALLS = ("/chat/completions", "/responses", "/messages")
_FORWARDED = ("authorization", "x-api-key", "anthropic-version", "content-type")


@contextlib.asynccontextmanager
async def recording_hop(target: str, socket: Path | None = None) -> AsyncIterator[CapturedRequests]:
    """An HTTP hop in front of `target` (a base URL) that forwards every request unchanged and keeps each model
    request's headers and body. It listens on the host's loopback, or on the unix socket `socket` (a door's, in
    place of the InterceptionServer: any local user may connect, as to a door the server serves)."""
    captured = CapturedRequests()
    async with ClientSession() as http:

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            if request.path.endswith(_MODEL_CALLS):
                captured.requests.append(({k.lower(): v for k, v in request.headers.items()}, orjson.loads(body)))
            headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
            async with http.request(request.method, target + request.path_qs, data=body, headers=headers) as r:
                reply = await r.read()
                return web.Response(body=reply, status=r.status, headers={"Content-Type": r.content_type})

        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            if socket is None:
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                captured.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            else:
                await web.UnixSite(runner, os.fspath(socket)).start()
                socket.chmod(0o666)  # the sandbox's user connects
                captured.url = f"unix:{socket}"
            yield captured
        finally:
            await runner.cleanup()


@dataclass
class PiRun:
    """One run of a real agent (Pi or another harness) with SCRIPTED model turns: how it ended, the
    InterceptionServer's record of the rollout, every chat request it sent (headers and body), the rollout's
    token, the diff it left against the base commit, and the output of each `after` command."""

    result: AgentResult
    record: RolloutRecord
    captured: CapturedRequests
    token: str
    patch: str
    after: dict[str, str]


async def capture_pi_run(
    bundle: PiBundle,
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    task: Task,
    replies: Sequence[Message],
    after: Sequence[str] = (),
) -> PiRun:
    """The real Pi of `bundle` on `task` with its model turns SCRIPTED to `replies`: `capture_agent_run`."""
    from swe_grpo.agents.pi import PiAgent

    return await capture_agent_run(PiAgent(bundle), tokenizer, backend, task, replies, after)


async def capture_agent_run(
    agent: Agent,
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    task: Task,
    replies: Sequence[Message],
    after: Sequence[str] = (),
    max_model_len: int = 32768,
    timeout_s: float = 180,
    *,
    door: bool = False,
) -> PiRun:
    """The real `agent` (any harness) in a fresh sandbox of `backend`, on `task`, its model turns SCRIPTED to
    `replies` (assistant messages in normalised form, see `ScriptedGenerator`), behind the
    InterceptionServer and a `recording_hop`. The sandbox has the host's network (the agent reaches the hop on
    the host's loopback), or with `door` none but a door (`swe_grpo.sandbox.door`) whose socket the hop serves,
    as a rollout's agent runs. `after`: shell commands run in the sandbox once the agent has exited, with the
    rollout's token in `$TOKEN`. `max_model_len`: the context the server says it serves (Claude Code's first
    prompt alone is ~32k tokens in the tiny model's vocabulary); `timeout_s`: the agent's wall clock (no request
    for two thirds of it is a stall). The sandbox and the door are gone when this returns."""
    from swe_grpo.agents.base import AgentConfig, run_agent
    from swe_grpo.sandbox.door import Door
    from swe_grpo.serving.interception import InterceptionServer

    template = TrainingTemplate(tokenizer)
    generator = ScriptedGenerator([completion_ids(template, reply) for reply in replies], max_model_len)
    stall_s = timeout_s * 2 / 3  # no request for that long: the agent hangs
    config = AgentConfig(context_window=max_model_len, max_tokens=256, timeout_s=timeout_s, stall_timeout_s=stall_s)
    gate = Door.make("capture") if door else None
    try:
        async with (
            InterceptionServer(generator, tokenizer) as server,
            recording_hop(server.public_base_url, gate.socket if gate else None) as hop,
            server.rollout(gate.rollout_id if gate else None) as session,
        ):
            endpoint = session.endpoint
            if gate is None:  # the agent reaches the hop on the host's loopback
                endpoint = replace(endpoint, base_url=hop.url + endpoint.base_url.removeprefix(server.public_base_url))
            mounts = [agent.mount(), *([gate.mount()] if gate else [])]
            async with await backend.create(task, mounts=mounts, network=gate is None) as sandbox:
                result = await run_agent(
                    agent, sandbox, endpoint, task.problem_statement, config, session.last_activity, door=gate
                )
                patch = await sandbox.diff(task.base_commit)
                outputs = {}
                for command in after:
                    done = await sandbox.exec(command, timeout_s=60, env={"TOKEN": endpoint.token})
                    outputs[command] = done.stdout + done.stderr
    finally:
        if gate is not None:
            gate.remove()
    assert session.record is not None
    record = session.record
    return PiRun(result, record, hop, endpoint.token, patch, outputs)
