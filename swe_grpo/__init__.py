"""swe_grpo: train coding agents with GRPO on real software-engineering tasks.

A rollout worker for TRL's `AsyncGRPOTrainer`: the Pi coding agent works on a repository, every model
call it makes is intercepted and answered by vLLM with exact token ids and log-probs, and the
repository's tests give the reward.
"""

import importlib
from typing import Any

from swe_grpo import _compat

_compat.install()

# Every name loads on first use: `import swe_grpo` imports no torch, transformers, TRL or aiohttp (the trainer's
# pieces alone take ~10 s), so the CLI, a rollout host and a user's `from swe_grpo import Task` stay quick.
_LAZY = {
    "GradeResult": "swe_grpo.grading",
    "grade": "swe_grpo.grading",
    "RolloutConfig": "swe_grpo.rollout",
    "Trajectory": "swe_grpo.rollout",
    "run_rollout": "swe_grpo.rollout",
    "make_backend": "swe_grpo.sandbox",
    "InterceptionServer": "swe_grpo.serving.interception",
    "RolloutRecord": "swe_grpo.serving.session",
    "BadResponseError": "swe_grpo.serving.vllm_client",
    "ContextOverflowError": "swe_grpo.serving.vllm_client",
    "Generation": "swe_grpo.serving.vllm_client",
    "SamplingParams": "swe_grpo.serving.vllm_client",
    "ServerUnavailableError": "swe_grpo.serving.vllm_client",
    "VLLMClient": "swe_grpo.serving.vllm_client",
    "VLLMError": "swe_grpo.serving.vllm_client",
    "Task": "swe_grpo.tasks",
    "load_tasks": "swe_grpo.tasks",
    "TokenChain": "swe_grpo.tokens.chain",
    "TrainingRow": "swe_grpo.tokens.chain",
    "TrainingTemplate": "swe_grpo.tokens.chain",
    "TurnRecord": "swe_grpo.tokens.chain",
    "ParsedResponse": "swe_grpo.tokens.responses",
    "ResponseParser": "swe_grpo.tokens.responses",
    "Policy": "swe_grpo.types",
    "RolloutEndpoint": "swe_grpo.types",
    "RolloutWorkerError": "swe_grpo.types",
    "SWERolloutWorker": "swe_grpo.worker.rollout_worker",
    "demo_tasks": "swe_grpo.demo.tasks",
    "WorkerConfig": "swe_grpo.worker.config",
    "use_cpu_fallbacks": "swe_grpo.extras.cpu",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swe_grpo' has no attribute {name!r}")


__all__ = [
    "BadResponseError",
    "ContextOverflowError",
    "Generation",
    "GradeResult",
    "InterceptionServer",
    "ParsedResponse",
    "Policy",
    "ResponseParser",
    "RolloutConfig",
    "RolloutEndpoint",
    "RolloutRecord",
    "RolloutWorkerError",
    "SWERolloutWorker",
    "SamplingParams",
    "ServerUnavailableError",
    "Task",
    "TokenChain",
    "TrainingRow",
    "TrainingTemplate",
    "Trajectory",
    "TurnRecord",
    "VLLMClient",
    "VLLMError",
    "WorkerConfig",
    "demo_tasks",
    "grade",
    "load_tasks",
    "make_backend",
    "run_rollout",
    "use_cpu_fallbacks",
]
