"""Where a benchmark's figures come from: the `provenance` object at the top of every JSON under
benchmarks/results/ (tests/test_benchmark_results.py fails on a file without it).

A figure is only worth quoting with its date, the code it measured and the box it ran on, loaded or not.
The checkout is shared and others commit to it during a long run, so the code's state is taken at the run's
start and again at its end.

    run = Provenance()  # at the start, before any work
    ...
    path.write_text(json.dumps({"provenance": run.record(), **results}, indent=1) + "\n")
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The code a benchmark measures: the package and the benchmarks themselves (their results excluded).
CODE_UNDER_TEST = ("swe_grpo", "benchmarks", ":(exclude)benchmarks/results")


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def code_state(code: tuple[str, ...] = CODE_UNDER_TEST) -> dict[str, Any]:
    """Now (UTC, ISO 8601), the commit checked out, and the files of `code` (git pathspecs) that differ
    from it (`dirty`: their paths, or False when there are none)."""
    dirty = [line[3:] for line in _git("status", "--porcelain", "--", *code).splitlines()]
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": _git("rev-parse", "HEAD").strip(),
        "dirty": dirty or False,
    }


def machine() -> dict[str, Any]:
    """The CPU model, the cores this process may use, and the memory of the box."""
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        "unknown",
    )
    memory_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:")
    )
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_gib": round(memory_kib / 2**20, 1)}


class Provenance:
    """One run's provenance: made at the run's start (its code state and load average), recorded at its end."""

    def __init__(self, code: tuple[str, ...] = CODE_UNDER_TEST) -> None:
        self.code = code
        self.started = code_state(code)
        self.load_before = os.getloadavg()

    def record(self) -> dict[str, Any]:
        """`date`, `commit` and `dirty` at the start; `ended`: the same at the end; `machine`; `load`: the
        1, 5 and 15-minute load averages before and after."""
        return {
            **self.started,
            "ended": code_state(self.code),
            "machine": machine(),
            "load": {
                "before": [round(x, 2) for x in self.load_before],
                "after": [round(x, 2) for x in os.getloadavg()],
            },
        }
