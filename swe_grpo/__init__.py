"""swe_grpo: train coding agents with GRPO on real software-engineering tasks.

A rollout worker for TRL's `AsyncGRPOTrainer`: the Pi coding agent works on a repository, every model
call it makes is intercepted and answered by vLLM with exact token ids and log-probs, and the
repository's tests give the reward.
"""

from swe_grpo.chain import TokenChain, TrainingRow, TrainingTemplate, TurnRecord
from swe_grpo.grading import GradeResult, grade
from swe_grpo.interception import InterceptionServer, RolloutEndpoint, RolloutRecord
from swe_grpo.responses import ParsedResponse, ResponseParser
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox import make_backend
from swe_grpo.tasks import Task, demo_tasks, load_tasks
from swe_grpo.vllm_client import (
    BadResponseError,
    ContextOverflowError,
    Generation,
    SamplingParams,
    ServerUnavailableError,
    VLLMClient,
    VLLMError,
)

__all__ = [
    "BadResponseError",
    "ContextOverflowError",
    "Generation",
    "GradeResult",
    "InterceptionServer",
    "ParsedResponse",
    "ResponseParser",
    "RolloutConfig",
    "RolloutEndpoint",
    "RolloutRecord",
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
    "demo_tasks",
    "grade",
    "load_tasks",
    "make_backend",
    "run_rollout",
]
