"""The probe (what the task's test runner imports and which of the grader's witnesses it supports, measured
once per task base without the patch) and the witnessed test run that the probe and the graded run share.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import shlex
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from swe_grpo.grading.canaries import Canaries
from swe_grpo.grading.limits import KILLED_BY_LIMIT, LIMIT_ENV, limit_secret, limit_source, limited
from swe_grpo.grading.protect import RunnerImports
from swe_grpo.grading.reports import RunReports, junit_key
from swe_grpo.grading.selection import SELECT_ENV, select_source, selection_files, selection_secret
from swe_grpo.grading.steps import DEFAULT_TEST_CMD, BrokenTask, failure, grade_setup, in_sandbox, step
from swe_grpo.grading.tamper import BOOT_ENV, AuditReport, boot_secret, boot_source, shim_script
from swe_grpo.sandbox.base import ExecResult, FileTooLarge, Sandbox, SandboxBackend, SandboxError
from swe_grpo.sandbox.bounded import BoundExceeded, run_bounded
from swe_grpo.tasks import Task

log = logging.getLogger(__name__)
T = TypeVar("T")

# The environment of every witnessed run: no user site (a patch could have written one outside the
# repository for a later interpreter), and no runner options from the environment.
PINNED_ENV = {"PYTHONNOUSERSITE": "1", "PYTEST_ADDOPTS": "", "PYTEST_PLUGINS": ""}


@dataclass
class WitnessedRun:
    """One run of the test command with the grader's witnesses: `reports` (None when it timed out),
    `audit` (the boot's report), `canaries` (None when not added), `junit_xml` (None when not written),
    `limited` (the grader asked for the runner's limits: `swe_grpo.grading.limits`), `limits_installed`
    (the runner's own status said they were in force, before any repository code ran; a file within the
    patch's reach afterwards, so it only names the layer armed, never decides a grade); `selection_taken`
    (a runner took the hidden selection, `swe_grpo.grading.selection`; to be trusted in a run without the
    patch only)."""

    tests: ExecResult
    reports: RunReports | None
    audit: AuditReport
    canaries: Canaries | None
    junit_xml: str | None
    limited: bool = False
    limits_installed: bool = False
    selection_taken: bool = False

    @property
    def killed_by_limit(self) -> bool:
        """The runner's limits ended the run (its runner made a call they refuse): read from the runner's exit
        status as the sandbox's exec reports it (the kernel's SIGSYS, seen by the shell that started the
        runner), outside every process the patch's code runs in; never from a file the runner writes."""
        return self.limited and not self.tests.timed_out and self.tests.exit_code == KILLED_BY_LIMIT


async def witnessed_run(
    sandbox: Sandbox,
    scratch: str,
    task: Task,
    test_ids: Sequence[str],
    *,
    env: dict[str, str],
    timeout_s: float,
    canaries: bool,
    mutate: Sequence[str] = (),
    patch_files: Collection[str] = (),
    allow: Collection[str] = (),
    limit: bool = False,
) -> WitnessedRun:
    """Run the task's test command on `test_ids` with the boot armed; with `canaries`, canaries planted in
    the files of `test_ids[0]` and of `mutate` (the tests to give mutants: `swe_grpo.grading.canaries`),
    shuffled in among the ids, and the ids handed to pytest off its command line (only their files are
    on it: `swe_grpo.grading.selection`); without, the ids on the command line; with `limit`, the runner's
    limits (`swe_grpo.grading.limits`). The report path is a shell variable of the command line, not
    exported: the code under test does not inherit it. The arguments travel in a file: thousands of them
    would not fit in one command-line argument."""
    q = shlex.quote
    token = secrets.token_hex(8)
    boot, bin_dir = f"{scratch}/boot-{token}", f"{scratch}/bin-{token}"
    nonce, audit_path, secret = secrets.token_hex(16), f"{scratch}/audit-{token}", f"{scratch}/secret-{token}"
    added = await _plant(sandbox, test_ids, mutate) if canaries else None
    ids = list(added.order) if added else list(test_ids)
    limit_secret_path, status_path = f"{scratch}/limit-{token}", f"{scratch}/limited-{token}"
    select_path = f"{scratch}/select-{token}"
    argv = selection_files(ids) if added else ids
    files: dict[str, str | bytes] = {
        f"{scratch}/argv-{token}": "".join(f"{arg}\n" for arg in argv),
        f"{boot}/sitecustomize.py": limit_source() + select_source() + boot_source(),
        **({select_path: selection_secret(ids)} if added else {}),
        audit_path: "",
        secret: boot_secret(nonce, audit_path, sandbox.workdir, allow, patch_files),
        **({f"{sandbox.workdir}/{path}": text for path, text in added.files.items()} if added else {}),
        **({limit_secret_path: limit_secret(status_path), status_path: ""} if limit else {}),
    }
    # One script writes them all (each put_file is a sandbox run of its own), and is gone, with the
    # secret it holds, before the test command starts.
    arm = f"{scratch}/arm-{token}"
    writes = "".join(
        f"base64 -d > {q(path)} <<'END'\n{base64.b64encode(_bytes(text)).decode()}\nEND\n"
        for path, text in files.items()
    )
    await sandbox.put_file(arm, f"set -e\numask 077\nmkdir -p {q(boot)}\n{writes}".encode(), mode=0o600)
    junit_path = f"{scratch}/junit-{token}.xml"
    command = (
        f"bash {q(arm)}; armed=$?; rm -f {q(arm)}; [ $armed = 0 ]"
        f' && {shim_script(q(boot), q(bin_dir))} && export PATH={q(bin_dir)}:"$PATH"'
        f" && mapfile -t args < {q(scratch)}/argv-{token} && SWE_GRPO_JUNIT_XML={q(junit_path)}"
        f' && {task.test_cmd or DEFAULT_TEST_CMD} "${{args[@]}}"'
    )
    full_env = {**env, **PINNED_ENV, BOOT_ENV: secret, **({LIMIT_ENV: limit_secret_path} if limit else {})}
    full_env.update({SELECT_ENV: select_path} if added else {})
    tests = await sandbox.exec(command, timeout_s=timeout_s, env=full_env, cwd=sandbox.workdir)
    # Both files are within the patch's reach: a report it deleted reads as empty (no start or exit record:
    # tampering, unless the run timed out, when no verdict is drawn from it), one it bloated as missing, and
    # neither is ever read past its cap or parsed on the event loop.
    audit_text = await _read_capped(sandbox, audit_path, _AUDIT_MAX_BYTES)
    audit = await parse_report(AuditReport.parse, audit_text or "", nonce) or AuditReport.parse("", nonce)
    installed = limit and limited(await _read_capped(sandbox, status_path, _STATUS_MAX_BYTES))
    # Whether a runner took the selection (its file is gone): the probe's to judge, in a run without the patch.
    # (Read whole when present: over a cap it would read as missing, as taken.)
    taken = added is not None and await _read_capped(sandbox, select_path, _JUNIT_MAX_BYTES) is None
    if tests.timed_out:
        return WitnessedRun(tests, None, audit, added, None, limit, installed, taken)
    junit_xml = await _read_capped(sandbox, junit_path, _JUNIT_MAX_BYTES)
    reports = await parse_report(RunReports.parse, ids, junit_xml, tests.stdout)
    if reports is None:  # a report too large to parse in its bounds reads as missing, as one over its cap does
        junit_xml = None
        reports = await parse_report(RunReports.parse, ids, None, tests.stdout) or RunReports(None, None)
    return WitnessedRun(tests, reports, audit, added, junit_xml, limit, installed, taken)


async def _plant(sandbox: Sandbox, test_ids: Sequence[str], mutate: Sequence[str]) -> Canaries:
    """Canaries for a run of `test_ids`, in the test files of `mutate` and `test_ids[0]` as they are now
    (test files are protected: the patch has not changed them; at most `_PLANT_FILES` of them)."""
    paths = list(dict.fromkeys(test_id.split("::", 1)[0] for test_id in (*mutate, test_ids[0])))[:_PLANT_FILES]
    sources = {}
    for path in paths:
        text = await _read_capped(sandbox, f"{sandbox.workdir}/{path}", _SOURCE_MAX_BYTES)
        if text is not None:
            sources[path] = text
    return Canaries.plant(test_ids, sources, mutate)


_PLANT_FILES = 4
_SOURCE_MAX_BYTES = 1024**2


def _bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode()


_AUDIT_MAX_BYTES = 4 * 1024**2
_JUNIT_MAX_BYTES = 64 * 1024**2
_STATUS_MAX_BYTES = 4096
# A parse of a report at its cap (tens of MiB of JUnit XML: hundreds of thousands of test cases) fits in these.
REPORT_TIMEOUT_S = 60.0
REPORT_MEMORY_BYTES = 1 << 30


async def parse_report(parse: Callable[..., T], *args: object) -> T | None:
    """`parse(*args)` on a report of the graded run (the patch's code wrote it, or could have) in a process of its
    own (`run_bounded`: a parser holds the GIL for its whole input, and would stall every rollout served
    beside this grade), within `REPORT_TIMEOUT_S` and `REPORT_MEMORY_BYTES`, its result within `run_bounded`'s
    default size (16 MiB pickled: a million distinct test names is over it); None, logged, when it is over one
    of them: the caller reads that report as missing."""
    try:
        return await run_bounded(parse, *args, timeout_s=REPORT_TIMEOUT_S, memory_bytes=REPORT_MEMORY_BYTES)
    except BoundExceeded as e:
        log.warning("a report of the graded run is read as missing: its parse is over its %s bound (%s)", e.bound, e)
        return None


async def _read_capped(sandbox: Sandbox, path: str, max_bytes: int) -> str | None:
    """A file of the graded run's scratch directory, or None when it is missing, unreadable or over `max_bytes`."""
    try:
        return (await sandbox.get_file(path, max_bytes=max_bytes)).decode("utf-8", "replace")
    except (SandboxError, FileTooLarge):
        return None


_PROBE = """\
# swe_grpo's grading probe (usercustomize.py in a probe-only HOME): at exit, record where this process
# looked for modules and where each top-level module it imported came from.
import atexit, json, os, sys


def _swe_grpo_probe():
    modules = {}
    for name, module in list(sys.modules.items()):
        if "." in name or module is None:
            continue
        origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(module, "__file__", None)
        if origin is None and getattr(module, "__path__", None):
            origin = next(iter(module.__path__), None)
        modules[name] = origin if isinstance(origin, str) else "built-in"
    out = os.path.join(os.environ["SWE_GRPO_PROBE_OUT"], f"{os.getpid()}.json")
    with open(out, "w") as f:
        json.dump({"path": [os.path.abspath(p or os.curdir) for p in sys.path], "modules": modules}, f)
        f.write("\\n")


atexit.register(_swe_grpo_probe)
"""


@dataclass(frozen=True)
class Probe:
    """What the probe found for a task: what its runner imports; whether the runner reports the grader's
    canaries as they are (`canaries`), prints the `-rA` summary with one closing line (`summary`), and
    runs in a Python process whose boot starts and ends cleanly (`audit`); `audit_allow`: the events the
    boot flagged without the patch (the project's own, allowed in its graded runs); `limits`: False once a
    run without the patch showed that the task's tests need what the runner's limits refuse
    (`lift_limits`)."""

    imports: RunnerImports
    canaries: bool = False
    summary: bool = False
    audit: bool = False
    audit_allow: tuple[str, ...] = ()
    limits: bool = True


_PROBED: dict[tuple[str | None, ...], Probe] = {}
_PROBED_MAX = 4096


def _runner_imports(probe_output: str, workdir: str) -> RunnerImports:
    """Parse the probe's JSON lines (one per Python process); the fallback when there are none."""
    records = []
    for line in probe_output.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not records:
        return RunnerImports()

    def inside(path: str) -> str | None:
        return "" if path == workdir else path[len(workdir) + 1 :] if path.startswith(workdir + "/") else None

    dirs = {inside(path) for record in records for path in record.get("path", [])} - {None}
    names = {
        name for record in records for name, origin in record.get("modules", {}).items() if inside(str(origin)) is None
    }
    return RunnerImports(search_dirs=frozenset({"", *dirs}), names=frozenset(names))  # type: ignore[arg-type]


async def probe_runner(backend: SandboxBackend, task: Task, env: dict[str, str], timeout_s: float) -> Probe:
    """Run the test command on one PASS_TO_PASS test (it passes, so it does not hang, without the patch;
    else the first FAIL_TO_PASS test) in a sandbox of its own, twice: with a usercustomize.py (in a HOME
    of its own) that records what every Python process imported, then as a graded run runs it (witnesses
    armed), to see which witnesses this runner supports; after the task's `grade_setup_cmd`, as a graded
    run. What it finds depends only on the task's base and environment: it is kept for the task's next
    grades."""
    key = _key(backend, task, env)
    if key in _PROBED:
        return _PROBED[key]
    test_id = (task.pass_to_pass or task.fail_to_pass)[0]
    q = shlex.quote

    async def probe(sandbox: Sandbox) -> Probe:
        made = await step(sandbox, "mktemp -d -t swe_grpo-probe.XXXXXXXXXX", "preparing the probe")
        scratch = made.stdout.strip()
        if made.exit_code != 0 or not scratch.startswith("/"):
            raise BrokenTask(failure("no scratch directory for the probe", made))
        if task.grade_setup_cmd:  # the graded runs' environment
            await grade_setup(sandbox, task, env)
        await sandbox.put_file(f"{scratch}/probe.py", _PROBE.encode())
        out = f"{scratch}/out"
        script = (
            f"export HOME={q(scratch)}/home SWE_GRPO_PROBE_OUT={q(out)} && mkdir -p {q(out)}"
            " && site=$(python3 -c 'import site; print(site.getusersitepackages())') && mkdir -p \"$site\""
            f' && cp {q(scratch)}/probe.py "$site/usercustomize.py" && SWE_GRPO_JUNIT_XML={q(scratch)}/junit.xml'
            f" && {{ {task.test_cmd or DEFAULT_TEST_CMD} {q(test_id)} >/dev/null 2>&1; }}"
            f"; cat {q(out)}/*.json 2>/dev/null"
        )
        probed = await sandbox.exec(script, timeout_s=timeout_s, env=env, cwd=sandbox.workdir)
        imports = _runner_imports("" if probed.timed_out else probed.stdout, sandbox.workdir)
        if probed.timed_out:
            return Probe(imports)
        witnessed = await witnessed_run(sandbox, scratch, task, [test_id], env=env, timeout_s=timeout_s, canaries=True)
        return _witnesses(witnessed, imports)

    found = await in_sandbox(backend, task, probe)
    if len(_PROBED) >= _PROBED_MAX:
        _PROBED.clear()
    _PROBED[key] = found
    return found


def _key(backend: SandboxBackend, task: Task, env: dict[str, str]) -> tuple[str | None, ...]:
    return (backend.name, task.repo, task.base_commit, task.image, task.test_cmd, task.grade_setup_cmd, str(env))


def lift_limits(backend: SandboxBackend, task: Task, env: dict[str, str], probe: Probe) -> Probe:
    """`probe` with the runner's limits off, kept for the task's next grades: its tests need them off."""
    lifted = replace(probe, limits=False)
    _PROBED[_key(backend, task, env)] = lifted
    return lifted


def _witnesses(run: WitnessedRun, imports: RunnerImports) -> Probe:
    """Which witnesses a run without the patch shows working."""
    reports, audit, canaries = run.reports, run.audit, run.canaries
    if reports is None or canaries is None:
        return Probe(imports)
    summary = reports.summary is not None and len(reports.final_lines) == 1
    # The canaries stand only where their ids stayed off the command line: the runner took the selection
    # and ran exactly it (a runner the boot does not reach runs the files whole).
    selected = {junit_key(test_id) for test_id in canaries.order}
    canaries_work = (
        run.selection_taken
        and reports.junit is not None
        and set(reports.junit) <= selected
        and run.tests.exit_code == 1
        and [reports.junit_status(test_id) for test_id in (*canaries.passing, *canaries.failing)]
        == ["passed", "failed"]
        and (not summary or not reports.disagreements(canaries.ids))
    )
    audit_works = audit.started and audit.ended and audit.pytest and not audit.forged
    allow = tuple(sorted({event.split(" ", 1)[0] for event in audit.events}))
    return Probe(imports, canaries_work, summary, audit_works, allow)
