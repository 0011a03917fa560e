"""WorkerConfig: how the rollout worker (swe_grpo/worker/rollout_worker.py) samples, schedules and judges rollouts.

Kept apart from the worker so that a script can build and check a configuration without importing TRL's
async GRPO trainer (~3 s), which the worker needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from swe_grpo.agents import agent_schedule, check_mix
from swe_grpo.grading import DEFAULT_TIMEOUT_S
from swe_grpo.sandbox.base import MAX_PATCH_BYTES
from swe_grpo.serving.vllm_client import DEFAULT_ROUTING_HEADER, SamplingParams
from swe_grpo.tasks.task import REWARD_MODES, RewardMode, Task
from swe_grpo.tokens.layouts import load_layout
from swe_grpo.worker.task_sampling import TASK_SAMPLING, TaskSampling

if TYPE_CHECKING:
    from trl.experimental.async_grpo import AsyncGRPOConfig

_SANDBOX_ALLOWANCE_S = 900.0  # creating and removing a rollout's two sandboxes (an image pull included)


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker samples, schedules and judges rollouts.

    `max_tokens` caps each model turn; the sampling settings (`temperature` ... `repetition_penalty`)
    and `chat_template_kwargs` must be the trainer's (its log-probs assume the same distribution), and
    so must `max_staleness`. `from_trainer_args` copies those. `adapter_dir` is where the trainer
    writes the policy adapters it publishes (`{adapter_dir}/{adapter_prefix}-v{N}`), so the worker can
    re-load one a restarted vLLM lost; None: it reports what to do instead.
    """

    num_generations: int = 8
    max_concurrent_rollouts: int = 8
    max_staleness: int = 2
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int = 2048
    drop_zero_variance_groups: bool = True
    # At most this many groups in a row are dropped for zero variance; the next is trained on (advantage 0),
    # so a policy that solves every task does not leave the trainer waiting on ever rarer mixed groups.
    max_zero_variance_drops: int | None = None  # None: no limit
    advantage_eps: float = 1e-6
    # DeepSWE's "compact filtering": the policy's truncations after its first turn (a context overflow, its
    # wall-clock or stall limit: `swe_grpo.rollout.TRUNCATED_OUTCOMES`) are left out of their group's baseline
    # and not trained on, instead of earning 0.0. Off by default: with it, a policy that cannot solve a task
    # loses nothing by running out the clock or the context there (docs/training.md says what it costs).
    mask_truncated: bool = False
    agent_timeout_s: float = 1800.0
    stall_timeout_s: float = 300.0
    grade_timeout_s: float = DEFAULT_TIMEOUT_S
    plugin_autoload: bool = True  # pytest plugin autoload when grading; a task's own setting wins
    reward_mode: RewardMode = "binary"  # or "fraction" (see swe_grpo.grading); a task's own setting wins
    max_patch_bytes: int = MAX_PATCH_BYTES  # a larger patch ends the rollout patch_too_large (reward 0.0)
    door: bool = True  # the agent's only network is its own endpoint (swe_grpo.sandbox.door); False: the backend's
    allow: tuple[str, ...] = ()  # with the door: host:port targets the agent may also reach (HTTPS proxy)
    adapter_prefix: str = "trl-policy"  # what AsyncGRPOTrainer names the adapters it publishes
    adapter_dir: str | None = None
    host: str = "127.0.0.1"  # the InterceptionServer's bind; sandboxes reach it at public_base_url
    port: int = 0
    public_base_url: str | None = None
    seed: int = 0  # of the task order
    task_sampling: TaskSampling = "shuffle"  # or "informative": see swe_grpo/worker/task_sampling.py
    queue_maxsize: int = 0  # launch no new group while this many samples wait for the trainer (0: no limit)
    # The trainer's: its TokenBudgetBatcher drops a longer sample alone, so a group with one is dropped whole here.
    # None: no limit (the trainer's default budget, vLLM's max_model_len, fits any row; <= 0 batches by count).
    token_budget: int | None = None
    log_traces: bool = False  # one group's agent conversations per policy version to the trainer's trackio run
    rollout_hosts: int = 1  # 0: rollouts run in a thread of this process; N: in N child processes (worker/hosts.py)
    # The harness when the worker is not given an Agent: a name of swe_grpo.agents.AGENTS, or a class of one's
    # own as "package.module:Class" (imported where the rollouts run); or a mix, {name: weight}, e.g.
    # {"pi": 2, "opencode": 1}: each GROUP runs one agent, taken in turn (`agent_schedule`), so that a group's
    # advantages compare the policy's attempts under one harness, not the harnesses (docs/training.md).
    agent: str | Mapping[str, int] = "pi"
    # A tool-call layout of one's own for a family no built-in layout reads, as "package.module:Class"
    # (`swe_grpo.tokens.layouts`, docs/models.md), imported where the rollouts are served; None: the built-in ones.
    tool_call_layout: str | None = None
    # What the backend the worker is given by name is built with (`make_backend(name, **sandbox_options)`, in each
    # rollout host), e.g. {"accept_network": True} for `hf`, whose grading sandboxes are otherwise refused.
    sandbox_options: Mapping[str, Any] = field(default_factory=dict)
    # The rollout hosts as Ray actors (worker/ray_hosts.py, extra swe_grpo[ray]) on nodes offering these resources
    # each, e.g. {"swe_grpo_sandboxes": 1}; None: child processes of the trainer. Unused with rollout_hosts=0.
    ray_resources: Mapping[str, float] | None = None
    # The header each generation request carries its rollout's id in, for a router's session affinity (docs/scale.md).
    routing_header: str | None = DEFAULT_ROUTING_HEADER  # None: none sent
    # Held-out evaluation while training (swe_grpo/worker/heldout.py): every `eval_every` policy versions (0: off),
    # each of `eval_tasks` (never trained on) is attempted `eval_k` times at `eval_temperature` (None: the
    # trainer's), `eval_concurrency` at a time on slots of their own, on top of `max_concurrent_rollouts`.
    eval_tasks: tuple[Task, ...] = ()
    eval_every: int = 0
    eval_k: int = 1
    eval_temperature: float | None = None
    eval_concurrency: int = 2

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError("num_generations must be at least 2: advantages are relative to the group")
        if self.max_zero_variance_drops is not None and self.max_zero_variance_drops < 0:
            raise ValueError("max_zero_variance_drops must be >= 0, or None for no limit")
        if self.max_concurrent_rollouts < 1 or self.max_staleness < 0:
            raise ValueError("max_concurrent_rollouts must be >= 1 and max_staleness >= 0")
        if not 0 <= self.rollout_hosts <= self.max_concurrent_rollouts:
            raise ValueError("rollout_hosts must be >= 0 and at most max_concurrent_rollouts (each host runs some)")
        if self.rollout_hosts > 1 and (self.port or self.public_base_url):
            raise ValueError("several rollout hosts bind a port each: leave port 0 and public_base_url unset")
        if self.task_sampling not in TASK_SAMPLING:
            raise ValueError(f"unknown task_sampling {self.task_sampling!r}: choose one of {', '.join(TASK_SAMPLING)}")
        self._check_agent()
        if self.tool_call_layout is not None:
            load_layout(self.tool_call_layout)  # refused here, by name, not in every rollout host
        if self.reward_mode not in REWARD_MODES:
            raise ValueError(f"unknown reward_mode {self.reward_mode!r}: choose one of {', '.join(REWARD_MODES)}")
        self._check_eval()

    def _check_agent(self) -> None:
        object.__setattr__(self, "agent", check_mix(self.agent))  # a mix is copied: the caller's mapping may change

    def agent_schedule(self) -> tuple[str, ...]:
        """The agents successive groups run, cycled: each agent of the mix as many times in a row as its weight
        (one name: that one)."""
        return agent_schedule(self.agent)

    def _check_eval(self) -> None:
        object.__setattr__(self, "eval_tasks", tuple(self.eval_tasks))  # a list is accepted, kept as a tuple
        if not all(isinstance(task, Task) for task in self.eval_tasks):
            raise TypeError("eval_tasks must be Tasks (swe_grpo.load_tasks or tasks_from_dataset make them)")
        if self.eval_every < 0 or self.eval_k < 1 or self.eval_concurrency < 1:
            raise ValueError("eval_every must be >= 0 (0: no held-out eval), eval_k and eval_concurrency >= 1")
        if self.eval_every and not self.eval_tasks:
            raise ValueError(f"eval_every={self.eval_every} needs eval_tasks: the held-out tasks to evaluate on")
        if self.eval_tasks and not self.eval_every:
            raise ValueError("eval_tasks are given but eval_every is 0: set eval_every (policy versions) to run them")
        ids = [task.instance_id for task in self.eval_tasks]
        if len(set(ids)) < len(ids):
            raise ValueError(f"eval_tasks repeat an instance_id: {sorted({i for i in ids if ids.count(i) > 1})}")

    def eval_sampling_params(self) -> SamplingParams:
        """The held-out eval's sampling: the trainer's, at `eval_temperature` when it is set."""
        params = self.sampling_params()
        return params if self.eval_temperature is None else replace(params, temperature=self.eval_temperature)

    @property
    def rollout_limit_s(self) -> float:
        """The longest a rollout may take, all stages: the agent's run, grading (a test run and, without
        a verdict, a control run) and its sandboxes. Past it the worker ends the rollout as `timeout`."""
        return self.agent_timeout_s + 2 * self.grade_timeout_s + _SANDBOX_ALLOWANCE_S

    def rollout_limit_for(self, task: Task) -> float:
        """`rollout_limit_s` plus the task's setup: its `setup_cmd` before the agent, its `grade_setup_cmd`
        in grading's probe, graded run and control run."""
        setups = bool(task.setup_cmd) + 3 * bool(task.grade_setup_cmd)
        return self.rollout_limit_s + setups * task.setup_timeout_s

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_tokens,
        )

    @classmethod
    def from_trainer_args(cls, args: AsyncGRPOConfig, **overrides: Any) -> WorkerConfig:
        """The fields the trainer and the worker must agree on, taken from the trainer's config: every
        sampling setting TRL's own worker sends to vLLM, the chat template kwargs it renders prompts
        with, and where the trainer writes its adapters. Raises ValueError, with the reason, for a
        setting the worker cannot honour."""
        if args.max_tool_calling_iterations is not None:
            raise ValueError(
                f"max_tool_calling_iterations={args.max_tool_calling_iterations} cannot be honoured: the agent (Pi) "
                "runs its own tool loop and ends its run itself, so the worker cannot cut a conversation after N "
                "tool calls as TRL's worker does. Leave it unset; agent_timeout_s and max_completion_length bound "
                "a rollout."
            )
        # Fixed-count micro-batches (token_budget <= 0) close every `per_step` samples, wherever a group
        # ends: unless a step is a whole number of groups, every step trains part of a group and the next
        # step, with other weights, the rest (tests/test_group_steps.py).
        per_step = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
        if args.token_budget is not None and args.token_budget <= 0 and per_step % args.num_generations:
            raise ValueError(
                f"per_device_train_batch_size={args.per_device_train_batch_size} x {args.world_size} process(es) x "
                f"gradient_accumulation_steps={args.gradient_accumulation_steps} = {per_step} samples per optimizer "
                f"step is not a multiple of num_generations={args.num_generations}: with token_budget <= 0 "
                "(fixed-count micro-batches) every step would train part of a group. Make it a multiple."
            )
        shared = {
            "num_generations": args.num_generations,
            "max_staleness": args.max_staleness,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k is not None else -1,
            "min_p": args.min_p if args.min_p is not None else 0.0,  # None: off (TRL's worker then sends none)
            "repetition_penalty": args.repetition_penalty,
            "chat_template_kwargs": dict(args.chat_template_kwargs or {}),
            "adapter_dir": os.path.abspath(os.path.join(args.output_dir, ".vllm_lora")),  # TRL 1.16's `_lora_dir`
            "max_tokens": args.max_completion_length,
            "seed": args.seed,
            "queue_maxsize": args.queue_maxsize,
            "token_budget": args.token_budget if args.token_budget and args.token_budget > 0 else None,
            "log_traces": "trackio" in (args.report_to or []),
        }
        return cls(**{**shared, **overrides})
