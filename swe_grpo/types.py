"""The records and errors that cross the layers: what an agent is given to reach its rollout
(`RolloutEndpoint`), the policy generating now (`Policy`), a request the server could not complete
(`RequestError`), the worker's own failure (`RolloutWorkerError`), and what a rollout engine's output
goes through (`RolloutOutlet`, `HostMessage`). Imports nothing from swe_grpo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class RolloutEndpoint:
    """What an agent needs to talk to its rollout: OpenAI `base_url`, bearer `token`, `model` name."""

    rollout_id: str
    base_url: str
    token: str
    model: str


@dataclass(frozen=True)
class Policy:
    """The policy that serves generations now: its version (recorded with every token it produces)
    and the model name vLLM serves it under (a LoRA adapter such as `trl-policy-v3`; None = the
    generator's default model)."""

    version: int = 0
    model: str | None = None


@dataclass(frozen=True)
class RequestError:
    """A request the server could not complete. `kind` is one of "context_overflow",
    "server_unavailable", "bad_response", "bad_request" (malformed messages, or a conversation the chat
    template refuses; a body too big, too slow or not JSON), "internal" (anything unexpected),
    "client_disconnected" (the agent went away before its reply was delivered; nothing was committed),
    "superseded" (a newer request of the same rollout arrived first; nothing was committed). Only
    "server_unavailable", "bad_response" and "internal" are the host's failures."""

    kind: str
    message: str
    turn: int
    at: float


class RolloutWorkerError(RuntimeError):
    """The worker crashed, stalled, or was misconfigured; raised by `check_health` and `start`."""


HostMessage = tuple[str, Any]
"""What a rollout engine's output becomes on its way to the trainer, in order: ("group", [RolloutSample, ...]),
a whole group; ("metrics", {key: value}); ("traces", (step, [trackio.Trace, ...])); ("log", logging.LogRecord)."""


class RolloutOutlet(Protocol):
    """Where a rollout engine's output goes: the trainer's queues in its own process (`QueueOutlet`), or the
    way out of a rollout host to them. Called from the engine's event loop: none of these may block."""

    def put_group(self, samples: list[Any]) -> None:
        """A whole group's samples (TRL `RolloutSample`s), delivered at once or not at all."""
        ...

    def put_metrics(self, metrics: dict[str, float | tuple[float, float]]) -> None:
        """Metric increments and (sum, count) pairs for the trainer's `metrics_queue`."""
        ...

    def put_traces(self, step: int, traces: list[Any]) -> None:
        """Agent traces (`trackio.Trace`) for the trainer's trackio run at `step`; best effort."""
        ...

    def waiting(self) -> int:
        """Samples waiting for the trainer (the engine's backpressure)."""
        ...
