"""Shared by the benchmarks: a simulated Pi agent, a stub generator, and report helpers.

`PiConversation` builds the requests Pi (`@mariozechner/pi-coding-agent`, `openai-completions` provider)
sends: its system prompt, the task as text parts, the tools `read`/`bash`/`edit`/`write`, `stream: true`
with usage, the whole history every turn. It reads the SSE answer as Pi does, echoes the assistant
message back (arguments re-serialised like JS `JSON.stringify`, empty content as `null`) and appends one
`tool` result per call, cut from Python standard-library sources so it tokenises like code. Pi's wire is
a `ClientWire` (`CHAT`); `_agent_dialects.py` has Codex's (Responses) and Claude Code's (Messages), for the
same conversation in their shapes. `StubGenerator` answers with the fixed token ids of a valid
tool-call answer as the family's template writes it (`FAMILIES`: Qwen3 by default, gpt-oss harmony, GLM);
`server_process` runs a benchmark's server in a process of its own. `TOOL_OUTPUTS` says how
much new content each turn brings: how many tool calls the stub's answer makes, and how long each result is.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import sysconfig
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import orjson
from transformers import PreTrainedTokenizerBase

from swe_grpo.extras.tiny_model import TinyModelSpec, build_tiny_model
from swe_grpo.serving.vllm_client import Generation, SamplingParams
from swe_grpo.tokens.chain import TrainingTemplate

if TYPE_CHECKING:
    from swe_grpo.types import RolloutEndpoint

# --------------------------------------------------------------------------- the request Pi sends

SYSTEM_PROMPT = (
    "You are an expert coding assistant operating inside pi, a coding agent harness. You help users by "
    "reading files, executing commands, editing code, and writing new files.\n\n"
    "Available tools:\n"
    "- read: Read file contents\n"
    "- bash: Execute bash commands (ls, grep, find, etc.)\n"
    "- edit: Make surgical edits to files (find exact text and replace)\n"
    "- write: Create or overwrite files\n\n"
    "In addition to the tools above, you may have access to other custom tools depending on the "
    "project.\n\n"
    "Guidelines:\n"
    "- Use bash for file operations like ls, rg, find\n"
    "- Use read to examine files before editing. You must use this tool instead of cat or sed.\n"
    "- Use edit for precise changes (old text must match exactly)\n"
    "- Use write only for new files or complete rewrites\n"
    "- When summarizing your actions, output plain text directly - do NOT use cat or bash to display "
    "what you did\n"
    "- Be concise in your responses\n"
    "- Show file paths clearly when working with files\n\n"
    "Pi documentation (read only when the user asks about pi itself, its SDK, extensions, themes, "
    "skills, or TUI):\n"
    "- Main documentation: /opt/pi/node_modules/@mariozechner/pi-coding-agent/README.md\n"
    "- Additional docs: /opt/pi/node_modules/@mariozechner/pi-coding-agent/docs\n"
    "- Examples: /opt/pi/node_modules/@mariozechner/pi-coding-agent/examples (extensions, custom "
    "tools, SDK)\n"
    "- When asked to create: custom models/providers (README.md), extensions (docs/extensions.md, "
    "examples/extensions/), themes (docs/themes.md), skills (docs/skills.md), prompt templates "
    "(docs/prompt-templates.md), TUI components (docs/tui.md), keybindings (docs/keybindings.md), SDK "
    "integrations (docs/sdk.md), custom providers (docs/custom-provider.md), adding models "
    "(docs/models.md), pi packages (docs/packages.md)\n"
    "- When working on pi topics, read the docs and examples, and follow .md cross-references before "
    "implementing\n"
    "- Always read pi .md files completely and follow links to related docs (e.g., tui.md for TUI API "
    "details)\n\n"
    "Working in this repository:\n"
    "- The repository is checked out at /testbed. Do not leave it.\n"
    "- Run the test suite with `python -m pytest -x -q` before you finish, and fix what fails.\n"
    "- Keep changes minimal and focused on the task; do not reformat unrelated code.\n"
    "- Do not modify the tests unless the task asks you to.\n"
    "- When you are done, reply with a short summary of the change and stop calling tools.\n"
    "Current date and time: Tuesday, March 3, 2026 at 09:41:17 AM UTC\n"
    "Current working directory: /testbed"
)

USER_TASK = (
    "The function `parse_duration` in `src/timeutil/parse.py` rejects inputs such as `1h30m` and "
    "`90s` that the documentation says are valid, and it silently accepts negative durations. Fix the "
    "parser so that every format listed in `docs/durations.md` is accepted, negative durations raise "
    "`ValueError`, and the existing behaviour for plain integers (seconds) is unchanged. Add tests for "
    "the new cases in `tests/test_parse.py`. Run the test suite before you finish."
)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required},
            "strict": False,
        },
    }


TOOLS: list[dict[str, Any]] = [
    _tool(
        "read",
        "Read the contents of a file. Supports text files and images (jpg, png, gif, webp). For text "
        "files, output is truncated to 2000 lines or 50KB (whichever is hit first). Use offset/limit "
        "for large files.",
        {
            "path": {"type": "string", "description": "Path to the file to read (relative or absolute)"},
            "offset": {"type": "number", "description": "Line number to start reading from (1-indexed)"},
            "limit": {"type": "number", "description": "Maximum number of lines to read"},
        },
        ["path"],
    ),
    _tool(
        "bash",
        "Execute a bash command in the current working directory. Returns stdout and stderr. Output is "
        "truncated to last 2000 lines or 50KB (whichever is hit first).",
        {
            "command": {"type": "string", "description": "Bash command to execute"},
            "timeout": {"type": "number", "description": "Timeout in seconds (optional, no default timeout)"},
        },
        ["command"],
    ),
    _tool(
        "edit",
        "Edit a file by replacing exact text. The oldText must match exactly (including whitespace). "
        "Use this for precise, surgical edits.",
        {
            "path": {"type": "string", "description": "Path to the file to edit (relative or absolute)"},
            "oldText": {
                "type": "string",
                "description": "Exact text to find and replace (must match exactly)",
            },
            "newText": {"type": "string", "description": "New text to replace the old text with"},
        },
        ["path", "oldText", "newText"],
    ),
    _tool(
        "write",
        "Write content to a file. Creates the file if it doesn't exist, overwrites if it does. "
        "Automatically creates parent directories.",
        {
            "path": {"type": "string", "description": "Path to the file to write (relative or absolute)"},
            "content": {"type": "string", "description": "Content to write to the file"},
        },
        ["path", "content"],
    ),
]

# --------------------------------------------------------------------------- how much each turn brings


@dataclass(frozen=True)
class ToolOutput:
    """New content per turn: the stub's answer makes `calls` tool calls, each result `chars` characters."""

    name: str
    calls: int
    chars: tuple[int, int]
    note: str


TOOL_OUTPUTS = {
    "small": ToolOutput("small", 1, (200, 600), "1 tool result of 200-600 chars per turn (ls, grep, a short command)"),
    "large": ToolOutput("large", 2, (300, 2000), "2 tool results of 300-2000 chars per turn (file reads, test runs)"),
}

# --------------------------------------------------------------------------- the stub model

# The model families the benchmarks serve: name -> the TRL chat template of its tiny model.
FAMILIES = {"qwen": "qwen3", "harmony": "gptoss", "glm": "glm4moe"}


def _call(index: int, name: str, arguments: dict[str, str]) -> dict[str, Any]:
    return {"id": f"call_{index}", "type": "function", "function": {"name": name, "arguments": arguments}}


# The stub's answers in thinking mode: one call, and two calls in one answer. Harmony ends a generation at its first
# call (`<|call|>`), so under it the two-call answer is its first call only.
_STUB_REPLIES = {
    1: {
        "role": "assistant",
        "reasoning_content": "I should look at the repository layout before changing anything.",
        "content": "",
        "tool_calls": [_call(0, "bash", {"command": "ls"})],
    },
    2: {
        "role": "assistant",
        "reasoning_content": "The parser lives in src/timeutil/parse.py; read it and find its callers.",
        "content": "",
        "tool_calls": [
            _call(0, "read", {"path": "src/timeutil/parse.py"}),
            _call(1, "bash", {"command": "grep -rn parse_duration src tests"}),
        ],
    },
}


def load_tokenizer(family: str = "qwen") -> PreTrainedTokenizerBase:
    """The tiny tokenizer of a family of `FAMILIES` (built once, then cached under `$SWE_GRPO_CACHE`). Loading it
    loads torch (through `AutoTokenizer` and the model's build): a process that must serve as a torch-free rollout
    host does, gets it pickled (as hosts get theirs)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tiny_model(TinyModelSpec(chat_template=FAMILIES[family])))


class StubGenerator:
    """A `Generator` that answers after `latency_s` (0: at once) with the fixed token ids of an answer making
    `calls` tool calls (1 or 2), as the tokenizer's chat template writes it (`TrainingTemplate.reply_text`)."""

    max_model_len = 262144

    def __init__(self, tokenizer: PreTrainedTokenizerBase, calls: int, latency_s: float = 0.0):
        template = TrainingTemplate(tokenizer)
        self.ids = template.encode(template.reply_text(_STUB_REPLIES[calls]))
        self.latency_s = latency_s

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams, model: str | None = None) -> Generation:
        if self.latency_s > 0:
            await asyncio.sleep(self.latency_s)
        return Generation(list(self.ids), [-0.5] * len(self.ids), "stop", model or "stub")


# --------------------------------------------------------------------------- tool results


def _source_corpus() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "difflib.py", "pathlib.py", "subprocess.py", "textwrap.py", "unittest/case.py"]
    return "\n".join((stdlib / n).read_text(encoding="utf-8") for n in names if (stdlib / n).is_file())


_CORPUS = _source_corpus()


def tool_output(rng: random.Random, name: str, chars: tuple[int, int]) -> str:
    """One tool result: a file excerpt (`read`), or grep hits, a failing pytest run or `ls -la` (`bash`)."""
    size = rng.randint(*chars)
    start = _CORPUS.find("\n", rng.randrange(0, len(_CORPUS) - 8000)) + 1
    excerpt = _CORPUS[start : start + 2 * size]
    kind = "read" if name == "read" else rng.choice(["grep", "pytest", "ls"])
    if kind == "read":
        text = excerpt
    elif kind == "grep":
        lines = excerpt.splitlines()
        text = "\n".join(f"src/timeutil/parse.py:{start // 40 + i}:{line}" for i, line in enumerate(lines))
    elif kind == "pytest":
        text = (
            "============================= test session starts ==============================\n"
            "collected 42 items\n\ntests/test_parse.py ....F.....\n\n"
            "=================================== FAILURES ===================================\n" + excerpt
        )
    else:
        names = [w for w in excerpt.split() if w.isidentifier()]
        text = "\n".join(
            f"-rw-r--r-- 1 root root {rng.randint(100, 60000):6d} Mar  3 09:{i % 60:02d} {n}.py"
            for i, n in enumerate(names)
        )
    cut = text.rfind("\n", 0, size)
    return text[: cut if cut > size // 2 else size]


# --------------------------------------------------------------------------- the agent


@dataclass
class Answer:
    """What one SSE response carried, as the agent accumulates it: `tool_calls` each `{id, name, arguments}`
    (arguments as JSON text), `usage` with `prompt_tokens` whatever the dialect calls it, `echo` the output items
    or content blocks a Responses or Messages client keeps to send back."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    echo: list[dict[str, Any]] = field(default_factory=list)


def parse_sse(payload: bytes) -> Answer:
    """Accumulate an OpenAI chat-completion SSE stream the way Pi's openai-completions provider does."""
    answer = Answer()
    calls: dict[int, dict[str, Any]] = {}
    for event in payload.decode("utf-8").split("\n\n"):
        if not event.startswith("data: ") or event == "data: [DONE]":
            continue
        chunk = orjson.loads(event[len("data: ") :])
        answer.usage = chunk.get("usage") or answer.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            answer.content += delta.get("content") or ""
            answer.reasoning += delta.get("reasoning_content") or delta.get("reasoning") or ""
            for call in delta.get("tool_calls") or []:
                slot = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                fn = call.get("function") or {}
                slot["id"] = call.get("id") or slot["id"]
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
    answer.tool_calls = [calls[i] for i in sorted(calls)]
    return answer


class ClientWire(Protocol):
    """How one agent CLI's requests and answers look: the dialect the server serves it in (`name`), its route
    under the rollout's base URL, its headers, and its body as `head` + the history's items joined by commas +
    `tail` (the history is sent whole every turn; each item is serialised once)."""

    name: str
    route: str
    tail: bytes

    def headers(self, token: str) -> dict[str, str]: ...

    def head(self, model: str) -> bytes:
        """The body up to its first history item."""
        ...

    def opening(self) -> list[dict[str, Any]]:
        """The history's first items: the system prompt (unless `head` carries it) and the task."""
        ...

    def parse(self, payload: bytes) -> Answer:
        """An answer's SSE stream, accumulated as the CLI does."""
        ...

    def turn(self, answer: Answer, results: list[str]) -> list[dict[str, Any]]:
        """The items the CLI appends after `answer`: the answer as it echoes it, then the result of each call."""
        ...


def request_tail(fields: dict[str, Any]) -> bytes:
    """What follows a request's history array: `],` and `fields` as the rest of the request's JSON object (written
    once: only the history changes from turn to turn)."""
    return b"]," + orjson.dumps(fields)[1:]


@dataclass(frozen=True)
class ChatClient:
    """Pi's wire (`openai-completions`): OpenAI chat completions."""

    name: str = "chat"
    route: str = "/chat/completions"
    tail: bytes = request_tail(
        {"tools": TOOLS, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4096}
    )

    def headers(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

    def head(self, model: str) -> bytes:
        return b'{"model":' + orjson.dumps(model) + b',"messages":['

    def opening(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "text", "text": USER_TASK}]},
        ]

    def parse(self, payload: bytes) -> Answer:
        return parse_sse(payload)

    def turn(self, answer: Answer, results: list[str]) -> list[dict[str, Any]]:
        """The assistant message (arguments re-serialised like JS `JSON.stringify`, empty content as `null`), then
        one `tool` message per call."""
        message: dict[str, Any] = {"role": "assistant", "content": answer.content or None}
        if answer.reasoning:
            message["reasoning_content"] = answer.reasoning
        message["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(
                        json.loads(call["arguments"] or "{}"), separators=(",", ":"), ensure_ascii=False
                    ),
                },
            }
            for call in answer.tool_calls
        ]
        calls = zip(answer.tool_calls, results, strict=True)
        return [message, *({"role": "tool", "tool_call_id": c["id"], "content": r} for c, r in calls)]


CHAT = ChatClient()


class PiConversation:
    """The history of one simulated Pi session, and the request body it sends each turn, on `wire` (Pi's own by
    default; another CLI's to send the same session in its dialect)."""

    def __init__(self, model: str, rng: random.Random, chars: tuple[int, int], wire: ClientWire = CHAT):
        self.model, self.rng, self.chars, self.wire = model, rng, chars, wire
        self.messages: list[dict[str, Any]] = wire.opening()  # the history's items, in the wire's shape
        # Each item is serialised once, when first sent (a sent item is never changed): the load
        # generator's cost must stay small beside the server's, or a benchmark measures the generator.
        self._sent: list[bytes] = []

    def body(self) -> bytes:
        """The JSON body of the next request: the whole history, as Pi re-sends it every turn."""
        self._sent += [orjson.dumps(m) for m in self.messages[len(self._sent) :]]
        return self.wire.head(self.model) + b",".join(self._sent) + self.wire.tail

    def absorb(self, answer: Answer) -> None:
        """Echo the answer back and run its tool calls (one result per call)."""
        if not answer.tool_calls:
            raise ValueError(f"expected tool calls, got finish_reason={answer.finish_reason!r}")
        results = [tool_output(self.rng, call["name"], self.chars) for call in answer.tool_calls]
        self.messages += self.wire.turn(answer, results)

    def copy(self, rng: random.Random) -> PiConversation:
        """Same history (items are shared, never mutated), its own RNG."""
        other = PiConversation(self.model, rng, self.chars, self.wire)
        other.messages = list(self.messages)
        other._sent = list(self._sent)
        return other


async def post(
    session: aiohttp.ClientSession, endpoint: RolloutEndpoint, body: bytes, wire: ClientWire = CHAT
) -> tuple[int, bytes, float]:
    """Send one request on `wire` (a chat completion by default); returns the status, the answer's bytes and the
    round-trip in seconds (from sending the serialised body to the last byte of the answer)."""
    t0 = time.perf_counter()
    async with session.post(endpoint.base_url + wire.route, data=body, headers=wire.headers(endpoint.token)) as resp:
        payload = await resp.read()
    return resp.status, payload, time.perf_counter() - t0


# --------------------------------------------------------------------------- the server's process


@dataclass
class ServerProcess:
    """A server running in a process of its own: `endpoints` is the first thing it sent. The protocol on
    `conn`: "report" asks for its report (sent back), "stop" ends it."""

    process: BaseProcess
    conn: Connection
    endpoints: list[RolloutEndpoint]

    def finish(self) -> Any:
        """The server's report, then stop it."""
        self.conn.send("report")
        report = self.conn.recv()
        self.conn.send("stop")
        return report


@asynccontextmanager
async def server_process(target: Callable[..., None], *args: Any) -> AsyncIterator[ServerProcess]:
    """Run `target(conn, *args)` in a spawned process until it has sent its endpoints (at most 120 s);
    the process is joined (killed after 10 s) on exit."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(child, *args), daemon=True)
    process.start()
    try:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        while not await loop.run_in_executor(None, parent.poll, 1.0):
            if not process.is_alive() or time.monotonic() - started > 120:
                raise RuntimeError(f"the server process did not start (exit code {process.exitcode})")
        yield ServerProcess(process, parent, parent.recv())
    finally:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()


# --------------------------------------------------------------------------- reporting


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics; NaN if empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
