"""What `swe-grpo tasks synth` costs and yields, per project: validated tasks, candidates tried, stable tests,
wall time (fetch and baseline included) and why candidates were rejected; then every task it made is graded
again in fresh sandboxes (gold patch and empty patch), as `swe-grpo grade` would.

    .venv/bin/python benchmarks/synth_tasks.py [--per-project 10] [--jobs 2] [--output FILE.json]

Minutes on the 2-core box (sdists from pip's cache, else fetched from PyPI once).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

from swe_grpo.grading import grade
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.synth.build import SynthConfig, synthesize
from swe_grpo.tasks import load_tasks

PROJECTS = ["toolz==1.0.0", "cachetools==5.5.0", "more-itertools==10.5.0", "boltons==24.0.0", "platformdirs==4.2.2"]
PROJECTS += ["semver==3.0.2"]  # its setup.cfg asks for pytest-cov: refused, and the reason is recorded


async def measure(per_project: int, jobs: int, timeout_s: float, out: Path) -> dict:
    backend = LocalBackend()
    await backend.start()
    try:
        reports = []
        for source in PROJECTS:  # one at a time, so that each wall time is its own
            config = SynthConfig(out=out, seed=0, max_per_project=per_project, jobs=jobs, timeout_s=timeout_s)
            reports += await synthesize([source], config, backend)
        tasks = load_tasks(out / "tasks.jsonl")
        semaphore = asyncio.Semaphore(jobs)

        async def regrade(task, patch: str) -> str:
            async with semaphore:
                return (await grade(task, patch, backend)).outcome

        start = time.monotonic()
        gold = await asyncio.gather(*(regrade(task, task.patch) for task in tasks))
        empty = await asyncio.gather(*(regrade(task, "") for task in tasks))
        regrade_s = time.monotonic() - start
    finally:
        await backend.close()
    return {
        "projects": [dataclasses.asdict(report) for report in reports],
        "tasks": len(tasks),
        "regrade": {"gold": dict(Counter(gold)), "empty": dict(Counter(empty)), "wall_s": round(regrade_s, 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-project", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/synth_tasks.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="synth-bench-") as tmp:
        os.chmod(tmp, 0o755)  # the sandbox user reads the bare repositories
        result = asyncio.run(measure(args.per_project, args.jobs, args.timeout, Path(tmp) / "out"))
    result |= {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "settings": {"per_project": args.per_project, "jobs": args.jobs, "timeout_s": args.timeout, "seed": 0},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
