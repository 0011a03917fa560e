"""Conversations in the exact request shape Pi sends (see PLATFORM.md), for driving the chain and the
server without a model that can act. The texts are our own; the SHAPE is Pi's: user content as a list
of text parts, the full history re-sent each turn, the assistant's tool-call `arguments` re-serialised
the way JavaScript's JSON.stringify does (no spaces), empty text sent as `content: null`, reasoning
echoed back under the field it came in, tool results as `{role: tool, tool_call_id, content}`.

`scripted_output` (`swe_grpo.testing.pi_capture.completion_ids`) gives the token ids a model would produce
for an assistant message under a template: these are SCRIPTED outputs (the template's own rendering), used
where a random tiny model cannot act.

And the real thing: `capture_pi_run` (`swe_grpo.testing.pi_capture`, the one the demo's warm start captures
its requests with) runs the real Pi of a bundle in a sandbox behind the InterceptionServer with SCRIPTED
model turns and records every request Pi sends (headers and body); `request_shapes` is what of them is
pinned per supported version in `tests/pi_requests/VERSION.json` (re-pin with `python tests/pi_shapes.py
VERSION...` and review the diff: it is what Pi changed).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from swe_grpo.agents.pi import PiBundle
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.tasks import Task
from swe_grpo.testing.pi_capture import PiRun, capture_pi_run, completion_ids

scripted_output = completion_ids  # the name the chain, parser and server tests script model output by

SYSTEM_PROMPT = (
    "You are a coding agent working in a git repository. You can read files, run shell commands, edit "
    "files and write new ones. Work step by step: inspect the code, reproduce the problem, make the "
    "smallest change that fixes it, and check the fix by running the tests. " * 12
)


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters, "strict": False},
    }


TOOLS = [
    _tool("read", "Read a file.", {"path": {"type": "string"}, "offset": {"type": "number"}}, ["path"]),
    _tool(
        "bash",
        "Run a shell command.",
        {"command": {"type": "string"}, "timeout": {"type": "number"}},
        ["command"],
    ),
    _tool(
        "edit",
        "Replace text in a file.",
        {"path": {"type": "string"}, "oldText": {"type": "string"}, "newText": {"type": "string"}},
        ["path", "oldText", "newText"],
    ),
    _tool(
        "write",
        "Write a file.",
        {"path": {"type": "string"}, "content": {"type": "string"}},
        ["path", "content"],
    ),
]


def js_stringify(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def echo_assistant(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message as Pi sends it back in the next request."""
    echoed: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("reasoning_content"):
        echoed["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        echoed["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": js_stringify(json.loads(call["function"]["arguments"])),
                },
            }
            for call in message["tool_calls"]
        ]
    return echoed


class PiConversation:
    """The growing history of one Pi session."""

    def __init__(self, task: str = "The test test_parse fails on empty input. Fix it.", max_tokens: int = 256):
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": [{"type": "text", "text": task}]},
        ]
        self.max_tokens = max_tokens

    def request(self, stream: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "policy",
            "messages": copy.deepcopy(self.messages),
            "tools": copy.deepcopy(TOOLS),
            "stream": stream,
            "max_tokens": self.max_tokens,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def add_reply(self, message: dict[str, Any], tool_outputs: list[str] | None = None) -> None:
        """Echo the assistant reply and answer each of its tool calls (outputs given, or a default)."""
        self.messages.append(echo_assistant(message))
        for i, call in enumerate(message.get("tool_calls") or []):
            output = tool_outputs[i] if tool_outputs else f"output of {call['function']['name']} #{i}\nline 2"
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})


def tool_call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


# --------------------------------------------------------------------------- pinned request shapes

PINNED_DIR = Path(__file__).resolve().parent / "pi_requests"
# What differs between machines or runs, never between Pi versions: the address, the body's length, the
# secret, the kernel release in Pi 0.74+'s User-Agent, 0.73.1's date line and the random tool-call ids.
_UNPINNED_HEADERS = {"host", "content-length", "authorization"}
_KERNEL = re.compile(r"^(pi \(linux )[^;]+(; x64\))$")
_DATE = re.compile(r"(?<=\nCurrent date: )\d{4}-\d{2}-\d{2}(?=\n)")
_CALL_ID = re.compile(r'"call_[0-9A-Za-z_-]+"')
SHAPE_REPLIES = [
    {"role": "assistant", "content": "", "tool_calls": [tool_call("bash", command="echo hi")]},
    {"role": "assistant", "content": "Done."},
]


def request_shapes(bundle: PiBundle, run: PiRun) -> dict[str, Any]:
    """Everything Pi sent on a `SHAPE_REPLIES` run that does not vary between machines or runs: the
    headers and the JSON bodies of its requests (system prompt, tools, messages), as pinned per version."""
    headers = [{k: v for k, v in h.items() if k not in _UNPINNED_HEADERS} for h, _ in run.captured.requests]
    for h in headers:
        h["user-agent"] = _KERNEL.sub(r"\1<release>\2", h["user-agent"])
    bodies = json.loads(_CALL_ID.sub('"call_0"', json.dumps([body for _, body in run.captured.requests])))
    for body in bodies:
        system = body["messages"][0]
        system["content"] = _DATE.sub("<date>", system["content"])
    return {"pi_version": bundle.version, "headers": headers, "bodies": bodies}


def pinned_shapes(version: str) -> dict[str, Any]:
    return json.loads((PINNED_DIR / f"{version}.json").read_text(encoding="utf-8"))


async def capture_shapes(
    bundle: PiBundle, tokenizer: PreTrainedTokenizerBase, backend: SandboxBackend, root: Path
) -> dict[str, Any]:
    """Run `SHAPE_REPLIES` with the real Pi of `bundle` on a one-file repository made under `root`."""
    run = await capture_pi_run(bundle, tokenizer, backend, make_repo(root), SHAPE_REPLIES)
    assert run.result.exit_code == 0 and len(run.captured.requests) == 2, run.result.stderr_tail
    return request_shapes(bundle, run)


def make_repo(root: Path, files: dict[str, str] | None = None) -> Task:
    """A task on a one-commit git repository under `root`: calc.py with a bug, plus `files`."""
    repo = root / "repo"
    for name, text in {"calc.py": "def add(a, b):\n    return a - b\n", **(files or {})}.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "init"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    return Task("calc-1", str(repo), head, "calc.add subtracts instead of adding. Fix it.")


def main(versions: list[str]) -> None:
    """Re-pin: `python tests/pi_shapes.py VERSION...` captures each installed version's requests into
    tests/pi_requests/VERSION.json (review the diff: it is what Pi changed)."""
    import asyncio
    import tempfile

    from transformers import AutoTokenizer

    from swe_grpo.extras.tiny_model import build_tiny_model
    from swe_grpo.sandbox.local import LocalBackend

    async def capture(version: str) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            root.chmod(0o711)  # the sandbox user must traverse it
            backend = LocalBackend(cache_dir=root / "checkouts", run_dir=root)
            return await capture_shapes(PiBundle.installed(version), tokenizer, backend, root)

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    PINNED_DIR.mkdir(exist_ok=True)
    for version in versions:
        path = PINNED_DIR / f"{version}.json"
        path.write_text(json.dumps(asyncio.run(capture(version)), indent=1, ensure_ascii=False) + "\n")
        print(path)


if __name__ == "__main__":
    main(sys.argv[1:])
