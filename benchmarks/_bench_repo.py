"""The ~100 MB repository the P3 benchmarks create sandboxes of: 3,000 generated Python modules plus
40 MB of binary blobs, a base commit and a later "fix" commit, packed; deterministic."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

GIT_ENV = {
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@localhost",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@localhost",
    "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
}
_DONE = "swe_grpo_bench_v3"  # marks a finished repository, so a cached one is reused


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=GIT_ENV
    ).stdout.strip()


def make_repo(root: Path) -> Path:
    """The benchmark repository at `root` (reused when a finished one is already there)."""
    if (root / ".git" / _DONE).exists():
        return root
    subprocess.run(["rm", "-rf", str(root)], check=True)
    rng = random.Random(0)
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "data"]
    words += [f"name_{i}" for i in range(500)]
    for i in range(3000):
        path = root / f"pkg_{i % 60:02d}" / f"module_{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines = (" ".join(rng.choices(words, k=12)) for _ in range(180))
        path.write_text("\n".join(lines) + "\n")
    (root / "assets").mkdir()
    for i in range(8):
        (root / "assets" / f"blob_{i}.bin").write_bytes(rng.randbytes(5 << 20))
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    (root / "pkg_00" / "module_0000.py").write_text("fixed\n")
    git(root, "commit", "-qam", "the fix")
    git(root, "gc", "-q")  # packed, as a cloned repository is (an unpacked one exports ~20 s slower)
    (root / ".git" / _DONE).touch()
    return root


def tree_mb(root: Path) -> tuple[float, float]:
    """Megabytes of the working tree and of .git."""
    work = sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and ".git" not in p.parts)
    dot_git = sum(p.stat().st_size for p in (root / ".git").rglob("*") if p.is_file())
    return work / 1e6, dot_git / 1e6
