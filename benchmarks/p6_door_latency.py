"""P6: the latency the agent's door (`swe_grpo.sandbox.door`) adds to each request. Target: p50 <= 1 ms.

What. A client inside a real `local` sandbox sends `GET /rollout/<id>/v1/models` (authenticated; no
generation, so the time is transport and aiohttp) to a real InterceptionServer, one request after another,
two ways: direct (a sandbox sharing the host's network, to the server's TCP port on 127.0.0.1, as before
the door) and through the door (a sandbox with no network, to 127.0.0.1:DOOR_PORT in its own namespace,
the forwarder `door_forwarder.c`, the rollout's unix socket). Each way with one kept-alive connection (as Pi's
HTTP client does) and with a new connection per request. The added latency is door minus direct, per
percentile. The client is Python's http.client in both arms, timing each request with perf_counter.
The door's accept limit (`ServingLimits.door_accepts_per_s`, 20 a second) is lifted: with it, a new
connection per request waits ~50 ms for the server's accept by design, whatever the forwarder does.
Behind the door the client, after its requests, also reads the memory of its parent process, the
forwarder (`/proc/PPID/status` and `smaps_rollup`: RSS, its peak, PSS): the door's cost per rollout.

Run as root: `.venv/bin/python benchmarks/p6_door_latency.py [--requests 2000] [--runs 3] [--output FILE.json]`.
Under a minute a run; the sandboxes and the door are removed at the end. Runs are noisy on a shared box, so
`--runs` of them are kept side by side in the JSON file's `runs` (the rows and the forwarder's memory), under
one provenance (benchmarks/_provenance.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _pi_agent import load_tokenizer, markdown_table, percentile
from _provenance import Provenance
from sandbox_helpers import calc_task, make_repo

from swe_grpo.agents.pi import PiBundle
from swe_grpo.sandbox.base import Sandbox
from swe_grpo.sandbox.door import DOOR_PORT, Door
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.limits import ServingLimits
from swe_grpo.serving.vllm_client import VLLMClient

# argv: port, path, token, requests, "keep" or "new"; prints {"times": latencies in seconds, "parent": the
# parent process's memory in KiB (behind the door: the forwarder)} as JSON.
CLIENT = r"""
import http.client, json, os, re, sys, time
port, path, token, n, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
headers = {"Authorization": f"Bearer {token}"}
conn, out = None, []
for i in range(n + 50):  # the first 50 warm up
    start = time.perf_counter()
    if conn is None or mode == "new":
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status
    if mode == "new":
        conn.close()
    if i >= 50:
        out.append(time.perf_counter() - start)
def kib(name, *fields):
    try:
        text = open(f"/proc/{os.getppid()}/{name}").read()
    except OSError:
        return {}
    return {f: int(m.group(1)) for f in fields if (m := re.search(rf"^{f}:\s+(\d+) kB", text, re.M))}
print(json.dumps({"times": out, "parent": kib("status", "VmRSS", "VmHWM") | kib("smaps_rollup", "Pss")}))
"""
CLIENT_ARGV = ["python3", "-c", CLIENT]


async def measure(sandbox: Sandbox, argv: list[str]) -> dict:
    result = await sandbox.exec(argv, timeout_s=300)
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


async def run(requests: int) -> dict:
    tokenizer = load_tokenizer()
    bundle = PiBundle.default()
    with tempfile.TemporaryDirectory() as work:
        run_dir = Path(work) / "run"
        run_dir.mkdir()
        run_dir.chmod(0o711)
        Path(work).chmod(0o711)
        task = calc_task(make_repo(Path(work)))
        backend = LocalBackend(cache_dir=Path(work) / "cache", run_dir=run_dir)
        unused = VLLMClient("http://127.0.0.1:9", "policy", max_model_len=8192)  # /models never generates
        limits = ServingLimits(door_accepts_per_s=1e6)
        async with unused, InterceptionServer(unused, tokenizer, limits=limits) as server:
            door = Door.make("p6")
            path = "/rollout/p6/v1/models"
            try:
                handle = await server.rollout("p6", socket=door.socket).__aenter__()
                endpoint = handle.endpoint
                direct = await backend.create(task, mounts=[bundle.mount()], network=True)
                behind = await backend.create(task, mounts=[bundle.mount(), door.mount()], network=False)
                async with direct, behind:
                    rows, memory = [], {}
                    for mode in ("keep", "new"):
                        args = [path, endpoint.token, str(requests), mode]
                        direct_run = await measure(direct, [*CLIENT_ARGV, str(server.port), *args])
                        door_run = await measure(behind, door.wrap([*CLIENT_ARGV, str(DOOR_PORT), *args]))
                        memory[mode] = door_run["parent"]
                        label = "kept-alive connection" if mode == "keep" else "new connection per request"
                        for q in (50, 90, 99):
                            d = percentile(direct_run["times"], q) * 1e3
                            o = percentile(door_run["times"], q) * 1e3
                            rows.append({"connection": label, "percentile": q, "direct_ms": d, "door_ms": o})
            finally:
                door.remove()  # the server's stop closes the rollout and stops serving its socket
    for row in rows:
        row["added_ms"] = row["door_ms"] - row["direct_ms"]
    forwarder = Path(door.wrap([])[0]).name  # what runs as the forwarder in the sandbox
    return {"requests": requests, "forwarder": forwarder, "rows": rows, "forwarder_kib": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    provenance = Provenance()
    runs = [report(asyncio.run(run(args.requests)), args.requests) for _ in range(args.runs)]
    if args.output:
        args.output.write_text(json.dumps({"provenance": provenance.record(), "runs": runs}, indent=1) + "\n")


def report(result: dict[str, Any], requests: int) -> dict[str, Any]:
    """Print one run's table; the run, with the load average at its end."""
    result["load_after"] = [round(x, 2) for x in os.getloadavg()]
    rows = [
        [
            r["connection"],
            f"p{r['percentile']}",
            *(f"{r[k]:.3f}" for k in ("direct_ms", "door_ms")),
            f"{r['added_ms']:+.3f}",
        ]
        for r in result["rows"]
    ]
    load = ", ".join(f"{x:.1f}" for x in result["load_after"])
    print(f"P6: door latency, {requests} sequential GET /v1/models per row (load average {load})\n")
    print(markdown_table(["connection", "percentile", "direct (ms)", "door (ms)", "added (ms)"], rows))
    print(f"\nthe forwarder's memory (KiB): {result['forwarder_kib']}")
    return result


if __name__ == "__main__":
    main()
