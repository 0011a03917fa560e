"""P9's attacker: one rollout's attacks on the InterceptionServer, through that rollout's door socket.

Standard library only, so that it runs as a script inside a real sandbox (`p9_attacks.py` copies it in) as well as
in a process of its own on the host. Usage: `python3 _p9_attacker.py ATTACK DOOR_SOCKET ROLLOUT_ID SECONDS`, with
the rollout's token in `$P9_TOKEN` (a secret never goes on a command line). It prints one JSON line: what it did
(connections opened, refused, requests sent and answered by status).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import sys
import time
from collections import Counter

ATTACKS = (
    "idle_flood",
    "slowloris",
    "big_bodies",
    "churn",
    "request_flood",
    "keepalive_flood",
    "get_flood",
    "fork_flood",
    "file_flood",
    "kernel_counters",
)
# The most processes the process attacks start (each within the sandbox's pids limit anyway).
_MOST_CHILDREN = 2000


def _head(rollout_id: str, token: str, chunked: bool = False, length: int = 0) -> bytes:
    size = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}"
    return (
        f"POST /rollout/{rollout_id}/v1/chat/completions HTTP/1.1\r\nHost: door\r\n"
        f"Authorization: Bearer {token}\r\nContent-Type: application/json\r\n{size}\r\n\r\n"
    ).encode()


def _children(seconds: float, work: str = "") -> dict[str, int]:
    """Fork children (at most `_MOST_CHILDREN`) until a fork is refused; each does `work` ("files": eventfds until
    refused) and sleeps out `seconds`. Returns how many started, the files they hold, and the refused fork's errno."""
    read, write = os.pipe()
    started = files = error = 0
    while started < _MOST_CHILDREN:
        try:
            pid = os.fork()
        except OSError as e:
            error = e.errno
            break
        if pid == 0:
            taken = 0
            with contextlib.suppress(OSError):
                while work == "files":
                    os.eventfd(0)
                    taken += 1
            os.write(write, b"%d\n" % taken)
            time.sleep(seconds)
            os._exit(0)
        started += 1
        files += int(os.read(read, 100))
    return {"processes": started, "files": files, "fork_errno": error}


def _kernel_counters() -> dict[str, int]:
    """Take what the kernel counts per user: inotify instances (at most 1,000) and pipe buffers (at most 200 pipes
    grown to 1 MiB), holding them (the descriptors stay open until the process exits)."""
    libc = ctypes.CDLL(None, use_errno=True)
    inotify = 0
    while inotify < 1000 and libc.inotify_init1(0) >= 0:
        inotify += 1
    pipes = 0
    for _ in range(200):
        _, w = os.pipe()
        try:
            fcntl.fcntl(w, 1031, 1 << 20)  # F_SETPIPE_SZ
        except OSError:
            break
        pipes += 1
    return {"inotify": inotify, "pipes_grown": pipes}


async def attack(name: str, path: str, rollout_id: str, token: str, seconds: float) -> dict[str, object]:
    """Run attack `name` for `seconds`; returns counts of what happened."""
    deadline = time.monotonic() + seconds
    counts: Counter[str] = Counter()
    held: list[asyncio.StreamWriter] = []

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            opened = await asyncio.open_unix_connection(path)
        except OSError as e:
            counts[f"connect_failed_{type(e).__name__}"] += 1
            await asyncio.sleep(0.001)  # e.g. EMFILE at the sandbox's open-files limit: do not spin
            return None
        counts["connected"] += 1
        return opened

    async def hold(count: int, dribble: bytes = b"") -> None:
        """Keep `count` connections open (re-opening those the server closes), sending `dribble` a byte a second."""
        slots: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, int] | None] = [None] * count
        while time.monotonic() < deadline:
            for i, slot in enumerate(slots):
                if slot is None or slot[0].at_eof() or slot[1].is_closing():
                    if slot is not None:
                        slot[1].close()
                    opened = await connect()
                    slots[i] = (*opened, 0) if opened else None
                elif dribble and slot[2] < len(dribble):
                    with contextlib.suppress(OSError):
                        slot[1].write(dribble[slot[2] : slot[2] + 1])
                    slots[i] = (slot[0], slot[1], slot[2] + 1)
            await asyncio.sleep(1.0 if dribble else 0.2)
        held.extend(s[1] for s in slots if s is not None)

    async def answer(reader: asyncio.StreamReader, timeout: float) -> None:
        with contextlib.suppress(OSError, TimeoutError, ValueError):
            line = await asyncio.wait_for(reader.readline(), timeout)
            counts[f"status_{line.split()[1].decode()}" if line.startswith(b"HTTP/") else "no_answer"] += 1

    async def big_body() -> None:
        chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"  # 1 MiB chunks
        while time.monotonic() < deadline:
            opened = await connect()
            if opened is None:
                continue
            reader, writer = opened
            writer.write(_head(rollout_id, token, chunked=True))
            answered = asyncio.ensure_future(answer(reader, seconds))
            with contextlib.suppress(OSError):
                for _ in range(150):
                    if answered.done() or time.monotonic() > deadline:
                        break
                    writer.write(chunk)
                    await writer.drain()
                    counts["body_mib_sent"] += 1
            answered.cancel()
            writer.close()

    async def churn() -> None:
        while time.monotonic() < deadline:
            opened = await connect()
            if opened:
                opened[1].close()

    async def request_flood() -> None:
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False}).encode()
        while time.monotonic() < deadline:
            opened = await connect()
            if opened is None:
                continue
            reader, writer = opened
            writer.write(_head(rollout_id, token, length=len(body)) + body)
            counts["requests_sent"] += 1
            await answer(reader, 1.0)
            writer.close()

    async def keepalive_flood(request: bytes) -> None:
        """`request` back to back on one kept-alive connection: no new connection, so no accept rate holds it."""
        while time.monotonic() < deadline:
            opened = await connect()
            if opened is None:
                continue
            reader, writer = opened
            with contextlib.suppress(OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
                while time.monotonic() < deadline and not reader.at_eof():
                    writer.write(request)
                    counts["requests_sent"] += 1
                    status = await asyncio.wait_for(reader.readline(), 5.0)
                    counts[f"status_{status.split()[1].decode()}" if status.startswith(b"HTTP/") else "no_answer"] += 1
                    length = 0
                    while (line := await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b""):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    await reader.readexactly(length)
            writer.close()

    if name == "idle_flood":
        await hold(1100)
    elif name == "slowloris":
        await hold(200, _head(rollout_id, token)[:-4])
    elif name == "big_bodies":
        await asyncio.gather(*(big_body() for _ in range(3)))
    elif name == "churn":
        await churn()
    elif name == "request_flood":
        await asyncio.gather(*(request_flood() for _ in range(16)))
    elif name == "keepalive_flood":
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": False}).encode()
        request = _head(rollout_id, token, length=len(body)) + body
        await asyncio.gather(*(keepalive_flood(request) for _ in range(8)))
    elif name == "get_flood":  # GET /models, answered without a generation: the cheapest request to ask for
        request = f"GET /rollout/{rollout_id}/v1/models HTTP/1.1\r\nHost: door\r\nAuthorization: Bearer {token}\r\n\r\n"
        await asyncio.gather(*(keepalive_flood(request.encode()) for _ in range(8)))
    elif name in ("fork_flood", "file_flood"):  # the sandbox's own limits; what matters is what the others see
        counts.update(_children(seconds, "files" if name == "file_flood" else ""))
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    elif name == "kernel_counters":
        counts.update(_kernel_counters())
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    else:
        raise ValueError(f"unknown attack {name!r}: one of {ATTACKS}")
    for writer in held:
        writer.close()
    return {"attack": name, **counts}


def main() -> int:
    name, path, rollout_id, seconds = sys.argv[1:5]
    print(json.dumps(asyncio.run(attack(name, path, rollout_id, os.environ["P9_TOKEN"], float(seconds)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
