"""`swe-grpo tasks synth SOURCE... --out DIR` (the command line of `swe_grpo.synth`) and `swe-grpo tasks
calibrate TASKS.jsonl -o OUT.jsonl` (`swe_grpo.grading.gold`), registered by `swe_grpo.cli` with `add_parser`."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from rich.progress import TaskID
from rich.table import Table

from swe_grpo.console import make_console, progress
from swe_grpo.grading.gold import Calibration, calibrate_file
from swe_grpo.synth.build import ProjectReport, SynthConfig, synthesize
from swe_grpo.tasks.task import TaskFormatError

console = make_console()


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `synth` and `calibrate` to `sub` (the subcommands of `swe-grpo tasks`); returns `synth`'s parser."""
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
    _add_calibrate(sub)
    return synth


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    calibrate = sub.add_parser(
        "calibrate",
        help="record each task's expected_statuses from a real grade of its gold patch",
        description=(
            "Grade each row's gold patch and write the rows whose gold resolves, with expected_statuses set to "
            "the FAIL_TO_PASS tests its gold run leaves XFAIL or XPASS ({} for none: strict stays strict). A row "
            "whose gold does not resolve is named on stderr and left out (exit status 1)."
        ),
    )
    calibrate.add_argument("tasks", type=Path, metavar="TASKS.jsonl", help="a local task file")
    calibrate.add_argument("-o", "--output", required=True, type=Path, metavar="OUT.jsonl", help="the calibrated rows")
    calibrate.add_argument(
        "--sandbox", default="local", help="the sandbox backend: local (default), docker, hf or package.module:Class"
    )
    calibrate.add_argument("--jobs", type=int, default=4, help="golds graded at once")
    calibrate.add_argument("--timeout", type=float, default=1800.0, help="seconds, for each test run")
    calibrate.add_argument(
        "--plugin-autoload",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let pytest load installed plugins (a task's own setting wins), as grading does",
    )
    calibrate.set_defaults(func=calibrate_main)


def calibrate_main(args: argparse.Namespace) -> int:
    """`swe-grpo tasks calibrate`: 0 when every row was calibrated, 1 when a gold did not resolve, 2 when the
    task file is malformed (nothing written)."""
    from swe_grpo.sandbox import make_backend

    def done(calibration: Calibration) -> None:
        if calibration.error is not None:
            console.print(f"[red]refused[/red] {calibration.instance_id}: {calibration.error}")
        else:
            console.print(f"calibrated {calibration.instance_id}: {calibration.expected_statuses or 'strict'}")

    try:
        backend = make_backend(args.sandbox)
    except ValueError as exc:
        console.print(f"[red]error[/red] --sandbox: {exc}")
        return 2

    async def run() -> list[Calibration]:
        await backend.start()
        try:
            return await calibrate_file(
                args.tasks,
                args.output,
                backend,
                jobs=args.jobs,
                timeout_s=args.timeout,
                plugin_autoload=args.plugin_autoload,
                on_done=done,
            )
        finally:
            await backend.close()

    try:
        results = asyncio.run(run())
    except (OSError, TaskFormatError) as exc:
        console.print(f"[red]error[/red] {exc}")
        return 2
    refused = [c.instance_id for c in results if c.error is not None]
    console.print(f"calibrated {len(results) - len(refused)} of {len(results)} tasks: {args.output}")
    if refused:
        console.print(f"[red]left out[/red], their gold does not resolve: {', '.join(refused)}")
    return 1 if refused else 0


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

    async def run() -> list[ProjectReport]:
        backend = make_backend(args.sandbox)
        await backend.start()
        try:
            with progress(console) as shown:
                bars: dict[str, TaskID] = {}

                def started(name: str, total: int) -> None:
                    bars[name] = shown.add_task(name, total=total)

                def decided(name: str, accepted: int, tried: int) -> None:
                    shown.update(bars[name], completed=accepted, detail=f"{tried} candidates tried")

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
