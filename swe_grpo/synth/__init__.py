"""Task synthesis: tasks made from real projects by mutating the code their own tests run (SWE-smith style).

    swe-grpo tasks synth more-itertools==10.5.0 ./my-project /path/to/repo --out tasks/synth

For each SOURCE (a pinned PyPI requirement, whose sdist is fetched; a git repository, whose HEAD is taken;
a directory), in sandboxes without network (`swe_grpo.synth.suite`): `local` (the host's python3 and its
packages) or `docker` (an image per project with the test requirements it declares installed,
`swe_grpo.synth.environment`; the rows' `image`):
1. Baseline: the suite runs twice on the clean code, once with a tracer that records which functions
   each test runs. Tests whose result differs between the two runs are flaky and left out; the tests
   that passed both times run once more as the grader runs them (only them, by id), and those still
   passing are the stable tests. No report, no passing test, or none passing when run by id:
   `SynthError` ("the suite does not run"),
   unless pytest rejected the options of the project's own configuration (`addopts` naming a plugin that is
   not installed): then the suite runs again with `-o addopts=`, and the tasks' `test_cmd` says so.
   unittest suites run the same way (pytest collects `unittest.TestCase` classes).
2. Candidates (`swe_grpo.synth.mutate`): every mutation of every function a stable test runs, in files
   the grader lets a patch change (`swe_grpo.grading.is_protected`), in a seeded order that spreads over
   functions. None: `SynthError` ("no covered function").
3. Validation, `jobs` candidates at a time, until `max_per_project` are validated: the mutant is a root
   commit (the BUGGY code is the base commit; nothing of the clean code is in its history) on its own
   branch in `out/repos/<project>.git`; the stable tests covering the mutated function run on it:
   FAIL_TO_PASS = those that do not pass; PASS_TO_PASS = every other stable test. No FAIL_TO_PASS: the
   candidate is rejected. Then the real grader (`swe_grpo.grading.grade`) must grade the gold patch (the
   revert of the mutation, a minimal diff) `resolved` and the empty patch `unresolved`, else rejected.
   A validated candidate whose problem statement an earlier one already has (the same tests failing with
   the same messages: to an agent, the same task) is left out of the tasks.
4. `out/tasks.jsonl`: one row per validated task (`load_tasks`, `swe-grpo grade` and `swe-grpo rollout`
   read it as it is; `repo` is `repos/<project>.git`, relative to the file), with `test_patch` empty, a
   problem statement naming the failing tests and their failure messages (`swe_grpo.synth.statement`),
   and a `synth` field saying which operator changed which function.

Deterministic: the same sources, seed and limit give the same tasks (commits have fixed dates and
identities; flaky validations aside). Resumable: every decision is appended to `out/.synth/`, and a rerun
validates only the candidates not yet decided.
"""

from swe_grpo.synth.build import ProjectReport, SynthConfig, synthesize
from swe_grpo.synth.mutate import Mutation, mutations
from swe_grpo.synth.source import SynthError, fetch_source

__all__ = ["Mutation", "ProjectReport", "SynthConfig", "SynthError", "fetch_source", "mutations", "synthesize"]
