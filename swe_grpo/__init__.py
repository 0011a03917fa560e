"""swe_grpo: train coding agents with GRPO on real software-engineering tasks.

A rollout worker for TRL's `AsyncGRPOTrainer`: the Pi coding agent works on a repository, every model
call it makes is intercepted and answered by vLLM with exact token ids and log-probs, and the
repository's tests give the reward.
"""

from swe_grpo.chain import TokenChain, TrainingRow, TrainingTemplate, TurnRecord
from swe_grpo.interception import InterceptionServer, RolloutEndpoint, RolloutRecord
from swe_grpo.responses import ParsedResponse, ResponseParser
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
    "InterceptionServer",
    "ParsedResponse",
    "ResponseParser",
    "RolloutEndpoint",
    "RolloutRecord",
    "SamplingParams",
    "ServerUnavailableError",
    "TokenChain",
    "TrainingRow",
    "TrainingTemplate",
    "TurnRecord",
    "VLLMClient",
    "VLLMError",
]
