"""Host start: how long a rollout host takes from spawning to serving, and the memory it holds then.

What. One `ProcessHost` (the child process `WorkerConfig.rollout_hosts` spawns) is started as the worker
starts it, on the demo tasks, the tiny Qwen3 tokenizer and the `local` sandbox backend, against a STUB of
vLLM's OpenAI server (`_agent_farm.stub_vllm`: the host asks it for `/v1/models` while it starts). The
trainer's buffer is reported full from the start (backpressure), so the host launches no rollout: what
is measured is the host before its first rollout. Per start: the wall time from `ProcessHost.start()` to
`wait_started()` returning (the engine's InterceptionServer serves), then the child's RSS and PSS
(`/proc/<pid>/smaps_rollup`), and whether torch's library is mapped into it (`/proc/<pid>/maps`).
Beside it, figures of a bare `import swe_grpo.worker.host_main` in a fresh
interpreter: wall time, peak RSS, modules loaded, and whether torch and TRL are among them.

This script's own top level imports only the standard library: a spawned child re-imports the parent's
main module, so anything imported here would be counted as the host's. That is what happens to a trainer
script whose top level imports TRL: `HOST_START_MAIN_IMPORTS=trl.experimental.async_grpo` makes this
script's top level import that module too (in the host as well), to measure such a script's hosts.

Run: `.venv/bin/python benchmarks/host_start.py` (about a minute), which writes
benchmarks/results/host_start.json (`--output` for another file), with its provenance.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

for _module in filter(None, os.environ.get("HOST_START_MAIN_IMPORTS", "").split(",")):
    importlib.import_module(_module)  # as a trainer script's top-level imports (see the docstring)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "host_start.json"
MIB = 1024 * 1024

# VmHWM, not ru_maxrss: the latter keeps the forking parent's high-water mark across exec.
_IMPORT_PROBE = """
import sys, time
t0 = time.perf_counter()
import swe_grpo.worker.host_main
wall = time.perf_counter() - t0
names = set(sys.modules)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(wall, hwm * 1024, len(names), "torch" in names, any(n == "trl" or n.startswith("trl.") for n in names))
"""


def smaps_rollup(pid: int) -> dict[str, int]:
    """The process's memory totals in bytes (`Rss`, `Pss`, ...)."""
    totals = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        totals[key.rstrip(":")] = int(value) * 1024
    return totals


def torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def import_probe() -> dict[str, float | int | bool]:
    """A bare import of the host's entry module in a fresh interpreter."""
    repo = str(HERE.parent)
    env = {**os.environ, "PYTHONPATH": repo, "TRL_EXPERIMENTAL_SILENCE": "1"}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _IMPORT_PROBE], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    wall, rss, modules, torch, trl = out[-5:]
    return {
        "import_s": float(wall),
        "import_peak_rss_mib": int(rss) / MIB,
        "modules": int(modules),
        "torch": torch == "True",
        "trl": trl == "True",
    }


def start_once(url: str, model: str) -> dict[str, float | bool]:
    """Start one host until it serves, measure it, stop it."""
    from _pi_agent import load_tokenizer

    from swe_grpo.agents import make_agent
    from swe_grpo.demo.tasks import demo_tasks
    from swe_grpo.types import Policy
    from swe_grpo.worker.config import WorkerConfig
    from swe_grpo.worker.hosts import EngineArgs, HostSpec, ProcessHost

    config = WorkerConfig(rollout_hosts=0, queue_maxsize=1)
    engine = EngineArgs(demo_tasks(), load_tokenizer(), url, model, "local", config, make_agent(config.agent), None)
    host = ProcessHost(HostSpec(engine, Policy(0, None), 0, 1, {}))
    host._waiting.value = 1 << 40  # the trainer's buffer is full: the host launches no rollout
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    host.start()
    try:
        host.wait_started(600.0)
        ready_s = time.perf_counter() - t0
        assert host.pid is not None
        memory = smaps_rollup(host.pid)
        torch = torch_mapped(host.pid)
    finally:
        host.stop(60.0)
    return {
        "ready_s": ready_s,
        "rss_mib": memory["Rss"] / MIB,
        "pss_mib": memory["Pss"] / MIB,
        "torch_mapped": torch,
        "load_1min_before": load,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from _agent_farm import STUB_MODEL, serving_process, stub_vllm
    from _provenance import Provenance

    provenance = Provenance()
    with serving_process(stub_vllm, set(os.sched_getaffinity(0)), 1, 0.05) as (url, _):
        probes = [import_probe() for _ in range(args.repeats)]
        starts = [start_once(url, STUB_MODEL) for _ in range(args.repeats)]
    run = {
        "provenance": provenance.record(),
        "main_module_imports": os.environ.get("HOST_START_MAIN_IMPORTS", ""),
        "import_host_main": probes,
        "host_start": starts,
        "summary": {
            "ready_s_median": sorted(s["ready_s"] for s in starts)[len(starts) // 2],
            "rss_mib_median": sorted(s["rss_mib"] for s in starts)[len(starts) // 2],
            "pss_mib_median": sorted(s["pss_mib"] for s in starts)[len(starts) // 2],
        },
    }
    args.output.write_text(json.dumps(run, indent=2) + "\n")
    print(json.dumps(run, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
