"""What the grader's tamper defences (issue 23, section 1) cost a grade, layer by layer.

What. For each task (the bundled demo tasks; with `--real`, also the real-project tasks of
tests/real_projects.py, built on first use), with its gold patch applied in one `local` sandbox, the test
command on the task's tests, `--repeat` times each, alternating:
  - plain: the command as the grader ran it before (no boot, no canaries, no pinned environment);
  - boot: the boot armed (the PATH shim, the audit hook, the exit scan) and the environment pinned;
  - witnessed: the boot plus the two canary tests, as a graded run runs it now.
Also: the capability gate on the gold patch's files (`gate_parse_s`: the parse and judgement alone, in the
host process; `gate_in_grade_s`: as a grade runs it, reading the files out of the sandbox too), the boot's
exit scan (inside the runner, as it reports it), the probe's extra witnessed run (one test plus the
canaries; once per task base, kept for later grades), and a whole `grade()` of the gold patch
(first grade of a task: probe included; then a second one, the probe reused). Medians, in seconds.

Run as root: `.venv/bin/python benchmarks/grading_tamper_cost.py [--repeat 5] [--real]
[--output benchmarks/results/grading_tamper_cost.json]`. A minute or two for the demo tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import Provenance

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import DEFAULT_TEST_CMD, FileChange, gate, grade
from swe_grpo.grading.probe import witnessed_run
from swe_grpo.sandbox.base import Sandbox
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import Task


async def _plain(sandbox: Sandbox, scratch: str, task: Task, ids: list[str]) -> float:
    q = shlex.quote
    await sandbox.put_file(f"{scratch}/plain_ids", "".join(f"{test_id}\n" for test_id in ids).encode())
    command = (
        f"mapfile -t ids < {q(scratch)}/plain_ids && SWE_GRPO_JUNIT_XML={q(scratch)}/plain.xml"
        f' && {task.test_cmd or DEFAULT_TEST_CMD} "${{ids[@]}}"'
    )
    started = time.monotonic()
    await sandbox.exec(command, timeout_s=300, cwd=sandbox.workdir)
    return time.monotonic() - started


async def _witnessed(sandbox: Sandbox, scratch: str, task: Task, ids: list[str], canaries: bool) -> float:
    started = time.monotonic()
    run = await witnessed_run(sandbox, scratch, task, ids, env={}, timeout_s=300, canaries=canaries)
    elapsed = time.monotonic() - started
    assert run.audit.started and run.audit.ended and not run.audit.events, run.audit
    return elapsed


async def measure(backend: LocalBackend, task: Task, repeat: int) -> dict[str, float | str | int]:
    ids = [*task.fail_to_pass, *task.pass_to_pass]
    times: dict[str, list[float]] = {"plain_s": [], "boot_s": [], "witnessed_s": []}

    paths = re.findall(r"^diff --git a/\S+ b/(\S+)$", task.patch, re.MULTILINE)
    files: dict[str, list[bytes]] = {path: [] for path in paths}

    async def runs(sandbox: Sandbox) -> float:
        made = await sandbox.exec("mktemp -d", timeout_s=30, cwd=sandbox.workdir)
        scratch = made.stdout.strip()
        for path in paths:
            files[path].append(await sandbox.get_file(f"{sandbox.workdir}/{path}"))
        applied = await sandbox.exec(f"git apply <<'EOF'\n{task.patch}EOF\n", timeout_s=60, cwd=sandbox.workdir)
        assert applied.exit_code == 0, applied.stderr
        for path in paths:
            files[path].append(await sandbox.get_file(f"{sandbox.workdir}/{path}"))
        for _ in range(repeat):
            times["plain_s"].append(await _plain(sandbox, scratch, task, ids))
            times["boot_s"].append(await _witnessed(sandbox, scratch, task, ids, canaries=False))
            times["witnessed_s"].append(await _witnessed(sandbox, scratch, task, ids, canaries=True))
        started = time.monotonic()
        await _witnessed(sandbox, scratch, task, ids[:1], canaries=True)
        return time.monotonic() - started

    sandbox = await backend.create(task, network=False)
    try:
        probe_run_s = await runs(sandbox)
    finally:
        await sandbox.destroy()
    changes = [FileChange(path, before, after) for path, (before, after) in files.items()]
    started = time.perf_counter()
    for _ in range(100):
        assert gate(changes).findings == []
    gate_parse_s = (time.perf_counter() - started) / 100
    first = await grade(task, task.patch, backend, timeout_s=300)
    again = await grade(task, task.patch, backend, timeout_s=300)
    assert first.outcome == again.outcome == "resolved", (first.error, again.error)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "task": task.instance_id,
        "tests": len(ids),
        **{name: round(value, 4) for name, value in medians.items()},
        "boot_overhead_s": round(medians["boot_s"] - medians["plain_s"], 4),
        "canary_overhead_s": round(medians["witnessed_s"] - medians["boot_s"], 4),
        "probe_extra_run_s": round(probe_run_s, 4),
        "gate_parse_s": round(gate_parse_s, 6),
        "gate_in_grade_s": round(again.timings["gate_s"], 4),
        "exit_scan_s": again.timings["exit_scan_s"],
        "grade_first_s": round(first.timings["total_s"], 3),
        "grade_again_s": round(again.timings["total_s"], 3),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--real", action="store_true", help="also the real-project tasks (tests/real_projects.py)")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "grading_tamper_cost.json")
    args = parser.parse_args()
    provenance = Provenance()
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp).chmod(0o755)  # the sandbox user binds from it
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        run_dir.chmod(0o755)
        backend = LocalBackend(cache_dir=Path(tmp) / "cache", run_dir=run_dir)
        await backend.start()
        tasks = demo_tasks()
        if args.real:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
            from real_projects import real_project_tasks

            tasks += await real_project_tasks(backend)
        rows = [await measure(backend, task, args.repeat) for task in tasks]
    for row in rows:
        print(json.dumps(row))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    result = {"provenance": provenance.record(), "repeat": args.repeat, "real": args.real, "rows": rows}
    args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
