"""Regenerate the demo tasks (`tasks.jsonl` and `repos/<name>.bundle`) from the source trees in `src/`.

    python -m swe_grpo.demo.tasks.build [--out DIR]     (default: this directory)

Each `src/<name>/` holds:
    task.json     instance_id, problem_statement, FAIL_TO_PASS, PASS_TO_PASS
    base/         the repository at its (buggy) base commit
    gold/         the files the reference fix changes, as they are after the fix   -> `patch`
    test_patch/   the test files the task's test patch changes, as they are after  -> `test_patch`

The base is committed with a fixed author, committer, date and an isolated git configuration, so the
commit id and the bundle's bytes are the same on every run and every machine; `tasks.jsonl` names the
bundle by a path relative to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "src"

_GIT_ENV = {
    "GIT_AUTHOR_NAME": "swe_grpo demo",
    "GIT_AUTHOR_EMAIL": "demo@swe-grpo.invalid",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00+00:00",
    "GIT_COMMITTER_NAME": "swe_grpo demo",
    "GIT_COMMITTER_EMAIL": "demo@swe-grpo.invalid",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00+00:00",
    # The user's and the system's git configuration must not change the result (hooks, signing, ...).
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "pack.threads=1", *args],
        cwd=repo,
        env={**os.environ, **_GIT_ENV},
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


def _copy_files(src: Path, dst: Path) -> None:
    # Contents only: modes and times of the source checkout must not leak into the commit.
    for path in sorted(src.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            target = dst / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())


def _overlay_diff(repo: Path, overlay: Path) -> str:
    """The patch that turns the base commit into base + the files of `overlay`; the checkout is reset."""
    _copy_files(overlay, repo)
    _git(repo, "add", "-A")
    patch = _git(repo, "diff", "--cached", "--no-color", "--no-ext-diff")
    _git(repo, "reset", "-q", "--hard")
    return patch


def build_task(src: Path, out_dir: Path) -> dict:
    """Build one task: write `out_dir/repos/<name>.bundle` and return its `tasks.jsonl` row."""
    spec = json.loads((src / "task.json").read_text(encoding="utf-8"))
    bundle = out_dir / "repos" / f"{src.name}.bundle"
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="swe_grpo-demo-build-") as tmp:
        repo = Path(tmp) / src.name
        repo.mkdir()
        _copy_files(src / "base", repo)
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"{src.name}: base of {spec['instance_id']}")
        base_commit = _git(repo, "rev-parse", "HEAD").strip()
        _git(repo, "bundle", "create", "-q", str(bundle), "HEAD", "main")
        patch = _overlay_diff(repo, src / "gold")
        test_patch = _overlay_diff(repo, src / "test_patch")
    return {
        "instance_id": spec["instance_id"],
        "repo": bundle.relative_to(out_dir).as_posix(),
        "base_commit": base_commit,
        "problem_statement": spec["problem_statement"],
        "test_patch": test_patch,
        "patch": patch,
        "FAIL_TO_PASS": spec["FAIL_TO_PASS"],
        "PASS_TO_PASS": spec["PASS_TO_PASS"],
    }


def build(out_dir: Path = HERE) -> Path:
    """Build every task under `src/` into `out_dir`; returns the path of the written `tasks.jsonl`."""
    rows = [build_task(src, out_dir) for src in sorted(SOURCES.iterdir()) if (src / "task.json").is_file()]
    tasks_file = out_dir / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return tasks_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE, help="output directory (default: %(default)s)")
    args = parser.parse_args()
    if shutil.which("git") is None:
        raise SystemExit("git is needed to build the demo tasks")
    print(build(args.out))


if __name__ == "__main__":
    main()
