"""Grading: does a patch resolve a task? Run the task's tests where the patch's author cannot reach them.

`grade(task, patch, backend)` works in a FRESH sandbox (`backend.create(task, network=False)`: the
repository at `base_commit`, no network) and always destroys it:

1. A probe, before the patch and in a sandbox of its own (nothing it writes reaches the graded run): the
   test command runs on one PASS_TO_PASS test (else the first FAIL_TO_PASS one) with a usercustomize.py
   (in a HOME of its own) that records, for every Python process, `sys.path` and where each top-level
   module came from (`RunnerImports`), then once more as the graded run runs it, witnesses armed (see
   5), to learn which witnesses this runner supports (`Probe`; all kept per task base, test command,
   plugin setting and backend, so a task's later grades reuse it).
   Then the task's `grade_setup_cmd`, if any (see "Task setup" below), in the graded sandbox and the
   probe's alike.
2. The patch is applied to a scratch git index holding `base_commit` (`git apply --cached`), so git's
   own parser decides what it touches (renames count as delete + add). Every touched path that is
   protected (see `is_protected`) is reset to `base_commit` in that index, and so is a source module
   whose doctests the task runs when the patch changes its doctest examples; the rest is diffed into
   a filtered patch, which is checked to contain no dropped path and applied to the working tree.
   A patch that git cannot apply is `patch_apply_failed` (a model failure; so is a filtered patch that
   does not apply to the working tree, which only a sandbox whose tree differs from `base_commit` or
   a patch playing with symlinks can cause). Before it is applied, the capability gate (the primary
   layer, `swe_grpo.grading.capability`, outside every process the patch runs in) parses every Python
   file it touches as `base_commit` has it and as the filtered patch leaves it, read out of the index
   with git, and names each capability a file uses after and not before: runtime introspection (gc,
   ctypes, frames, trace hooks, code objects, dunder writes, the import system, builtins, namespaces,
   writes into imported modules), process and descriptor control (fork/exec/spawn/_exit/kill, dup2,
   subprocess, multiprocessing, signal, atexit, faulthandler, finalizers, argv and /proc), dynamic code
   and names (exec/eval/compile, imports by computed name, getattr and kin with a name built at run
   time), the test machinery (pytest, _pytest, pluggy, unittest, doctest, bdb, the test modules), and
   non-UTF-8 code, coding cookies, bytecode and extension files. A finding is `grading_tampered`
   ("static scan: <capability> in <path>: <line>") and the tests do not run. A task may allow
   capabilities by name (`Task.tamper_allow`, for projects that are themselves test tools). A file the
   grader's Python cannot parse lets the run earn nothing (`grading_tampered` where it would).
3. The task's `test_patch` is applied (it must apply: if not, the task is broken: `infra_error`).
4. All FAIL_TO_PASS and PASS_TO_PASS tests run in ONE test-runner call: `task.test_cmd` or `python3 -m pytest
   -rA -p no:cacheprovider --junitxml="$SWE_GRPO_JUNIT_XML"`, with the test ids appended, or, where the
   canaries are armed, only the test files (the ids reach pytest off its command line and environment:
   `swe_grpo.grading.selection`). `SWE_GRPO_JUNIT_XML` is a shell variable of that command line, NOT exported:
   the code under test does not inherit it. Pytest plugins installed in the sandbox load
   (`PYTEST_DISABLE_PLUGIN_AUTOLOAD=1` only when plugin autoload is off: `task.plugin_autoload`, else the
   worker's setting, on by default). The environment is pinned: `PYTHONNOUSERSITE=1` (no user site, wherever
   the patch's code wrote one), `PYTEST_ADDOPTS` and `PYTEST_PLUGINS` empty.
5. Witnesses (`swe_grpo.grading.tamper`), each used where the probe saw it work without the patch: canaries
   (`swe_grpo.grading.canaries`: tests named and placed like the project's own, in its test files, shuffled in
   among the task's ids, none of them on the runner's command line: one must pass, one must fail, and a copy
   of each FAIL_TO_PASS test with an expected value changed must fail when the original passes), the runner's
   limits (`swe_grpo.grading.limits`: a seccomp filter the runner installs before any repository code; a
   runner that forks, execs, reaches into another process or re-points pytest's saved descriptors is ended
   with SIGSYS, read from its exit status as the sandbox reports it, never from the runner:
   `grading_tampered`; off for a task whose base suite needs them, as `Task.runner_limits` or a run without
   the patch shows), and the boot: a sitecustomize.py that every `python`/`python3` of the command runs before
   any repository code, installing a PEP 578 audit hook (trace/profile functions, exec of the runner, a pytest
   started from inside, a code object replaced, another audit hook, the C API through ctypes) and, at the
   runner's exit, a scan for the patch's functions inside pytest, pluggy, unittest and the other runner
   modules or among pytest's hook implementations. Its report carries a per-grade nonce; a report with an
   event, a foreign line, or without the runner's start or exit record is `grading_tampered`.
6. Per-test statuses come from the JUnit XML and the `-rA` summary on stdout together (see
   `report_statuses`; the worst wins). A FAIL_TO_PASS test passes only as PASSED (an XFAIL or XPASS of
   one is not a fix, unless `Task.expected_statuses` records that status from its gold run:
   `gold_statuses`, `swe-grpo tasks calibrate`); a PASS_TO_PASS test passes as PASSED, XFAIL or a
   non-strict XPASS (SWE-bench semantics; JUnit writes that XPASS as a pass, the summary names it); a
   test no report names counts as failed. Then a run that would resolve must be complete and consistent, or it
   is `grading_tampered`: a JUnit report (the summary alone resolves nothing: `unresolved`), the summary
   where this runner prints one, the two agreeing about every test and canary, the summary's closing
   counts matching its status lines and the JUnit testcases, the canaries as they must be, and the exit
   status matching (1, for the failing canary). A task without FAIL_TO_PASS tests cannot be resolved
   (`infra_error`). When the tests need a fixture no loaded plugin provides ("fixture 'mocker' not
   found") or async tests were skipped for want of a plugin, the grade's `error` says so.
   `GradeResult.witnesses` names the layers armed for the grade (`WITNESSES`), as the probe decided.
   The boot is a tripwire: what it sees counts, but no grade depends on it alone (a patch written
   against it can turn it off from inside the runner; each class it names is refused by the gate too).

Why protected paths, not just "the files the test patch touches" (what SWE-bench reverts): a patch could
otherwise make tests pass without fixing anything, by editing or deleting tests, adding a conftest.py
whose hooks rewrite reports, turning on a plugin through pytest.ini/tox.ini/setup.cfg/pyproject.toml
`addopts` or through an entry point in a `*.dist-info` directory (found because the repository is on
sys.path), shadowing a module the runner imports (pytest, or `attr`, which pytest 7 imports, or a
plugin's imports) with a module of the same name in a directory on the runner's sys.path, adding
sitecustomize.py / usercustomize.py / `*.pth` / bytecode, or rewriting the script `test_cmd` runs
(`bash run_tests.sh`). All of these are protected, so they keep their `base_commit` contents (test-patch
contents for the test files). Nothing the patch writes is read by the grader: the report files live
outside the repository under a random name, and a report written by anyone else cannot vouch for a test
the other report says failed.

Plugin autoload is on by default because SWE-bench's harness runs with the image's installed plugins
(repositories whose tests use pytest-mock's `mocker` cannot resolve without them), and a patch cannot
add a plugin either way: plugin metadata (`*.dist-info`, `*.egg-info`, `.pth`), configuration and
start-up hooks are protected. tests/test_real_projects.py grades the whole cheat catalogue with
autoload on.

Outcomes and rewards (a `None` reward means "no reward: never train on this as 0"):
    resolved 1.0 | unresolved 0.0 (a share under "fraction", below) | patch_apply_failed 0.0 |
    grading_tampered 0.0: the capability gate (2), the runner's limits, the audit report or an inconsistent
        run (6) shows the patch's code reaching into the test machinery; `error` says which and what
    timeout: 0.0 when the tests finish in time without the patch (so the patch made them hang), else None
    resource_exhausted 0.0: the test run hit a limit of the grading sandbox (memory, processes or disk:
        `Sandbox.exhausted()`, named in `error`, which starts with "grading:") that it stays within
        without the patch; with the patch's help it stays within none: `infra_error`
    infra_error None (sandbox failures, broken tasks; the cause is in `error`)
A test run that yields no report at all (and, where the boot works, ended as an interpreter does: one
that did not is `grading_tampered`), or hits a limit, is re-run once without the patch (a control run)
to find out whose fault it is: when the control run does report, the patch broke the runner:
`unresolved`; when it stays within the limits, the patch's code exhausted the sandbox.

Reward modes (`grade(..., reward_mode=)`, the run's; `Task.reward_mode` wins; `GradeResult.reward_mode`
says which produced the reward): "binary" (the default, SWE-bench's: 1.0 iff every FAIL_TO_PASS and
PASS_TO_PASS test passes) and "fraction" (the share of FAIL_TO_PASS tests that pass, 0.0 when any
PASS_TO_PASS test does not pass; outcome `unresolved` below 1.0). The share counts every FAIL_TO_PASS test
the task names: one no report names (deleted, not collected) is failed, so breaking collection or
deleting tests never raises it. Only the verdict of a finished run is a share: every other outcome keeps
its reward in both modes, and a partial reward must pass the same checks as a resolving run (a JUnit
report, the reports agreeing, the canaries, the exit status), or it is `grading_tampered` / `unresolved`.

Task setup: `Task.grade_setup_cmd` (the task author's shell command, only from the task row) runs in the
repository of the grading sandbox (no network) at `base_commit`, before the patch and the test patch are
applied, so nothing of the patch runs outside the witnessed test run; within `Task.setup_timeout_s`. A
failure, a timeout, or a tracked file it changed is the task's: `infra_error`, reward None.

Why `resource_exhausted` with reward 0.0, whatever the tests said: the tests import the patch's code, so
a fork bomb, a memory hog or a disk filler in it runs in the grading sandbox, and that is the policy's
doing, as in its own sandbox (`swe_grpo.rollout`): trained on as 0, so the policy learns not to. The
sandbox's limits kept it from harming any other grade or rollout, and a verdict reached in a sandbox at
its limits is not trusted (a refused fork or an OOM kill can change what a test sees). The control run
keeps a task whose own tests need more than the limits from being blamed on the patch.

What this cannot stop: the code under test runs inside the test runner's process, as the same user, so
nothing in that process is trusted on its own; the gate judges the patch's text, and what it does not
read it cannot refuse. Open: a capability the base file already uses may be used for anything in that
file (allowances are per file); a name built in a way the gate does not fold and handed to a sink it does
not know (a format string's `{0.attr}` made at run time); writes into objects reached without any of the
capabilities (an object a test hands the patched function); code that only behaves differently for the
tests' inputs, which is a fix as far as the tests can tell; non-Python code the tests run (a C extension
the task builds, a shell script the tests call). Capabilities and events that a project uses by being
a test tool (its own pytest plugin, tests that run pytest) must be allowed per task (`Task.tamper_allow`),
or its gold patch grades `grading_tampered`.
The boot and the canaries need a pytest-like runner started through `python`/`python3` on PATH; a task
whose runner the probe does not see them work on keeps the other layers only (a `test_cmd` running
unittest or a script gets the gate, the pinned environment and the strict, JUnit-only statuses). What
a `test_cmd` script runs in turn (another script it calls) is protected only when it is test code or
configuration by name. The probe sees the modules imported on the way to one test; a module that only
other tests' runs import lazily is covered when it is in the standard library or named pytest*.
"""

from swe_grpo.grading.canaries import Canaries
from swe_grpo.grading.capability import CAPABILITIES, FileChange, GateResult, gate
from swe_grpo.grading.gold import Calibration, GoldUnresolved, calibrate_file, gold_statuses
from swe_grpo.grading.predictions import grade_predictions, load_predictions
from swe_grpo.grading.protect import RunnerImports, command_words, doctest_examples, is_protected
from swe_grpo.grading.reports import PASS_STATUSES, RunReports, junit_key, report_statuses
from swe_grpo.grading.run import WITNESSES, GradeResult, Outcome, grade
from swe_grpo.grading.steps import DEFAULT_TEST_CMD, DEFAULT_TIMEOUT_S
from swe_grpo.grading.tamper import SCAN_RULES, AuditReport

__all__ = [
    "CAPABILITIES",
    "DEFAULT_TEST_CMD",
    "DEFAULT_TIMEOUT_S",
    "PASS_STATUSES",
    "SCAN_RULES",
    "WITNESSES",
    "AuditReport",
    "Calibration",
    "Canaries",
    "FileChange",
    "GateResult",
    "GoldUnresolved",
    "GradeResult",
    "Outcome",
    "RunReports",
    "RunnerImports",
    "calibrate_file",
    "command_words",
    "doctest_examples",
    "gate",
    "gold_statuses",
    "grade",
    "grade_predictions",
    "is_protected",
    "junit_key",
    "load_predictions",
    "report_statuses",
]
