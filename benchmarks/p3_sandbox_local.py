"""P3 (local part): how fast the `local` backend makes and removes sandboxes of a ~100 MB repository.

What. Per sandbox: `create()` (private directories, the copy-on-write view of the cached checkout, one
bwrap run proving the binds), ready (`create()` plus the first `exec("true")` answered: the sandbox can
be used), the first `git status` in /testbed (git checks its index against the tree once per sandbox:
agents pay it on their first git command) and `destroy()` (unmount, remove the directories). Target:
create-to-ready <= 100 ms. With the default limits (`LocalLimits()`): each sandbox gets its own memory
and pids cgroup and a tmpfs for what it writes, and every exec joins the cgroup first. Measured for each
copy-on-write method: the one the backend detects here (kernel overlayfs as root) and the fallbacks
(fuse-overlayfs, `cp -a`), and for the detected one also without network (`network=False`, as grading
creates them: a network namespace per exec). Also timed: 8 sandboxes created at once (a rollout group).
Reported separately, as they happen once per (repository, commit): the cache fill (fetch of the base
commit, checkout, chown to the sandbox user, index refresh), which the first `create()` of a task pays.

Repository. Generated deterministically (seeded) in a temporary directory, as for the docker part:
3,000 text files of ~20 KB in 60 directories (~60 MB) plus 8 random 5 MB blobs (40 MB), committed, and a
second commit on top (which the checkout must not contain), packed.

Run as root: `.venv/bin/python benchmarks/p3_sandbox_local.py [--iterations 20] [--output FILE]`. About
one minute; everything it makes (repository, cache, sandboxes) is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_repo import git, make_repo, tree_mb
from _pi_agent import markdown_table, percentile

from swe_grpo.sandbox.local import CowMethod, LocalBackend
from swe_grpo.tasks import Task


def ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q) * 1000:.0f}"


async def measure(backend: LocalBackend, task: Task, iterations: int, network: bool = True) -> list[list[str]]:
    """Rows (step, p50, p90, max in ms) for `iterations` sandboxes made and removed one after another."""
    create, ready, status, destroy = [], [], [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        sandbox = await backend.create(task, network=network)
        try:
            t1 = time.perf_counter()
            result = await sandbox.exec("true", timeout_s=60)
            t2 = time.perf_counter()
            assert result.exit_code == 0, result
            result = await sandbox.exec("git status --porcelain", timeout_s=60)
            t3 = time.perf_counter()
            assert result.exit_code == 0 and result.stdout == "", result
        finally:
            await sandbox.destroy()
        t4 = time.perf_counter()
        create.append(t1 - t0)
        ready.append(t2 - t0)
        status.append(t3 - t2)
        destroy.append(t4 - t3)
    return [
        [name, ms(xs, 50), ms(xs, 90), ms(xs, 100)]
        for name, xs in (
            ("create()", create),
            ("**create() to ready** (first exec answered)", ready),
            ("first `git status` in the sandbox", status),
            ("destroy()", destroy),
        )
    ]


async def run(repo: Path, cache_dir: Path, iterations: int) -> list[str]:
    base = git(repo, "rev-parse", "HEAD~1")
    task = Task(instance_id="bench__repo100mb-1", repo=str(repo), base_commit=base, problem_statement="")
    backend = LocalBackend(cache_dir=cache_dir)
    await backend.start()
    detected = backend.method
    assert detected is not None
    t = time.perf_counter()
    await (await backend.create(task, network=True)).destroy()
    first_create = time.perf_counter() - t

    lines = []
    methods: list[CowMethod] = [detected, *(m for m in ("overlay", "fuse-overlayfs", "copy") if m != detected)]
    for method in methods:
        rows = await measure(LocalBackend(cache_dir=cache_dir, method=method), task, iterations)
        label = "detected here, used by default" if method == detected else "fallback"
        lines += [f"`{method}` ({label}), {iterations} iterations, checkout cached (ms):", ""]
        lines += [markdown_table(["step", "p50", "p90", "max"], rows), ""]
        if method == detected:
            rows = await measure(LocalBackend(cache_dir=cache_dir, method=method), task, iterations, network=False)
            lines += [f"`{method}`, `network=False` (grading), {iterations} iterations (ms):", ""]
            lines += [markdown_table(["step", "p50", "p90", "max"], rows), ""]

    t = time.perf_counter()
    group = await asyncio.gather(*(backend.create(task, network=True) for _ in range(8)))
    try:
        await asyncio.gather(*(s.exec("true", timeout_s=60) for s in group))
        group_ready = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        await asyncio.gather(*(s.destroy() for s in group))
    group_destroy = time.perf_counter() - t
    lines += [
        f"8 sandboxes at once (`{detected}`): all created and ready in {group_ready * 1000:.0f} ms, destroyed in "
        f"{group_destroy * 1000:.0f} ms.",
        "",
        f"One-time cache fill: the first `create()` of the task (fill + create) took {first_create:.2f} s.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="swe_grpo_p3_local_") as scratch:
        t = time.perf_counter()
        repo = make_repo(Path(scratch) / "repo")
        generate_s = time.perf_counter() - t
        work_mb, git_mb = tree_mb(repo)
        lines = asyncio.run(run(repo, Path(scratch) / "checkouts", args.iterations))
    out = [
        f"### P3: local sandbox create/destroy, {work_mb:.0f} MB working tree + {git_mb:.0f} MB .git",
        "",
        *lines,
        f"Generating the repository took {generate_s:.1f} s.",
    ]
    text = "\n".join(out)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
