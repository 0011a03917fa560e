"""One rollout on a server, as one handle: `async with server.rollout(rollout_id) as session:`.

The handle is what `run_rollout` and the worker hold of a rollout while its agent works: its `endpoint` (id, URL,
secret), the unix `socket` it is also served on (a sandbox's door: the server is handed the path, it knows no
sandbox), `last_activity()` and `in_flight()` for the stall watch and the agent's exit, `oldest_version()` for
staleness, and, once the block is left, its `record`. Entering opens the rollout (and serves the socket); leaving,
however the block ends, stops serving the socket and closes the rollout: later requests get 410.

`RolloutServer` is what `run_rollout` needs of a server, and `RolloutView` what it needs of a handle: the
InterceptionServer's `RolloutHandle` and the evaluation's `PassthroughServer` both satisfy them
(tests/test_interception.py checks both have every member).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from swe_grpo.serving.session import RolloutRecord, RolloutSession
from swe_grpo.tokens.chain import oldest_version
from swe_grpo.types import RolloutEndpoint

Socket = str | os.PathLike[str]


@runtime_checkable
class RolloutView(Protocol):
    """One open rollout as its caller sees it (see the module docstring)."""

    endpoint: RolloutEndpoint
    socket: Path | None
    record: RolloutRecord | None  # set when the rollout is closed

    def last_activity(self) -> float:
        """For stall watchdogs: now while one of its requests is being served, else the `time.monotonic()` at
        which its latest request started or ended."""
        ...

    def in_flight(self) -> bool:
        """Whether a chat request of it is being served or waits its turn: a reply its agent has not had."""
        ...

    def oldest_version(self) -> int | None:
        """The oldest policy version that produced any of its tokens; None before its first token."""
        ...

    def waiting_s(self) -> float:
        """Seconds so far that its agent waited for generations (vLLM, however slow), the one in flight included:
        what the agent's wall clock leaves out (`swe_grpo.agents.base.run_launch`). Not the time its own requests
        take to arrive, nor their rate's hold: those are the agent's."""
        ...


@runtime_checkable
class RolloutServer(Protocol):
    """A server `run_rollout` can run rollouts on."""

    def rollout(
        self, rollout_id: str | None = None, *, socket: Socket | None = None
    ) -> AbstractAsyncContextManager[RolloutView]:
        """A handle on a new rollout named `rollout_id` (a fresh id when None), also served on the unix socket
        `socket` when given; opened by `async with`."""
        ...


@dataclass(frozen=True)
class SessionOps:
    """What a handle asks of its InterceptionServer: open and close the rollout's session, serve a unix socket
    for it and stop serving one."""

    open: Callable[[], RolloutSession]
    close: Callable[[RolloutSession], RolloutRecord]
    serve_socket: Callable[[RolloutSession, Path], None]
    close_socket: Callable[[Path], None]


class RolloutHandle:
    """The InterceptionServer's handle on one rollout (`InterceptionServer.rollout`). Single use."""

    def __init__(self, ops: SessionOps, socket: Socket | None):
        self._ops = ops
        self._session: RolloutSession | None = None
        self.socket = Path(socket) if socket is not None else None
        self.record: RolloutRecord | None = None

    @property
    def endpoint(self) -> RolloutEndpoint:
        return self._live().endpoint

    async def __aenter__(self) -> RolloutHandle:
        if self._session is not None or self.record is not None:
            raise RuntimeError("a rollout handle is used once")
        self._session = self._ops.open()
        if self.socket is not None:
            try:
                self._ops.serve_socket(self._session, self.socket)
            except BaseException:
                self._close()
                raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        session = self._live()
        if self.socket is not None:
            self._ops.close_socket(self.socket)
        self.record = self._ops.close(session)

    def _live(self) -> RolloutSession:
        if self._session is None:
            raise RuntimeError("the rollout is not open: use `async with server.rollout(...) as session`")
        return self._session

    def last_activity(self) -> float:
        session = self._live()
        return time.monotonic() if session.serving is not None else session.last_activity

    def in_flight(self) -> bool:
        return bool(self._live().pending) and self.record is None

    def waiting_s(self) -> float:
        session = self._live()
        since = session.generating_since
        return session.generation_s + (time.monotonic() - since if since is not None else 0.0)

    def oldest_version(self) -> int | None:
        return oldest_version(self.record.rows if self.record is not None else self._live().chain.rows)
