"""P5 (benchmarks/p5_big_requests.py) runs as a reader would run it, shortened: it shares P2's server process
(`p2_concurrency.serve`), whose arguments grew under it once unnoticed (the server process died at start)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_p5_answers_its_big_requests_without_an_error() -> None:
    args = ["--rollouts", "6", "--big", "1", "--baseline-s", "2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "p5_big_requests.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Big requests: 1 of 1 answered" in done.stdout, done.stdout[-2000:]
    assert "Errors: 0 (agent-side: none; server-recorded 0, forks 0 of" in done.stdout, done.stdout[-2000:]
