"""The agent's one door (`swe_grpo.sandbox.door`) on real sandboxes and a real InterceptionServer: from inside an
agent sandbox its own rollout's endpoint answers (and still wants the token), while the server's other
routes and rollouts, its TCP port, vLLM's port and another host loopback port are out of reach, and the
sandbox has no interface or route but its own loopback. A real Pi run goes through the door.

Traffic goes only to 127.0.0.1 of the host (to check the listeners exist) or of the sandbox's own network
namespace; what lies beyond is checked by interfaces and routes, never by sending traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import SERVED_NAME
from sandbox_helpers import calc_task, make_repo

from swe_grpo.agents.base import AgentConfig, run_agent
from swe_grpo.agents.pi import PiAgent, PiBundle
from swe_grpo.sandbox import door as door_module
from swe_grpo.sandbox.base import Sandbox, SandboxBackend
from swe_grpo.sandbox.door import DOOR_PORT, PROXY_PORT, Door, ForwarderBuildError
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient
from swe_grpo.tasks import Task

# Run inside the sandbox behind the door; argv[1] is JSON {rollout, token, other, other_token, ports}.
PROBE = r"""
import http.client, json, socket, sys
a = json.loads(sys.argv[1])
def status(path, token=None):
    conn = http.client.HTTPConnection("127.0.0.1", DOOR_PORT, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"} if token else {})
    response = conn.getresponse()
    response.read()
    return response.status
def reach(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return "connected"
    except OSError as e:
        return type(e).__name__
print(json.dumps({
    "own": status(f"/rollout/{a['rollout']}/v1/models", a["token"]),
    "own_without_token": status(f"/rollout/{a['rollout']}/v1/models"),
    "other_rollout": status(f"/rollout/{a['other']}/v1/models", a["other_token"]),
    "health": status("/health"),
    "unknown_path": status("/metrics", a["token"]),
    "ports": {str(p): reach(p) for p in a["ports"]},
    "interfaces": [name for _, name in socket.if_nameindex()],
    "routes": open("/proc/net/route").read().splitlines()[1:] + open("/proc/net/ipv6_route").read().splitlines(),
}))
""".replace("DOOR_PORT", str(DOOR_PORT))


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Task:
    return calc_task(make_repo(tmp_path_factory.mktemp("origin")))


@pytest.fixture
def host_listener() -> Iterator[int]:
    """A service on the host's loopback that no sandbox may reach; its port."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def reachable_from_host(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


async def probe(
    server: InterceptionServer, backend: SandboxBackend, task: Task, bundle: PiBundle, ports: list[int]
) -> dict:
    """Open two rollouts, give the first a door, run PROBE behind it in an agent sandbox; what it saw."""
    door = Door.make("probe")
    try:
        async with server.rollout("probe", socket=door.socket) as mine, server.rollout() as theirs:
            own, other = mine.endpoint, theirs.endpoint
            sandbox: Sandbox = await backend.create(task, mounts=[bundle.mount(), door.mount()], network=False)
            async with sandbox:
                args = {"rollout": own.rollout_id, "token": own.token, "other": other.rollout_id}
                args |= {"other_token": other.token, "ports": ports}
                result = await sandbox.exec(door.wrap(["python3", "-c", PROBE, json.dumps(args)]), timeout_s=120)
                assert result.exit_code == 0, result
                # The forwarder passes the agent's exit status on.
                assert (await sandbox.exec(door.wrap(["sh", "-c", "exit 7"]), timeout_s=60)).exit_code == 7
        assert not door.socket.exists()  # the server stopped serving it, and removed it
    finally:
        door.remove()
    assert not door.host_dir.exists()
    return json.loads(result.stdout)


def assert_only_the_door(seen: dict, ports: list[int]) -> None:
    assert seen["own"] == 200
    assert seen["own_without_token"] == 401  # the door narrows what is reachable; the token still counts
    assert seen["other_rollout"] == seen["health"] == seen["unknown_path"] == 403
    assert seen["ports"] == {str(p): "ConnectionRefusedError" for p in ports}
    assert seen["interfaces"] == ["lo"]
    # IPv6: at most loopback's own routes (the kernel adds them to `lo` once it is up).
    assert all(line.split()[-1] == "lo" for line in seen["routes"]), seen["routes"]


async def test_door_reaches_only_its_own_rollout(
    backend: SandboxBackend, task: Task, tokenizer, pi_bundle: PiBundle, host_listener: int
) -> None:
    """Behind the door: its rollout's route answers; the server's other routes and rollouts get 403; the
    server's TCP port and a host loopback service are refused; no interface or route but loopback."""
    unused = VLLMClient("http://127.0.0.1:9", SERVED_NAME, max_model_len=8192)  # /models never generates
    async with unused, InterceptionServer(unused, tokenizer) as server:
        ports = [server.port, host_listener]
        assert all(reachable_from_host(p) for p in ports)
        assert_only_the_door(await probe(server, backend, task, pi_bundle, ports), ports)


@pytest.mark.integration
async def test_pi_through_the_door(vllm_server, vllm_client, tokenizer, pi_bundle, local_backend, task) -> None:
    """vLLM's port is out of reach behind the door, and a real Pi run reaches its model through it."""
    vllm_port = urlsplit(vllm_server.url).port
    assert vllm_port is not None and reachable_from_host(vllm_port)
    sampling = SamplingParams(temperature=1.0, max_tokens=64)
    async with InterceptionServer(vllm_client, tokenizer, model_name=SERVED_NAME, sampling=sampling) as server:
        assert_only_the_door(await probe(server, local_backend, task, pi_bundle, [vllm_port]), [vllm_port])
        door = Door.make("pi")
        try:
            async with (
                server.rollout("pi", socket=door.socket) as handle,
                await local_backend.create(task, mounts=[pi_bundle.mount(), door.mount()], network=False) as sandbox,
            ):
                config = AgentConfig(context_window=vllm_client.max_model_len, max_tokens=64, timeout_s=180)
                result = await run_agent(
                    PiAgent(pi_bundle),
                    sandbox,
                    handle.endpoint,
                    "Fix calc.py.",
                    config,
                    handle.last_activity,
                    door=door,
                )
        finally:
            door.remove()
        record = handle.record
    assert len(record.turns) >= 1, result
    assert not [e for e in record.errors if e.kind != "client_disconnected"], record.errors


async def test_a_served_socket_is_removed_however_the_server_ends(tokenizer, tmp_path: Path) -> None:
    """A socket the server was handed, its rollout closed after the server stopped (a rollout's `finally` after
    Ctrl-C), or never closed, is no longer served and leaves no file behind; a path served already is refused.
    The door's directory is its maker's: the server leaves it."""
    unused = VLLMClient("http://127.0.0.1:9", SERVED_NAME, max_model_len=8192)
    closed_late, never_closed = tmp_path / "late", tmp_path / "never"
    async with unused:
        server = await InterceptionServer(unused, tokenizer).start()
        late = server.rollout(socket=closed_late)
        await late.__aenter__()
        await server.rollout(socket=never_closed).__aenter__()
        assert closed_late.is_socket() and never_closed.is_socket()
        with pytest.raises(ValueError, match="already served"):
            async with server.rollout(socket=closed_late):
                pass
        await server.stop()
        await late.__aexit__(None, None, None)
    assert sorted(tmp_path.iterdir()) == []


# Run inside the sandbox behind a door with an allowlist; argv[1] is JSON {allowed, refused} (host:port).
TUNNEL = r"""
import json, os, socket, sys
a = json.loads(sys.argv[1])
def connect(target):
    conn = socket.create_connection(("127.0.0.1", PROXY_PORT), timeout=10)
    conn.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += conn.recv(1)
    status = int(head.split()[1])
    if status == 200:
        conn.sendall(b"ping")
        return status, conn.recv(4).decode()
    return status, None
print(json.dumps({
    "allowed": connect(a["allowed"]),
    "refused": connect(a["refused"]),
    "proxy_env": [os.environ.get(k) for k in ("HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY")],
}))
""".replace("PROXY_PORT", str(PROXY_PORT))


async def test_allowlist_admits_only_the_listed_targets(
    backend: SandboxBackend, task: Task, tokenizer, pi_bundle: PiBundle, host_listener: int
) -> None:
    """With `Door.allow`, the agent reaches exactly the listed `host:port`s through the proxy (here an echo
    server on the host's loopback, standing in for a package index); another target is refused (403)."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readexactly(4))
        await writer.drain()
        writer.close()

    echo_server = await asyncio.start_server(echo, "127.0.0.1", 0)
    allowed = f"127.0.0.1:{echo_server.sockets[0].getsockname()[1]}"
    unused = VLLMClient("http://127.0.0.1:9", SERVED_NAME, max_model_len=8192)
    async with echo_server, unused, InterceptionServer(unused, tokenizer) as server:
        door = replace(Door.make("tunnel"), allow=(allowed,))
        proxy = await door.serve_allowlist()
        try:
            async with (
                server.rollout("tunnel", socket=door.socket),
                await backend.create(task, mounts=[pi_bundle.mount(), door.mount()], network=False) as sandbox,
            ):
                args = json.dumps({"allowed": allowed, "refused": f"127.0.0.1:{host_listener}"})
                result = await sandbox.exec(door.wrap(["python3", "-c", TUNNEL, args]), timeout_s=120)
        finally:
            proxy.close()
            door.remove()
    assert result.exit_code == 0, result
    seen = json.loads(result.stdout)
    assert seen["allowed"] == [200, "ping"]
    assert seen["refused"] == [403, None]
    proxy_url = f"http://127.0.0.1:{PROXY_PORT}"
    assert seen["proxy_env"] == [proxy_url, proxy_url, "127.0.0.1,localhost"]
    assert not door.host_dir.exists()


def test_allowlist_entries_are_host_and_port() -> None:
    with pytest.raises(ValueError, match="host:port"):
        replace(Door("r", Path(os.devnull)), allow=("pypi.org",))


# The forwarder alone: a host server on a door's socket (what the InterceptionServer would serve), a client
# behind the door in a real sandbox. A connection's first byte picks the server's answer: "E" echoes each
# chunk as it comes and half-closes at the end of the stream; "H" reads to the end of the stream, then
# answers the length and SHA-256 of what it read (so the end of stream must cross the door while the reply
# direction stays open).
async def serve_test_protocol(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    mode = await reader.read(1)
    if mode == b"E":
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    elif mode == b"H":
        digest, length = hashlib.sha256(), 0
        while data := await reader.read(1 << 16):
            digest.update(data)
            length += len(data)
        writer.write(f"{length} {digest.hexdigest()}".encode())
    writer.write_eof()
    await writer.drain()
    writer.close()


# Run behind the door: big bodies both ways, a half-close, 64 connections open at once; then the memory of
# its parent, the forwarder (KiB), after all that traffic.
EDGES = r"""
import hashlib, json, os, re, socket, threading
def connect(mode):
    conn = socket.create_connection(("127.0.0.1", DOOR_PORT), timeout=60)
    conn.sendall(mode)
    return conn
def read_all(conn):
    chunks = []
    while chunk := conn.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)
body = os.urandom(1 << 20) * 24  # 24 MiB
conn = connect(b"H")
conn.sendall(body)
conn.shutdown(socket.SHUT_WR)
hashed = read_all(conn).decode() == f"{len(body)} {hashlib.sha256(body).hexdigest()}"
conn = connect(b"E")
sender = threading.Thread(target=lambda: (conn.sendall(body), conn.shutdown(socket.SHUT_WR)))
sender.start()  # both directions at once: the forwarder must not stall either when the other is full
echoed = read_all(conn) == body
sender.join()
conns = [connect(b"E") for _ in range(64)]
for i, c in enumerate(conns):
    c.sendall(b"%d" % i)
    c.shutdown(socket.SHUT_WR)
concurrent = [read_all(c) for c in conns] == [b"%d" % i for i in range(len(conns))]
def kib(name, field):
    text = open(f"/proc/{os.getppid()}/{name}").read()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))
memory = {"rss": kib("status", "VmRSS"), "peak": kib("status", "VmHWM"), "pss": kib("smaps_rollup", "Pss")}
print(json.dumps({"hashed": hashed, "echoed": echoed, "concurrent": concurrent, "memory_kib": memory}))
""".replace("DOOR_PORT", str(DOOR_PORT))


@pytest.fixture
async def served_door() -> AsyncIterator[Door]:
    """A door whose socket is served by `serve_test_protocol`."""
    door = Door.make("edges")
    server = await asyncio.start_unix_server(serve_test_protocol, path=door.socket)
    door.socket.chmod(0o666)
    try:
        yield door
    finally:
        server.close()
        door.remove()


async def test_forwarder_edges_and_memory(backend: SandboxBackend, task: Task, served_door: Door) -> None:
    """Through the forwarder: 24 MiB each way, with both directions streaming at once; a half-close passed on
    (the reply comes back after it); 64 connections at once (more than the host's backlog holds: those
    wait for it). And its memory after all that, in a real sandbox: at most 5 MiB RSS, PSS and peak RSS."""
    async with await backend.create(task, mounts=[served_door.mount()], network=False) as sandbox:
        result = await sandbox.exec(served_door.wrap(["python3", "-c", EDGES]), timeout_s=300)
    assert result.exit_code == 0, result
    seen = json.loads(result.stdout)
    assert (seen["hashed"], seen["echoed"], seen["concurrent"]) == (True, True, True), seen
    assert max(seen["memory_kib"].values()) <= 5 * 1024, seen["memory_kib"]


async def test_forwarder_passes_on_status_and_signals(
    local_backend: SandboxBackend, task: Task, served_door: Door
) -> None:
    """The forwarder exits with its agent's status, 128 + the signal that ended it, 127 when the agent cannot
    run, 125 when it cannot listen (here: a second forwarder on the first one's port); it passes a signal
    it receives on to the agent (which here exits 9 on SIGTERM); and the agent's stdout takes 4 MiB at once
    (the forwarder leaves the agent's stdio as it found it)."""
    forwarded = 'trap "exit 9" TERM; kill -TERM $PPID; sleep 30 & wait'
    cases = {
        "exit 3": (served_door.wrap(["sh", "-c", "exit 3"]), 3),
        "big stdout": (served_door.wrap(["python3", "-c", "print('x' * (4 << 20)); print('done')"]), 0),
        "killed": (served_door.wrap(["sh", "-c", "kill -KILL $$"]), 128 + signal.SIGKILL),
        "forwarded": (served_door.wrap(["sh", "-c", forwarded]), 9),
        "cannot run": (served_door.wrap(["/nonexistent/agent"]), 127),
        "cannot listen": (served_door.wrap(served_door.wrap(["true"])), 125),
    }
    async with await local_backend.create(task, mounts=[served_door.mount()], network=False) as sandbox:
        results = {name: await sandbox.exec(argv, timeout_s=60) for name, (argv, _) in cases.items()}
    assert {name: r.exit_code for name, r in results.items()} == {name: code for name, (_, code) in cases.items()}
    assert results["big stdout"].stdout.endswith("x\ndone\n")
    assert "door: cannot run /nonexistent/agent: No such file or directory" in results["cannot run"].stderr
    assert f"door: cannot listen on 127.0.0.1:{DOOR_PORT}: Address already in use" in results["cannot listen"].stderr


def test_forwarder_source_compiles_cleanly(tmp_path: Path) -> None:
    """The forwarder's source builds with every common warning on (users' newer compilers build it without
    -Werror, so a warning there cannot break their door)."""
    source = Path(door_module.__file__).with_name("door_forwarder.c")
    build = ["cc", "-static", "-Os", "-Wall", "-Wextra", "-Werror", "-o", str(tmp_path / "f"), str(source)]
    subprocess.run(build, check=True, capture_output=True)


def test_forwarder_build_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Without a C compiler, opening a door fails with `ForwarderBuildError` naming what to install."""
    monkeypatch.setenv("SWE_GRPO_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(ForwarderBuildError, match="libc6-dev"):
        Door.make("no-compiler")


def test_the_first_door_a_process_makes_removes_the_doors_dead_processes_left(tmp_path: Path) -> None:
    """The server no longer reaps doors (it knows none): the first `Door.make` of each process does. A fresh
    process (the reap runs once per process) makes a door; one left by a dead pid is gone, one of a live process
    (younger than the reaper's grace) stays."""
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    left = tmp_path / f"swe-grpo-door-{dead}-x"
    live = tmp_path / f"swe-grpo-door-{os.getpid()}-x"
    for directory in (left, live):
        directory.mkdir()
    make = "from swe_grpo.sandbox.door import Door; Door.make('reaper').remove()"
    subprocess.run([sys.executable, "-c", make], check=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert sorted(tmp_path.iterdir()) == [live]
