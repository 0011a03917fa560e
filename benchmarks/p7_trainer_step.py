"""P7: the trainer's CPU step while 256 rollouts run against it, rollouts in its process vs in a rollout host.

What. A training step of the demo's policy (the tiny Qwen3 built by `swe_grpo.extras.tiny_model`: forward,
backward and AdamW over `--batch` sequences of `--seq-len` tokens) on one thread, timed step by step in
three modes:

- `none`: no rollouts (the baseline);
- `in-process`: the real `SWERolloutWorker` with `rollout_hosts=0`, its engine (InterceptionServer,
  rollouts, sandboxes, grading) in a thread of the trainer's process, as before rollout hosts existed;
- `out-of-process`: the same worker with `rollout_hosts=1` (the default), its engine in a child process.

The rollouts: `--rollouts` concurrent ones (256) on the bundled demo tasks, each a real `local` sandbox,
a simulated Pi session of `--turns` turns with 2-5 s between them (`_agent_farm.FarmAgent`: the agents
run in a farm process, as Pi runs in processes of its own), graded by the task's tests in a fresh
sandbox; generation is a STUB of vLLM answering every completion after 50 ms (`_agent_farm.stub_vllm`).
The trainer loop drains the worker's queues between steps, as TRL's trainer does.

Placement (2+ CPUs): the trainer's thread runs on CPU 0 and everything the worker starts (its engine
thread or host process, sandboxes, grading) plus the farm and the stub on the last CPU, so that the
modes differ in one thing only: whether the engine shares the trainer's process (its GIL, its heap and
garbage collector). On a GPU box the trainer's step is mostly this Python thread driving the GPU.

Reported per mode: step time p50 / mean / p90 and the mean's ratio to `none`; what the rollouts did while
the steps were timed (rollouts in flight, completions/s, turns/s); the trainer process's full GCs.
Target: out-of-process within 10 % of `none`.

Run: `.venv/bin/python benchmarks/p7_trainer_step.py` (~8 minutes; `--modes`, `--rollouts`, `--window-s`,
`--batch`, `--seq-len`; `--batch 1 --seq-len 128` for a step dominated by Python dispatch, as a GPU
trainer's thread is).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _agent_farm import STUB_MODEL, FarmAgent, agent_farm, serving_process, stats, stub_vllm
from _pi_agent import TOOL_OUTPUTS, markdown_table, percentile
from transformers import AutoModelForCausalLM, AutoTokenizer

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.extras.tiny_model import build_tiny_model
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.worker import SWERolloutWorker
from swe_grpo.worker.config import WorkerConfig

MODES = ("none", "in-process", "out-of-process")
log = logging.getLogger("p7")


@dataclass
class ModeResult:
    mode: str
    step_s: list[float]
    in_flight: list[float] = field(default_factory=list)  # sampled once per timed step
    completions_per_s: float = 0.0
    samples: int = 0  # drained from the worker's buffer while steps were timed
    gc_full: int = 0
    start_s: float = 0.0  # worker.start()
    stop_s: float = 0.0  # worker.stop()


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """One thread's training step on the demo's policy model: forward, backward, AdamW."""

    def __init__(self, batch: int, seq_len: int):
        model_dir = build_tiny_model()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        vocab = self.model.config.vocab_size
        self.input_ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))

    def step(self) -> float:
        t0 = time.perf_counter()
        loss = self.model(input_ids=self.input_ids, labels=self.input_ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


class GcCounter:
    def __init__(self) -> None:
        self.full = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        self.full += phase == "stop" and info.get("generation") == 2


# --------------------------------------------------------------------------- helper processes


@contextlib.contextmanager
def on_cpus(cpus: set[int]) -> Iterator[None]:
    """Run the block on `cpus`: threads and processes started in it inherit them."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# --------------------------------------------------------------------------- one mode


def run_mode(
    mode: str, args: argparse.Namespace, trainer: Trainer, rollout_cpus: set[int], farm: str, vllm: str
) -> ModeResult:
    for _ in range(args.warmup_steps):
        trainer.step()
    if mode == "none":
        counter = GcCounter()
        steps: list[float] = []
        end = time.perf_counter() + args.window_s
        while time.perf_counter() < end:
            steps.append(trainer.step())
        return ModeResult(mode, steps, gc_full=counter.full)

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    config = WorkerConfig(
        num_generations=8,
        max_concurrent_rollouts=args.rollouts,
        max_tokens=256,
        door=False,  # the farm's sessions reach the endpoint on loopback
        rollout_hosts=0 if mode == "in-process" else 1,
        drop_zero_variance_groups=False,
        agent_timeout_s=600,
        seed=0,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="p7-", dir="/tmp"))
    run_dir.chmod(0o711)
    worker = SWERolloutWorker(
        demo_tasks(),
        tokenizer,
        vllm_url=vllm,
        model=STUB_MODEL,
        sandbox=LocalBackend(run_dir=run_dir),
        config=config,
        agent=FarmAgent(farm),
    )
    totals: dict[str, float] = {}

    def drain() -> int:
        samples = 0
        while not worker.rollout_buffer.empty():
            worker.rollout_buffer.get()
            samples += 1
        while not worker.metrics_queue.empty():
            for key, value in worker.metrics_queue.get().items():
                if isinstance(value, int | float):
                    totals[key] = totals.get(key, 0.0) + value if key.endswith("_total") else value
        return samples

    result = ModeResult(mode, [])
    t0 = time.perf_counter()
    with on_cpus(rollout_cpus):
        worker.update_model_version(0)
        worker.start()
    result.start_s = time.perf_counter() - t0
    try:
        deadline = time.monotonic() + 300
        while totals.get("rollout/in_flight", 0.0) < 0.9 * args.rollouts and time.monotonic() < deadline:
            drain()
            time.sleep(0.5)
        for _ in range(args.warmup_steps):
            trainer.step()
            drain()
        counter = GcCounter()
        vllm0, t_window = asyncio.run(stats(vllm)), time.perf_counter()
        while time.perf_counter() < t_window + args.window_s:
            result.step_s.append(trainer.step())
            result.samples += drain()
            result.in_flight.append(totals.get("rollout/in_flight", 0.0))
        window = time.perf_counter() - t_window
        vllm1 = asyncio.run(stats(vllm))
        result.gc_full = counter.full
        result.completions_per_s = (vllm1["completions"] - vllm0["completions"]) / window
        worker.check_health(stale_after_s=600)
    finally:
        t1 = time.perf_counter()
        worker.stop()
        result.stop_s = time.perf_counter() - t1
    return result


# --------------------------------------------------------------------------- report


def report(results: list[ModeResult], args: argparse.Namespace, load: tuple[float, float]) -> str:
    base = next((statistics.mean(r.step_s) for r in results if r.mode == "none"), None)
    rows = []
    for r in results:
        mean = statistics.mean(r.step_s)
        rows.append(
            [
                r.mode,
                str(len(r.step_s)),
                f"{percentile(r.step_s, 50) * 1e3:.1f}",
                f"{mean * 1e3:.1f}",
                f"{percentile(r.step_s, 90) * 1e3:.1f}",
                f"**{mean / base:.2f}x**" if base else "",
                f"{statistics.mean(r.in_flight):.0f}" if r.in_flight else "0",
                f"{r.completions_per_s:.0f}",
                str(r.samples),
                str(r.gc_full),
                f"{r.start_s:.1f} / {r.stop_s:.1f}" if r.mode != "none" else "",
            ]
        )
    headers = [
        "rollouts",
        "steps",
        "step p50 ms",
        "step mean ms",
        "step p90 ms",
        "mean vs none",
        "rollouts in flight",
        "completions/s",
        "samples drained",
        "full GCs in the trainer",
        "worker start / stop s",
    ]
    out = [
        f"### P7: a training step of the demo's policy ({args.batch} x {args.seq_len} tokens, one thread) while "
        f"{args.rollouts} rollouts run ({args.turns} turns, 2-5 s between turns, stub generation 50 ms)",
        "",
        markdown_table(headers, rows),
        "",
    ]
    by_mode = {r.mode: r for r in results}
    if base and "out-of-process" in by_mode:
        ratio = statistics.mean(by_mode["out-of-process"].step_s) / base
        out.append(
            f"- Target (out-of-process within 10 % of no rollouts): **{'met' if ratio <= 1.10 else 'NOT met'}** "
            f"({(ratio - 1) * 100:+.1f} %)."
        )
    out.append(
        f"- Steps timed for {args.window_s:.0f} s per mode after {args.warmup_steps} warm-up steps, from when "
        f"the rollouts were >= 90 % of {args.rollouts} in flight. Placement: {args.placement}. Machine: "
        f"{os.cpu_count()} CPUs, "
        f"1-minute load average {load[0]:.2f} before, {load[1]:.2f} after."
    )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--window-s", type=float, default=120.0, help="how long steps are timed in each mode")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    trainer_cpus, rollout_cpus = set(cpus), set(cpus)
    args.placement = "no pinning (one CPU)"
    if len(cpus) >= 2:
        trainer_cpus, rollout_cpus = {cpus[0]}, set(cpus[1:])
        args.placement = f"trainer on CPU {cpus[0]}, rollouts (worker, sandboxes, farm, stub vLLM) on {cpus[1:]}"
    os.sched_setaffinity(0, trainer_cpus)
    trainer = Trainer(args.batch, args.seq_len)
    results = []
    with (
        serving_process(stub_vllm, rollout_cpus, TOOL_OUTPUTS["large"].calls, 0.05) as (vllm, _),
        serving_process(agent_farm, rollout_cpus, args.turns, (2.0, 5.0), "large") as (farm, _),
    ):
        for mode in args.modes.split(","):
            print(f"running {mode} ...", file=sys.stderr, flush=True)
            results.append(run_mode(mode, args, trainer, rollout_cpus, farm, vllm))
    print(report(results, args, (load_before, os.getloadavg()[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
