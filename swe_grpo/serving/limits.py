"""What one agent can make the InterceptionServer hold: every resource a rollout's connections touch, bounded.

The policy is an adversary (it optimises against every seam), and an agent sandbox holds its rollout's token:
whatever its connections make the server hold (memory for bodies, descriptors for connections, time) must stay
bounded, so that `/health` and every other rollout keep being served. The bounds (`ServingLimits`, defaults in
brackets):

- connections: each listener counts its open connections: a door at most `door_connections` [8] (an agent makes
  one request at a time; its HTTP client may keep a spare connection or two), the TCP port at most
  `tcp_connections` [512]; and all of them together at most `descriptor_share` [0.5] of the process's
  RLIMIT_NOFILE, so that vLLM's connections, sandboxes' pipes and files always find descriptors. A connection
  over a cap is answered `503` at once and closed: it never reaches aiohttp and holds nothing. A door also
  accepts at most `door_accepts_per_s` [20] new connections a second (a burst of `door_connections`): beyond
  that it stops accepting for a moment and the rest wait in its small backlog, in the kernel, so that a
  sandbox opening and closing connections in a loop costs the server's event loop nothing more. A TCP
  connection (no door: the `hf` backend's way in) counts for the rollout whose token its first request carried,
  at most `rollout_tcp_connections` [8] a rollout (past it that request is answered `503` and its connection
  closed); one that has carried no request yet belongs to no rollout: the port's cap and the header timeout
  bound those.
- time: a connection that has not sent a whole request head within `idle_timeout_s` [30 s] of opening or of its
  previous reply is closed (aiohttp's `keepalive_timeout`, which runs from the connection's start: a header
  timeout and an idle timeout in one; agents' HTTP clients drop idle connections sooner themselves), and a
  request body that has not arrived whole within `body_timeout_s` [60 s] is answered 408.
- bytes: a request body is read only once the rollout's previous request is over (the rollout's lock), and a
  rollout has at most one request in flight: a newer one supersedes it (`InterceptionServer`). So a rollout holds
  at most one body of at most `max_request_bytes` [32 MiB: 16 x a 2 MB tool output, more than any context
  window holds] plus its waiting connections' read buffers (aiohttp stops reading a connection whose buffered
  body passes 2 x 64 KiB). And a freed body goes back to the system (`return_big_buffers`; not in a process that
  trains).
- bytes across rollouts: a body announced (Content-Length) within `own_body_bytes` [4 MiB: more than an agent's
  requests bring] is read at once; any other (bigger, or chunked: counted as `max_request_bytes`) is read only
  within `shared_body_bytes` [64 MiB] for all such bodies being read together (`BodyShare`), and waits, unread in
  its connection, for its turn: six rollouts each streaming a 31 MiB body at once moved the server's RSS by +292
  MiB, each rollout within its own bound. Its wait counts against its own `body_timeout_s`: waiting and reading
  take at most that together (before, a body waited up to the others' timeouts and then had a whole one of its own).
- training data: a rollout holds at most `rollout_rows` [64] training rows and `rollout_tokens` [2 Mi] tokens in
  them (13 bytes a token, held until the rollout is trained on). A request that would take it past either (counting
  the reply's `max_tokens`) is refused, 400 `rollout_budget_exceeded`, before any generation, and recorded
  `rollout_budget`: the rollout is then `budget_exceeded`, reward 0 (`swe_grpo.rollout`: the policy's doing). An
  agent extends one conversation, a row, to at most the context window, and starts a new one (a fork) rarely:
  each request a different conversation of ~100 kB, 19 a second, built 799 rows and 21.2 M tokens in 45 s.
- rate: every request, on every route, is held (`Rate`), before anything of it is read but its head, to
  `connection_requests_per_s` [20] a second on its connection (bursts of `connection_request_burst` [20]); one
  that carries its rollout's token also to `rollout_requests_per_s` [20] a second for its rollout (bursts of
  `rollout_request_burst` [20], `RolloutSession.rate`), and one that carries no valid token (401, 403, 404: it
  names no rollout it may speak for, so it may not spend any rollout's rate) to `unauthorized_per_s` [20] a second
  for the whole server (bursts of `unauthorized_burst` [20]). Requests sent back to back on a kept-alive
  connection, pipelined or each superseding the one before, pass no accept rate: they had thousands a second
  served and kept the event loop busy (P9's keepalive_flood: 0.92 of a core; `GET /models` pipelined on 8
  connections: 197,154 answers in 12 s, and 181,723 answers of 401 without a token). A held request costs a
  sleeping handler, and a connection whose handler sleeps is read no further once aiohttp has queued a few of its
  requests; an agent, which waits for each reply and for its tools, never comes near the rates.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MMAP_THRESHOLD = 128 * 1024
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class ServingLimits:
    """The InterceptionServer's bounds (see the module docstring)."""

    max_request_bytes: int = 32 * 1024**2
    own_body_bytes: int = 4 * 1024**2
    shared_body_bytes: int = 64 * 1024**2
    door_connections: int = 8
    door_accepts_per_s: float = 20.0
    tcp_connections: int = 512
    rollout_tcp_connections: int = 8
    descriptor_share: float = 0.5
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    rollout_requests_per_s: float = 20.0
    rollout_request_burst: int = 20
    rollout_rows: int = 64
    rollout_tokens: int = 2 * 1024**2
    connection_requests_per_s: float = 20.0
    connection_request_burst: int = 20
    unauthorized_per_s: float = 20.0
    unauthorized_burst: int = 20

    def total_connections(self) -> int:
        """How many connections all listeners together may hold: a share of the descriptors this process may open."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return max(1, int(soft * self.descriptor_share))


@dataclass
class Rate:
    """Holds requests to at most `per_second` a second in bursts of `burst` (a generic cell-rate algorithm: each
    request reserves the next slot as it arrives, so held requests go on in the order they came). `held` counts
    the requests it held back."""

    per_second: float
    burst: int
    next_slot: float = 0.0
    held: int = 0

    async def pace(self) -> None:
        """Return once the calling request is within the rate."""
        now = time.monotonic()
        self.next_slot = max(self.next_slot, now) + 1 / self.per_second
        delay = self.next_slot - now - self.burst / self.per_second
        if delay > 0:
            self.held += 1
            await asyncio.sleep(delay)


def return_big_buffers() -> bool:
    """Have glibc serve every allocation over 128 KiB with its own mapping, returned to the system when freed, and
    say whether it was done. By default glibc raises that threshold after the first such free (up to 32 MiB), and
    request bodies read after that would stay in its heap once freed. Process-wide, so not in a process that
    trains (torch loaded: a server in the trainer's process, `rollout_hosts=0`): each of its tensors would then be
    a fresh mapping, and the demo policy's step took 1.5x as long (`benchmarks/mmap_threshold.py`); its freed
    bodies are reused by its heap instead. A no-op where the C library is not glibc."""
    return "torch" not in sys.modules and pin_mmap_threshold()


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at 128 KiB in this process, whatever it runs (`return_big_buffers` decides
    when; `benchmarks/mmap_threshold.py` pins it in a training process on purpose); whether it was done."""
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError, AttributeError, TypeError):
        return ctypes.CDLL(name).mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    return False


class BodyShare:
    """The bytes all rollouts' big request bodies being read together may take (see the module docstring)."""

    def __init__(self, limits: ServingLimits):
        self._limits = limits
        self.used = 0
        self._freed = asyncio.Condition()

    @contextlib.asynccontextmanager
    async def reading(self, announced: int | None) -> AsyncIterator[None]:
        """Hold the block (the body's reading) until the body, of `announced` bytes (None: chunked), fits the
        share; a small one, or one refused unread over `max_request_bytes`, does not wait."""
        limits = self._limits
        if announced is not None and (announced <= limits.own_body_bytes or announced > limits.max_request_bytes):
            yield
            return
        size = min(limits.shared_body_bytes, limits.max_request_bytes if announced is None else announced)
        async with self._freed:
            await self._freed.wait_for(lambda: self.used + size <= limits.shared_body_bytes)
            self.used += size
        try:
            yield
        finally:
            async with self._freed:
                self.used -= size
                self._freed.notify_all()


class _Refused(asyncio.Protocol):
    """A connection over its cap: answered 503 and closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(_BUSY)
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted open until the connection is lost."""

    def __init__(self, inner: asyncio.Protocol, listener: Listener):
        self._inner, self._listener = inner, listener
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._listener._closed(self)
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class ConnectionBudget:
    """The connections all listeners of one server hold together, against one cap."""

    def __init__(self, cap: int):
        self.cap = cap
        self.open = 0


class Listener:
    """A protocol factory for `loop.create_server` / `create_unix_server` that caps its open connections at `cap`
    and, with every other listener of its `budget`, at `budget.cap`. `refused` counts the connections it turned
    away; `on_lost` is called with each counted connection's transport once it is gone; `close` stops listening
    and closes what is still open."""

    def __init__(self, name: str, factory: Callable[[], asyncio.Protocol], cap: int, budget: ConnectionBudget):
        self.name, self._factory, self.cap, self._budget = name, factory, cap, budget
        self._open: set[_Counted] = set()
        self.refused = 0
        self.server: asyncio.Server | None = None  # a listener started by `loop.create_server`
        self._sock: socket.socket | None = None  # or one that `serve_unix` accepts on itself
        self._accepting: asyncio.Task | None = None
        self.on_lost: Callable[[asyncio.BaseTransport], None] | None = None

    @property
    def open(self) -> int:
        return len(self._open)

    def __call__(self) -> asyncio.Protocol:
        if len(self._open) >= self.cap or self._budget.open >= self._budget.cap:
            if not self.refused:
                log.warning(
                    "%s: connection refused (%d open here, %d of %d in all)",
                    self.name,
                    len(self._open),
                    self._budget.open,
                    self._budget.cap,
                )
            self.refused += 1
            return _Refused()
        counted = _Counted(self._factory(), self)
        self._open.add(counted)
        self._budget.open += 1
        return counted

    def _closed(self, counted: _Counted) -> None:
        if counted in self._open:
            self._open.discard(counted)
            self._budget.open -= 1
            if self.on_lost is not None and counted.transport is not None:
                self.on_lost(counted.transport)

    def serve_unix(self, path: str, per_second: float) -> None:
        """Listen on the unix socket `path`, accepting at most `per_second` connections a second (bursts of `cap`)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(self.cap)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._accepting = asyncio.get_running_loop().create_task(self._accept(sock, per_second))

    async def _accept(self, sock: socket.socket, per_second: float) -> None:
        loop = asyncio.get_running_loop()
        tokens, then = float(self.cap), loop.time()
        while True:
            now = loop.time()
            tokens, then = min(float(self.cap), tokens + (now - then) * per_second), now
            if tokens < 1:  # over the rate: accept nothing for a moment; the kernel's backlog holds the rest
                await asyncio.sleep((1 - tokens) / per_second)
                continue
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as e:  # EMFILE and the like: the process is short of descriptors; try again soon
                log.warning("%s: accept failed: %s", self.name, e)
                await asyncio.sleep(0.1)
                continue
            tokens -= 1
            try:
                await loop.connect_accepted_socket(self, conn)
            except OSError:
                conn.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self._accepting is not None:
            self._accepting.cancel()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        for counted in list(self._open):
            if counted.transport is not None:
                counted.transport.close()
