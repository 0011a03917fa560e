"""A graded run's reports are the patch's to write: their parses run bounded, off the serving loop (issue 35, 3).

Before, the grader parsed the JUnit report twice (`RunReports.parse`, `report_statuses`) and the audit report
in `asyncio.to_thread`: ElementTree's C parser holds the GIL for its whole input, so a report of 2,000,000
empty elements (8 MiB, well under the 64 MiB cap) stood the event loop that serves every rollout still for
seconds and grew the serving process by hundreds of MiB. Now each parse is a forked child's
(`swe_grpo.sandbox.bounded.run_bounded`), and a parse over its bound reads the report as missing."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import replace

import pytest
from sandbox_helpers import no_sandbox_left_in_run_dir  # noqa: F401  (autouse here; `local_backend` is conftest's)
from tampers import tamper_patch

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.grading import SCAN_RULES, grade
from swe_grpo.grading import probe as grading_probe
from swe_grpo.sandbox.local import LocalBackend

INIPARSE = next(task for task in demo_tasks() if "iniparse" in task.instance_id)
# The audit's events the bloater's code raises (it opens the report at exit), allowed as the witness tests do.
EVENTS = ("os.exec", "sys.settrace", "object.__setattr__", "foreign")
# At the runner's exit, the JUnit report replaced by one of 2,000,000 empty elements.
BLOAT_JUNIT_AT_EXIT = """
import atexit as _atexit


def _bloat():
    args = open("/proc/self/cmdline", "rb").read().decode().split("\\0")
    path = next(a.split("=", 1)[1] for a in args if a.startswith("--junitxml="))
    open(path, "w").write("<testsuites>" + "<a/>" * 2_000_000 + "</testsuites>")


_atexit.register(_bloat)
"""


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as refs:  # "5": this process's peak RSS starts again from now
        refs.write("5")


async def test_a_pathological_junit_report_neither_stalls_the_loop_nor_grows_the_server(
    local_backend: LocalBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Over its memory bound (lowered here to 64 MiB, so that 2,000,000 elements exceed it; the default 1 GiB
    is sized for reports at their 64 MiB cap), the report reads as missing: the grade is the patch's,
    `unresolved` 0.0, and the cause is logged. Meanwhile a neighbour ticking every 10 ms is never held up
    more than 100 ms beyond the slowest tick of a baseline grade (the gold patch, same test, same load), and
    the serving process's peak RSS grows no more than the baseline's plus 64 MiB (to_thread: +200 MiB and
    more, with a loop still for 2-8 s)."""
    monkeypatch.setattr(grading_probe, "REPORT_MEMORY_BYTES", 64 << 20)
    task = replace(INIPARSE, tamper_allow=(*SCAN_RULES, *EVENTS), runner_limits=False)

    async def measured(patch: str) -> tuple[str, float | None, float, int]:
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        _reset_peak_rss()
        before = _peak_rss_bytes()
        ticker = asyncio.ensure_future(tick())
        try:
            result = await grade(task, patch, local_backend, timeout_s=120)
        finally:
            ticks.append(time.monotonic())
            ticker.cancel()
        longest = max(later - earlier for earlier, later in itertools.pairwise(ticks))
        return result.outcome, result.reward, longest, _peak_rss_bytes() - before

    baseline = await measured(task.patch)
    assert baseline[:2] == ("resolved", 1.0)
    with caplog.at_level(logging.WARNING, logger=grading_probe.__name__):
        outcome, reward, longest, grown = await measured(tamper_patch(INIPARSE, BLOAT_JUNIT_AT_EXIT))
    assert (outcome, reward) == ("unresolved", 0.0)
    assert longest < baseline[2] + 0.1, (longest, baseline[2])
    assert grown < baseline[3] + (64 << 20), (grown >> 20, baseline[3] >> 20)
    # Whether the parse hits its memory bound depends on this process: the forked child reuses the heap the
    # parent has freed before its address space grows, so late in a full run (a big heap) the 2 M elements fit
    # and read as a report with none of the tests (unresolved all the same); alone, the bound is hit and logged.
    if caplog.text:
        assert "read as missing: its parse is over its memory bound" in caplog.text
