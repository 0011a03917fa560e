"""`synthesize`: sources in, validated tasks out (see `swe_grpo.synth` for what it guarantees).

Files under `out`: `tasks.jsonl` (rewritten after every decision, so an interrupted run leaves the tasks
validated so far), `repos/<project>.git` (a bare repository: a `clean` branch and one branch per
candidate, each a root commit), and `.synth/` (the state a rerun resumes from: each project's baseline,
and `decisions.jsonl`, one line per validated or rejected candidate).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from swe_grpo.grading import DEFAULT_TEST_CMD, grade, is_protected
from swe_grpo.grading.gold import runner_limits
from swe_grpo.paths import cache_root
from swe_grpo.sandbox.base import SandboxBackend, SandboxError
from swe_grpo.sandbox.docker import DockerBackend
from swe_grpo.synth.environment import environment_image, requirements
from swe_grpo.synth.mutate import Mutation, mutations
from swe_grpo.synth.source import Source, SynthError, commit_tree, fetch_source, git
from swe_grpo.synth.statement import problem_statement
from swe_grpo.synth.suite import run_suite
from swe_grpo.tasks import Task

_STATE = ".synth"
#: Appended to the default test command when the project's own pytest configuration makes it fail.
NO_ADDOPTS = "-o addopts="
# What pytest says when the configuration's `addopts` name an option or plugin that is not installed.
_USAGE_ERRORS = ("error: unrecognized arguments:", "Error importing plugin")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SynthConfig:
    """`max_per_project` validated tasks per source at most; `jobs` candidates validated at once;
    `timeout_s` bounds each run of the suite; `test_cmd` overrides the test command of every source
    (default: the grader's, with `PYTHONPATH=src` for a src/ layout)."""

    out: Path
    seed: int = 0
    max_per_project: int = 20
    jobs: int = 2
    timeout_s: float = 600.0
    test_cmd: str | None = None
    sdist_cache: Path | None = None


@dataclass
class ProjectReport:
    """What became of one source: its tasks, its rejected candidates (reason -> count), its cost."""

    source: str
    name: str = ""
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    candidates: int = 0
    tried: int = 0  # candidates decided (validated or rejected)
    tests: int = 0
    wall_s: float = 0.0
    infra_errors: int = 0  # candidates a sandbox failure left undecided (tried again on a rerun)
    error: str | None = None


# Callbacks for a progress display: started(name, total), decided(name, accepted, tried).
Started = Callable[[str, int], None]
Decided = Callable[[str, int, int], None]


def _test_cmd(config: SynthConfig, tree: Path) -> str:
    if config.test_cmd:
        return config.test_cmd
    src = tree / "src"
    if src.is_dir() and any(p.suffix == ".py" or (p / "__init__.py").is_file() for p in src.iterdir()):
        return "PYTHONPATH=src " + DEFAULT_TEST_CMD
    return DEFAULT_TEST_CMD


class _State:
    """`out/.synth`: baselines and decisions (appended, read back on a rerun)."""

    def __init__(self, out: Path) -> None:
        self.dir = out / _STATE
        self.dir.mkdir(parents=True, exist_ok=True)
        self.decisions: dict[str, dict] = {}
        path = self.dir / "decisions.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by an interruption
                self.decisions[record["instance_id"]] = record
        self._file = path.open("a", encoding="utf-8")

    def decide(self, record: dict) -> None:
        self.decisions[record["instance_id"]] = record
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _kept(records: list[dict]) -> list[dict]:
    """The validated of `records` (decisions in candidate order) that are tasks: without those that fail the
    same tests with the same problem statement as an earlier one (to an agent, the same task)."""
    seen: set[str] = set()
    kept = []
    for record in records:
        row = record.get("row")
        if row is not None and row["problem_statement"] not in seen:
            seen.add(row["problem_statement"])
            kept.append(record)
    return kept


def _write_tasks(out: Path, state: _State, projects: dict[str, str], limit: int) -> int:
    """`out/tasks.jsonl` from the accepted decisions: per project, in candidate order, at most `limit`.
    `projects`: this run's projects and their clean commits (a project's decisions about an older tree
    are left out; projects of earlier runs only are kept as they were)."""
    by_project: dict[str, list[dict]] = {name: [] for name in projects}
    for record in state.decisions.values():
        if record.get("row") is not None and projects.get(record["project"], record["clean"]) == record["clean"]:
            by_project.setdefault(record["project"], []).append(record)
    rows = [
        r["row"] for records in by_project.values() for r in _kept(sorted(records, key=lambda r: r["order"]))[:limit]
    ]
    tmp = out / "tasks.jsonl.tmp"
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(out / "tasks.jsonl")
    return len(rows)


async def _baseline(backend: SandboxBackend, task: Task, path: Path, timeout_s: float, label: str) -> dict:
    """The clean code's stable tests and what each covers, cached in `path`: the suite run twice (once
    traced), then the tests that passed both times run again as the grader runs them (only them)."""
    if path.is_file():
        saved = json.loads(path.read_text())
        if (saved.get("clean"), saved.get("test_cmd"), saved.get("image")) == (
            task.base_commit,
            task.test_cmd,
            task.image,
        ):
            return saved
    traced, plain = await asyncio.gather(
        run_suite(backend, task, trace=True, timeout_s=timeout_s), run_suite(backend, task, timeout_s=timeout_s)
    )
    if traced.statuses is None or plain.statuses is None:
        why = "it timed out" if traced.timed_out or plain.timed_out else "it gives no test report"
        raise SynthError(f"{label}: the test suite does not run ({why}):\n{traced.output[-3000:]}")
    passing = [t for t, s in traced.statuses.items() if s == "passed" and plain.statuses.get(t) == "passed"]
    if not passing:
        why = f"no test passes, of {len(traced.statuses)} reported"
        raise SynthError(f"{label}: the test suite does not run ({why}):\n{traced.output[-3000:]}")
    flaky = sorted(t for t in traced.statuses if traced.statuses[t] != plain.statuses.get(t, "missing"))
    selected = await run_suite(backend, task, passing, timeout_s=timeout_s)
    stable = [t for t in passing if (selected.statuses or {}).get(t) == "passed"]
    if not stable:  # e.g. parametrized ids that change from run to run (isodate 0.7.2's do)
        why = f"none of the {len(passing)} tests that passed twice passes when run by id, as the grader runs them"
        raise SynthError(f"{label}: the test suite does not run ({why}):\n{selected.output[-3000:]}")
    covering: dict[str, list[str]] = {}
    for test_id in stable:
        for path_, line in sorted(traced.coverage.get(test_id, ())):
            covering.setdefault(f"{path_}:{line}", []).append(test_id)
    saved = {
        "clean": task.base_commit,
        "test_cmd": task.test_cmd,
        "image": task.image,
        "stable": stable,
        "flaky": flaky,
        "order_dependent": sorted(set(passing) - set(stable)),
        "covering": covering,
        "suite_s": plain.wall_s,
    }
    path.write_text(json.dumps(saved))
    return saved


def _ordered(candidates: list[Mutation], seed: int, name: str) -> list[Mutation]:
    """A seeded order that spreads over functions and operators: the functions shuffled, each one's
    mutations shuffled; then, round after round, one mutation of each function: of the operators it has
    left, the one taken least so far (small functions would otherwise give mostly `drop_return`)."""
    rng = random.Random(f"{seed}:{name}")
    groups: dict[tuple[str, str], list[Mutation]] = {}
    for mutation in candidates:
        groups.setdefault((mutation.path, mutation.function), []).append(mutation)
    keys = sorted(groups)
    rng.shuffle(keys)
    for key in keys:
        rng.shuffle(groups[key])
    taken: dict[str, int] = {}
    ordered = []
    while keys:
        for key in keys:
            group = groups[key]
            pick = min(range(len(group)), key=lambda i: taken.get(group[i].operator, 0))
            mutation = group.pop(pick)
            taken[mutation.operator] = taken.get(mutation.operator, 0) + 1
            ordered.append(mutation)
        keys = [key for key in keys if groups[key]]
    return ordered


def _candidates(tree: Path, baseline: dict) -> tuple[list[Mutation], dict[str, list[str]]]:
    """Mutations of the covered functions of files a patch may change, and the tests covering each."""
    lines: dict[str, set[int]] = {}
    for key in baseline["covering"]:
        path, _, line = key.rpartition(":")
        if path.endswith(".py") and not is_protected(path):
            lines.setdefault(path, set()).add(int(line))
    found: list[Mutation] = []
    tests: dict[str, list[str]] = {}
    for path in sorted(lines):
        if (tree / path).is_file():
            for mutation in mutations(path, (tree / path).read_bytes(), lines[path]):
                found.append(mutation)
                tests[mutation.key] = baseline["covering"].get(f"{path}:{mutation.function_line}", [])
    return found, tests


async def _validate(
    backend: SandboxBackend,
    source: Source,
    repo: Path,
    clean: str,
    test_cmd: str,
    mutation: Mutation,
    covering: list[str],
    stable: list[str],
    timeout_s: float,
    environment: tuple[str | None, list[str]],
) -> tuple[dict | None, str, str]:
    """The task row of one candidate and "validated", or None, why it was rejected and the grader's error
    (when a grade was the reason). `timeout_s` bounds each run: a mutant that makes the tests hang costs
    that much, not the suite's whole `--timeout`. `environment`: the project's image (None: `local`) and
    requirements."""
    image, wanted = environment
    instance_id = f"{source.name}__synth-{mutation.key}"
    original = (source.tree / mutation.path).read_bytes()
    mode = git(repo, "ls-tree", clean, "--", mutation.path).split()[0]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "mutant").write_bytes(mutation.apply(original))
        blob = git(repo, "hash-object", "-w", "--no-filters", f"{tmp}/mutant")
        index = {"GIT_INDEX_FILE": f"{tmp}/index"}
        git(repo, "read-tree", clean, env=index)
        git(repo, "update-index", "--cacheinfo", f"{mode},{blob.strip()},{mutation.path}", env=index)
        tree = git(repo, "write-tree", env=index).strip()
    base = git(repo, "commit-tree", tree, "-m", source.name).strip()
    git(repo, "update-ref", f"refs/heads/{instance_id}", base)
    patch = git(repo, "diff", "--binary", base, clean)
    probe = Task(instance_id, str(repo), base, "synthesising", fail_to_pass=("-",), test_cmd=test_cmd, image=image)
    run = await run_suite(backend, probe, covering, timeout_s=timeout_s)
    if run.statuses is None:
        return None, "the suite gives no report on the mutant" + (" (timed out)" if run.timed_out else ""), ""
    f2p = [test_id for test_id in covering if run.statuses.get(test_id) != "passed"]
    if not f2p:
        return None, "no test fails on the mutant", ""
    p2p = [test_id for test_id in stable if test_id not in set(f2p)]
    statement = problem_statement(source.name, f2p, run.messages, test_cmd, mutation)
    task = Task(instance_id, str(repo), base, statement, fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p))
    task = Task(**{**task.__dict__, "test_cmd": test_cmd, "patch": patch, "image": image})
    gold, empty = await asyncio.gather(
        grade(task, patch, backend, timeout_s=timeout_s), grade(task, "", backend, timeout_s=timeout_s)
    )
    if gold.outcome != "resolved":
        return None, f"the gold patch grades {gold.outcome}", (gold.error or "")[:1000]
    if empty.outcome != "unresolved":
        return None, f"the empty patch grades {empty.outcome}", (empty.error or "")[:1000]
    row = {
        "instance_id": instance_id,
        "repo": f"repos/{repo.name}",
        "base_commit": base,
        "problem_statement": statement,
        "patch": patch,
        "test_patch": "",
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "test_cmd": test_cmd if test_cmd != DEFAULT_TEST_CMD else None,
        "runner_limits": runner_limits(gold),
        **({"image": image} if image else {}),
        "synth": {
            "source": source.spec,
            "operator": mutation.operator,
            "path": mutation.path,
            "function": mutation.function,
            "line": mutation.line,
            "requirements": wanted,
        },
    }
    return row, "validated", ""


async def _project(
    spec: str,
    backend: SandboxBackend,
    config: SynthConfig,
    state: _State,
    work: Path,
    report: ProjectReport,
    started: Started,
    decided: Decided,
    projects: dict[str, str],
) -> None:
    loop = asyncio.get_running_loop()
    begin = loop.time()
    source = await asyncio.to_thread(fetch_source, spec, work, config.sdist_cache or cache_root() / "synth" / "sdists")
    report.name = source.name
    repo = config.out / "repos" / f"{source.name}.git"
    if not (repo / "HEAD").is_file():
        repo.parent.mkdir(parents=True, exist_ok=True)
        git(repo.parent, "init", "-q", "--bare", repo.name)
    clean = commit_tree(repo, source.tree, source.name)
    git(repo, "update-ref", "refs/heads/clean", clean)
    projects[source.name] = clean
    test_cmd = _test_cmd(config, source.tree)
    wanted = requirements(source.tree)
    # `docker`: an image with the project's requirements installed; `local`: the host's python3 as it is.
    image = await environment_image(backend, source.name, wanted) if isinstance(backend, DockerBackend) else None
    baseline_path = state.dir / f"{source.name}.baseline.json"
    clean_task = Task(
        f"{source.name}__clean", str(repo), clean, "baseline", fail_to_pass=("-",), test_cmd=test_cmd, image=image
    )
    try:
        baseline = await _baseline(backend, clean_task, baseline_path, config.timeout_s, spec)
    except SynthError as exc:
        # The project's configuration asks pytest for options of a plugin this Python lacks (`--cov` in
        # `addopts`, say): run without its addopts, as a maintainer without the plugin would.
        if config.test_cmd or not any(sign in str(exc) for sign in _USAGE_ERRORS):
            raise
        test_cmd += " " + NO_ADDOPTS
        clean_task = replace(clean_task, test_cmd=test_cmd)
        baseline = await _baseline(backend, clean_task, baseline_path, config.timeout_s, spec)
    report.tests = len(baseline["stable"])
    candidates, covering = _candidates(source.tree, baseline)
    if not candidates:
        raise SynthError(f"{spec}: no function that its passing tests run can be mutated (no covered function)")
    ordered = _ordered(candidates, config.seed, source.name)
    report.candidates = len(ordered)
    limit = config.max_per_project
    started(source.name, limit)
    ids = [f"{source.name}__synth-{m.key}" for m in ordered]
    known = {i for i in ids if state.decisions.get(i, {}).get("clean") == clean}

    def accepted_prefix() -> tuple[int, bool]:
        """Accepted candidates in the decided prefix of the order, and whether that prefix is everything."""
        prefix = []
        for i in ids:
            if i not in known:
                return len(_kept(prefix)), False
            prefix.append(state.decisions[i])
        return len(_kept(prefix)), True

    semaphore = asyncio.Semaphore(config.jobs)
    # A run on a mutant takes about what the clean suite takes; far longer means it hangs.
    bound = min(config.timeout_s, max(60.0, 10 * baseline["suite_s"]))

    async def one(order: int, mutation: Mutation) -> None:
        async with semaphore:
            if accepted_prefix()[0] >= limit:
                return
            try:
                row, why, detail = await _validate(
                    backend,
                    source,
                    repo,
                    clean,
                    test_cmd,
                    mutation,
                    covering[mutation.key],
                    baseline["stable"],
                    bound,
                    (image, wanted),
                )
            except SandboxError as exc:  # the machinery's failure, not the candidate's: decided on a rerun
                log.warning("%s: %s", ids[order], exc)
                report.infra_errors += 1
                return
        record = {"instance_id": ids[order], "project": source.name, "clean": clean, "order": order, "row": row}
        state.decide({**record, "reason": why, **({"detail": detail} if detail else {})})
        known.add(ids[order])
        _write_tasks(config.out, state, projects, limit)
        done = len(_kept([state.decisions[i] for i in ids if i in known]))
        decided(source.name, min(done, limit), len(known))

    # Once the first `limit` of the order are in, the candidates not started return at once; those in
    # flight are let finish (and recorded), not cancelled: a cancelled grade may leave its sandbox's
    # teardown running after it returns.
    pending = [asyncio.ensure_future(one(n, m)) for n, m in enumerate(ordered) if ids[n] not in known]
    decided(source.name, min(accepted_prefix()[0], limit), len(known))
    try:
        await asyncio.gather(*pending)
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    decisions = [state.decisions[i] for i in ids if i in known]
    kept = {record["instance_id"] for record in _kept(decisions)}
    for record in decisions:
        if record.get("row") is None or record["instance_id"] not in kept:
            why = record.get("reason", "?") if record.get("row") is None else "same failure as an earlier task"
            report.rejected[why] = report.rejected.get(why, 0) + 1
    report.tried = len(decisions)
    report.accepted = min(len(kept), limit)
    report.wall_s = loop.time() - begin


async def synthesize(
    sources: Sequence[str],
    config: SynthConfig,
    backend: SandboxBackend,
    *,
    started: Started = lambda name, total: None,
    decided: Decided = lambda name, accepted, tried: None,
) -> list[ProjectReport]:
    """Make tasks from `sources` into `config.out` (see `swe_grpo.synth`). A source that cannot be fetched,
    whose suite does not run or that has no covered function gets its `ProjectReport.error`; the others
    go on. Rerun with the same `out` to resume."""
    config.out.mkdir(parents=True, exist_ok=True)
    state = _State(config.out)
    reports = [ProjectReport(source) for source in sources]
    projects: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="work-", dir=state.dir))
    try:
        for spec, report in zip(sources, reports, strict=True):
            begin = time.monotonic()
            try:
                await _project(spec, backend, config, state, work, report, started, decided, projects)
            except SynthError as exc:
                report.error = str(exc)
                report.wall_s = time.monotonic() - begin  # what finding out cost
        _write_tasks(config.out, state, projects, config.max_per_project)
    finally:
        state.close()
        shutil.rmtree(work, ignore_errors=True)
    return reports
