"""One rollout's state on the InterceptionServer, and what is handed back when it closes.

A `RolloutSession` holds a rollout's endpoint (its id, URL and secret), its TokenChain, its sampling, its counters
and the errors recorded against it. It serialises the rollout's requests: `lock` is held while one is served, and
`supersede` ends every older request of the rollout when a newer one arrives, so that at most one reply is ever
delivered, the newest's; `rate` holds its requests, on every route, to a rate (`swe_grpo.serving.limits`).
`record_error` keeps a named `RequestError` per failure, at most `ERRORS_PER_KIND` of each kind (an attacker's
rollout can send bad requests without end; later ones are only counted). `close` refuses further requests and
abandons those in flight; `record()` is the `RolloutRecord` its handle holds once closed (`swe_grpo.serving.handle`).
Single event loop, no threads: nothing here locks beyond the rollout's `lock`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from swe_grpo.serving.limits import Rate
from swe_grpo.serving.vllm_client import SamplingParams
from swe_grpo.tokens.chain import TokenChain, TrainingRow, TurnRecord
from swe_grpo.tokens.messages import Message
from swe_grpo.types import RequestError, RolloutEndpoint

log = logging.getLogger(__name__)

# Each kind of error is recorded this many times at most; later ones of a kind are only counted
# (`RolloutRecord.errors_not_recorded`).
ERRORS_PER_KIND = 100


@dataclass
class RolloutRecord:
    """Everything recorded for one rollout: its handle's `record` once it is closed."""

    rollout_id: str
    rows: list[TrainingRow]
    turns: list[TurnRecord]
    errors: list[RequestError]
    requests: int
    malformed_tool_calls: int  # in delivered replies
    generation_s: float  # time spent waiting for vLLM, all turns
    messages: list[Message]  # the conversation through the latest reply, for traces
    retries: int = 0  # turns whose undelivered reply an agent's retry replaced (`TurnRecord.retries`, summed)
    errors_not_recorded: int = 0  # errors beyond `ERRORS_PER_KIND` of their kind, only counted
    refused_connections: int = 0  # its connections over a cap: its door's, or its TCP connections'
    paced_requests: int = 0  # requests held back to keep the rollout within its request rate


@dataclass
class RolloutSession:
    """One open rollout. `model` is pinned when it is opened (None: the live policy's)."""

    endpoint: RolloutEndpoint
    chain: TokenChain
    sampling: SamplingParams
    model: str | None
    rate: Rate  # its requests' rate, on every route (`ServingLimits.rollout_requests_per_s`)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    errors: list[RequestError] = field(default_factory=list)
    requests: int = 0
    malformed_tool_calls: int = 0
    generation_s: float = 0.0
    last_activity: float = field(default_factory=time.monotonic)  # the latest request's start or end
    generating_since: float | None = None  # when the generation in flight started (its time is in `generation_s`
    # once it ends)
    closed: bool = False
    serving: asyncio.Task | None = None  # the request being served (it holds the lock)
    pending: set[asyncio.Task] = field(default_factory=set)  # its chat requests, being served or waiting
    superseded: set[asyncio.Task] = field(default_factory=set)  # of those, the ones a newer request ended
    body_bytes: int = 0  # the size of its latest request
    errors_not_recorded: int = 0
    refused_connections: int = 0
    tcp_connections: int = 0  # TCP connections that carried its requests first, still open

    def close(self) -> None:
        """Refuse further requests and abandon those in flight: cancelling a handler cancels its generation,
        whose HTTP request vLLM then aborts, and nothing more is committed."""
        self.closed = True
        for task in self.pending:
            task.cancel()

    def supersede(self, newer: asyncio.Task) -> None:
        """`newer` is now the rollout's request: the one being served and any waiting are ended (their handlers
        answer "superseded"), so that at most one reply to the agent's requests is ever delivered, and it is
        the newest's: the one the agent still waits for, and the one trained."""
        for older in self.pending:
            self.superseded.add(older)
            older.cancel()
        self.pending.add(newer)

    def record_error(self, kind: str, message: str, turn: int) -> None:
        """Record a failed request of this rollout as a `RequestError` of `kind` at `turn` (and log it)."""
        if sum(e.kind == kind for e in self.errors) >= ERRORS_PER_KIND:
            self.errors_not_recorded += 1
            return
        log.warning("rollout %s turn %d: %s: %s", self.endpoint.rollout_id, turn, kind, message)
        self.errors.append(RequestError(kind, message, turn, time.monotonic()))

    def record(self) -> RolloutRecord:
        """Everything recorded for this rollout so far."""
        chain = self.chain
        return RolloutRecord(
            rollout_id=self.endpoint.rollout_id,
            rows=chain.rows,
            turns=chain.turns,
            errors=self.errors,
            requests=self.requests,
            malformed_tool_calls=self.malformed_tool_calls,
            generation_s=self.generation_s,
            messages=chain.messages,
            retries=sum(t.retries for t in chain.turns),
            errors_not_recorded=self.errors_not_recorded,
            refused_connections=self.refused_connections,
            paced_requests=self.rate.held,
        )
