"""An evaluation's output directory: what it holds, how it is written, and how a run resumes from it.

    OUT/run.json            the settings the attempts were made with; a re-run must match them
    OUT/attempts.jsonl      one JSON line per finished attempt, appended as attempts finish
    OUT/predictions.jsonl   SWE-bench predictions, one per task (see `predictions`)
    OUT/report.json         `metrics.build_report` of the attempts
    OUT/trajectories/       with --save-trajectories: one JSON per attempt (`Trajectory.to_json`)

attempts.jsonl is the run's state. Each record is appended with ONE `write(2)` on an `O_APPEND` descriptor,
so a killed run leaves whole lines and at most one cut-off last line; opening the log cuts such a tail
off (it was never a finished attempt), and any other line that is not a JSON attempt record is skipped
with a warning. The latest record of an (instance_id, attempt) pair wins, so an attempt retried later
(`--retry-infra`) replaces the earlier one without rewriting the file. The other files are rewritten whole
and atomically (a temporary file renamed over them).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from swe_grpo.evaluation.metrics import is_infra

log = logging.getLogger(__name__)

ATTEMPTS = "attempts.jsonl"
PREDICTIONS = "predictions.jsonl"
REPORT = "report.json"
RUN = "run.json"
TRAJECTORIES = "trajectories"
_REQUIRED = ("instance_id", "attempt", "outcome")


class EvalSetupError(ValueError):
    """An evaluation that cannot start as asked (said to the user without a traceback)."""


class SettingsMismatch(EvalSetupError):
    """A re-run whose settings differ from those OUT's attempts were made with."""


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check_settings(out: Path, settings: Mapping[str, Any]) -> None:
    """Record `settings` in OUT/run.json, or check them against those recorded: attempts made with another
    model, agent or sampling must not be mixed into one report."""
    path = out / RUN
    if path.exists():
        recorded = json.loads(path.read_text(encoding="utf-8"))
        differ = {key: (recorded.get(key), value) for key, value in settings.items() if recorded.get(key) != value}
        if differ:
            said = ", ".join(f"{key}: {old!r} then, {new!r} now" for key, (old, new) in differ.items())
            raise SettingsMismatch(f"{out} holds attempts made with other settings ({said}); use another --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(dict(settings), indent=2) + "\n")


class AttemptLog:
    """OUT/attempts.jsonl: `records` (the valid lines read at opening), `append` (one line per attempt)."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.skipped = 0  # lines that were not attempt records
        self._fd: int | None = None
        if path.exists():
            self._load()

    def _load(self) -> None:
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # a line cut off by a killed run: never a finished attempt
            log.warning("%s: ignoring a cut-off last line (%d bytes)", self.path, len(data) - end)
            with self.path.open("r+b") as f:
                f.truncate(end)
            data = data[:end]
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or any(key not in record for key in _REQUIRED):
                log.warning("%s:%d: not an attempt record; ignored", self.path, number)
                self.skipped += 1
                continue
            self.records.append(record)

    def append(self, record: Mapping[str, Any]) -> None:
        """Append `record` as one line, in one write: a kill never leaves half of it in the middle of the file."""
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = (json.dumps(record) + "\n").encode("utf-8")
        written = os.write(self._fd, line)
        if written != len(line):  # a full disk; the cut-off line is dropped at the next opening
            raise OSError(f"{self.path}: wrote {written} of {len(line)} bytes")
        self.records.append(dict(record))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> AttemptLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def latest(records: Iterable[Mapping[str, Any]]) -> dict[tuple[str, int], Mapping[str, Any]]:
    """The last record of each (instance_id, attempt), in file order."""
    found: dict[tuple[str, int], Mapping[str, Any]] = {}
    for record in records:
        found[(record["instance_id"], int(record["attempt"]))] = record
    return found


def done(records: Iterable[Mapping[str, Any]], retry_infra: bool = False) -> set[tuple[str, int]]:
    """The attempts a re-run skips: every one recorded, but those whose latest record is an infra failure
    when `retry_infra`."""
    return {key for key, record in latest(records).items() if not (retry_infra and is_infra(record))}


def predictions(records: Iterable[Mapping[str, Any]], model_name: str) -> list[dict[str, Any]]:
    """SWE-bench predictions, one per task (SWE-bench keys them by instance_id): the patch of the task's
    lowest-numbered scored attempt (attempt 0 unless the host failed it), with `attempt` saying which. A
    task whose attempts all failed on the host has no prediction (SWE-bench counts it as not resolved)."""
    chosen: dict[str, Mapping[str, Any]] = {}
    for (instance_id, _attempt), record in sorted(latest(records).items()):
        if instance_id not in chosen and not is_infra(record):
            chosen[instance_id] = record
    return [
        {
            "instance_id": instance_id,
            "model_name_or_path": model_name,
            "model_patch": record.get("model_patch") or "",
            "attempt": record["attempt"],
        }
        for instance_id, record in chosen.items()
    ]
