"""Train a coding agent with GRPO on SWE tasks: TRL's `AsyncGRPOTrainer` fed by `SWERolloutWorker`.

    accelerate launch examples/train.py --config examples/configs/qwen3_swe_gym_lite.yaml
    python examples/train.py --config examples/configs/cpu_tiny.yaml        # one process, CPU or one GPU

Any field of the three argument groups can be set in the YAML or on the command line (the command line
wins): `SWEArguments` below (tasks, sandboxes, the agent), TRL's `AsyncGRPOConfig` (training; its
`vllm_server_base_url` is the server rollouts and weight syncs go to) and TRL's `ModelConfig` (the
model, and LoRA with `use_peft: true`). The vLLM server is started separately (docs/training.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, TrlParser, get_peft_config
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from swe_grpo import SWERolloutWorker, WorkerConfig, load_tasks, use_cpu_fallbacks
from swe_grpo.sandbox import hf_network_options
from swe_grpo.sandbox.door import check_allow
from swe_grpo.tasks import Task


@dataclass
class SWEArguments:
    """What to train on and how rollouts run."""

    tasks: str = field(
        default="demo", metadata={"help": "JSONL file, Hugging Face dataset name, saved dataset dir, or 'demo'."}
    )
    split: str = field(default="train", metadata={"help": "Dataset split (Hub datasets)."})
    instance_ids: list[str] | None = field(default=None, metadata={"help": "Train on these tasks only."})
    sandbox: str = field(
        default="local", metadata={"help": "Sandbox backend: local, docker, hf, or your own as package.module:Class."}
    )
    hf_accept_network: bool = field(
        default=False,
        metadata={
            "help": "With sandbox hf: accept that sandboxes asked for no network (grading's) keep HF's network, "
            "which HF cannot cut; without it the hf backend refuses them, so grading fails."
        },
    )
    agent: str = field(
        default="pi",
        metadata={
            "help": "Agent harness: pi, mini-swe-agent, opencode, or your own as package.module:Class; or a mix, "
            "one agent per group in turn: pi=2,opencode=1."
        },
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "Name vLLM serves the base model under (default: model_name_or_path)."}
    )
    max_concurrent_rollouts: int = field(default=8, metadata={"help": "Rollouts (agent + sandbox) at once."})
    agent_timeout_s: float = field(default=1800.0, metadata={"help": "Wall-clock limit of one agent run."})
    stall_timeout_s: float = field(default=300.0, metadata={"help": "Kill an agent silent for this long."})
    grade_timeout_s: float = field(default=1800.0, metadata={"help": "Limit of one grading run."})
    reward_mode: str = field(
        default="binary",
        metadata={"help": "binary (all FAIL_TO_PASS and PASS_TO_PASS pass) or fraction; a task's own mode wins."},
    )
    interception_host: str = field(default="127.0.0.1", metadata={"help": "Bind of the InterceptionServer."})
    interception_port: int = field(default=0, metadata={"help": "Its port (0: any free one)."})
    public_base_url: str | None = field(
        default=None, metadata={"help": "Where sandboxes reach the InterceptionServer (remote sandboxes)."}
    )
    door: bool = field(
        default=True,
        metadata={"help": "The agent's only network is its own endpoint; --no_door: the sandbox backend's network."},
    )
    allow: list[str] = field(
        default_factory=list,
        metadata={"help": "With the door: host:port targets the agent may also reach, through an HTTPS proxy."},
    )
    drop_zero_variance_groups: bool = field(
        default=True,
        metadata={
            "help": "Drop groups whose rewards are all equal (advantage 0: no signal). Turn off only for a policy "
            "that never succeeds (a plumbing check), or the trainer waits forever for samples."
        },
    )
    max_zero_variance_drops: int | None = field(
        default=None,
        metadata={
            "help": "Drop at most this many all-equal groups in a row; train on the next with advantage 0, so a "
            "policy that solves (or fails) every task does not stall the trainer. Default: no limit."
        },
    )

    task_sampling: str = field(
        default="shuffle",
        metadata={
            "help": "Which task each group works on: shuffle (every task once per pass) or informative (drawn by the "
            "chance that the group's rewards differ, from the task's recent resolved rate: fewer groups dropped)."
        },
    )

    # Held-out evaluation while training (docs/training.md): the policy attempts these tasks, never trained on,
    # every eval_every policy versions; eval/resolved_rate and eval/pass@k join the training metrics.
    eval_tasks: str | None = field(
        default=None,
        metadata={"help": "Held-out tasks, as for tasks (JSONL, Hub dataset, saved dir, 'demo'); none: no eval."},
    )
    eval_split: str = field(
        default="train", metadata={"help": "Their split (Hub datasets), e.g. train[200:] beside split train[:200]."}
    )
    eval_instance_ids: list[str] | None = field(default=None, metadata={"help": "Evaluate on these tasks only."})
    eval_every: int = field(
        default=0, metadata={"help": "Evaluate at the first policy and every this many policy versions (0: never)."}
    )
    eval_k: int = field(default=1, metadata={"help": "Attempts per held-out task and round (pass@1..k)."})
    eval_temperature: float | None = field(
        default=None, metadata={"help": "Sampling temperature of the eval (default: the training temperature)."}
    )
    eval_concurrency: int = field(
        default=2, metadata={"help": "Eval rollouts at once, on top of max_concurrent_rollouts."}
    )

    def __post_init__(self) -> None:
        check_allow(self.allow, self.door)  # a bad entry fails the command line, not the worker's start
        hf_network_options(self.sandbox, self.hf_accept_network)  # asked for another backend: refused here


@dataclass
class ModelArguments(ModelConfig):
    """TRL's `ModelConfig` (the model, LoRA) without its `dtype`: `AsyncGRPOConfig.dtype` is the one the trainer
    loads the model in, and one parser cannot hold two `--dtype` options."""

    dtype: str | None = field(default=None, init=False)


def worker_config(swe: SWEArguments, args: AsyncGRPOConfig, eval_tasks: Sequence[Task] = ()) -> WorkerConfig:
    """The rollout worker's settings: the trainer's where they must agree (`from_trainer_args`), else `swe`'s;
    `eval_tasks`: the held-out tasks (`swe.eval_tasks`, loaded)."""
    return WorkerConfig.from_trainer_args(
        args,
        max_concurrent_rollouts=swe.max_concurrent_rollouts,
        agent_timeout_s=swe.agent_timeout_s,
        stall_timeout_s=swe.stall_timeout_s,
        grade_timeout_s=swe.grade_timeout_s,
        reward_mode=swe.reward_mode,
        host=swe.interception_host,
        port=swe.interception_port,
        public_base_url=swe.public_base_url,
        drop_zero_variance_groups=swe.drop_zero_variance_groups,
        max_zero_variance_drops=swe.max_zero_variance_drops,
        task_sampling=swe.task_sampling,
        door=swe.door,
        allow=tuple(swe.allow),
        agent=swe.agent,
        sandbox_options=hf_network_options(swe.sandbox, swe.hf_accept_network),
        eval_tasks=tuple(eval_tasks),
        eval_every=swe.eval_every,
        eval_k=swe.eval_k,
        eval_temperature=swe.eval_temperature,
        eval_concurrency=swe.eval_concurrency,
    )


def build_trainer(swe: SWEArguments, args: AsyncGRPOConfig, model_args: ModelConfig) -> AsyncGRPOTrainer:
    """The trainer with its rollout worker, from the three argument groups."""
    use_cpu_fallbacks()  # no-op where CUDA is available
    tasks = load_tasks(swe.tasks, swe.split, swe.instance_ids)
    eval_tasks = load_tasks(swe.eval_tasks, swe.eval_split, swe.eval_instance_ids) if swe.eval_tasks else []
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    worker = SWERolloutWorker(
        tasks,
        tokenizer,
        vllm_url=args.vllm_server_base_url,
        model=swe.served_model_name or model_args.model_name_or_path,
        sandbox=swe.sandbox,
        config=worker_config(swe, args, eval_tasks),
    )
    return AsyncGRPOTrainer(
        model=model_args.model_name_or_path,
        args=args,
        # The trainer counts epochs in groups trained per task; the worker draws the tasks themselves.
        train_dataset=Dataset.from_dict({"instance_id": [t.instance_id for t in tasks]}),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        rollout_worker=worker,
    )


# TRL saves and restores its policy version (which names the adapters it publishes, `trl-policy-v{N}`) only
# for its own rollout worker. Without it a resumed run would publish `trl-policy-v1` again, under a name a
# still-running vLLM server already holds with other weights. We keep the version beside each checkpoint.
_VERSION_FILE = "swe_grpo_state.json"


class _SavePolicyVersion(TrainerCallback):
    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            with open(os.path.join(checkpoint, _VERSION_FILE), "w") as f:
                json.dump({"model_version": self.trainer.model_version}, f)


def restore_policy_version(trainer: AsyncGRPOTrainer, checkpoint: str | bool | None, output_dir: str) -> None:
    """Resume the adapter numbering where `checkpoint` left it (a path, or True: the latest in `output_dir`)."""
    if checkpoint is True:
        checkpoint = get_last_checkpoint(output_dir)
    if not checkpoint:
        return
    path = os.path.join(checkpoint, _VERSION_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: this checkpoint was not written by examples/train.py")
    with open(path) as f:
        trainer.model_version = json.load(f)["model_version"]


def main() -> None:
    parser = TrlParser((SWEArguments, AsyncGRPOConfig, ModelArguments))
    swe, args, model_args = parser.parse_args_and_config()
    trainer = build_trainer(swe, args, model_args)
    trainer.add_callback(_SavePolicyVersion(trainer))
    restore_policy_version(trainer, args.resume_from_checkpoint, args.output_dir)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
