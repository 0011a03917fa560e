"""P3: how fast the `docker` backend makes and removes sandboxes of a ~100 MB repository.

What. Per sandbox: `create()` (container created and started from the task's prepared image), ready
(`create()` plus the first `exec("true")` answered: the sandbox can be used), the first `git status` in
/testbed (git refreshes its index once per sandbox: agents pay it on their first git command) and
`destroy()` (container killed and removed). Target: create-to-ready <= 1 s. With the default limits
(`DockerLimits()`: memory, pids, CPU and disk: a read-only root and tmpfs volumes, the repository copied
into /testbed's at start). Also timed: create-to-ready of a sandbox without network (`network=False`, as
grading creates them), of one without the disk limit (`disk=None`: the copy-on-write layer, no copy), and
8 sandboxes created at once (a rollout group).
Reported separately, as they happen once: starting a private dockerd (when no engine runs), building the
base image (when missing), `start()` (connect + reap), and building the task's prepared image (export
the repository at its base commit, copy it into a container of the base image, check and chown it,
commit), which the first `create()` of a task pays.

Repository. Generated deterministically (seeded) and cached under `cache_root()/bench/repo-100mb`: 3,000
text files of ~20 KB in 60 directories (~60 MB) plus 8 random 5 MB blobs (40 MB), committed, and a
second commit on top (so the export drops it), packed. Its .git adds ~55 MB (the blobs do not compress).

Run: `.venv/bin/python benchmarks/p3_sandbox_docker.py [--iterations 10] [--output FILE]` as root (or
with a reachable Docker engine). About 1 minute once the base image exists.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import docker

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _bench_repo import git, make_repo, tree_mb
from _pi_agent import markdown_table, percentile
from docker_env import docker_engine, ensure_base_image

from swe_grpo.paths import cache_root
from swe_grpo.sandbox.docker import DockerBackend, DockerLimits
from swe_grpo.tasks import Task


async def measure(url: str, repo: Path, iterations: int, one_time: dict[str, float]) -> list[str]:
    task = Task(
        instance_id="bench__repo100mb-1",
        repo=str(repo),
        base_commit=git(repo, "rev-parse", "HEAD~1").strip(),
        problem_statement="",
    )
    backend = DockerBackend(base_url=url)
    t = time.perf_counter()
    await backend.start()
    one_time["backend start() (connect + reap)"] = time.perf_counter() - t

    # The prepared image: found from a first sandbox, removed, then timed being rebuilt.
    sandbox = await backend.create(task, network=True)
    engine = docker.DockerClient(base_url=url)
    tag = engine.containers.get(sandbox.id).attrs["Config"]["Image"]
    await sandbox.destroy()
    engine.images.remove(tag)
    t = time.perf_counter()
    sandbox = await backend.create(task, network=True)
    one_time["first create() of the task: prepared image build + create"] = time.perf_counter() - t
    image_mb = engine.images.get(tag).attrs["Size"] / 1e6
    await sandbox.destroy()

    create, ready, status, destroy = [], [], [], []
    for _ in range(iterations):
        t0 = time.perf_counter()
        sandbox = await backend.create(task, network=True)
        t1 = time.perf_counter()
        result = await sandbox.exec("true", timeout_s=60)
        t2 = time.perf_counter()
        assert result.exit_code == 0, result
        result = await sandbox.exec("git status --porcelain", timeout_s=60)
        t3 = time.perf_counter()
        assert result.exit_code == 0 and result.stdout == "", result
        await sandbox.destroy()
        t4 = time.perf_counter()
        create.append(t1 - t0)
        ready.append(t2 - t0)
        status.append(t3 - t2)
        destroy.append(t4 - t3)

    async def ready_times(backend: DockerBackend, network: bool) -> list[float]:
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter()
            sandbox = await backend.create(task, network=network)
            result = await sandbox.exec("true", timeout_s=60)
            times.append(time.perf_counter() - t0)
            assert result.exit_code == 0, result
            await sandbox.destroy()
        return times

    offline = await ready_times(backend, network=False)
    unlimited_backend = DockerBackend(base_url=url, limits=DockerLimits(disk=None))
    await unlimited_backend.start()
    unlimited = await ready_times(unlimited_backend, network=True)
    await unlimited_backend.close()

    t = time.perf_counter()
    group = await asyncio.gather(*(backend.create(task, network=True) for _ in range(8)))
    await asyncio.gather(*(s.exec("true", timeout_s=60) for s in group))
    group_ready = time.perf_counter() - t
    t = time.perf_counter()
    await asyncio.gather(*(s.destroy() for s in group))
    group_destroy = time.perf_counter() - t
    await backend.close()
    engine.close()

    def ms(xs: list[float], q: float) -> str:
        return f"{percentile(xs, q) * 1000:.0f}"

    rows = [
        [name, ms(xs, 50), ms(xs, 90), ms(xs, 100)]
        for name, xs in (
            ("create()", create),
            ("create() to ready (first exec answered)", ready),
            ("create() to ready, `network=False` (grading)", offline),
            ("create() to ready, `disk=None` (no disk limit, no copy)", unlimited),
            ("first `git status` in the sandbox", status),
            ("destroy()", destroy),
        )
    ]
    lines = [f"Per sandbox, {iterations} iterations, prepared image cached (ms):", ""]
    lines.append(markdown_table(["step", "p50", "p90", "max"], rows))
    lines += [
        "",
        f"8 sandboxes at once: all created and ready in {group_ready * 1000:.0f} ms, destroyed in "
        f"{group_destroy * 1000:.0f} ms.",
        f"Prepared image: {image_mb:.0f} MB (base image + repository layer).",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    one_time: dict[str, float] = {}
    t = time.perf_counter()
    repo = make_repo(cache_root() / "bench" / "repo-100mb")
    one_time["generate the repository (cached after the first run)"] = time.perf_counter() - t
    work_mb, git_mb = tree_mb(repo)
    t = time.perf_counter()
    with docker_engine() as url:
        one_time["engine ready (private dockerd start, or an existing engine)"] = time.perf_counter() - t
        t = time.perf_counter()
        ensure_base_image(url)
        one_time["base image (debootstrap + import, ~100 s; 0 when cached)"] = time.perf_counter() - t
        lines = asyncio.run(measure(url, repo, args.iterations, one_time))
        t = time.perf_counter()
    one_time["engine stop"] = time.perf_counter() - t

    out = [
        f"### P3: docker sandbox create/destroy, {work_mb:.0f} MB working tree + {git_mb:.0f} MB .git",
        "",
        *lines,
        "",
        "One-time costs (s):",
        "",
        markdown_table(["step", "s"], [[name, f"{s:.2f}"] for name, s in one_time.items()]),
    ]
    text = "\n".join(out)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
