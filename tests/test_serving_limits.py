"""Every bound of `swe_grpo.serving.limits`, tried as an attacker holding its rollout's token would (issue 23,
section 3): a real InterceptionServer on loopback and on a rollout's door (a unix socket), raw sockets that open
connections and never speak, dribble a request head, or stream bodies far bigger than any request; meanwhile the
server's own health, its descriptors and memory, and another rollout's requests are watched. The generator is a
STUB (`ScriptedGenerator`): the attacks never reach generation."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from pi_shapes import PiConversation
from test_interception import ScriptedGenerator, post_chat, stub_server, training

from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.limits import ServingLimits
from swe_grpo.types import RolloutEndpoint

MIB = 1024 * 1024
LIMITS = ServingLimits(max_request_bytes=8 * MIB, door_connections=4, idle_timeout_s=0.5, body_timeout_s=1.0)


@contextlib.asynccontextmanager
async def limited_server(limits: ServingLimits = LIMITS) -> AsyncIterator[InterceptionServer]:
    generator = ScriptedGenerator.texts(training("qwen3"), ["Done.<|im_end|>"])
    async with stub_server("qwen3", generator, limits=limits) as srv:
        yield srv


@pytest.fixture
async def http() -> Any:
    async with aiohttp.ClientSession() as session:
        yield session


async def served(http: aiohttp.ClientSession, srv: InterceptionServer, endpoint: RolloutEndpoint) -> float:
    """/health and a chat completion of a well-behaved rollout both answered; the latter's seconds."""
    async with http.get(f"{srv.public_base_url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
        assert r.status == 200
    started = time.monotonic()
    body = PiConversation().request(stream=False)
    async with await post_chat(http, endpoint, body, timeout=aiohttp.ClientTimeout(total=5)) as r:
        assert r.status == 200, await r.text()
    return time.monotonic() - started


def head(endpoint: RolloutEndpoint, length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (
        f"POST /rollout/{endpoint.rollout_id}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {endpoint.token}\r\nContent-Type: application/json\r\n{size}\r\n\r\n"
    ).encode()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the server sent before closing the connection (fails if it is still open after `seconds`)."""
    data = b""
    async with asyncio.timeout(seconds):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_a_flood_of_idle_door_connections_holds_only_the_doors_cap(http, tmp_path: Path) -> None:
    """A flood of idle connections to a door cannot exhaust the server's descriptors: the door holds at most
    `door_connections`, accepts at most `door_accepts_per_s` more a second (each answered 503 while it is full),
    leaves the rest in the kernel, and the server stays healthy for everyone."""
    async with limited_server(replace(LIMITS, idle_timeout_s=5.0)) as srv:
        door = tmp_path / "door"  # a unix socket the server is handed
        async with srv.rollout(socket=door) as handle, srv.rollout() as other:
            attacker, victim = handle.endpoint, other.endpoint
            fds = psutil.Process().num_fds()
            flood = []
            for _ in range(300):  # a connect the full backlog refuses is the attacker's loss, not the server's
                with contextlib.suppress(OSError):
                    flood.append(await asyncio.open_unix_connection(str(door)))
            await asyncio.sleep(1.0)
            assert srv.open_connections()[f"door of {attacker.rollout_id}"] == LIMITS.door_connections
            # The flood's own client sockets are this process's too: the server's share is what is left.
            assert psutil.Process().num_fds() - fds <= len(flood) + LIMITS.door_connections + 8
            assert await served(http, srv, victim) < 1.0
            for _, writer in flood:
                writer.close()
        record = handle.record
    # 1 s at 20 a second beyond the first `door_connections`: about 20 accepted and answered 503, not 300.
    assert 5 <= record.refused_connections <= 2 * LIMITS.door_accepts_per_s


CHURN = """
import socket, sys, time
end, opened = time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < end:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(0.01)
    try:
        s.connect(sys.argv[1])
        opened += 1
    except OSError:
        pass
    s.close()
print(opened)
"""


async def test_opening_and_closing_door_connections_in_a_loop_costs_the_loop_little(http, tmp_path: Path) -> None:
    """Churn, from a process of its own (as a sandbox): connections opened and closed as fast as it can. The door
    accepts them at its rate only; another rollout's requests are answered about as fast as without the churn."""
    async with limited_server() as srv:
        door = tmp_path / "door"  # a unix socket the server is handed
        async with srv.rollout(socket=door), srv.rollout() as other:
            victim = other.endpoint
            quiet = sorted([await served(http, srv, victim) for _ in range(5)])[2]
            churn = await asyncio.create_subprocess_exec(
                sys.executable, "-c", CHURN, str(door), "3", stdout=asyncio.subprocess.PIPE
            )
            await asyncio.sleep(0.5)
            busy = sorted([await served(http, srv, victim) for _ in range(5)])[2]
            opened = int((await churn.communicate())[0])
    # 3 s at 20 a second, and the backlog: the door accepts a few dozen, not every connection the churn opens.
    assert opened < 10 * LIMITS.door_accepts_per_s and busy < quiet + 0.01, (quiet, busy, opened)


@pytest.mark.parametrize("speaks", [b"", b"POST /rollout/x/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"])
async def test_a_connection_that_never_completes_its_request_head_is_closed(speaks: bytes, tmp_path: Path) -> None:
    """Silent, or dribbling a head it never finishes (slowloris): closed after `idle_timeout_s`, over TCP and
    through a door, and its slot in the door's cap is free again."""
    async with limited_server() as srv:
        door = tmp_path / "door"  # a unix socket the server is handed
        async with srv.rollout(socket=door) as handle:
            endpoint = handle.endpoint
            opened = [
                await asyncio.open_connection("127.0.0.1", srv.port),
                *[await asyncio.open_unix_connection(str(door)) for _ in range(LIMITS.door_connections)],
            ]
            started = time.monotonic()
            for _, writer in opened:
                writer.write(speaks)
            for reader, _ in opened:
                await closed_within(reader, LIMITS.idle_timeout_s + 2)
            assert time.monotonic() - started >= LIMITS.idle_timeout_s * 0.9
            reader, writer = await asyncio.open_unix_connection(str(door))  # the door has room again
            writer.write(head(endpoint, 2) + b"{}")
            assert (await closed_within(reader, 5)).startswith(b"HTTP/1.1 400")
            writer.close()


async def test_a_body_that_never_arrives_whole_is_answered_408() -> None:
    async with limited_server() as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(head(endpoint, 1000) + b'{"messages": ')
            reply = await closed_within(reader, LIMITS.body_timeout_s + 12)  # + aiohttp's lingering time (10 s)
            writer.close()
        record = handle.record
    assert reply.startswith(b"HTTP/1.1 408")
    assert [e.kind for e in record.errors] == ["bad_request"] and "not received" in record.errors[0].message


async def test_big_bodies_on_many_connections_hold_at_most_one_capped_body(http) -> None:
    """Three connections each streaming 64 MiB (chunked: no length to refuse them by) made the server hold all of
    it at once. Now a rollout's request is read only once its previous one is over, a newer one supersedes it,
    and a body stops at `max_request_bytes`: memory grows by about one capped body, and the others are served."""
    async with limited_server() as srv:
        async with srv.rollout() as handle, srv.rollout() as other:
            attacker, victim = handle.endpoint, other.endpoint
            process = psutil.Process()
            before, peak = process.memory_info().rss, 0
            chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"  # 16 KiB chunks

            async def stream(mib: int) -> bytes:
                """Stream `mib` MiB until the server answers; its answer."""
                reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                writer.write(head(attacker, None))
                reply = asyncio.create_task(reader.read(100))
                with contextlib.suppress(ConnectionError):
                    for _ in range(mib * 64):
                        if reply.done():
                            break
                        writer.write(chunk)
                        await writer.drain()
                try:
                    return await reply
                finally:
                    writer.close()

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, process.memory_info().rss)
                    await asyncio.sleep(0.01)

            watching = asyncio.create_task(watch())
            replies = await asyncio.gather(*(stream(64) for _ in range(3)))
            victim_s = await served(http, srv, victim)
            watching.cancel()
        record = handle.record
    assert sorted(r[:12] for r in replies) == [b"HTTP/1.1 409", b"HTTP/1.1 409", b"HTTP/1.1 413"], replies
    assert peak - before < 4 * LIMITS.max_request_bytes, (peak - before) / MIB
    assert victim_s < 1.0
    assert sorted(e.kind for e in record.errors) == ["bad_request", "superseded", "superseded"]


async def test_a_body_announced_over_the_cap_is_refused_unread() -> None:
    async with limited_server() as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(head(endpoint, 250 * MIB))
            reply = await asyncio.wait_for(reader.read(100), 5)
            writer.close()
        record = handle.record
    assert reply.startswith(b"HTTP/1.1 413") and [e.kind for e in record.errors] == ["bad_request"]


async def test_the_tcp_port_and_all_listeners_together_are_capped(http) -> None:
    """Over TCP no rollout is known before a request: the port has its own cap, and every listener together
    stays within a share of the process's descriptors."""
    limits = ServingLimits(tcp_connections=20, idle_timeout_s=5.0)
    async with limited_server(limits) as srv:
        flood = [await asyncio.open_connection("127.0.0.1", srv.port) for _ in range(60)]
        await asyncio.sleep(0.1)
        refused = 0
        for reader, _ in flood:
            with contextlib.suppress(TimeoutError):
                refused += (await asyncio.wait_for(reader.read(100), 0.01)).startswith(b"HTTP/1.1 503")
        assert refused == 40
        for _, writer in flood:
            writer.close()
        await asyncio.sleep(0.1)
        async with srv.rollout() as handle:
            assert await served(http, srv, handle.endpoint) < 1.0
    assert 0 < limits.total_connections() < psutil.Process().rlimit(psutil.RLIMIT_NOFILE)[0]


async def test_a_rollout_holds_at_most_its_cap_of_tcp_connections(http) -> None:
    """Over TCP (the `hf` backend's way in: no door) one rollout could keep as many kept-alive connections as the
    port holds, and so refuse every other rollout its port. A TCP connection now counts for the rollout whose token
    its first request carried: past `rollout_tcp_connections` a request of that rollout on a new connection is
    answered 503 and its connection closed; a closed one frees its place; other rollouts are served throughout."""
    limits = replace(LIMITS, rollout_tcp_connections=3, idle_timeout_s=5.0)
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": false}'
    async with limited_server(limits) as srv:
        async with srv.rollout() as handle, srv.rollout() as other:
            attacker, victim = handle.endpoint, other.endpoint

            async def kept_alive() -> tuple[bytes, asyncio.StreamReader, asyncio.StreamWriter]:
                reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                writer.write(head(attacker, len(body)) + body)
                status = await asyncio.wait_for(reader.readline(), 5)
                return status, reader, writer

            opened = [await kept_alive() for _ in range(5)]
            statuses = [status.split()[1] for status, _, _ in opened]
            assert statuses[3:] == [b"503", b"503"], statuses
            assert all(s != b"503" for s in statuses[:3]), statuses
            assert await served(http, srv, victim) < 1.0
            opened[0][2].close()
            await asyncio.sleep(0.2)
            status, _, writer = await kept_alive()
            assert status.split()[1] != b"503", status
            writer.close()
            for _, _, w in opened:
                w.close()
        record = handle.record
    assert record.refused_connections == 2


async def test_an_agent_that_goes_away_mid_body_is_a_client_disconnection(caplog) -> None:
    async with limited_server() as srv:
        async with srv.rollout() as handle:
            endpoint = handle.endpoint
            _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(head(endpoint, 1000) + b'{"messages": ')
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.transport.abort()
            await asyncio.sleep(0.2)
        record = handle.record
    assert [e.kind for e in record.errors] == ["client_disconnected"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


@pytest.mark.parametrize("ending", ["over_the_cap", "too_slow"])
async def test_a_refused_body_is_freed_with_its_answer(ending: str) -> None:
    """A body refused part-read over the cap (413) was kept alive after its answer: the refusal's exception chained
    aiohttp's, whose frame holds the bytes read so far, in a reference cycle that only the cyclic collector frees. A
    sandbox repeating it piled capped bodies up in the server (P9's big_bodies from a real sandbox: +171 MiB beside
    a bound of +160). With the collector off, what a refused body held (413, and 408 too slow) is gone once the
    refusal is answered."""
    async with limited_server() as srv, srv.rollout() as handle:
        endpoint = handle.endpoint
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(head(endpoint, None))
            chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"  # 16 KiB chunks
            mib = (
                2 * LIMITS.max_request_bytes // MIB
                if ending == "over_the_cap"
                else LIMITS.max_request_bytes // MIB // 2
            )
            with contextlib.suppress(ConnectionError):
                for _ in range(mib * 64):
                    writer.write(chunk)
                    await writer.drain()
            reply = await asyncio.wait_for(reader.read(100), LIMITS.body_timeout_s + 5)
            writer.close()
            await asyncio.sleep(0.2)  # the handler has returned
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            gc.enable()
    assert reply.startswith(b"HTTP/1.1 413" if ending == "over_the_cap" else b"HTTP/1.1 408"), reply
    assert held < LIMITS.max_request_bytes // 8, held / MIB


KEEPALIVE_FLOOD = """
import json, socket, sys, time
path, rollout, token, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False}).encode()
request = (f"POST /rollout/{rollout}/v1/chat/completions HTTP/1.1\\r\\nHost: door\\r\\nAuthorization: Bearer {token}"
           f"\\r\\nContent-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n").encode() + body
s = socket.socket(socket.AF_UNIX)
s.connect(path)
reader, answered, end = s.makefile("rb"), 0, time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(request)
    length = 0
    while (line := reader.readline()) not in (b"\\r\\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    reader.read(length)
    answered += 1
print(answered)
"""


async def test_requests_back_to_back_on_a_kept_alive_connection_are_held_to_the_rollouts_rate(
    http, tmp_path: Path
) -> None:
    """A rollout that sends valid requests back to back on one kept-alive door connection (each superseding the one
    before; no new connection, so no accept rate held it) had thousands a second served: one rollout kept the
    server's event loop busy. Now a rollout's requests are held to `rollout_requests_per_s` (bursts of
    `rollout_request_burst`) before anything of them is read: the flood gets about that many answers, each held
    request costs a sleeping handler, and another rollout is served as fast as before. (Its connection's own rate
    is lifted here: it would hold the flood first.)"""
    unlimited_connections = replace(LIMITS, connection_requests_per_s=1e6, connection_request_burst=10**6)
    async with limited_server(unlimited_connections) as srv:
        door = tmp_path / "door"  # a unix socket the server is handed
        async with srv.rollout(socket=door) as handle, srv.rollout() as other:
            attacker, victim = handle.endpoint, other.endpoint
            quiet = sorted([await served(http, srv, victim) for _ in range(5)])[2]
            flood = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                KEEPALIVE_FLOOD,
                str(door),
                attacker.rollout_id,
                attacker.token,
                "3",
                stdout=asyncio.subprocess.PIPE,
            )
            await asyncio.sleep(0.5)
            busy = sorted([await served(http, srv, victim) for _ in range(5)])[2]
            answered = int((await flood.communicate())[0])
        record = handle.record
    allowed = LIMITS.rollout_request_burst + 3 * LIMITS.rollout_requests_per_s
    assert answered <= allowed + 2 and record.requests <= allowed + 2, (answered, record.requests, allowed)
    assert record.paced_requests >= answered - LIMITS.rollout_request_burst - 1
    assert busy < quiet + 0.01, (quiet, busy)


PINS = """
import subprocess
import sys
if sys.argv[1] == "torch":
    import torch  # noqa: F401
from swe_grpo.serving.limits import return_big_buffers
print(return_big_buffers())
"""


@pytest.mark.parametrize("process", ["server", "torch"])
def test_a_process_that_trains_keeps_glibcs_allocation_threshold(process: str) -> None:
    """Pinning glibc's mmap threshold (so that freed request bodies go back to the system) is process-wide: with
    `rollout_hosts=0` the server runs in the trainer's process, whose tensors then each became a fresh mapping, and
    the demo policy's training step took 1.5x as long (benchmarks/mmap_threshold.py). A process with torch loaded
    keeps glibc's default; a server's own process (a rollout host: no torch) still pins it."""
    ran = subprocess.run([sys.executable, "-c", PINS, process], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[-1] == ("True" if process == "server" else "False")


GET_FLOOD = """
import socket, sys, threading, time
port, rollout, token, seconds = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4])
auth = f"Authorization: Bearer {token}\\r\\n" if token != "-" else ""
request = f"GET /rollout/{rollout}/v1/models HTTP/1.1\\r\\nHost: x\\r\\n{auth}\\r\\n".encode()
answered, end = [0] * 8, time.monotonic() + seconds

def flood(i):
    while time.monotonic() < end:  # a connection the server closed is opened again
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(0.5)
        got = b""
        try:
            while time.monotonic() < end:
                s.sendall(request * 16)  # pipelined: 16 requests before reading any answer
                got = b""
                while got.count(b"HTTP/1.1 ") < 16:
                    chunk = s.recv(65536)
                    if not chunk:
                        raise ConnectionError
                    got += chunk
                answered[i] += 16
        except (OSError, ConnectionError):
            answered[i] += got.count(b"HTTP/1.1 ")
        finally:
            s.close()

threads = [threading.Thread(target=flood, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sum(answered))
"""


@pytest.mark.parametrize("token", ["valid", "none"])
async def test_a_flood_of_pipelined_gets_is_held_to_a_rate_per_connection_and_rollout(http, token: str) -> None:
    """`GET /models` pipelined on 8 connections, with the rollout's token or none: every route was answered as fast
    as it came (197,154 answers in 12 s, 181,723 of them 401 without a token; the server at one full core), since
    only chat was held to a rate. Now every request is held to `connection_requests_per_s` on its connection, an
    authenticated one also to its rollout's rate, and one that carries no valid token to the server's
    `unauthorized_per_s`: the flood gets a few answers a second, the server spends little CPU on it, and another
    rollout is served about as fast as without the flood."""
    seconds = 3.0
    async with limited_server() as srv, srv.rollout() as handle, srv.rollout() as other:
        attacker, victim = handle.endpoint, other.endpoint
        quiet = sorted([await served(http, srv, victim) for _ in range(5)])[2]
        cpu, started = time.process_time(), time.monotonic()  # this process is the server's, not the flood's
        flood = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            GET_FLOOD,
            str(srv.port),
            attacker.rollout_id,
            attacker.token if token == "valid" else "-",
            str(seconds),
            stdout=asyncio.subprocess.PIPE,
        )
        await asyncio.sleep(0.5)
        busy = sorted([await served(http, srv, victim) for _ in range(5)])[2]
        answered = int((await flood.communicate())[0])
        cpu, elapsed = time.process_time() - cpu, time.monotonic() - started
    limits = srv.limits
    rate = limits.rollout_requests_per_s if token == "valid" else limits.unauthorized_per_s
    burst = limits.rollout_request_burst if token == "valid" else limits.unauthorized_burst
    allowed = burst + elapsed * rate  # it reads the answers to what it sent until a while after its end
    assert answered <= allowed, (answered, allowed)
    assert cpu < elapsed / 4, (cpu, elapsed)
    assert busy < quiet + 0.01, (quiet, busy)


@pytest.mark.parametrize("cap", ["rows", "tokens"])
async def test_a_rollout_that_sends_a_new_conversation_each_request_is_capped(http, cap: str) -> None:
    """Each request a different conversation (a fork: a new training row rendered whole): 19 a second of ~100 kB
    built 799 rows and 21.2 M tokens in 45 s, all held in the server and shipped to the trainer. Now a rollout
    holds at most `rollout_rows` rows and `rollout_tokens` tokens: a request that would take it past either is
    refused (400 `rollout_budget_exceeded`, no generation), recorded `rollout_budget`, and the rollout's rows stay
    within the caps (the rollout is then `budget_exceeded`, reward 0: `swe_grpo.rollout`); another rollout is
    served as before."""
    padding = "lorem ipsum " * 400  # a few thousand tokens a conversation

    def conversation(i: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"conversation {i}: {padding}"}], "stream": False}

    async with limited_server() as srv, srv.rollout() as probe:  # one conversation's tokens, as the chain holds them
        answered = await post_chat(http, probe.endpoint, conversation(0))
        assert answered.status == 200, await answered.text()
        answered.release()
    one = sum(len(row.input_ids) for row in probe.record.rows)
    limits = replace(LIMITS, rollout_rows=4) if cap == "rows" else replace(LIMITS, rollout_tokens=int(2.5 * one))
    kept = 4 if cap == "rows" else 2
    async with limited_server(limits) as srv, srv.rollout() as handle, srv.rollout() as other:
        statuses, codes = [], []
        for i in range(kept + 3):
            async with await post_chat(http, handle.endpoint, conversation(i)) as r:
                statuses.append(r.status)
                codes.append((await r.json())["error"]["code"] if r.status != 200 else None)
        victim_s = await served(http, srv, other.endpoint)
    record = handle.record
    assert statuses == [200] * kept + [400] * 3, statuses
    assert codes[kept:] == ["rollout_budget_exceeded"] * 3, codes
    assert len(record.rows) == kept and sum(len(row.input_ids) for row in record.rows) <= limits.rollout_tokens
    assert [e.kind for e in record.errors] == ["rollout_budget"] * 3
    assert victim_s < 1.0


async def test_big_bodies_from_many_rollouts_at_once_hold_the_servers_share(http) -> None:
    """Six rollouts each streaming a body past the cap at once: a rollout holds at most one body, but six of them
    held six (P9's big_bodies from six sandboxes: RSS +292 MiB against a bound of +160). Now a body not announced
    within `own_body_bytes` is read only within the server's `shared_body_bytes` for all such bodies together (one
    of unknown length counts as `max_request_bytes`): the others wait, unread, in their connections, memory grows
    by about that share (a body being read takes up to twice its size: aiohttp's buffer grows as it comes), and a
    rollout's small request is read without waiting. Here the share is one capped body: six were read at once."""
    limits = replace(LIMITS, shared_body_bytes=LIMITS.max_request_bytes)
    chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"  # 16 KiB chunks
    async with contextlib.AsyncExitStack() as stack:
        srv = await stack.enter_async_context(limited_server(limits))
        attackers = [(await stack.enter_async_context(srv.rollout())).endpoint for _ in range(6)]
        victim = (await stack.enter_async_context(srv.rollout())).endpoint
        process = psutil.Process()
        gc.collect()
        before, peak = process.memory_info().rss, 0

        async def stream(endpoint: RolloutEndpoint) -> bytes:
            """Stream twice the cap, chunked, until the server answers; its answer."""
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(head(endpoint, None))
            reply = asyncio.create_task(reader.read(100))
            with contextlib.suppress(ConnectionError):
                for _ in range(2 * limits.max_request_bytes // 0x4000):
                    if reply.done():
                        break
                    writer.write(chunk)
                    await writer.drain()
            try:
                return await reply
            finally:
                writer.close()

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, process.memory_info().rss)
                await asyncio.sleep(0.01)

        watching = asyncio.create_task(watch())
        streams = [asyncio.create_task(stream(endpoint)) for endpoint in attackers]
        await asyncio.sleep(0.3)
        victim_s = await served(http, srv, victim)
        replies = await asyncio.gather(*streams)
        watching.cancel()
    assert [r[:12] for r in replies] == [b"HTTP/1.1 413"] * 6, replies
    assert peak - before < 3 * limits.shared_body_bytes, (peak - before) / MIB
    assert victim_s < 1.0


async def test_a_big_bodys_wait_for_the_share_counts_against_its_own_timeout() -> None:
    """A body that waits for the server's share of big bodies waits within its own `body_timeout_s`, not before
    it: behind a rollout that holds the share with a body it never sends, another's stalled body is answered 408
    within one body timeout of its head (before: the wait, up to the other's whole timeout, came first, and then
    a timeout of its own, nearly twice as long)."""
    limits = replace(LIMITS, shared_body_bytes=LIMITS.max_request_bytes, body_timeout_s=3.0)
    async with contextlib.AsyncExitStack() as stack:
        srv = await stack.enter_async_context(limited_server(limits))
        holder, waiter = [(await stack.enter_async_context(srv.rollout())).endpoint for _ in range(2)]

        async def stalled(endpoint: RolloutEndpoint) -> tuple[bytes, float]:
            """A big announced body of which nothing is sent: the server's answer and its seconds from the head."""
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            started = time.monotonic()
            writer.write(head(endpoint, 6 * MIB))
            try:
                return await reader.read(100), time.monotonic() - started
            finally:
                writer.close()

        holding = asyncio.create_task(stalled(holder))
        await asyncio.sleep(0.5)  # its body is being read: it holds the whole share
        reply, waited = await stalled(waiter)
        assert (await holding)[0][:12] == b"HTTP/1.1 408"
    assert reply[:12] == b"HTTP/1.1 408", reply
    assert limits.body_timeout_s - 0.1 < waited < limits.body_timeout_s + 1.5, waited
