"""Where a project's code comes from, and the git repository its tasks live in.

`fetch_source(spec, work)` turns a SOURCE of `swe-grpo tasks synth` into a clean tree under `work`:
- `name==version`: the released sdist, `pip download --no-deps --no-binary :all:` (cached in
  `cache_root()/synth/sdists`), extracted;
- a git repository (a directory with `.git`, or a bare one): the tree of its HEAD (`git archive`);
- any other directory: its files, without `.git`, caches and virtual environments.
Anything else, or a download that fails, is a `SynthError`.

`commit_tree(repo, tree)` makes a ROOT commit (no parent, fixed identity and dates: the same tree gives the
same commit id on every machine), so a sandbox, which fetches only the base commit's history, shows no
trace of any other commit: the buggy base commit hides the clean code.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

GIT_ENV = {
    **os.environ,
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "swe-grpo-synth",
    "GIT_AUTHOR_EMAIL": "swe-grpo-synth@localhost",
    "GIT_COMMITTER_NAME": "swe-grpo-synth",
    "GIT_COMMITTER_EMAIL": "swe-grpo-synth@localhost",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
}
_REQUIREMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)")
# Not part of a project's source: never copied from a directory SOURCE.
_SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", ".tox", ".nox", ".pytest_cache", ".mypy_cache", "build"}


class SynthError(RuntimeError):
    """A source cannot be made into tasks: it cannot be fetched, its suite does not run, nothing of it is
    covered by its tests, ... The message says which source and why."""


def git(repo: Path, *args: str, stdin: str | None = None, env: dict[str, str] | None = None) -> str:
    """`git args` in `repo` with a fixed identity and no user configuration; `SynthError` when it fails."""
    done = subprocess.run(
        ["git", *args], cwd=repo, input=stdin, capture_output=True, text=True, env={**GIT_ENV, **(env or {})}
    )
    if done.returncode != 0:
        raise SynthError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def commit_tree(repo: Path, tree_dir: Path, message: str) -> str:
    """A root commit of `tree_dir`'s files in the bare repository `repo` (deterministic: fixed identity and
    dates, so the same files give the same commit id)."""
    index = {"GIT_INDEX_FILE": str(repo / f"synth-{os.getpid()}-{id(tree_dir)}.index"), "GIT_WORK_TREE": str(tree_dir)}
    try:
        git(repo, "read-tree", "--empty", env=index)
        git(repo, "add", "-A", "-f", ".", env=index)
        tree = git(repo, "write-tree", env=index).strip()
    finally:
        Path(index["GIT_INDEX_FILE"]).unlink(missing_ok=True)
    return git(repo, "commit-tree", tree, "-m", message).strip()


def download_sdist(requirement: str, dest: Path, sha256: str | None = None) -> Path:
    """The sdist of `name==version`, downloaded once into `dest` with pip; with `sha256`, checked against
    it. `SynthError` when pip cannot get it or the digest differs."""
    match = _REQUIREMENT.fullmatch(requirement)
    if match is None:
        raise SynthError(f"{requirement!r} is not a pinned requirement (name==version)")
    name, version = match.groups()

    def normal(text: str) -> str:
        return re.sub(r"[-_.]+", "-", text).lower()

    def cached() -> Path | None:
        for path in sorted(dest.glob("*")) if dest.is_dir() else ():
            stem = re.sub(r"\.(tar\.gz|zip|tar\.bz2)$", "", path.name)
            dist, _, got = stem.rpartition("-")
            if stem != path.name and normal(dist) == normal(name) and got == version:
                return path
        return None

    archive = cached()
    if archive is None:
        dest.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(dest)]
        try:
            done = subprocess.run([*cmd, requirement], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise SynthError(f"pip download {requirement}: no answer in 600 s") from None
        archive = cached()
        if done.returncode != 0 or archive is None:
            raise SynthError(f"cannot fetch {requirement}: pip download: {done.stderr.strip()[-1500:]}")
    if sha256 is not None:
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            raise SynthError(f"{archive} has sha256 {digest}, not the pinned {sha256}")
    return archive


def extract_sdist(archive: Path, dest: Path) -> None:
    """The archive's files in `dest` (made here), without the archive's top directory."""
    dest.mkdir(parents=True)
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(dest)
    else:
        with tarfile.open(archive) as tar:
            tar.extractall(dest, filter="data")
    entries = list(dest.iterdir())
    if len(entries) == 1 and entries[0].is_dir():
        top = entries[0]
        for item in top.iterdir():
            item.rename(dest / item.name)
        top.rmdir()


@dataclass(frozen=True)
class Source:
    """A fetched SOURCE: `name` (file-name safe: `dist-version`, a directory's name, a repository's name and
    HEAD), the clean tree at `tree`."""

    spec: str
    name: str
    tree: Path


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).strip("._") or "project"


def fetch_source(spec: str, work: Path, sdist_cache: Path) -> Source:
    """The clean tree of `spec` in a new directory under `work` (see the module docstring)."""
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SynthError(f"{spec}: not a directory, a git repository or name==version")
        path = path.resolve()
        inside = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "--is-bare-repository", "--show-toplevel"],
            capture_output=True,
            text=True,
            env=GIT_ENV,
        )
        lines = inside.stdout.split()
        is_repo = inside.returncode == 0 and (lines[:1] == ["true"] or Path(lines[-1]).resolve() == path)
        if is_repo:
            head = git(path, "rev-parse", "--short=12", "HEAD").strip()
            name = _safe(f"{path.name.removesuffix('.git')}-{head}")
            tree = Path(tempfile.mkdtemp(prefix="tree-", dir=work))
            archive = subprocess.run(["git", "-C", str(path), "archive", "HEAD"], capture_output=True, env=GIT_ENV)
            if archive.returncode != 0:
                raise SynthError(f"{spec}: git archive HEAD: {archive.stderr.decode(errors='replace').strip()}")
            subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
            return Source(spec, name, tree)
        tree = Path(tempfile.mkdtemp(prefix="tree-", dir=work)) / "tree"
        shutil.copytree(path, tree, symlinks=True, ignore=lambda _dir, names: [n for n in names if n in _SKIP_DIRS])
        return Source(spec, _safe(path.name), tree)
    if _REQUIREMENT.fullmatch(spec) is None:
        raise SynthError(f"{spec}: no such directory, and not a pinned PyPI requirement (name==version)")
    archive = download_sdist(spec, sdist_cache)
    tree = Path(tempfile.mkdtemp(prefix="tree-", dir=work)) / "tree"
    extract_sdist(archive, tree)
    name, version = spec.split("==")
    return Source(spec, _safe(f"{name}-{version}"), tree)
