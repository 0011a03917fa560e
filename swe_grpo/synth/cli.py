"""`swe-grpo tasks synth SOURCE... --out DIR`: the command line of `swe_grpo.synth` (registered by
`swe_grpo.cli` with `add_parser`)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swe_grpo.synth.build import ProjectReport, SynthConfig, synthesize

console = Console(stderr=True)


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `synth` to `sub` (the subcommands of `swe-grpo tasks`)."""
    synth = sub.add_parser(
        "synth",
        help="make validated tasks by mutating the code a project's own tests run (SWE-smith style)",
        description="Tasks made by mutating the code a project's own tests run; see docs/task-synthesis.md.",
    )
    synth.add_argument(
        "sources", nargs="+", metavar="SOURCE", help="name==version (a PyPI sdist), a git repository or a directory"
    )
    synth.add_argument("--out", required=True, type=Path, help="where tasks.jsonl and repos/ go (rerun to resume)")
    synth.add_argument("--seed", type=int, default=0, help="the order candidates are tried in")
    synth.add_argument("--max-per-project", type=int, default=20, help="validated tasks per source, at most")
    synth.add_argument("--jobs", type=int, default=2, help="candidates validated at once")
    synth.add_argument("--timeout", type=float, default=600.0, help="seconds, for each run of a test suite")
    synth.add_argument(
        "--test-cmd",
        help="the test command of every source (default: the grader's pytest command, PYTHONPATH=src for src/)",
    )
    synth.add_argument(
        "--sandbox",
        choices=("local", "docker"),
        default="local",
        help="where suites run; docker: each project gets an image with its test requirements (the rows' image)",
    )
    synth.set_defaults(func=main)
    return synth


def _table(reports: list[ProjectReport]) -> Table:
    table = Table(title="Synthesised tasks")
    for column in ("source", "tasks", "candidates tried", "stable tests", "wall s", "rejected / error"):
        table.add_column(column, justify="left" if column in ("source", "rejected / error") else "right")
    for r in reports:
        reasons = sorted(r.rejected.items(), key=lambda kv: -kv[1])
        if r.infra_errors:
            reasons.append(("sandbox failures (retried on a rerun)", r.infra_errors))
        why = (r.error or "").split("\n", 1)[0][:200] or ", ".join(f"{reason} {n}" for reason, n in reasons)
        table.add_row(r.source, str(r.accepted), f"{r.tried}/{r.candidates}", str(r.tests), f"{r.wall_s:.0f}", why)
    return table


def main(args: argparse.Namespace) -> int:
    from swe_grpo.sandbox import make_backend

    config = SynthConfig(
        out=args.out,
        seed=args.seed,
        max_per_project=args.max_per_project,
        jobs=args.jobs,
        timeout_s=args.timeout,
        test_cmd=args.test_cmd,
    )
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())

    async def run() -> list[ProjectReport]:
        backend = make_backend(args.sandbox)
        await backend.start()
        try:
            with Progress(*columns, console=console) as progress:
                bars: dict[str, object] = {}

                def started(name: str, total: int) -> None:
                    bars[name] = progress.add_task(name, total=total)

                def decided(name: str, accepted: int, tried: int) -> None:
                    progress.update(bars[name], completed=accepted, description=f"{name} ({tried} tried)")

                return await synthesize(args.sources, config, backend, started=started, decided=decided)
        finally:
            await backend.close()

    reports = asyncio.run(run())
    console.print(_table(reports))
    for report in reports:
        if report.error:
            console.print(f"[red]error[/red] {report.source}: {report.error}")
    console.print(f"tasks: {args.out / 'tasks.jsonl'}")
    return 2 if any(report.error for report in reports) else 0
