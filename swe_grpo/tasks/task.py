"""Tasks: a repository at a commit, a problem statement, and the tests that decide success.

`Task` is the SWE-Gym/SWE-bench row shape. `load_tasks` reads a local JSONL file, a dataset saved with
`datasets.Dataset.save_to_disk`, or a Hugging Face Hub dataset (`SWE-Gym/SWE-Gym`, ...); every row of
every source goes through the same `task_from_row`, so they accept and reject exactly the same rows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# The tasks bundled with the package (`swe_grpo.demo.tasks`), loadable by the source name "demo": read
# as data, so loading tasks never imports the demo.
DEMO_TASKS = Path(__file__).resolve().parents[1] / "demo" / "tasks" / "tasks.jsonl"

#: How a graded run becomes a reward (`swe_grpo.grading`): "binary" (SWE-bench: 1.0 iff every FAIL_TO_PASS
#: and PASS_TO_PASS test passes) or "fraction" (the share of FAIL_TO_PASS tests passing, 0.0 when any
#: PASS_TO_PASS test does not pass).
RewardMode = Literal["binary", "fraction"]
REWARD_MODES: tuple[RewardMode, ...] = ("binary", "fraction")
DEFAULT_SETUP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Task:
    """One SWE task. `repo` is a GitHub "owner/name", or an absolute path to a local git repository or
    git bundle (local task files only); `image` is the container image holding the repository at
    `base_commit` (docker/hf backends); `test_cmd` overrides the test runner: a shell command run in the
    repository, to which the test ids are appended (a pytest command should pass `-rA` and
    `--junitxml="$SWE_GRPO_JUNIT_XML"`, a shell variable of that command line, not exported: a script
    must get the path as an argument; see `swe_grpo.grading`); `plugin_autoload` overrides the grader's
    setting for this task's pytest plugins; FAIL_TO_PASS / PASS_TO_PASS are test ids (pytest node ids);
    `expected_statuses`, `tamper_allow` and `runner_limits` adjust the grader's tamper checks for this task
    (see `swe_grpo.grading`); `reward_mode` overrides the run's reward mode for this task (`REWARD_MODES`);
    `setup_cmd` is a shell command run in the repository of the agent's sandbox before the agent starts,
    `grade_setup_cmd` one run in the grading sandbox before the patch is applied (each within
    `setup_timeout_s`; see `swe_grpo.rollout` and `swe_grpo.grading`). Only the task row sets them."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str = ""
    fail_to_pass: tuple[str, ...] = ()
    pass_to_pass: tuple[str, ...] = ()
    image: str | None = None
    test_cmd: str | None = None
    plugin_autoload: bool | None = None  # let pytest load installed plugins; None: the grader's setting
    patch: str = ""  # the reference ("gold") fix, when known
    # A FAIL_TO_PASS test whose gold run is not PASSED (e.g. "xfail") -> that status; see swe_grpo.grading.
    expected_statuses: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    # Grading tamper checks this project trips by being what it is (a test tool): capabilities of the gate
    # (swe_grpo.grading.capability: names, groups, or the rule names of the scan it replaced), audit events.
    tamper_allow: tuple[str, ...] = ()
    # Whether the graded runner may not fork, exec or re-point its descriptors (swe_grpo.grading.limits), as
    # calibration found: False where the gold's run needs them; None: never calibrated (the grader decides).
    runner_limits: bool | None = None
    reward_mode: RewardMode | None = None  # None: the run's (RolloutConfig/WorkerConfig.reward_mode)
    setup_cmd: str | None = None  # the task author's command, in the agent's sandbox before the agent
    grade_setup_cmd: str | None = None  # the task author's command, in the grading sandbox before the patch
    setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S  # each of setup_cmd and grade_setup_cmd
    metadata: dict = field(default_factory=dict, compare=False, hash=False)  # the row's other fields


class TaskFormatError(ValueError):
    """A task row is malformed. The message names the source, the row (JSONL line or dataset index) and
    the field; the same facts are attributes."""

    def __init__(self, source: str, row: str, field: str | None, problem: str) -> None:
        self.source, self.row, self.field = source, row, field
        where = f"{source}: {row}" + (f": field {field!r}" if field else "")
        super().__init__(f"{where}: {problem}")


_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # a full SHA-1 or SHA-256 id: reproducible
_KNOWN_FIELDS = (
    frozenset(("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "patch", "image", "test_cmd"))
    | {"FAIL_TO_PASS", "PASS_TO_PASS", "plugin_autoload", "expected_statuses", "tamper_allow", "runner_limits"}
    | {"reward_mode", "setup_cmd", "grade_setup_cmd", "setup_timeout_s"}
)


def swe_gym_image(instance_id: str) -> str:
    """The prebuilt evaluation image of a SWE-Gym (or SWE-bench) instance, as OpenHands publishes them
    (image names are lower-case)."""
    return f"xingyaoww/sweb.eval.x86_64.{instance_id.replace('__', '_s_').lower()}"


def task_from_row(
    row: Mapping[str, Any],
    *,
    source: str,
    where: str,
    base_dir: Path | None = None,
    default_image: Callable[[str], str] | None = None,
) -> Task:
    """Convert one SWE-Gym-shaped row (a JSONL object or a `datasets` row) into a `Task`.

    Required: `instance_id`, `repo`, `base_commit` (a full commit id), `problem_statement`,
    `FAIL_TO_PASS` (non-empty). Optional: `PASS_TO_PASS`, `test_patch`, `patch`, `image`, `test_cmd`,
    `plugin_autoload` (a boolean; missing or null = default), `expected_statuses` (an object: test id ->
    passed|xfail|xpass), `tamper_allow` (a list of names), `runner_limits` (a boolean, written by
    `swe-grpo tasks calibrate`; missing or null = not calibrated), `reward_mode` (binary|fraction; missing or
    null = the run's), `setup_cmd` and `grade_setup_cmd` (non-empty strings), `setup_timeout_s` (a
    positive number of seconds). Test-id lists may be lists or JSON strings
    of lists (SWE-Gym has both).
    With `base_dir` (local files), a `repo` that is a path (starts with "/", "./" or "../", ends with
    ".git" or ".bundle", or exists relative to `base_dir`) is resolved against `base_dir` to an absolute
    path that must exist. `default_image(instance_id)` fills a missing `image`. Other fields go to
    `metadata`. Raises `TaskFormatError` naming `source`, `where` and the field."""

    def fail(field: str | None, problem: str) -> TaskFormatError:
        return TaskFormatError(source, where, field, problem)

    def optional(name: str) -> str | None:
        value = row.get(name)
        if value is not None and not isinstance(value, str):
            raise fail(name, f"expected a string, got {type(value).__name__}")
        return value

    def required(name: str) -> str:
        value = optional(name)
        if value is None:
            raise fail(name, "missing")
        if not value.strip():
            raise fail(name, "empty")
        return value

    def test_ids(name: str, *, required: bool) -> tuple[str, ...]:
        value = row.get(name)
        if value is None and not required:
            return ()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise fail(name, f"a string that is not a JSON list: {exc}") from None
        if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
            raise fail(name, f"expected a list of test ids (or a JSON string of one), got {row.get(name)!r:.80}")
        if required and not value:
            raise fail(name, "must name at least one test")
        return tuple(value)

    instance_id = required("instance_id")
    repo = required("repo")
    base_commit = required("base_commit")
    if not _COMMIT.fullmatch(base_commit):
        raise fail("base_commit", f"expected a full commit id (40 or 64 hex digits), got {base_commit!r}")
    if base_dir is not None:
        repo = _resolve_local_repo(repo, base_dir, fail)
    plugin_autoload = row.get("plugin_autoload")
    if plugin_autoload is not None and not isinstance(plugin_autoload, bool):
        raise fail("plugin_autoload", f"expected true, false or null, got {plugin_autoload!r:.40}")
    expected = row.get("expected_statuses") or {}
    if not isinstance(expected, dict) or not all(
        isinstance(k, str) and v in ("passed", "xfail", "xpass") for k, v in expected.items()
    ):
        raise fail("expected_statuses", f"expected {{test id: passed|xfail|xpass}}, got {expected!r:.60}")
    allow = row.get("tamper_allow") or []
    if not isinstance(allow, list) or not all(isinstance(item, str) for item in allow):
        raise fail("tamper_allow", f"expected a list of names, got {allow!r:.60}")
    runner_limits = row.get("runner_limits")
    if runner_limits is not None and not isinstance(runner_limits, bool):
        raise fail("runner_limits", f"expected true, false or null, got {runner_limits!r:.40}")
    reward_mode = row.get("reward_mode")
    if reward_mode is not None and reward_mode not in REWARD_MODES:
        raise fail("reward_mode", f"expected {', '.join(REWARD_MODES)} or null, got {reward_mode!r:.40}")
    setup_cmd, grade_setup_cmd = optional("setup_cmd"), optional("grade_setup_cmd")
    for name, command in (("setup_cmd", setup_cmd), ("grade_setup_cmd", grade_setup_cmd)):
        if command is not None and not command.strip():
            raise fail(name, "empty: leave it out (or null) for no setup")
    setup_timeout_s = row.get("setup_timeout_s", DEFAULT_SETUP_TIMEOUT_S)
    if setup_timeout_s is None:
        setup_timeout_s = DEFAULT_SETUP_TIMEOUT_S
    if isinstance(setup_timeout_s, bool) or not isinstance(setup_timeout_s, int | float) or not setup_timeout_s > 0:
        raise fail("setup_timeout_s", f"expected a positive number of seconds, got {setup_timeout_s!r:.40}")
    image = optional("image") or None
    if image is None and default_image is not None:
        image = default_image(instance_id)
    return Task(
        instance_id=instance_id,
        repo=repo,
        base_commit=base_commit,
        problem_statement=required("problem_statement"),
        test_patch=optional("test_patch") or "",
        fail_to_pass=test_ids("FAIL_TO_PASS", required=True),
        pass_to_pass=test_ids("PASS_TO_PASS", required=False),
        image=image,
        test_cmd=optional("test_cmd") or None,
        plugin_autoload=plugin_autoload,
        patch=optional("patch") or "",
        expected_statuses=dict(expected),
        tamper_allow=tuple(allow),
        runner_limits=runner_limits,
        reward_mode=reward_mode,
        setup_cmd=setup_cmd,
        grade_setup_cmd=grade_setup_cmd,
        setup_timeout_s=float(setup_timeout_s),
        metadata={key: value for key, value in row.items() if key not in _KNOWN_FIELDS},
    )


def _resolve_local_repo(repo: str, base_dir: Path, fail: Callable[[str, str], TaskFormatError]) -> str:
    candidate = base_dir / repo  # an absolute `repo` stays as it is
    looks_local = repo.startswith(("/", "./", "../")) or repo.endswith((".git", ".bundle"))
    if not (looks_local or candidate.exists()):
        return repo  # a GitHub "owner/name"
    if not candidate.exists():
        raise fail("repo", f"no local repository or bundle at {candidate}")
    return str(candidate.resolve())


def tasks_from_rows(
    rows: Iterable[tuple[str, Mapping[str, Any]]],
    *,
    source: str,
    base_dir: Path | None = None,
    default_image: Callable[[str], str] | None = None,
) -> list[Task]:
    """`task_from_row` over `(where, row)` pairs; a repeated `instance_id` is a `TaskFormatError`."""
    tasks: dict[str, Task] = {}
    for where, row in rows:
        if not isinstance(row, Mapping):
            raise TaskFormatError(source, where, None, f"expected an object, got {type(row).__name__}")
        task = task_from_row(row, source=source, where=where, base_dir=base_dir, default_image=default_image)
        if task.instance_id in tasks:
            raise TaskFormatError(source, where, "instance_id", f"duplicate instance_id {task.instance_id!r}")
        tasks[task.instance_id] = task
    return list(tasks.values())


def jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """The rows of the JSONL task file `path` as `(where, row)` pairs ("line N"), blank lines skipped, read as
    they are asked for; a line that is not JSON raises `TaskFormatError`."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFormatError(str(path), f"line {number}", None, f"not valid JSON: {exc}") from None
            yield f"line {number}", row


def load_jsonl(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file, one row per non-blank line; local `repo` paths are relative to the file."""
    path = Path(path)
    return tasks_from_rows(jsonl_rows(path), source=str(path), base_dir=path.parent.resolve())


def tasks_from_dataset(dataset: Iterable[Mapping[str, Any]], *, source: str) -> list[Task]:
    """Tasks from a `datasets.Dataset` (or any iterable of SWE-Gym-shaped rows). Rows without an `image`
    get the SWE-Gym evaluation image; `repo` is never treated as a local path."""
    rows = ((f"row {index}", row) for index, row in enumerate(dataset))
    return tasks_from_rows(rows, source=source, default_image=swe_gym_image)


def load_tasks(source: str | Path, split: str = "train", instance_ids: Sequence[str] | None = None) -> list[Task]:
    """Tasks from `source`: `demo` is the bundled demo tasks; an existing file is JSONL; an existing
    directory is a dataset saved with `save_to_disk` (a `DatasetDict` is indexed by `split`); a `*.jsonl`
    path that does not exist is an error; anything else is a Hugging Face Hub dataset name
    (`SWE-Gym/SWE-Gym`, `SWE-Gym/SWE-Gym-Lite`) loaded with `datasets.load_dataset(source, split=split)`.
    With `instance_ids`, only those tasks, in source order; an id that is not in the source raises
    `KeyError`."""
    path = DEMO_TASKS if str(source) == "demo" else Path(source)
    if path.is_file():
        tasks = load_jsonl(path)
    elif path.is_dir():
        import datasets  # heavy; only the dataset sources need it

        saved = datasets.load_from_disk(str(path))
        tasks = tasks_from_dataset(saved[split] if isinstance(saved, datasets.DatasetDict) else saved, source=str(path))
    elif str(source).endswith(".jsonl"):
        raise FileNotFoundError(f"no task file {path}")
    else:
        import datasets

        tasks = tasks_from_dataset(datasets.load_dataset(str(source), split=split), source=str(source))
    if instance_ids is None:
        return tasks
    missing = set(instance_ids) - {task.instance_id for task in tasks}
    if missing:
        raise KeyError(f"{source}: no task with instance_id {', '.join(sorted(missing))}")
    wanted = set(instance_ids)
    return [task for task in tasks if task.instance_id in wanted]
