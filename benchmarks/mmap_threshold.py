"""Does pinning glibc's mmap threshold (what the InterceptionServer does to its process) slow a trainer's step?

Why. `swe_grpo.serving.limits.pin_mmap_threshold` has glibc serve every allocation over 128 KiB with a mapping of
its own, returned to the system when freed, so that request bodies do not stay in the server's heap. It is
process-wide: with `rollout_hosts=0` the server runs in the trainer's process, and torch's CPU tensors come from
the same malloc, so each big tensor of each step would then be a fresh mapping (page faults, zeroed pages). What
this measured is why `return_big_buffers` no longer pins it in a process with torch loaded.

What. P7's training step of the demo's policy (`p7_trainer_step.Trainer`: the tiny Qwen3, forward + backward +
AdamW, one thread) timed in fresh processes, alternately without and with the pin, `--rounds` of each, `--steps`
steps a process after `--warmup`. Reported: each variant's median step over all its steps and the ratio pinned /
default. Results as JSON (`--json`).

Run: `.venv/bin/python benchmarks/mmap_threshold.py --json benchmarks/results/mmap_threshold.json` (~2 minutes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import Provenance


def timed_steps(pinned: bool, batch: int, seq_len: int, warmup: int, steps: int, out: multiprocessing.Queue) -> None:
    import torch
    from p7_trainer_step import Trainer

    from swe_grpo.serving.limits import pin_mmap_threshold

    torch.set_num_threads(1)
    # The pin itself: `return_big_buffers` would now refuse it here, torch being loaded (this benchmark is why).
    if pinned and not pin_mmap_threshold():
        raise RuntimeError("glibc's mmap threshold could not be pinned here")
    trainer = Trainer(batch, seq_len)
    for _ in range(warmup):
        trainer.step()
    out.put([trainer.step() for _ in range(steps)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    provenance, t0 = Provenance(), time.perf_counter()
    times: dict[str, list[float]] = {"default": [], "pinned": []}
    for _ in range(args.rounds):
        for variant in ("default", "pinned"):
            out = ctx.Queue()
            process = ctx.Process(
                target=timed_steps, args=(variant == "pinned", args.batch, args.seq_len, args.warmup, args.steps, out)
            )
            process.start()
            times[variant] += out.get()
            process.join()
    medians = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "provenance": provenance.record(),
        "step_s_median": {k: round(v, 4) for k, v in medians.items()},
        "pinned_over_default": round(medians["pinned"] / medians["default"], 3),
        "steps_per_variant": len(times["default"]),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "run_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
