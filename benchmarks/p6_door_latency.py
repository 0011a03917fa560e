"""P6: the latency the agent's door (`swe_grpo.serving.door`) adds to each request. Target: p50 <= 1 ms.

What. A client inside a real `local` sandbox sends `GET /rollout/<id>/v1/models` (authenticated; no
generation, so the time is transport and aiohttp) to a real InterceptionServer, one request after another,
two ways: direct (a sandbox sharing the host's network, to the server's TCP port on 127.0.0.1, as before
the door) and through the door (a sandbox with no network, to 127.0.0.1:DOOR_PORT in its own namespace,
the forwarder `door.cjs`, the rollout's unix socket). Each way with one kept-alive connection (as Pi's
HTTP client does) and with a new connection per request. The added latency is door minus direct, per
percentile. The client is Python's http.client in both arms, timing each request with perf_counter.

Run as root: `.venv/bin/python benchmarks/p6_door_latency.py [--requests 2000] [--output FILE]`. Under a
minute; the sandboxes and the door are removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _pi_agent import load_tokenizer, markdown_table, percentile
from sandbox_helpers import calc_task, make_repo

from swe_grpo.agents.pi import NODE_PATH, PI_MOUNT, PiBundle
from swe_grpo.sandbox.base import Sandbox
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.door import DOOR_PORT
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import VLLMClient

# argv: port, path, token, requests, "keep" or "new"; prints the latencies in seconds as JSON.
CLIENT = r"""
import http.client, json, sys, time
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
print(json.dumps(out))
"""
CLIENT_ARGV = ["python3", "-c", CLIENT]
NODE = f"{PI_MOUNT}/{NODE_PATH}"


async def latencies(sandbox: Sandbox, argv: list[str]) -> list[float]:
    result = await sandbox.exec(argv, timeout_s=300)
    assert result.exit_code == 0, result
    return json.loads(result.stdout)


async def run(requests: int) -> str:
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
        async with unused, InterceptionServer(unused, tokenizer) as server:
            endpoint = server.open_rollout()
            door = await server.open_door(endpoint.rollout_id)
            path = f"/rollout/{endpoint.rollout_id}/v1/models"
            try:
                direct = await backend.create(task, mounts=[bundle.mount()], network=True)
                behind = await backend.create(task, mounts=[bundle.mount(), door.mount()], network=False)
                async with direct, behind:
                    rows = []
                    for mode in ("keep", "new"):
                        args = [path, endpoint.token, str(requests), mode]
                        times = {
                            "direct": await latencies(direct, [*CLIENT_ARGV, str(server.port), *args]),
                            "door": await latencies(behind, door.wrap(NODE, [*CLIENT_ARGV, str(DOOR_PORT), *args])),
                        }
                        label = "kept-alive connection" if mode == "keep" else "new connection per request"
                        for q in (50, 90, 99):
                            d, o = percentile(times["direct"], q) * 1e3, percentile(times["door"], q) * 1e3
                            rows.append([label, f"p{q}", f"{d:.3f}", f"{o:.3f}", f"{o - d:+.3f}"])
            finally:
                await server.close_door(door)
                server.close_rollout(endpoint.rollout_id)
    table = markdown_table(["connection", "percentile", "direct (ms)", "door (ms)", "added (ms)"], rows)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"P6: door latency, {requests} sequential GET /v1/models per row (load average {load})\n\n{table}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    text = asyncio.run(run(args.requests))
    print(text)
    if args.output:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()
