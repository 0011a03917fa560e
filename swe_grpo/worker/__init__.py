"""The trainer-side rollout worker: `SWERolloutWorker` (TRL's `RolloutWorkerProtocol`), the engine that runs
rollouts and assembles groups (`RolloutEngine`, whose output goes to a `RolloutOutlet` such as
`QueueOutlet`), the rollout hosts it runs them on, and its configuration (`WorkerConfig`).

The names here load on first use: `SWERolloutWorker` imports TRL's trainer, which a rollout host's child
process never needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "QueueOutlet": "swe_grpo.worker.rollout_worker",
    "RolloutEngine": "swe_grpo.worker.engine",
    "RolloutOutlet": "swe_grpo.types",
    "SWERolloutWorker": "swe_grpo.worker.rollout_worker",
    "RolloutWorkerError": "swe_grpo.types",
    "WorkerConfig": "swe_grpo.worker.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swe_grpo.worker' has no attribute {name!r}")
