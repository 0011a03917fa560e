"""The graded run and the verdict: see `swe_grpo.grading` for the rules they follow."""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from swe_grpo.grading.capability import CAPABILITIES, allowed_capabilities
from swe_grpo.grading.limits import KILLED_BY_LIMIT
from swe_grpo.grading.probe import Probe, WitnessedRun, lift_limits, parse_report, probe_runner, witnessed_run
from swe_grpo.grading.protect import command_words, doctest_examples, is_protected
from swe_grpo.grading.reports import PASS_STATUSES, report_statuses
from swe_grpo.grading.steps import (
    DEFAULT_TIMEOUT_S,
    STEP_TIMEOUT_S,
    BrokenTask,
    failure,
    grade_setup,
    in_sandbox,
    nul_list,
    step,
)
from swe_grpo.grading.tamper import gate_patch
from swe_grpo.sandbox.base import ExecResult, Exhaustion, Sandbox, SandboxBackend, SandboxError
from swe_grpo.tasks import Task
from swe_grpo.tasks.task import REWARD_MODES, RewardMode

Outcome = Literal[
    "resolved", "unresolved", "patch_apply_failed", "timeout", "resource_exhausted", "grading_tampered", "infra_error"
]

_LOG_TAIL_CHARS = 4000

#: The grader's witness layers, in `GradeResult.witnesses`' order: "scan", the capability gate on the patch
#: (`swe_grpo.grading.capability`, the primary layer, outside the runner), the pinned environment, the boot
#: (audit hook and exit scan: a tripwire inside the runner, never the only layer a grade rests on), the
#: canaries, the run's consistency with the
#: runner's `-rA` summary (every test and canary alike in both reports, the closing counts, the exit status),
#: and the runner's out-of-process limits (`swe_grpo.grading.limits`).
WITNESSES = ("scan", "pinned_env", "boot", "canaries", "consistency", "limits")


@dataclass(frozen=True)
class GradeResult:
    """The grade of one patch for one task. `reward` is 1.0 for `resolved`, 0.0 for model failures, None
    when there is no reward (infrastructure failures: never train on them as 0), and under the "fraction"
    `reward_mode` (the mode that produced it: the task's, else the run's) the share of FAIL_TO_PASS tests
    passing for an `unresolved` run whose PASS_TO_PASS tests all pass. `tests` maps
    every F2P/P2P test id to passed|xfail|xpass|failed|error|skipped|missing (empty when no report was
    obtained); `dropped_paths` are the paths removed from the patch as protected; `witnesses` names the
    layers of `WITNESSES` armed for this grade, as the task's probe decided (the boot, the canaries and the
    consistency checks only where it saw them work without the patch; the scan, the capability gate,
    unless the task allows every capability; empty when no probe result reached the grade: a broken task,
    a sandbox failure). "boot" there is a tripwire: what it saw counts (`grading_tampered`), but since it
    runs inside the process the patch's code runs in, no grade depends on it alone: every class of
    tampering it names is refused by the gate before the tests run. `timings` in seconds (`gate_s`: the
    gate, reading the files and judging them)."""

    instance_id: str
    outcome: Outcome
    reward: float | None
    f2p_passed: int = 0
    f2p_total: int = 0
    p2p_passed: int = 0
    p2p_total: int = 0
    tests: dict[str, str] = field(default_factory=dict)
    dropped_paths: tuple[str, ...] = ()
    error: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    log_tail: str = ""
    reward_mode: RewardMode = "binary"
    witnesses: tuple[str, ...] = ()


@dataclass
class _Run:
    dropped: tuple[str, ...] = ()
    apply_error: str | None = None  # the patch did not apply: the patch's fault
    scanned: list[str] = field(default_factory=list)  # the capability gate's findings: the tests did not run
    unparsed: list[str] = field(default_factory=list)  # files the gate could not parse: no reward from this run
    witnessed: WitnessedRun | None = None
    statuses: dict[str, str] | None = None
    exhausted: Exhaustion | None = None  # the limit the sandbox hit, seen once the tests ran
    probe: Probe | None = None


def _test_file(test_id: str) -> str:
    return test_id.split("::", 1)[0]


async def _touched(sandbox: Sandbox, base: str, patch_file: str, index: str) -> ExecResult:
    """Apply a patch to a scratch index holding `base`; stdout: `git diff --name-status -z` of it."""
    q = shlex.quote
    script = (
        f"export GIT_INDEX_FILE={q(index)} && git read-tree {q(base)} && git apply --cached {q(patch_file)}"
        f" && git diff --cached --name-status -z --no-renames {q(base)}"
    )
    return await step(sandbox, script, "git apply --cached")


def _paths(name_status: str) -> list[str]:
    items = nul_list(name_status)
    return items[1::2]  # (status, path) pairs


async def _doctests_changed(sandbox: Sandbox, base: str, index: str, paths: Iterable[str]) -> list[str]:
    """Those of `paths` (source modules whose doctests the task runs) whose doctest examples differ
    between `base` and the index `index`."""
    changed = []
    q = shlex.quote
    for path in paths:
        shown = await step(
            sandbox,
            f"git show {q(base)}:{q(path)}; printf '\\0'; GIT_INDEX_FILE={q(index)} git show :{q(path)}",
            "reading a doctest module",
        )
        before, _, after = shown.stdout.partition("\0")
        if doctest_examples(before) != doctest_examples(after):
            changed.append(path)
    return changed


async def _graded_run(
    sandbox: Sandbox,
    task: Task,
    patch: str,
    *,
    timeout_s: float,
    env: dict[str, str],
    probe: Probe,
    limit: bool,
    timings: dict[str, float],
) -> _Run:
    q = shlex.quote
    base = task.base_commit
    started = time.monotonic()
    # Without the base commit every apply below would fail, and be blamed on the patch.
    prepare = f"git cat-file -e {q(base)}^{{commit}} && mktemp -d -t swe_grpo-grade.XXXXXXXXXX"
    made = await step(sandbox, prepare, "preparing")
    scratch = made.stdout.strip()
    if made.exit_code != 0 or not scratch.startswith("/"):
        raise BrokenTask(failure("no base_commit in the sandbox's repository, or no scratch directory", made))
    test_ids = [*task.fail_to_pass, *task.pass_to_pass]
    runner = probe.imports

    # A test id's file is protected, except a source module whose doctests are tests: the fix may have to
    # change it, so only its doctest examples are (checked below).
    named = {_test_file(test_id) for test_id in test_ids}
    doctest_modules = {path for path in named if path.endswith(".py") and not is_protected(path)}
    explicit = named - doctest_modules
    words = command_words(task.test_cmd or "")
    if words:  # the scripts test_cmd runs, where they are files of the repository
        listed = await step(sandbox, f"git ls-tree -z {q(base)} -- {' '.join(map(q, words))}", "git ls-tree")
        explicit.update(entry.split("\t", 1)[1] for entry in nul_list(listed.stdout) if " blob " in entry)
    if task.test_patch:
        await sandbox.put_file(f"{scratch}/test.patch", task.test_patch.encode())
        touched = await _touched(sandbox, base, f"{scratch}/test.patch", f"{scratch}/test.index")
        if touched.exit_code != 0:
            raise BrokenTask(failure("the task's test_patch does not apply to base_commit", touched))
        explicit.update(_paths(touched.stdout))

    if task.grade_setup_cmd:  # the task author's, at base_commit: nothing of the patch runs outside the tests
        setup_started = time.monotonic()
        await grade_setup(sandbox, task, env)
        timings["setup_s"] = time.monotonic() - setup_started
        started += timings["setup_s"]  # apply_s: the patch's steps only
    run = _Run(probe=probe)
    kept: list[str] = []
    if patch.strip():
        index = f"{scratch}/agent.index"
        await sandbox.put_file(f"{scratch}/agent.patch", (patch if patch.endswith("\n") else patch + "\n").encode())
        touched = await _touched(sandbox, base, f"{scratch}/agent.patch", index)
        if touched.exit_code != 0:
            run.apply_error = failure("git apply", touched)
            return run
        paths = _paths(touched.stdout)
        protected = [path for path in paths if is_protected(path, explicit, runner)]
        run.dropped = (*protected, *await _doctests_changed(sandbox, base, index, doctest_modules & set(paths)))
        reset = ""
        if run.dropped:
            await sandbox.put_file(f"{scratch}/dropped", "".join(f"{path}\0" for path in run.dropped).encode())
            reset = f"xargs -0 -a {q(scratch)}/dropped git --literal-pathspecs reset -q {q(base)} -- && "
        filtered = await step(
            sandbox,
            f"export GIT_INDEX_FILE={q(index)} && {reset}"
            f"git diff --cached --binary --no-renames --no-color --no-ext-diff --src-prefix=a/ --dst-prefix=b/"
            f" {q(base)} > {q(scratch)}/filtered.patch && git diff --cached --name-status -z --no-renames {q(base)}",
            "filtering the patch",
        )
        if filtered.exit_code != 0:
            raise BrokenTask(failure("filtering the patch", filtered))
        kept = _paths(filtered.stdout)
        if set(kept) & set(run.dropped) or any(is_protected(path, explicit, runner) for path in kept):
            raise BrokenTask(f"filtering the patch left protected paths in it: {kept}")  # never grade that
        if kept:
            gate_started = time.monotonic()
            gated = await gate_patch(sandbox, scratch, base, index, kept, task.tamper_allow)
            timings["gate_s"] = time.monotonic() - gate_started
            run.scanned, run.unparsed = gated.findings, gated.unparsed
            if run.scanned:
                return run
            applied = await step(sandbox, f"git apply {q(scratch)}/filtered.patch", "git apply")
            if applied.exit_code != 0:
                run.apply_error = failure("git apply (protected paths removed)", applied)
                return run
    if task.test_patch:
        applied = await step(sandbox, f"git apply {q(scratch)}/test.patch", "applying the test patch")
        if applied.exit_code != 0:
            raise BrokenTask(failure("the task's test_patch does not apply after the patch", applied))
    timings["apply_s"] = time.monotonic() - started

    run.witnessed = await witnessed_run(
        sandbox,
        scratch,
        task,
        test_ids,
        env=env,
        timeout_s=timeout_s,
        canaries=probe.canaries,
        mutate=task.fail_to_pass,
        patch_files=kept,
        allow=(*probe.audit_allow, *task.tamper_allow),
        limit=limit,
    )
    tests = run.witnessed.tests
    timings["tests_s"] = tests.wall_s
    timings["exit_scan_s"] = run.witnessed.audit.exit_scan_s
    run.exhausted = await sandbox.exhausted()
    if run.witnessed.reports is not None:
        # Bounded, off the event loop: the report may be tens of MiB (its cap), as the patch's code left it.
        run.statuses = await parse_report(report_statuses, test_ids, run.witnessed.junit_xml, tests.stdout)
    return run


def _env(plugin_autoload: bool) -> dict[str, str]:
    return {} if plugin_autoload else {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


async def _run(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    *,
    timeout_s: float,
    plugin_autoload: bool,
    timings: dict[str, float],
) -> _Run:
    env = _env(plugin_autoload)
    started = time.monotonic()
    probe = await probe_runner(backend, task, env, min(timeout_s, STEP_TIMEOUT_S))
    timings["probe_s"] = time.monotonic() - started
    limit = task.runner_limits is not False and probe.limits

    async def graded(sandbox: Sandbox) -> _Run:
        return await _graded_run(
            sandbox, task, patch, timeout_s=timeout_s, env=env, probe=probe, limit=limit, timings=timings
        )

    return await in_sandbox(backend, task, graded, timings)


_MISSING_FIXTURE = re.compile(r"fixture '(\w+)' not found")
_ASYNC_SKIPPED = "async def functions are not natively supported"


def _plugin_hint(output: str, plugin_autoload: bool) -> str | None:
    """What the run's output says about a pytest plugin its tests need and did not have."""
    missing = sorted(set(_MISSING_FIXTURE.findall(output)))
    needs = [f"fixture(s) {', '.join(map(repr, missing))}"] if missing else []
    if _ASYNC_SKIPPED in output:
        needs.append("an async test plugin (pytest-asyncio, anyio): async tests were skipped")
    if not needs:
        return None
    why = "plugin autoload is off for this grade" if not plugin_autoload else "no installed plugin provides them"
    return f"the tests need {' and '.join(needs)}, which no loaded pytest plugin provides ({why})"


def _join(*parts: str | None) -> str | None:
    return "; ".join(part for part in parts if part) or None


def _armed(task: Task, probe: Probe | None, limited: bool) -> tuple[str, ...]:
    """The layers of `WITNESSES` a grade of `task` arms, given what its probe found and whether the runner's
    limits were in force."""
    if probe is None:
        return ()
    armed = {
        "scan": not set(CAPABILITIES) <= allowed_capabilities(task.tamper_allow),
        "pinned_env": True,
        "boot": probe.audit,
        "canaries": probe.canaries,
        "consistency": probe.summary,
        "limits": limited,
    }
    return tuple(layer for layer in WITNESSES if armed[layer])


def _finished(run: _Run) -> bool:
    return run.witnessed is not None and not run.witnessed.tests.timed_out and run.statuses is not None


def _f2p_passes(task: Task, test_id: str) -> frozenset[str]:
    """The statuses in which a FAIL_TO_PASS test counts as passed: PASSED, or what its gold run recorded."""
    return frozenset({"passed", task.expected_statuses.get(test_id, "passed")})


def run_inconsistency(
    run: WitnessedRun, probe: Probe | None, test_ids: list[str], all_passed: bool = True
) -> str | None:
    """Why a run whose statuses would earn a reward cannot be trusted, when it cannot: the witnesses that
    the probe showed working for this runner disagree with the statuses or with each other.
    `all_passed`: every graded test passed (a runner that prints a summary then exits 0 without
    canaries; with a failing test, 1)."""
    reports = run.reports
    if reports is None or probe is None:
        return None
    if probe.summary:
        if reports.summary is None:
            return "the run printed no test summary, which this runner prints"
        differ = reports.disagreements([*test_ids, *(run.canaries.ids if run.canaries else ())])
        if differ:
            return "the JUnit report and the summary disagree: " + "; ".join(differ[:5])
        counts = reports.count_mismatch()
        if counts is not None:
            return counts
    if run.canaries is not None:
        canaries = run.canaries
        got = [reports.junit_status(test_id) for test_id in (*canaries.passing, *canaries.failing)]
        if got != ["passed", "failed"]:
            return f"the grader's canary tests (one must pass, one must fail) came out {got[0]} and {got[1]}"
        for mutant, original in canaries.mutants.items():
            status = reports.junit_status(mutant)
            if reports.junit_status(original) == "passed" and status not in ("failed", "error"):
                return f"the grader's copy of {original} with an expected value changed came out {status}, not failed"
        if run.tests.exit_code != 1:
            return f"the runner exited {run.tests.exit_code} although the grader's failing canary failed"
    elif probe.summary and run.tests.exit_code != (0 if all_passed else 1):
        got = "every test passed" if all_passed else "some tests failed"
        return f"the runner exited {run.tests.exit_code} although {got}"
    return None


async def _tests_need_more(task: Task, patch: str, attempt: Callable[[str, dict[str, float]], Awaitable[_Run]]) -> bool:
    """Whether the task's tests need what the runner's limits refuse, for a patch whose run they ended: the
    run was the gold fix's own (`patch` is `task.patch`), or a control run ended too: without the patch,
    then with the gold fix when the task has one (a FAIL_TO_PASS test may spawn only once fixed)."""
    if task.patch.strip() and patch == task.patch:
        return True
    for control_patch in ("", *([task.patch] if task.patch.strip() else [])):
        control = await attempt(control_patch, {})
        # Ended by the limits too; or run without them, because a grade of the same task beside this one (the
        # gold fix's, say) found they are needed and lifted them meanwhile.
        if control.witnessed is not None and (control.witnessed.killed_by_limit or not control.witnessed.limited):
            return True
    return False


async def grade(
    task: Task,
    patch: str,
    backend: SandboxBackend,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugin_autoload: bool = True,
    reward_mode: RewardMode = "binary",
) -> GradeResult:
    """Grade `patch` (a `git apply`-able diff against `task.base_commit`; "" for none) in a fresh sandbox;
    see the module docstring for the rules. `timeout_s` bounds the test run. `plugin_autoload` (the
    worker's setting; `task.plugin_autoload`, when set, wins) lets pytest load the plugins installed in
    the sandbox, as SWE-bench's harness does (repositories whose tests use pytest-mock's `mocker` need
    it); a patch cannot bring a plugin in either way. `reward_mode` (the run's; `task.reward_mode`, when
    set, wins) turns the statuses into a reward: "binary" or "fraction" (`swe_grpo.grading`). Never raises
    for a sandbox failure (`infra_error`); cancellation propagates, after the sandboxes are destroyed."""
    if task.plugin_autoload is not None:
        plugin_autoload = task.plugin_autoload
    mode = task.reward_mode or reward_mode
    if mode not in REWARD_MODES:
        raise ValueError(f"unknown reward mode {mode!r}: choose one of {', '.join(REWARD_MODES)}")
    started = time.monotonic()
    timings: dict[str, float] = {}
    run = _Run()

    def result(outcome: Outcome, reward: float | None, error: str | None = None) -> GradeResult:
        statuses = run.statuses or {}
        f2p, p2p = task.fail_to_pass, task.pass_to_pass
        tests = run.witnessed.tests if run.witnessed is not None else None
        output = tests.stdout + tests.stderr if tests is not None else ""
        return GradeResult(
            instance_id=task.instance_id,
            outcome=outcome,
            reward=reward,
            f2p_passed=sum(statuses.get(test_id) in PASS_STATUSES for test_id in f2p),
            f2p_total=len(f2p),
            p2p_passed=sum(statuses.get(test_id) in PASS_STATUSES for test_id in p2p),
            p2p_total=len(p2p),
            tests=statuses,
            dropped_paths=run.dropped,
            error=error if outcome == "resolved" else _join(error, _plugin_hint(output, plugin_autoload)),
            timings={**timings, "total_s": time.monotonic() - started},
            log_tail=output[-_LOG_TAIL_CHARS:],
            reward_mode=mode,
            witnesses=_armed(task, run.probe, run.witnessed is not None and run.witnessed.limits_installed),
        )

    async def attempt(patch: str, timings: dict[str, float]) -> _Run:
        return await _run(task, patch, backend, timeout_s=timeout_s, plugin_autoload=plugin_autoload, timings=timings)

    if not task.fail_to_pass:  # nothing could show that the patch fixes anything
        return result("infra_error", None, "the task names no FAIL_TO_PASS test")
    try:
        run = await attempt(patch, timings)
        if run.apply_error is not None:
            return result("patch_apply_failed", 0.0, run.apply_error)
        if run.scanned:
            return result("grading_tampered", 0.0, "static scan: " + "; ".join(run.scanned))
        assert run.witnessed is not None  # the patch applied and passed the scan, so the tests ran
        if run.witnessed.killed_by_limit:
            # Never calibrated: whose doing? When the task's tests need what the limits refuse (the gold fix's
            # run, or a control run without the patch or with the gold fix, is ended too), they are off for the
            # task and the patch is graded again without them.
            if task.runner_limits is None and run.probe is not None:
                control_started = time.monotonic()
                needed = await _tests_need_more(task, patch, attempt)
                timings["control_s"] = time.monotonic() - control_started
                if needed:
                    lift_limits(backend, task, _env(plugin_autoload), run.probe)
                    run = await attempt(patch, timings)
                    assert run.witnessed is not None  # the same patch, applied and scanned as before
            if run.witnessed.killed_by_limit:
                error = "the runner made a call its limits refuse (a new process, an exec, another process's "
                error += f"memory or a re-pointed descriptor) and was ended (exit {KILLED_BY_LIMIT}, SIGSYS)"
                return result("grading_tampered", 0.0, "limits: " + error)
        tests = run.witnessed.tests
        if run.exhausted is None and not tests.timed_out and run.probe is not None and run.probe.audit:
            tampered = run.witnessed.audit.tampering()
            if tampered is not None:
                return result("grading_tampered", 0.0, f"audit: {tampered}")
        if run.exhausted is not None or not _finished(run):
            # No verdict, or none to trust. Whose fault? Run the tests once more without the patch.
            control_started = time.monotonic()
            control = await attempt("", {})
            timings["control_s"] = time.monotonic() - control_started
            if run.exhausted is not None:
                if control.exhausted is not None:
                    error = f"the tests run the grading sandbox out of {control.exhausted} without the patch too"
                    return result("infra_error", None, f"grading: {error} (its {control.exhausted} limit)")
                error = f"the patch's code ran the grading sandbox out of {run.exhausted} when the tests ran"
                return result("resource_exhausted", 0.0, f"grading: {error} (its {run.exhausted} limit)")
            control_ok = _finished(control)
            exit_code = tests.exit_code
            if tests.timed_out:
                cause = "they finish without it" if control_ok else "they do not finish without it either"
                error = f"the tests did not finish in {timeout_s:g}s with the patch; {cause}"
                return result("timeout", 0.0 if control_ok else None, error)
            if control_ok:
                return result("unresolved", 0.0, f"the patch broke the test runner: no report (exit {exit_code})")
            return result("infra_error", None, f"the test command yields no report (exit {exit_code}), patch or not")
        statuses = run.statuses or {}
        f2p_failed = [t for t in task.fail_to_pass if statuses.get(t) not in _f2p_passes(task, t)]
        p2p_failed = [t for t in task.pass_to_pass if statuses.get(t) not in PASS_STATUSES]
        resolved = not f2p_failed and not p2p_failed
        # A test no report names is failed: a patch that breaks collection or deletes tests earns nothing.
        reward = 1.0 if resolved else 0.0
        if mode == "fraction" and not p2p_failed:
            reward = (len(task.fail_to_pass) - len(f2p_failed)) / len(task.fail_to_pass)
        strict = [f"{t} ({statuses.get(t)})" for t in f2p_failed if statuses.get(t) in PASS_STATUSES]
        error = f"a FAIL_TO_PASS test passes only as PASSED: {', '.join(strict)}" if strict else None
        if reward == 0.0:
            return result("unresolved", 0.0, error)
        # Any reward must come from a complete, consistent run, a partial one as much as a resolving one.
        if run.witnessed.junit_xml is None:
            return result("unresolved", 0.0, "no JUnit report: the terminal summary alone resolves nothing")
        tampered = run_inconsistency(
            run.witnessed, run.probe, [*task.fail_to_pass, *task.pass_to_pass], all_passed=resolved
        )
        if tampered is not None:
            return result("grading_tampered", 0.0, tampered)
        if run.unparsed:  # the runner's Python read what the gate's could not: the gate never saw that code
            error = f"the grader's Python cannot parse {', '.join(run.unparsed[:5])}, and the run would earn a reward"
            return result("grading_tampered", 0.0, f"static scan: {error}")
        return result("resolved", 1.0) if resolved else result("unresolved", reward, error)
    except BrokenTask as exc:
        return result("infra_error", None, str(exc))
    except SandboxError as exc:
        return result("infra_error", None, f"sandbox: {exc}")
