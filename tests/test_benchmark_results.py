"""Every figure under benchmarks/results/ says where it comes from: each results JSON carries one top-level
`provenance` object (benchmarks/_provenance.py) with the run's date, the commit it ran on, the uncommitted
files of the code under test (or false), the machine (CPU model, cores, memory) and the load average before
and after. A result that cannot say all five is not quoted: it is re-run or removed.

A `NAME.samples.json` side file (chaos.py's resource samples, written as the run goes) has no provenance of its
own: `NAME.json`'s covers it, so the pair must exist and hold the same samples."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SIDE_SUFFIX = ".samples.json"

sys.path.insert(0, str(ROOT / "benchmarks"))

from _provenance import Provenance  # noqa: E402


def problems(provenance: Any) -> list[str]:
    """What is missing or malformed in a `provenance` object; empty when it is whole."""
    if not isinstance(provenance, dict):
        return ["no top-level 'provenance' object"]
    found = []
    date = provenance.get("date")
    try:
        if datetime.fromisoformat(str(date).replace("Z", "+00:00")).utcoffset() is None:
            found.append(f"date {date!r} has no time zone")
    except ValueError:
        found.append(f"date {date!r} is not ISO 8601")
    commit = provenance.get("commit")
    if not (isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{7,40}", commit)):
        found.append(f"commit {commit!r} is not a commit id")
    # An ancestor of HEAD, not merely an object here: a commit left behind by a rebase is in the checkout where it
    # ran but not in a fresh clone of main.
    elif subprocess.run(
        ["git", "-C", str(ROOT), "merge-base", "--is-ancestor", commit, "HEAD"], capture_output=True
    ).returncode:
        found.append(f"commit {commit} is not in the history of HEAD")
    dirty = provenance.get("dirty")
    if not (dirty is False or (isinstance(dirty, list) and dirty and all(isinstance(p, str) for p in dirty))):
        found.append(f"dirty {dirty!r} is neither false nor a list of files")
    machine = provenance.get("machine")
    if not (
        isinstance(machine, dict)
        and isinstance(machine.get("cpu"), str)
        and machine["cpu"]
        and isinstance(machine.get("cores"), int)
        and machine["cores"] > 0
        and isinstance(machine.get("memory_gib"), int | float)
        and machine["memory_gib"] > 0
    ):
        found.append(f"machine {machine!r} lacks its CPU model, cores or memory")
    load = provenance.get("load")
    triples = [load.get(when) for when in ("before", "after")] if isinstance(load, dict) else [None]
    if not all(isinstance(t, list) and len(t) == 3 and all(isinstance(x, int | float) for x in t) for t in triples):
        found.append(f"load {load!r} lacks the 1/5/15-minute averages before and after")
    if "source" in provenance and not (isinstance(provenance["source"], str) and provenance["source"]):
        found.append("source (where backfilled fields come from) is empty")
    return found


RESULT_FILES = sorted(p for p in RESULTS.glob("*.json") if not p.name.endswith(SIDE_SUFFIX))
SIDE_FILES = sorted(RESULTS.glob(f"*{SIDE_SUFFIX}"))


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_results_file_says_when_on_what_code_and_box_under_what_load(path: Path) -> None:
    result = json.loads(path.read_text())
    assert isinstance(result, dict), f"{path.name}: a results file is an object with its provenance at the top"
    assert not problems(result.get("provenance")), problems(result.get("provenance"))


@pytest.mark.parametrize("path", SIDE_FILES, ids=lambda p: p.name)
def test_a_samples_side_file_is_covered_by_its_main_files_provenance(path: Path) -> None:
    main = path.with_name(path.name.removesuffix(SIDE_SUFFIX) + ".json")
    assert main.exists(), f"{path.name} has no {main.name} whose provenance covers it"
    assert json.loads(path.read_text()) == json.loads(main.read_text())["resource_samples"], (
        f"{path.name} does not hold the samples of {main.name}: they come from different runs"
    )


def test_the_shared_helper_writes_a_whole_provenance() -> None:
    assert not problems(Provenance().record())


def test_a_provenance_missing_a_field_is_refused() -> None:
    whole = Provenance().record()
    for field in ("date", "commit", "dirty", "machine", "load"):
        assert problems({k: v for k, v in whole.items() if k != field}), field
    assert problems(whole | {"commit": "0" * 40})  # not a commit of this repository
    assert problems(whole | {"machine": {"cpu": "AMD EPYC", "cores": 2}})  # "2 CPUs" is not a machine
    assert problems(whole | {"dirty": []})  # clean is false, not an empty list
    assert problems(whole | {"load": {"before": [1.0, 2.0, 3.0]}})
    assert problems(None)
