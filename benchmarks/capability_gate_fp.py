"""False positives of the capability gate (issue 32 §1) on synthesized gold patches, and its cost.

What. The synthesized task set (`SYNTH_PROJECTS`) kept no task rows, only the projects it was made from; a
synthesized task's gold patch reverts one mutation (`swe_grpo.synth.mutate`). So this takes each project of
that set (its sdist, from PyPI; `--projects` for a subset), every mutation of every function of its non-test
Python files (a superset of the tasks the set accepted: those are the mutations some test caught), and asks
the gate about the gold patch of each (all, or a seeded sample of `--per-project`): the mutant as the base,
the released file as the patched one. A gold patch the gate refuses is a false positive; each is listed with
the capability and the line. Also the time one gate takes (parsing the mutant; the released file's uses are
computed once per file, as the gate's result is the difference of the two).

Run: `.venv/bin/python benchmarks/capability_gate_fp.py [--per-project 40] [--projects NAME==VERSION ...]
[--output benchmarks/results/capability_gate_fp.json]` (downloads the sdists once into the synth cache; a
few minutes on 2 cores with a sample, an hour or more for every mutation of every project).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import Provenance

from swe_grpo.grading.capability_uses import uses
from swe_grpo.paths import cache_root
from swe_grpo.synth.mutate import Mutation, mutations
from swe_grpo.synth.source import download_sdist, extract_sdist

RESULTS = Path(__file__).parent / "results"


# The projects of the synthesized task set measured in 9f37874 (218 tasks; its results were later removed
# for want of a provenance, and it kept no task rows): every one of them, isodate (0 tasks) included.
SYNTH_PROJECTS = (
    "boltons==24.0.0",
    "cachetools==5.5.0",
    "idna==3.10",
    "inflection==0.5.1",
    "isodate==0.7.2",
    "jmespath==1.0.1",
    "more-itertools==10.5.0",
    "parse==1.20.2",
    "platformdirs==4.2.2",
    "pyflakes==3.2.0",
    "semver==3.0.2",
    "tabulate==0.9.0",
    "webcolors==24.8.0",
    "xmltodict==0.13.0",
)


def _is_test(path: Path, tree: Path) -> bool:
    parts = path.relative_to(tree).parts
    return any(part in ("tests", "test", "testing", "docs") for part in parts[:-1]) or parts[-1].startswith("test")


def sweep(spec: str, work: Path, per_project: int | None) -> dict:
    tree = work / spec.replace("==", "-")
    extract_sdist(download_sdist(spec, cache_root() / "synth" / "sdists"), tree)
    candidates: list[tuple[Path, bytes, Mutation]] = []
    for path in sorted(tree.rglob("*.py")):
        if not _is_test(path, tree):
            source = path.read_bytes()
            candidates += [(path, source, m) for m in mutations(str(path.relative_to(tree)), source)]
    chosen = candidates
    if per_project is not None and len(candidates) > per_project:
        chosen = random.Random(f"{spec}-0").sample(candidates, per_project)
    refused, findings, took = 0, [], []
    released_uses: dict[Path, dict[str, int]] = {}
    for path, source, mutation in chosen:
        package_main = path.name == "__main__.py"  # as the gate judges a file (`capability.gate`)
        if path not in released_uses:
            released_uses[path] = uses(source.decode("utf-8"), package_main)
        released = released_uses[path]
        started = time.perf_counter()
        mutant = uses(mutation.apply(source).decode("utf-8"), package_main)
        took.append(time.perf_counter() - started)
        added = sorted(set(released) - set(mutant))
        if added:
            refused += 1
            lines = source.decode("utf-8").splitlines()
            findings += [
                f"{cap} in {mutation.path} ({mutation.operator}): {lines[released[cap] - 1].strip()[:100]}"
                for cap in added
            ]
    return {
        "project": spec,
        "candidates": len(candidates),
        "gold_patches": len(chosen),
        "refused": refused,
        "findings": findings,
        "gate_s_median": round(statistics.median(took), 5) if took else None,
        "gate_s_max": round(max(took), 4) if took else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-project", type=int, default=None, help="a seeded sample of this many a project")
    parser.add_argument("--projects", nargs="*", default=list(SYNTH_PROJECTS), help="a subset of SYNTH_PROJECTS")
    parser.add_argument("--output", type=Path, default=RESULTS / "capability_gate_fp.json")
    args = parser.parse_args()
    run = Provenance()
    rows: list[dict] = []

    def write(complete: bool) -> None:
        # After every project, so that a run cut short still leaves what it measured.
        projects = [row["project"] for row in rows]
        summary = {"per_project": args.per_project, "complete": complete, "projects": projects}
        summary |= {"gold_patches": sum(r["gold_patches"] for r in rows), "refused": sum(r["refused"] for r in rows)}
        args.output.write_text(json.dumps({"provenance": run.record(), **summary, "rows": rows}, indent=1) + "\n")
        print(json.dumps(summary), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.projects:
            rows.append(sweep(spec, Path(tmp), args.per_project))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "findings"}), flush=True)
            write(complete=False)
    write(complete=True)


if __name__ == "__main__":
    main()
