"""Train a coding agent with GRPO on SWE tasks: TRL's `AsyncGRPOTrainer` fed by `SWERolloutWorker`.

    accelerate launch examples/train.py --config examples/configs/qwen3_swe_gym_lite.yaml
    python examples/train.py --config examples/configs/cpu_tiny.yaml        # one process, CPU or one GPU

Any field of the three argument groups can be set in the YAML or on the command line (the command line
wins): `SWEArguments` below (tasks, sandboxes, the agent), TRL's `AsyncGRPOConfig` (training; its
`vllm_server_base_url` is the server rollouts and weight syncs go to) and TRL's `ModelConfig` (the
model, and LoRA with `use_peft: true`). The vLLM server is started separately (README: "Training").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoTokenizer
from trl import ModelConfig, TrlParser, get_peft_config
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

from swe_grpo import SWERolloutWorker, WorkerConfig, load_tasks, use_cpu_fallbacks


@dataclass
class SWEArguments:
    """What to train on and how rollouts run."""

    tasks: str = field(
        default="demo", metadata={"help": "JSONL file, Hugging Face dataset name, saved dataset dir, or 'demo'."}
    )
    split: str = field(default="train", metadata={"help": "Dataset split (Hub datasets)."})
    instance_ids: list[str] | None = field(default=None, metadata={"help": "Train on these tasks only."})
    sandbox: str = field(default="local", metadata={"help": "Sandbox backend: local, docker or hf."})
    served_model_name: str | None = field(
        default=None, metadata={"help": "Name vLLM serves the base model under (default: model_name_or_path)."}
    )
    max_concurrent_rollouts: int = field(default=8, metadata={"help": "Rollouts (agent + sandbox) at once."})
    agent_timeout_s: float = field(default=1800.0, metadata={"help": "Wall-clock limit of one agent run."})
    stall_timeout_s: float = field(default=300.0, metadata={"help": "Kill an agent silent for this long."})
    grade_timeout_s: float = field(default=1800.0, metadata={"help": "Limit of one grading run."})
    interception_host: str = field(default="127.0.0.1", metadata={"help": "Bind of the InterceptionServer."})
    interception_port: int = field(default=0, metadata={"help": "Its port (0: any free one)."})
    public_base_url: str | None = field(
        default=None, metadata={"help": "Where sandboxes reach the InterceptionServer (remote sandboxes)."}
    )
    drop_zero_variance_groups: bool = field(
        default=True,
        metadata={
            "help": "Drop groups whose rewards are all equal (advantage 0: no signal). Turn off only for a policy "
            "that never succeeds (a plumbing check), or the trainer waits forever for samples."
        },
    )


@dataclass
class ModelArguments(ModelConfig):
    """TRL's `ModelConfig` (the model, LoRA) without its `dtype`: `AsyncGRPOConfig.dtype` is the one the trainer
    loads the model in, and one parser cannot hold two `--dtype` options."""

    dtype: str | None = field(default=None, init=False)


def build_trainer(swe: SWEArguments, args: AsyncGRPOConfig, model_args: ModelConfig) -> AsyncGRPOTrainer:
    """The trainer with its rollout worker, from the three argument groups."""
    use_cpu_fallbacks()  # no-op where CUDA is available
    tasks = load_tasks(swe.tasks, swe.split, swe.instance_ids)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    worker = SWERolloutWorker(
        tasks,
        tokenizer,
        vllm_url=args.vllm_server_base_url,
        model=swe.served_model_name or model_args.model_name_or_path,
        sandbox=swe.sandbox,
        config=WorkerConfig.from_trainer_args(
            args,
            max_concurrent_rollouts=swe.max_concurrent_rollouts,
            agent_timeout_s=swe.agent_timeout_s,
            stall_timeout_s=swe.stall_timeout_s,
            grade_timeout_s=swe.grade_timeout_s,
            host=swe.interception_host,
            port=swe.interception_port,
            public_base_url=swe.public_base_url,
            drop_zero_variance_groups=swe.drop_zero_variance_groups,
        ),
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


def main() -> None:
    parser = TrlParser((SWEArguments, AsyncGRPOConfig, ModelArguments))
    swe, args, model_args = parser.parse_args_and_config()
    trainer = build_trainer(swe, args, model_args)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)


if __name__ == "__main__":
    main()
