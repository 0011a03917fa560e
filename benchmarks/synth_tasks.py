"""What `swe-grpo tasks synth` costs and yields, per project: validated tasks, candidates tried, stable tests,
wall time (fetch and baseline included) and why candidates were rejected; then every task it made is graded
again in fresh sandboxes (gold patch and empty patch), as `swe-grpo grade` would.

    .venv/bin/python benchmarks/synth_tasks.py [--per-project 18] [--jobs 2] [--output FILE.json]

The projects (`PROJECTS`) are small pure-Python PyPI releases whose suites run on the sandbox's Python with
pytest alone (pytest-mock for platformdirs); idna, pyflakes, xmltodict and webcolors have unittest suites
(pytest runs them). One project at a time, so that each wall time is its own; the result file is rewritten
after each project (`"complete": false` until the last), so an interrupted run leaves what it measured.
An hour on the 2-core box (sdists from pip's cache, else fetched from PyPI once).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import Provenance

from swe_grpo.grading import grade
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.synth.build import SynthConfig, synthesize
from swe_grpo.tasks import load_tasks

PROJECTS = [
    "cachetools==5.5.0",
    "more-itertools==10.5.0",
    "boltons==24.0.0",
    "platformdirs==4.2.2",
    "semver==3.0.2",  # its setup.cfg's addopts want pytest-cov: run with `-o addopts=`
    "idna==3.10",  # unittest
    "pyflakes==3.2.0",  # unittest
    "xmltodict==0.13.0",  # unittest
    "webcolors==24.8.0",  # unittest
    "parse==1.20.2",
    "inflection==0.5.1",
    "isodate==0.7.2",
    "jmespath==1.0.1",
    "tabulate==0.9.0",
]


async def measure(args: argparse.Namespace, out: Path, write: Callable[..., None]) -> None:
    backend = LocalBackend()
    await backend.start()
    semaphore = asyncio.Semaphore(args.jobs)

    async def regrade(task, patch: str) -> str:
        async with semaphore:
            return (await grade(task, patch, backend, timeout_s=args.timeout)).outcome

    projects: list[dict] = []
    try:
        for source in args.projects:
            config = SynthConfig(
                out=out, seed=0, max_per_project=args.per_project, jobs=args.jobs, timeout_s=args.timeout
            )
            (report,) = await synthesize([source], config, backend)
            tasks = [t for t in load_tasks(out / "tasks.jsonl") if t.metadata["synth"]["source"] == source]
            start = time.monotonic()
            gold = await asyncio.gather(*(regrade(task, task.patch) for task in tasks))
            empty = await asyncio.gather(*(regrade(task, "") for task in tasks))
            operators = Counter(task.metadata["synth"]["operator"] for task in tasks)
            projects.append(
                dataclasses.asdict(report)
                | {
                    "test_cmd": tasks[0].test_cmd if tasks else None,
                    "operators": dict(operators.most_common()),
                    "regrade": {
                        "gold": dict(Counter(gold)),
                        "empty": dict(Counter(empty)),
                        "wall_s": round(time.monotonic() - start, 1),
                    },
                }
            )
            write(projects, complete=False)
    finally:
        await backend.close()
    write(projects, complete=True)


def merge(parts: list[Path], output: Path) -> None:
    """One result from several runs over disjoint projects (run side by side to finish sooner): the projects
    in `PROJECTS` order, the totals summed, one provenance from the first run's start to the last run's end (the
    runs must share their code and machine), and each run's own provenance, wall time and settings under `runs`."""
    runs = [json.loads(path.read_text()) for path in parts]
    projects = sorted((p for run in runs for p in run["projects"]), key=lambda p: PROJECTS.index(p["source"]))
    names = [p["source"] for p in projects]
    if len(names) != len(set(names)):
        raise SystemExit(f"a project is in more than one of {parts}")
    total = Counter()
    for run in runs:
        total.update(run["regrade"])
    first = min(runs, key=lambda run: run["provenance"]["date"])["provenance"]
    last = max(runs, key=lambda run: run["provenance"]["ended"]["date"])["provenance"]
    for key in ("commit", "dirty", "machine"):
        if any(run["provenance"][key] != first[key] for run in runs):
            raise SystemExit(f"the runs differ in their {key}: they are not one measurement")
    provenance = first | {
        "ended": last["ended"],
        "load": {"before": first["load"]["before"], "after": last["load"]["after"]},
    }
    result = {
        "provenance": provenance,  # from the first run's start to the last run's end
        "complete": all(run["complete"] for run in runs),
        "projects": projects,
        "tasks": sum(p["accepted"] for p in projects),
        "projects_with_tasks": sum(p["accepted"] > 0 for p in projects),
        "regrade": dict(total),
        "runs": [
            {"file": str(path), **{k: v for k, v in run.items() if k not in ("projects", "regrade", "tasks")}}
            for path, run in zip(parts, runs, strict=True)
        ],
    }
    output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "projects"}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-project", type=int, default=18)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/synth_tasks.json"))
    parser.add_argument("--out", type=Path, help="keep the tasks here (default: a temporary directory)")
    parser.add_argument(
        "--projects", type=lambda text: text.split(","), default=PROJECTS, help="a comma-separated subset"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        help="measure nothing: write --output from these result files (runs of disjoint --projects at once)",
    )
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.output)
        return
    provenance = Provenance()
    begin = time.monotonic()

    def write(projects: list[dict], complete: bool) -> None:
        total = Counter()
        for project in projects:
            total.update({f"gold_{k}": v for k, v in project["regrade"]["gold"].items()})
            total.update({f"empty_{k}": v for k, v in project["regrade"]["empty"].items()})
        result = {
            "provenance": provenance.record(),
            "complete": complete,
            "projects": projects,
            "tasks": sum(p["accepted"] for p in projects),
            "projects_with_tasks": sum(p["accepted"] > 0 for p in projects),
            "regrade": dict(total),
            "wall_s": round(time.monotonic() - begin, 1),
            "settings": {"per_project": args.per_project, "jobs": args.jobs, "timeout_s": args.timeout, "seed": 0},
            "projects_asked": args.projects,
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "projects"} | {"last": projects[-1:]}), flush=True)

    if args.out is not None:
        asyncio.run(measure(args, args.out, write))
        return
    with tempfile.TemporaryDirectory(prefix="synth-bench-") as tmp:
        os.chmod(tmp, 0o755)  # the sandbox user reads the bare repositories
        asyncio.run(measure(args, Path(tmp) / "out", write))


if __name__ == "__main__":
    main()
