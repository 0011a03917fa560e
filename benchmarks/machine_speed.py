"""The speed of this box, to put beside any other benchmark's numbers.

Why. Machines of the same size (2 cores) have run this project's benchmarks 1.6-2.5x apart in speed
(docs/benchmarks.md): a latency or a demo's wall time means little without the speed of the box it was
taken on. Two references, each on one pinned core, ~20 s in all:

- Python: the interpreter work that dominates the request path (JSON of a Pi-sized 80 kB body, dict
  and string churn): ms per round.
- Torch: P7's training step of the demo's policy (8 x 1,024 tokens, forward, backward, AdamW) on one
  thread: ms per step.

Run it when the box is quiet (it prints the 1-minute load average beside the numbers):
`.venv/bin/python benchmarks/machine_speed.py`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from p7_trainer_step import Trainer


def python_round(body: dict) -> None:
    for _ in range(20):
        data = json.loads(json.dumps(body))
        "".join(m["content"] for m in data["messages"]).split()


def median_ms(fn, repeat: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    body = {"messages": [{"role": "tool", "content": f"line {i} " * 200} for i in range(50)]}
    python_ms = median_ms(lambda: python_round(body), repeat=30, warmup=3)
    trainer = Trainer(batch=8, seq_len=1024)
    torch_ms = median_ms(trainer.step, repeat=10, warmup=2)
    print(
        f"machine speed: Python round {python_ms:.1f} ms, torch step (8 x 1,024 tokens, one thread) {torch_ms:.0f} ms; "
        f"{os.cpu_count()} CPUs, 1-minute load average {load:.2f} before"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
