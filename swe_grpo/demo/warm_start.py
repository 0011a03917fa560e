"""A warm-started tiny policy for the CPU learning demo: the tiny model, fine-tuned so that Pi can drive it.

A randomly initialised tiny model never writes a tool call, so GRPO has nothing to reinforce. This module
teaches it, by supervised fine-tuning on CPU, one small repertoire per bundled demo task: when Pi runs
it on the task, its first turn is one of a few candidate `bash` tool calls (one fixes the task, the
others are plausible wrong fixes; see `tasks/warm_start/candidates.json`), drawn roughly uniformly,
and after the tool result its second turn is `Done.` and the end-of-turn token, so Pi exits. RL then has
a real choice to learn: which candidate.

The training tokens are exactly the tokens a rollout puts in its training row. The conversations are
the default Pi's real requests (`tasks/warm_start/pi_requests.json`, captured by running the real Pi in
a `local` sandbox against an InterceptionServer answering with the candidate, see `capture_pi_requests`),
replayed through the same TokenChain and ResponseParser the server uses. Nothing in them varies between
runs of Pi on these tasks (the working directory is always /testbed, Pi's documentation paths are under
the fixed bundle mount, and the default Pi puts no date in its prompt), so one replay serves every step.

Fine-tuning is fast because the twelve sequences of a step (3 tasks x 4 candidates, both turns) are
mostly one shared prompt: the prefix all prompts share (Pi's system prompt and tool schemas) is
forwarded once, each task's remainder (its problem statement) once, and only the two turns once per
sequence, each level reusing the key/value cache of the level before (see `completion_loss`).
The result is cached on disk under a key of the tiny model's files, the capture, the spec and
`BUILDER_VERSION`. The repository ships the policy too (`SHIPPED_DIR`, made by `python -m
swe_grpo.demo.warm_start ship`), used wherever the build would make it (the same key): a fresh machine's
demo starts training without the minutes of fine-tuning, and a test checks it against a fresh build.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import math
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import ClientSession, web
from transformers import PreTrainedTokenizerBase

from swe_grpo.extras.tiny_model import build_tiny_model
from swe_grpo.paths import cache_root
from swe_grpo.serving.vllm_client import Generation, SamplingParams
from swe_grpo.tokens.chain import Message, TokenChain, TrainingTemplate
from swe_grpo.tokens.responses import ResponseParser

if TYPE_CHECKING:
    import torch

    from swe_grpo.agents.base import AgentResult
    from swe_grpo.agents.pi import PiBundle
    from swe_grpo.sandbox.base import SandboxBackend
    from swe_grpo.serving.interception import RolloutRecord
    from swe_grpo.tasks import Task

log = logging.getLogger(__name__)

BUILDER_VERSION = "2"
DATA_DIR = Path(__file__).resolve().parent / "tasks" / "warm_start"
CANDIDATES_PATH = DATA_DIR / "candidates.json"
CAPTURE_PATH = DATA_DIR / "pi_requests.json"
# The policy as `python -m swe_grpo.demo.warm_start ship` built it: a fresh machine's demo skips the build.
SHIPPED_DIR = DATA_DIR / "policy"
CLOSING_TEXT = "Done."
METADATA_FILE = "warm_start.json"
# Tool-call ids are random per run; no chat template renders them. Stored canonical so a capture is
# reproducible.
_CALL_ID = "call_0"


class WarmStartError(RuntimeError):
    """The capture or the fine-tuned policy is not what the demo needs (the message says what)."""


# --------------------------------------------------------------------------- candidates and messages


@dataclass(frozen=True)
class Candidate:
    """One first-turn action: a `bash` command, and whether it resolves its task."""

    command: str
    resolves: bool


def load_candidates(path: Path = CANDIDATES_PATH) -> dict[str, list[Candidate]]:
    """Candidates per task instance id, in file order."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {task: [Candidate(c["command"], bool(c["resolves"])) for c in cands] for task, cands in raw.items()}


def action_message(command: str) -> Message:
    """The assistant turn that calls Pi's `bash` tool with `command` (normalised form)."""
    call = {"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


CLOSING_MESSAGE: Message = {"role": "assistant", "content": CLOSING_TEXT}


def completion_ids(template: TrainingTemplate, message: Message) -> list[int]:
    """The ids a model emits for the assistant `message`: the training template's own rendering of the
    turn after the generation prompt, through the EOS token."""
    user = {"role": "user", "content": "."}
    prompt = template.render([user], generation_prompt=True)
    full = template.render([user, message])
    if not full.startswith(prompt):
        raise WarmStartError("the template writes the generation prompt differently from an assistant turn")
    end = full.rfind(template.eos_token) + len(template.eos_token)
    return template.encode(full[len(prompt) : end])


# --------------------------------------------------------------------------- capturing Pi's requests


class ScriptedGenerator:
    """A SCRIPTED generation backend (no model): request k is answered with `outputs[k]`, requests past the
    script with the last one (a caller that needs an exact count checks `requests`). For driving the real
    Pi where a model cannot be trusted to act: capturing its requests here, pinning their shapes in tests."""

    max_model_len = 32768

    def __init__(self, outputs: list[list[int]]):
        self.outputs = outputs
        self.requests = 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, model: str | None = None) -> Generation:
        ids = self.outputs[min(self.requests, len(self.outputs) - 1)]
        self.requests += 1
        return Generation(list(ids), [0.0] * len(ids), "stop", model or "")


@dataclass
class CapturedRequests:
    """The chat requests an agent sent, as they left it: each one's headers (names lower-cased) and JSON body."""

    url: str = ""
    requests: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.requests]


@contextlib.asynccontextmanager
async def recording_hop(target: str) -> AsyncIterator[CapturedRequests]:
    """A loopback HTTP hop in front of `target` (a base URL) that forwards every request unchanged and keeps
    each chat request's headers and body."""
    captured = CapturedRequests()
    async with ClientSession() as http:

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            if request.path.endswith("/chat/completions"):
                captured.requests.append(({k.lower(): v for k, v in request.headers.items()}, orjson.loads(body)))
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
            async with http.request(request.method, target + request.path_qs, data=body, headers=headers) as r:
                reply = await r.read()
                return web.Response(body=reply, status=r.status, headers={"Content-Type": r.content_type})

        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            captured.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            yield captured
        finally:
            await runner.cleanup()


@dataclass
class PiRun:
    """One run of the real Pi with SCRIPTED model turns: how Pi ended, the InterceptionServer's record of
    the rollout, every chat request Pi sent (headers and body), the rollout's token, the diff Pi left
    against the base commit, and the output of each `after` command."""

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
    """The real Pi of `bundle` in a fresh sandbox of `backend`, on `task`, its model turns SCRIPTED to
    `replies` (assistant messages in normalised form, see `ScriptedGenerator`), behind the
    InterceptionServer and a `recording_hop`. `after`: shell commands run in the sandbox once Pi has
    exited, with the rollout's token in `$TOKEN`. The sandbox is gone when this returns."""
    from swe_grpo.agents.base import AgentConfig
    from swe_grpo.agents.pi import run_pi
    from swe_grpo.serving.interception import InterceptionServer

    template = TrainingTemplate(tokenizer)
    generator = ScriptedGenerator([completion_ids(template, reply) for reply in replies])
    config = AgentConfig(context_window=generator.max_model_len, max_tokens=256, timeout_s=120, stall_timeout_s=60)
    async with InterceptionServer(generator, tokenizer) as server, recording_hop(server.public_base_url) as hop:
        endpoint = server.open_rollout()
        try:
            proxied = replace(endpoint, base_url=hop.url + endpoint.base_url.removeprefix(server.public_base_url))
            async with await backend.create(task, mounts=[bundle.mount()]) as sandbox:
                result = await run_pi(
                    sandbox,
                    bundle,
                    proxied,
                    task.problem_statement,
                    config,
                    lambda: server.last_activity(endpoint.rollout_id),
                )
                patch = await sandbox.diff(task.base_commit)
                outputs = {}
                for command in after:
                    done = await sandbox.exec(command, timeout_s=60, env={"TOKEN": endpoint.token})
                    outputs[command] = done.stdout + done.stderr
        finally:
            record = server.close_rollout(endpoint.rollout_id)
    return PiRun(result, record, hop, endpoint.token, patch, outputs)


async def _capture_one(
    task: Task,
    candidate: Candidate,
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    bundle: PiBundle,
) -> tuple[list[dict[str, Any]], str]:
    """Run Pi on `task` with the first turn scripted to `candidate` and the second to the closing
    message; grade its diff. Returns Pi's chat requests and the grading outcome."""
    from swe_grpo.grading import grade

    run = await capture_pi_run(bundle, tokenizer, backend, task, [action_message(candidate.command), CLOSING_MESSAGE])
    bodies, pi, turns = run.captured.bodies, run.result, [t.kind for t in run.record.turns]
    if pi.exit_code != 0 or len(bodies) != 2 or turns != ["clean", "clean"]:
        raise WarmStartError(
            f"{task.instance_id} / {candidate.command!r}: expected Pi to exit 0 after two clean turns; exit "
            f"{pi.exit_code}, {len(bodies)} requests, turns {turns}; stderr: {pi.stderr_tail[-500:]}"
        )
    result = await grade(task, run.patch, backend)
    return bodies, result.outcome


def _canonical_ids(messages: list[Message]) -> list[Message]:
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [{**call, "id": _CALL_ID} for call in message["tool_calls"]]
        if "tool_call_id" in message:
            message["tool_call_id"] = _CALL_ID
        out.append(message)
    return out


async def capture_pi_requests(
    tokenizer: PreTrainedTokenizerBase,
    backend: SandboxBackend,
    bundle: PiBundle,
    tasks: Sequence[Task] | None = None,
    candidates: dict[str, list[Candidate]] | None = None,
    concurrency: int = 2,
) -> dict[str, Any]:
    """Pi's real requests for every demo task and candidate, in the form `pi_requests.json` stores.

    Per task and candidate, Pi runs in a fresh sandbox of `backend` (at most `concurrency` at a time)
    with its first turn scripted to the candidate's tool call and its second to the closing message;
    each diff is graded, and a candidate whose outcome contradicts its `resolves` flag raises
    WarmStartError. Checked too: Pi makes exactly two requests, the second extends the first by the
    assistant turn and the tool result, the tools and the first request are the same for every
    candidate of a task. Tool-call ids are made canonical (they are random and never rendered).
    `tokenizer` only scripts the replies; the capture does not depend on it.
    """
    from swe_grpo.demo.tasks import demo_tasks

    tasks = list(tasks or demo_tasks())
    candidates = candidates or load_candidates()
    limit = asyncio.Semaphore(concurrency)

    async def capture(task: Task, candidate: Candidate) -> tuple[list[dict[str, Any]], str]:
        async with limit:
            return await _capture_one(task, candidate, tokenizer, backend, bundle)

    async with asyncio.TaskGroup() as group:
        runs = [[group.create_task(capture(t, c)) for c in candidates[t.instance_id]] for t in tasks]
    tools = runs[0][0].result()[0][0]["tools"]
    captured = []
    for task, task_runs in zip(tasks, runs, strict=True):
        first: list[Message] | None = None
        entries = []
        for candidate, run in zip(candidates[task.instance_id], task_runs, strict=True):
            bodies, outcome = run.result()
            where = f"{task.instance_id} / {candidate.command!r}"
            if outcome != ("resolved" if candidate.resolves else "unresolved"):
                raise WarmStartError(f"{where}: graded {outcome}, but the candidate says resolves={candidate.resolves}")
            turn1, turn2 = bodies[0]["messages"], bodies[1]["messages"]
            if any(b["tools"] != tools for b in bodies) or turn2[: len(turn1)] != turn1 or len(turn2) != len(turn1) + 2:
                raise WarmStartError(f"{where}: Pi's second request does not extend its first by two messages")
            if first is not None and turn1 != first:
                raise WarmStartError(f"{where}: Pi's first request differs between candidates of one task")
            first = first or turn1
            entries.append({**asdict(candidate), "outcome": outcome, "then": _canonical_ids(turn2[len(turn1) :])})
        captured.append({"instance_id": task.instance_id, "messages": first, "candidates": entries})
    return {"pi_version": bundle.version, "tools": tools, "tasks": captured}


def load_capture(path: Path = CAPTURE_PATH) -> dict[str, Any]:
    """A capture as `capture_pi_requests` returns it (default: the shipped one)."""
    return json.loads(path.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- token sequences


@dataclass(frozen=True)
class Episode:
    """One two-turn conversation as a rollout's TokenChain holds it: `prompt_ids` (Pi's first request),
    `action_ids` (the candidate's tool call, generated, ends with EOS), `tool_ids` (the tool result and
    the next generation prompt), `closing_ids` (CLOSING_TEXT, generated, ends with EOS)."""

    instance_id: str
    command: str
    resolves: bool
    prompt_ids: list[int]
    action_ids: list[int]
    tool_ids: list[int]
    closing_ids: list[int]

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.action_ids + self.tool_ids + self.closing_ids

    @property
    def completion_mask(self) -> list[int]:
        lengths = (len(self.prompt_ids), len(self.action_ids), len(self.tool_ids), len(self.closing_ids))
        return [0] * lengths[0] + [1] * lengths[1] + [0] * lengths[2] + [1] * lengths[3]


class EpisodeBuilder:
    """Replays a capture through a TokenChain and ResponseParser, as the InterceptionServer would serve
    it: `episodes` holds every (task, candidate) conversation, in capture order."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, capture: dict[str, Any]):
        self.template = TrainingTemplate(tokenizer)
        self.parser = ResponseParser(tokenizer)
        self.capture = capture
        self.closing_ids = completion_ids(self.template, CLOSING_MESSAGE)
        self.episodes = self._replay()

    @property
    def instance_ids(self) -> list[str]:
        return [task["instance_id"] for task in self.capture["tasks"]]

    def _replay(self) -> list[Episode]:
        """Each conversation replayed turn by turn through a fresh TokenChain. Raises WarmStartError when
        the replay does not go as a rollout's would: the action not parsed back to the candidate's call,
        or the second turn forking the chain."""
        tools = self.capture["tools"]
        out = []
        for task in self.capture["tasks"]:
            for candidate in task["candidates"]:
                chain = TokenChain(self.template)
                first = chain.prepare(task["messages"], tools)
                action = completion_ids(self.template, action_message(candidate["command"]))
                parsed = self.parser.parse(action, first.prompt_ids, "stop", tools)
                if _bash_command(parsed.message) != candidate["command"]:
                    raise WarmStartError(f"the scripted action {candidate['command']!r} does not parse back to it")
                chain.commit(first, action, [0.0] * len(action), 0, parsed.message, parsed.finish_reason)
                second = chain.prepare(task["messages"] + candidate["then"], tools)
                if second.fork:
                    raise WarmStartError(f"replaying {candidate['command']!r}: the second turn forks the chain")
                out.append(
                    Episode(
                        task["instance_id"],
                        candidate["command"],
                        candidate["resolves"],
                        first.prompt_ids,
                        action,
                        second.new_ids,
                        self.closing_ids,
                    )
                )
        return out


def _bash_command(message: dict[str, Any]) -> str | None:
    """The command of `message` when it is exactly one `bash` call with only a command; else None."""
    calls = message.get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] != "bash":
        return None
    try:
        arguments = json.loads(calls[0]["function"]["arguments"])
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict) or set(arguments) != {"command"} or not isinstance(arguments["command"], str):
        return None
    return arguments["command"]


# --------------------------------------------------------------------------- fine-tuning


@dataclass(frozen=True)
class WarmStartSpec:
    """How to fine-tune. Every field is part of the cache key."""

    steps: int = 250  # 150 left ~5 % of first turns invalid; the loss is flat from ~125 on
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.05  # cosine decay from the peak down to this fraction of it
    max_grad_norm: float = 1.0
    seed: int = 0  # of the evaluation's sampling (fine-tuning itself draws nothing)
    # The build refuses a policy below these rates, measured at temperature 1 after fine-tuning. They
    # guard against a broken build: below the ~99.5 % a good one reaches, with room for sampling noise.
    eval_samples: int = 48  # per task
    min_valid_rate: float = 0.97
    min_closed_rate: float = 0.97


def _common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    for i, token in enumerate(first):
        if any(len(s) <= i or s[i] != token for s in sequences[1:]):
            return i
    return len(first)


def _prefix_cache(model: Any, prefix: list[int], copies: int) -> Any:
    """The key/value cache of `prefix` (forwarded once, gradients kept), repeated for `copies` rows."""
    import torch

    cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(copies)
    return cache


def _padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` right-padded with `pad` into one tensor, and the mask of the real entries."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        real[i, : len(row)] = 1
    return ids, real


def completion_loss(model: Any, episodes: Sequence[Episode], pad_token_id: int) -> torch.Tensor:
    """Mean cross-entropy of every completion token (both turns) of `episodes` under `model`, a Hugging
    Face Qwen-style causal LM (`.model`, `.lm_head`). Equal to forwarding each episode on its own, but
    cheap: the prefix all prompts share is forwarded once, each distinct prompt's remainder once, and
    only the turns after it once per episode, each level reusing the key/value cache of the one before."""
    import torch
    import torch.nn.functional as F

    prompts = list(dict.fromkeys(tuple(e.prompt_ids) for e in episodes))
    # The last prompt token goes with the turns: then every trained token is predicted from that level.
    shared = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
    cache = _prefix_cache(model, list(prompts[0][:shared]), len(prompts))
    # Each distinct prompt's remainder, right-padded; the padding stays in the cache, masked out.
    rests, rests_real = _padded([p[shared:-1] for p in prompts], pad_token_id)
    if rests.shape[1]:
        positions = shared + torch.arange(rests.shape[1]).expand(len(prompts), -1)
        mask = torch.cat([torch.ones(len(prompts), shared, dtype=torch.long), rests_real], dim=1)
        model.model(input_ids=rests, past_key_values=cache, position_ids=positions, attention_mask=mask)
    rows = [prompts.index(tuple(e.prompt_ids)) for e in episodes]
    cache.batch_select_indices(torch.tensor(rows))
    turns, turns_real = _padded([e.input_ids[len(e.prompt_ids) - 1 :] for e in episodes], pad_token_id)
    trained, _ = _padded([e.completion_mask[len(e.prompt_ids) - 1 :] for e in episodes], 0)
    starts = torch.tensor([len(e.prompt_ids) - 1 for e in episodes])
    positions = starts[:, None] + torch.arange(turns.shape[1])
    mask = torch.cat([torch.ones(len(episodes), shared, dtype=torch.long), rests_real[rows], turns_real], dim=1)
    hidden = model.model(input_ids=turns, past_key_values=cache, position_ids=positions, attention_mask=mask)
    predicts = trained[:, 1:].bool()
    logits = model.lm_head(hidden.last_hidden_state[:, :-1][predicts])
    return F.cross_entropy(logits.float(), turns[:, 1:][predicts])


Progress = Callable[[int, int, str], None]
"""`progress(done, total, detail)`: how far a build is, in steps (fine-tuning steps, then one per evaluated task)."""


def _fine_tune(
    model: Any, builder: EpisodeBuilder, spec: WarmStartSpec, pad_token_id: int, progress: Progress
) -> list[float]:
    """Fine-tune `model` in place; returns the loss of every step."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return spec.final_lr_fraction + (1 - spec.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    total = spec.steps + len(builder.instance_ids)
    model.train()
    losses = []
    for step in range(spec.steps):
        loss = completion_loss(model, builder.episodes, pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        progress(step + 1, total, f"fine-tuning, loss {losses[-1]:.3f}")
        if step % 50 == 0 or step == spec.steps - 1:
            log.info("warm start: step %d/%d loss %.4f", step + 1, spec.steps, losses[-1])
    model.eval()
    return losses


# --------------------------------------------------------------------------- sampling and evaluation


def sample(
    model: Any,
    prompt_ids: list[int],
    n: int,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> list[list[int]]:
    """`n` completions of `prompt_ids` sampled from `model` (a Hugging Face causal LM) at `temperature`
    with nothing else changing the distribution (no top-p/top-k), as vLLM samples for a rollout. Each
    ends at its first EOS token (included) or after `max_new_tokens`."""
    import torch

    with torch.no_grad():
        cache = _prefix_cache(model, prompt_ids[:-1], n)
        last = torch.full((n, 1), prompt_ids[-1])
        outputs: list[list[int]] = [[] for _ in range(n)]
        open_rows = set(range(n))
        for step in range(max_new_tokens):
            position = torch.full((n, 1), len(prompt_ids) - 1 + step)
            hidden = model.model(input_ids=last, past_key_values=cache, position_ids=position).last_hidden_state
            probs = torch.softmax(model.lm_head(hidden[:, -1]).float() / temperature, dim=-1)
            last = torch.multinomial(probs, 1, generator=generator)
            for row in list(open_rows):
                token = int(last[row, 0])
                outputs[row].append(token)
                if token == eos_token_id:
                    open_rows.discard(row)
            if not open_rows:
                break
    return outputs


@dataclass(frozen=True)
class TaskStats:
    """How a policy acts on one task at temperature 1. `valid`: first turns that are exactly one of the
    task's candidate calls, ended by EOS; `correct`: those that are the resolving candidate; `closed`:
    second turns (after each candidate's tool result) that are exactly CLOSING_TEXT, ended by EOS."""

    instance_id: str
    samples: int
    valid: int
    correct: int
    closings: int
    closed: int

    @property
    def valid_rate(self) -> float:
        return self.valid / self.samples

    @property
    def correct_rate(self) -> float:
        return self.correct / self.samples

    @property
    def closed_rate(self) -> float:
        return self.closed / self.closings

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "valid_rate": round(self.valid_rate, 4),
            "correct_rate": round(self.correct_rate, 4),
            "closed_rate": round(self.closed_rate, 4),
        }


def evaluate_policy(
    model: Any,
    builder: EpisodeBuilder,
    *,
    samples_per_task: int = 64,
    seed: int = 0,
    on_task: Callable[[int, TaskStats], None] | None = None,
) -> list[TaskStats]:
    """Sample `model` at temperature 1 on every captured task's first prompt and on every candidate's
    second prompt; count what it does (see TaskStats). `on_task(k, stats)` sees the k-th task's stats as
    they come."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    eos = builder.template.eos_token_id
    tools = builder.capture["tools"]
    episodes = builder.episodes
    stats = []
    for instance_id in builder.instance_ids:
        mine = [e for e in episodes if e.instance_id == instance_id]
        resolving = {e.command for e in mine if e.resolves}
        prompt = mine[0].prompt_ids
        longest = max(len(e.action_ids) for e in mine)
        valid = correct = 0
        for ids in sample(
            model, prompt, samples_per_task, max_new_tokens=2 * longest, eos_token_id=eos, generator=generator
        ):
            command = _bash_command(builder.parser.parse(ids, prompt, "stop", tools).message)
            if ids[-1] == eos and command in {e.command for e in mine}:
                valid += 1
                correct += command in resolving
        per_candidate = math.ceil(samples_per_task / len(mine))
        closed = 0
        for e in mine:
            second = e.prompt_ids + e.action_ids + e.tool_ids
            for ids in sample(
                model,
                second,
                per_candidate,
                max_new_tokens=4 * len(e.closing_ids),
                eos_token_id=eos,
                generator=generator,
            ):
                message = builder.parser.parse(ids, second, "stop", tools).message
                closed += ids[-1] == eos and not message.get("tool_calls") and message["content"] == CLOSING_TEXT
        stats.append(TaskStats(instance_id, samples_per_task, valid, correct, per_candidate * len(mine), closed))
        if on_task is not None:
            on_task(len(stats), stats[-1])
    return stats


# --------------------------------------------------------------------------- the cached build


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside, as many as before after. For work beside other busy processes (the
    demo's vLLM and agents, a test run, other users): oversubscribed OpenMP threads spin-wait on each
    other. Measured on 2 cores: under a load of ~20, 25 fine-tuning steps took 50 s on one thread and
    over 14 min on two; beside six busy processes the trainer's forward+backward 2.1 s on one, 9.2 s on two."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _cache_key(spec: WarmStartSpec, tiny_model_dir: Path, capture_path: Path) -> str:
    import transformers

    h = hashlib.sha256(f"{BUILDER_VERSION}/{transformers.__version__}".encode())
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    for path in sorted(p for p in tiny_model_dir.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(capture_path.read_bytes())
    return h.hexdigest()[:16]


def build_warm_policy(
    spec: WarmStartSpec = WarmStartSpec(),
    *,
    tiny_model_dir: Path | None = None,
    capture_path: Path = CAPTURE_PATH,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    shipped: Path | None = SHIPPED_DIR,
) -> Path:
    """Build (or reuse) the warm-started policy; returns its directory: the `shipped` one when it is what
    this build would make (the same cache key), else the cached build, else a new build. `progress`
    sees how far a build is (see `Progress`), and nothing when the policy is reused.

    The directory is a Hugging Face checkpoint of the tiny model (default: `build_tiny_model()`) with
    the same tokenizer and chat template, fine-tuned as the module docstring says; vLLM and transformers
    load it like the tiny model. `warm_start.json` in it records the spec, the loss curve's ends, the
    build time and the rates measured at temperature 1 after fine-tuning (see `evaluate_policy`). A
    policy whose valid-call or closing rate falls below the spec's minimum is not cached: WarmStartError.
    The cache key covers the tiny model's files, the capture, the spec and BUILDER_VERSION. Safe to call
    from several processes at once: one builds, the others wait for it and reuse the result.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_model_dir = Path(tiny_model_dir) if tiny_model_dir else build_tiny_model()
    root = Path(cache_dir) if cache_dir else cache_root()
    key = _cache_key(spec, tiny_model_dir, capture_path)
    if shipped is not None and _metadata(shipped).get("key") == key:
        return shipped
    target = root / f"warm-{key}"
    if (target / METADATA_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".warm-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build takes minutes: wait for another process's instead
        if (target / METADATA_FILE).is_file():
            return target
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        capture = load_capture(capture_path)
        builder = EpisodeBuilder(tokenizer, capture)
        progress = progress or (lambda done, total, detail: None)
        total = spec.steps + len(builder.instance_ids)
        with one_torch_thread():
            losses = _fine_tune(model, builder, spec, tokenizer.pad_token_id, progress)
            trained_s = time.monotonic() - started
            stats = evaluate_policy(
                model,
                builder,
                samples_per_task=spec.eval_samples,
                seed=spec.seed,
                on_task=lambda k, s: progress(spec.steps + k, total, f"evaluated {s.instance_id}"),
            )
        valid = sum(s.valid for s in stats) / sum(s.samples for s in stats)
        closed = sum(s.closed for s in stats) / sum(s.closings for s in stats)
        summaries = [s.summary() for s in stats]
        if valid < spec.min_valid_rate or closed < spec.min_closed_rate:
            raise WarmStartError(f"the fine-tuned policy is too weak to start RL from: {summaries}")
        metadata = {
            "builder_version": BUILDER_VERSION,
            "key": key,
            "spec": asdict(spec),
            "tiny_model": str(tiny_model_dir),
            "pi_version": capture["pi_version"],
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "train_s": round(trained_s, 1),
            "build_s": round(time.monotonic() - started, 1),
            "eval": {"valid_rate": valid, "closed_rate": closed, "tasks": summaries},
        }
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        staging.chmod(0o755)  # sandboxed agents and servers running as other users read it
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            # Written last: its presence is what marks a finished build.
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("warm start built in %.0f s: %s", metadata["build_s"], target)
    return target


def _metadata(policy: Path) -> dict[str, Any]:
    """A built policy's `warm_start.json`, or {} where there is none."""
    path = policy / METADATA_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def ship(target: Path = SHIPPED_DIR) -> Path:
    """Build the policy from the repository (or take the cached build: never the shipped one) and put
    its files in `target`, replacing what was there."""
    built = build_warm_policy(shipped=None)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in sorted(built.iterdir()):
        shutil.copyfile(path, target / path.name)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m swe_grpo.demo.warm_start build` prints the policy's directory and its measured rates;
    `... ship` rebuilds the shipped policy (`SHIPPED_DIR`) from the repository; `... capture` re-captures
    Pi's requests into the shipped file (needs root, bubblewrap and Pi, as the `local` sandbox does)."""
    parser = argparse.ArgumentParser(prog="python -m swe_grpo.demo.warm_start")
    parser.add_argument("command", choices=["build", "ship", "capture"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command in ("build", "ship"):
        path = build_warm_policy() if args.command == "build" else ship()
        print(path)
        print((path / METADATA_FILE).read_text())
        return 0

    async def capture() -> dict[str, Any]:
        from transformers import AutoTokenizer

        from swe_grpo.agents.pi import PiBundle
        from swe_grpo.sandbox.local import LocalBackend

        backend = LocalBackend()
        await backend.start()
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
        return await capture_pi_requests(tokenizer, backend, PiBundle.default())

    CAPTURE_PATH.write_text(json.dumps(asyncio.run(capture()), indent=1, ensure_ascii=False) + "\n")
    print(CAPTURE_PATH)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
