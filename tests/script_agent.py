"""A thin, real agent for end-to-end tests of what an agent's own actions make of its rollout
(tests/test_policy_outcomes.py): a stdlib Python script run the way every agent is run (`run_agent`: in the
agent's sandbox, behind the rollout's door, its secret only in its environment), from a host directory mounted
read-only as its "bundle".

It asks its model as an OpenAI client does (streaming chat completions through its door, with its token) and
reads the reply whole: the policy's first turn. Then it does what its `behaviour` says:

- `finish`: run `action` (a shell command, its "bash tool", in the repository), exit 0;
- `finish_1`: the same, then exit 1 (a failed agent that lost no reply);
- `finish_3`: the same, then exit 3 (a crash after the first turn, as `process.exit(3)` through Pi's inspector);
- `overflow`: ask again with a message longer than the model's context (refused: `context_overflow`), exit 1;
- `drop`: ask again and, once the response headers are in (the server sends them when it starts generating),
  close the connection without reading the reply and exit 1: a client that gave up while its reply was on its
  way, as Pi does once its retries are spent;
- `drop_0`: the same, but exit 0 (an agent that says it finished).

It needs no model that can write code: its replies are read (or not), never acted on.
"""

from __future__ import annotations

from pathlib import Path

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

MOUNT = "/opt/swe_grpo/script-agent"
BEHAVIOURS = ("finish", "finish_1", "finish_3", "overflow", "drop", "drop_0")

# Run in the sandbox: argv[1] the behaviour, argv[2] the action; OPENAI_BASE_URL, OPENAI_MODEL, OPENAI_API_KEY.
SCRIPT = r"""
import http.client, json, os, subprocess, sys
from urllib.parse import urlsplit

behaviour, action = sys.argv[1], sys.argv[2]
url = urlsplit(os.environ["OPENAI_BASE_URL"])
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
messages = [{"role": "user", "content": "Fix the bug."}]

def ask():
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": os.environ["OPENAI_MODEL"], "stream": True, "max_tokens": 8, "messages": messages}
    conn.request("POST", url.path + "/chat/completions", json.dumps(body), headers)
    reply = conn.getresponse()  # the status line and headers only
    if reply.status != 200:
        sys.exit(f"model request failed: {reply.status} {reply.read()[:500]!r}")
    return conn, reply

def read_whole(reply):
    events = [line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: ")]
    if events[-1:] != ["[DONE]"]:
        sys.exit(f"no whole reply: {events[-3:]!r}")
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1] if json.loads(e)["choices"]]
    return "".join(d.get("content") or "" for d in deltas)

read_whole(ask()[1])  # the policy's first turn
if behaviour == "overflow":
    long = " ".join(map(str, range(30000)))  # ~170 kB: tens of thousands of tokens
    messages += [{"role": "assistant", "content": "Looking."}, {"role": "user", "content": long}]
    ask()  # refused: it exits 1
if behaviour.startswith("drop"):
    messages += [{"role": "assistant", "content": "Looking."}, {"role": "user", "content": "Go on."}]
    conn, reply = ask()
    conn.sock.close()  # the reply is being generated: nothing of it is read
    print("gave up waiting for the model", file=sys.stderr)
    sys.exit(0 if behaviour == "drop_0" else 1)
if action:
    subprocess.run(["bash", "-c", action])  # its bash tool: the tool's parent is this process
sys.exit({"finish_1": 1, "finish_3": 3}.get(behaviour, 0))
"""


class ScriptAgent:
    """The agent of the module docstring, installed in `home` (a host directory it writes its script into and
    mounts; the sandbox user must be able to reach it). One instance serves any number of rollouts."""

    name = "script-agent"

    def __init__(self, home: Path, behaviour: str, action: str = "") -> None:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}: one of {', '.join(BEHAVIOURS)}")
        self.home, self.behaviour, self.action = home, behaviour, action
        (home / "agent.py").write_text(SCRIPT)

    def mount(self) -> Mount:
        return Mount(self.home, MOUNT)

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        return Launch(
            argv=["python3", f"{MOUNT}/agent.py", self.behaviour, self.action],
            env={"OPENAI_BASE_URL": endpoint.base_url, "OPENAI_MODEL": endpoint.model},
            files={},
            secret_env="OPENAI_API_KEY",
        )
