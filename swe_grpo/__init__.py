"""swe_grpo: train coding agents with GRPO on real software-engineering tasks.

A rollout worker for TRL's `AsyncGRPOTrainer`: the Pi coding agent works on a repository, every model
call it makes is intercepted and answered by vLLM with exact token ids and log-probs, and the
repository's tests give the reward.
"""

import importlib
from typing import Any

from swe_grpo import _compat
from swe_grpo.grading import GradeResult, grade
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox import make_backend
from swe_grpo.serving.interception import InterceptionServer, RolloutRecord
from swe_grpo.serving.vllm_client import (
    BadResponseError,
    ContextOverflowError,
    Generation,
    SamplingParams,
    ServerUnavailableError,
    VLLMClient,
    VLLMError,
)
from swe_grpo.tasks import Task, load_tasks
from swe_grpo.tokens.chain import TokenChain, TrainingRow, TrainingTemplate, TurnRecord
from swe_grpo.tokens.responses import ParsedResponse, ResponseParser
from swe_grpo.types import Policy, RolloutEndpoint, RolloutWorkerError

_compat.install()

# The trainer-side pieces import TRL's trainer (~10 s), and the demo is not the library: loaded on first
# use, so the CLI and the rollout-only API stay quick to import.
_LAZY = {
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
