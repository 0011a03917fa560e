"""Task loading: local JSONL files (relative repository paths, malformed rows), SWE-Gym-shaped datasets
built locally with `datasets` (the Hub itself cannot be reached here), and the bundled demo tasks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import datasets
import pytest

from swe_grpo.demo.tasks import build as demo_build
from swe_grpo.demo.tasks import demo_tasks, demo_tasks_path
from swe_grpo.grading import is_protected
from swe_grpo.tasks import (
    Task,
    TaskFormatError,
    load_jsonl,
    load_tasks,
    swe_gym_image,
    tasks_from_dataset,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git(cwd: Path, *args: str, input_text: str | None = None) -> str:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    done = subprocess.run(cmd, cwd=cwd, input=input_text, check=True, capture_output=True, text=True, env=env)
    return done.stdout.strip()


def row(**overrides: Any) -> dict[str, Any]:
    base = {
        "instance_id": "owner__proj-1",
        "repo": "owner/proj",
        "base_commit": COMMIT,
        "problem_statement": "It is broken.",
        "test_patch": "diff --git a/tests/test_a.py b/tests/test_a.py\n",
        "FAIL_TO_PASS": ["tests/test_a.py::test_new"],
        "PASS_TO_PASS": ["tests/test_a.py::test_old"],
    }
    return {key: value for key, value in {**base, **overrides}.items() if value is not ...}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# --- local JSONL -----------------------------------------------------------------------------------


def test_jsonl_rows_become_tasks(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            row(patch="the fix", test_cmd="pytest -x", image="img:1", hints_text="look at a.py", version="1.0"),
            "",
            row(instance_id="owner__proj-2", PASS_TO_PASS=..., test_patch=None),
        ],
    )
    first, second = load_jsonl(path)
    assert first == Task(
        instance_id="owner__proj-1",
        repo="owner/proj",  # a GitHub name stays as it is
        base_commit=COMMIT,
        problem_statement="It is broken.",
        test_patch="diff --git a/tests/test_a.py b/tests/test_a.py\n",
        fail_to_pass=("tests/test_a.py::test_new",),
        pass_to_pass=("tests/test_a.py::test_old",),
        image="img:1",
        test_cmd="pytest -x",
        patch="the fix",
    )
    assert first.metadata == {"hints_text": "look at a.py", "version": "1.0"}
    # Optional fields may be missing or null; local rows get no default image.
    assert (second.pass_to_pass, second.test_patch, second.image, second.patch) == ((), "", None, "")


def test_test_ids_may_be_lists_or_json_strings(tmp_path: Path) -> None:
    ids = ["tests/test_a.py::test_x[1-2]", "tests/test_a.py::TestC::test_y"]
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [row(FAIL_TO_PASS=ids, PASS_TO_PASS="[]"), row(instance_id="b", FAIL_TO_PASS=json.dumps(ids))],
    )
    as_list, as_string = load_jsonl(path)
    assert as_list.fail_to_pass == as_string.fail_to_pass == tuple(ids)
    assert as_list.pass_to_pass == ()


def test_local_repo_paths_resolve_relative_to_the_jsonl_file(tmp_path: Path) -> None:
    repo = tmp_path / "data" / "repos" / "calc"
    repo.mkdir(parents=True)
    git(repo, "init", "-q")
    (repo / "calc.py").write_text("x = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    commit = git(repo, "rev-parse", "HEAD")
    bundle = tmp_path / "elsewhere" / "calc.bundle"
    bundle.parent.mkdir()
    git(repo, "bundle", "create", "-q", str(bundle), "HEAD")
    path = write_jsonl(
        tmp_path / "data" / "sets" / "tasks.jsonl",
        [
            row(instance_id="dir", repo="../repos/calc", base_commit=commit),
            row(instance_id="bundle", repo="../../elsewhere/calc.bundle", base_commit=commit),
            row(instance_id="absolute", repo=str(repo), base_commit=commit),
            row(instance_id="github", repo="owner/proj"),
        ],
    )
    # Loading from another working directory must not matter.
    tasks = {task.instance_id: task.repo for task in load_tasks(os.path.relpath(path, Path.cwd()))}
    assert tasks == {"dir": str(repo), "bundle": str(bundle), "absolute": str(repo), "github": "owner/proj"}


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        (row(instance_id=...), "instance_id", "missing"),
        (row(repo=""), "repo", "empty"),
        (row(problem_statement=3), "problem_statement", "expected a string, got int"),
        (row(base_commit="abc123"), "base_commit", "full commit id"),
        (row(FAIL_TO_PASS=...), "FAIL_TO_PASS", "expected a list"),
        (row(FAIL_TO_PASS=[]), "FAIL_TO_PASS", "at least one test"),
        (row(FAIL_TO_PASS="[]"), "FAIL_TO_PASS", "at least one test"),
        (row(FAIL_TO_PASS="tests/test_a.py::test_x"), "FAIL_TO_PASS", "not a JSON list"),
        (row(PASS_TO_PASS='{"a": 1}'), "PASS_TO_PASS", "expected a list"),
        (row(PASS_TO_PASS=["ok", 7]), "PASS_TO_PASS", "expected a list"),
        (row(repo="repos/missing.bundle"), "repo", "no local repository or bundle"),
        (row(repo="./missing"), "repo", "no local repository or bundle"),
        (row(image=["a"]), "image", "expected a string"),
        ("{not json", None, "not valid JSON"),
        ('["a list"]', None, "expected an object"),
    ],
)
def test_a_malformed_row_names_the_file_line_and_field(
    tmp_path: Path, line: dict[str, Any] | str, field: str | None, problem: str
) -> None:
    path = write_jsonl(tmp_path / "tasks.jsonl", [row(instance_id="fine"), "", line])
    with pytest.raises(TaskFormatError) as caught:
        load_jsonl(path)
    error = caught.value
    assert (error.source, error.row, error.field) == (str(path), "line 3", field)
    assert str(path) in str(error) and "line 3" in str(error) and problem in str(error)
    if field:
        assert repr(field) in str(error)


def test_duplicate_instance_ids_are_rejected(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tasks.jsonl", [row(), row()])
    with pytest.raises(TaskFormatError, match="line 2: field 'instance_id': duplicate"):
        load_jsonl(path)


def test_instance_ids_select_tasks_in_source_order(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "tasks.jsonl", [row(instance_id=name) for name in "abc"])
    assert [t.instance_id for t in load_tasks(path, instance_ids=["c", "a"])] == ["a", "c"]
    with pytest.raises(KeyError, match="zzz"):
        load_tasks(path, instance_ids=["a", "zzz"])


def test_a_missing_jsonl_file_is_not_taken_for_a_hub_dataset(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tasks(tmp_path / "nope.jsonl")


# --- SWE-Gym-shaped datasets -----------------------------------------------------------------------


def swe_gym_rows() -> list[dict[str, Any]]:
    """Rows shaped like SWE-Gym's: test ids as JSON strings, the dataset's extra columns, no image."""
    return [
        {
            "instance_id": f"Project-MONAI__MONAI-{n}",
            "repo": "Project-MONAI/MONAI",
            "base_commit": f"{n:040x}",
            "patch": "diff --git a/monai/x.py b/monai/x.py\n",
            "test_patch": "diff --git a/tests/test_x.py b/tests/test_x.py\n",
            "problem_statement": f"Bug {n}",
            "hints_text": "",
            "created_at": "2023-01-01T00:00:00Z",
            "version": "1.1",
            "FAIL_TO_PASS": json.dumps([f"tests/test_x.py::test_{n}"]),
            "PASS_TO_PASS": json.dumps(["tests/test_x.py::test_ok"]),
        }
        for n in (1, 2)
    ]


def test_a_saved_swe_gym_dataset_loads(tmp_path: Path) -> None:
    datasets.Dataset.from_list(swe_gym_rows()).save_to_disk(str(tmp_path / "gym"))
    first, second = load_tasks(tmp_path / "gym")
    assert first.instance_id == "Project-MONAI__MONAI-1"
    assert first.repo == "Project-MONAI/MONAI"  # never resolved as a local path
    assert first.fail_to_pass == ("tests/test_x.py::test_1",)
    assert first.pass_to_pass == ("tests/test_x.py::test_ok",)
    assert first.patch.startswith("diff --git a/monai/x.py")
    assert first.image == "xingyaoww/sweb.eval.x86_64.project-monai_s_monai-1"
    assert first.metadata == {"hints_text": "", "created_at": "2023-01-01T00:00:00Z", "version": "1.1"}
    assert second.base_commit == f"{2:040x}"


def test_a_saved_dataset_dict_is_indexed_by_split(tmp_path: Path) -> None:
    rows = swe_gym_rows()
    splits = {"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows[1:])}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "gym"))
    assert [t.instance_id for t in load_tasks(tmp_path / "gym", split="test")] == ["Project-MONAI__MONAI-2"]


def test_list_valued_test_ids_and_explicit_images_in_a_dataset() -> None:
    rows = [{**r, "FAIL_TO_PASS": json.loads(r["FAIL_TO_PASS"]), "image": "mine:1"} for r in swe_gym_rows()]
    rows[1]["image"] = None  # a row with no image gets SWE-Gym's
    first, second = tasks_from_dataset(datasets.Dataset.from_list(rows), source="gym")
    assert first.fail_to_pass == ("tests/test_x.py::test_1",)
    assert (first.image, second.image) == ("mine:1", swe_gym_image("Project-MONAI__MONAI-2"))


def test_a_malformed_dataset_row_names_its_index() -> None:
    rows = swe_gym_rows()
    rows[1]["FAIL_TO_PASS"] = "not json"
    with pytest.raises(TaskFormatError, match=r"^gym: row 1: field 'FAIL_TO_PASS': a string that is not a JSON list"):
        tasks_from_dataset(datasets.Dataset.from_list(rows), source="gym")


def test_a_hub_name_goes_to_load_dataset_with_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    # The Hub cannot be reached here: this checks only that a dataset name is handed to
    # `datasets.load_dataset` with the split, and that its rows take the same conversion.
    calls = []

    def load_dataset(name: str, split: str) -> datasets.Dataset:
        calls.append((name, split))
        return datasets.Dataset.from_list(swe_gym_rows())

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    tasks = load_tasks("SWE-Gym/SWE-Gym-Lite", split="train", instance_ids=["Project-MONAI__MONAI-2"])
    assert calls == [("SWE-Gym/SWE-Gym-Lite", "train")]
    assert [t.instance_id for t in tasks] == ["Project-MONAI__MONAI-2"]


# --- the bundled demo tasks ------------------------------------------------------------------------


def test_demo_tasks_load_and_their_bundles_clone_to_base_commit(tmp_path: Path) -> None:
    tasks = demo_tasks()
    assert len(tasks) >= 3
    for task in tasks:
        bundle = Path(task.repo)
        assert bundle.is_absolute() and bundle.parent == demo_tasks_path().parent / "repos"
        checkout = tmp_path / task.instance_id
        git(tmp_path, "clone", "-q", str(bundle), str(checkout))
        assert git(checkout, "rev-parse", "HEAD") == task.base_commit
        # The gold patch and the test patch apply to the base; the gold patch touches no protected
        # path and the test patch only tests; F2P and P2P are disjoint.
        for patch in (task.patch, task.test_patch):
            git(checkout, "apply", "--check", "-", input_text=patch)
        gold_paths = git(checkout, "apply", "--numstat", "-", input_text=task.patch)
        assert gold_paths and not any(is_protected(line.split("\t")[2]) for line in gold_paths.splitlines())
        test_paths = git(checkout, "apply", "--numstat", "-", input_text=task.test_patch)
        assert all(line.split("\t")[2].startswith("tests/") for line in test_paths.splitlines())
        assert task.fail_to_pass and task.pass_to_pass and not set(task.fail_to_pass) & set(task.pass_to_pass)


def test_the_demo_build_reproduces_the_shipped_files(tmp_path: Path) -> None:
    built = demo_build.build(tmp_path)
    shipped = demo_tasks_path()
    assert built.read_bytes() == shipped.read_bytes()
    for bundle in (shipped.parent / "repos").glob("*.bundle"):
        assert (tmp_path / "repos" / bundle.name).read_bytes() == bundle.read_bytes(), bundle.name
