"""Running a project's test suite in a sandbox, the way the grader runs tests, and reading what came out.

`run_suite(backend, task, ids=None, trace=False)` runs, in a fresh sandbox of `backend` at
`task.base_commit` without network, the task's test command (`task.test_cmd` or the grader's
`DEFAULT_TEST_CMD`, with the JUnit path as the grader gives it) on `ids` (in that order, as the grader
passes them) or on the whole suite. Statuses come from the grader's own parsers
(`swe_grpo.grading.report_statuses`, `RunReports`): a test's status is the worst of the JUnit report and
the `-rA` summary, a test neither names is "missing". Failure messages come from the JUnit report.

With `trace`, a small pytest plugin (`_TRACER`, put in the sandbox user's site-packages and loaded with
`-p`) records, for each test (setup, call and teardown), the functions of the repository that ran: the
code objects whose file is under the repository, keyed by file and first line (`co_firstlineno`). It uses
`sys.settrace`/`threading.settrace` with "call" events only (no line events): cheap, and available on every
Python the sandbox may have. Functions started in other processes are not seen.
"""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field

from swe_grpo.grading import DEFAULT_TEST_CMD, RunReports, junit_key, report_statuses
from swe_grpo.sandbox.base import WORKDIR, SandboxBackend
from swe_grpo.tasks import Task

_TRACER = r'''
"""swe-grpo synth: which repository functions each test runs (pytest plugin)."""
import json, os, sys, threading
import pytest

_ROOT = os.environ.get("SWE_GRPO_SYNTH_ROOT", "/testbed").rstrip("/") + "/"
_OUT = os.environ["SWE_GRPO_SYNTH_TRACE"]
_seen = set()
_tests = {}


def _trace(frame, event, arg):
    _seen.add(frame.f_code)
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _seen.clear()
    threading.settrace(_trace)
    sys.settrace(_trace)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        ran = _tests.setdefault(item.nodeid, set())
        for code in _seen:
            name = code.co_filename
            if name.startswith(_ROOT):
                ran.add((name[len(_ROOT):], code.co_firstlineno))
        _seen.clear()


def pytest_sessionfinish(session, exitstatus):
    with open(_OUT, "w") as out:
        json.dump({test: sorted(ran) for test, ran in _tests.items()}, out)
'''

_PLUGIN = "swe_grpo_synth_trace"
_MESSAGE_CHARS = 600


@dataclass
class SuiteRun:
    """What one run of the suite gave. `statuses`: test id -> passed|failed|error|skipped|xfail|xpass|
    missing (None when the run yielded no report at all); `messages`: test id -> the failure's message
    from the JUnit report; `coverage`: test id -> {(path, first line)} of the repository functions it ran
    (traced runs only); `output`: the end of stdout and stderr."""

    statuses: dict[str, str] | None
    messages: dict[str, str] = field(default_factory=dict)
    coverage: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    output: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0


def _messages(junit_xml: str | None, ids: Sequence[str]) -> dict[str, str]:
    if not junit_xml:
        return {}
    try:
        root = ET.fromstring(junit_xml)
    except ET.ParseError:
        return {}
    found: dict[tuple[str, str], str] = {}
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                message = child.get("message") or (child.text or "").strip().splitlines()[-1:] or [""]
                text = message if isinstance(message, str) else message[0]
                found.setdefault((case.get("classname", ""), case.get("name", "")), text[:_MESSAGE_CHARS])
    return {test_id: found[junit_key(test_id)] for test_id in ids if junit_key(test_id) in found}


async def run_suite(
    backend: SandboxBackend,
    task: Task,
    ids: Sequence[str] | None = None,
    *,
    trace: bool = False,
    timeout_s: float = 600.0,
) -> SuiteRun:
    """Run `ids` (or the whole suite) at `task.base_commit`; see the module docstring."""
    sandbox = await backend.create(task, network=False)  # as the grader's
    try:
        scratch = "/tmp/swe_grpo_synth"
        await sandbox.put_file(f"{scratch}/ids", "".join(f"{test_id}\n" for test_id in ids or ()).encode())
        env = {}
        extra = ""
        if trace:
            site = await sandbox.exec(["python3", "-c", "import site; print(site.getusersitepackages())"], timeout_s=60)
            user_site = site.stdout.strip()
            if site.exit_code != 0 or not user_site.startswith("/"):
                return SuiteRun(None, output=f"python3 has no user site-packages: {site.stderr[-2000:]}")
            await sandbox.put_file(f"{user_site}/{_PLUGIN}.py", _TRACER.encode())
            env = {"SWE_GRPO_SYNTH_TRACE": f"{scratch}/trace.json", "SWE_GRPO_SYNTH_ROOT": WORKDIR}
            extra = f" -p {_PLUGIN}"
        selection = '"${ids[@]}"' if ids else "--continue-on-collection-errors"
        command = (
            f"mapfile -t ids < {scratch}/ids && SWE_GRPO_JUNIT_XML={scratch}/junit.xml && "
            f"{task.test_cmd or DEFAULT_TEST_CMD}{extra} {selection}"
        )
        run = await sandbox.exec(command, timeout_s=timeout_s, env=env, cwd=WORKDIR)
        output = (run.stdout + run.stderr)[-20000:]
        junit = await _read(sandbox, f"{scratch}/junit.xml")
        coverage: dict[str, set[tuple[str, int]]] = {}
        if trace:
            traced = await _read(sandbox, f"{scratch}/trace.json")
            for test_id, ran in json.loads(traced or "{}").items():
                coverage[test_id] = {(path, line) for path, line in ran}
    finally:
        await sandbox.destroy()
    if run.timed_out:
        return SuiteRun(None, output=output, timed_out=True, wall_s=run.wall_s)
    wanted = list(ids) if ids else sorted({*(RunReports.parse((), junit, run.stdout).summary or {}), *coverage})
    statuses = report_statuses(wanted, junit, run.stdout)
    return SuiteRun(
        statuses,
        messages=_messages(junit, wanted),
        coverage=coverage,
        output=output,
        exit_code=run.exit_code,
        wall_s=run.wall_s,
    )


async def _read(sandbox, path: str) -> str | None:
    got = await sandbox.exec(f"test -f {shlex.quote(path)}", timeout_s=30)
    if got.exit_code != 0:
        return None
    return (await sandbox.get_file(path)).decode("utf-8", "replace")
