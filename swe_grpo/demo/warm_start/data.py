"""The warm start's shipped data and what it holds: the candidate first turns per demo task
(`candidates.json`), the capture of Pi's requests (`pi_requests.json`) and the shipped policy (`policy/`),
all under `swe_grpo/demo/tasks/warm_start/`; the two scripted assistant turns (a candidate's `bash` call,
the closing message)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swe_grpo.tokens.chain import Message

BUILDER_VERSION = "2"
DATA_DIR = Path(__file__).resolve().parent.parent / "tasks" / "warm_start"
CANDIDATES_PATH = DATA_DIR / "candidates.json"
CAPTURE_PATH = DATA_DIR / "pi_requests.json"
# The policy as `python -m swe_grpo.demo.warm_start ship` built it: a fresh machine's demo skips the build.
SHIPPED_DIR = DATA_DIR / "policy"
CLOSING_TEXT = "Done."
METADATA_FILE = "warm_start.json"


class WarmStartError(RuntimeError):
    """The capture or the fine-tuned policy is not what the demo needs (the message says what)."""


@dataclass(frozen=True)
class Candidate:
    """One first-turn action: a `bash` command, and whether it resolves its task."""

    command: str
    resolves: bool


def load_candidates(path: Path = CANDIDATES_PATH) -> dict[str, list[Candidate]]:
    """Candidates per task instance id, in file order."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    return {task: [Candidate(c["command"], bool(c["resolves"])) for c in cands] for task, cands in raw.items()}


def load_capture(path: Path = CAPTURE_PATH) -> dict[str, Any]:
    """A capture as `capture_pi_requests` returns it (default: the shipped one)."""
    return json.loads(path.read_text(encoding="utf-8"))


def action_message(command: str) -> Message:
    """The assistant turn that calls Pi's `bash` tool with `command` (normalised form)."""
    call = {"type": "function", "function": {"name": "bash", "arguments": {"command": command}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


CLOSING_MESSAGE: Message = {"role": "assistant", "content": CLOSING_TEXT}
