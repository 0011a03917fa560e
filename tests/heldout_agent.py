"""A FAKE agent for the held-out eval tests (tests/test_heldout_eval.py), in a module of its own so that it
pickles by name into a rollout host (a spawned process) without importing a test module there.

`GoldOrNothing` is a stdlib Python script run the way every agent is run (`run_agent`: in the agent's sandbox,
its secret only in its environment) that makes one real model request through its rollout's endpoint (the real
InterceptionServer, answered by the real vLLM), so each attempt is served at its rollout's sampling and recorded
with the policy version that served it; then, on the tasks it is given the gold patch of, it applies that patch,
and on the others it leaves the repository as it is. Grading is the real thing: gold attempts resolve, the
others do not. It needs no model that can write code, which is why it stands in for Pi here."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from swe_grpo.agents.base import AgentConfig, Launch
from swe_grpo.sandbox.base import Mount
from swe_grpo.types import RolloutEndpoint

_PATCH = "/tmp/swe_grpo/gold.patch"
# Run in the sandbox: one chat request (not streamed) to OPENAI_BASE_URL as OPENAI_MODEL with OPENAI_API_KEY; exits
# with a message unless it is answered 200. Also tests/test_setup_cmd.py's agent.
ASK = r"""
import http.client, json, os, sys
from urllib.parse import urlsplit
url = urlsplit(os.environ["OPENAI_BASE_URL"])
body = {"model": os.environ["OPENAI_MODEL"], "messages": [{"role": "user", "content": "Go."}], "max_tokens": 4}
conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
headers = {"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"}
conn.request("POST", url.path + "/chat/completions", json.dumps(body), headers)
reply = conn.getresponse()
if reply.status != 200:
    sys.exit(f"the model request failed: {reply.status} {reply.read()[:300]!r}")
reply.read()
"""
# Then: argv[1] the seconds to wait; argv[2] the patch to apply, if it exists.
SCRIPT = (
    ASK
    + r"""
import subprocess, time
time.sleep(float(sys.argv[1]))
if os.path.exists(sys.argv[2]):
    subprocess.run(["git", "apply", sys.argv[2]], check=True)
"""
)


class GoldOrNothing:
    """A FAKE agent (see the module docstring). `gold`: problem statement -> the patch to apply; `delay_s`:
    problem statement -> seconds to wait after the model request (a slow attempt); `mount_dir`: an empty
    host directory to mount as its "install"."""

    name = "gold-or-nothing"

    def __init__(self, mount_dir: str, gold: Mapping[str, str], delay_s: Mapping[str, float] | None = None) -> None:
        self.mount_dir = mount_dir
        self.gold = dict(gold)
        self.delay_s = dict(delay_s or {})

    def mount(self) -> Mount:
        return Mount(Path(self.mount_dir), "/opt/swe_grpo/gold-or-nothing")

    def launch(self, workdir: str, endpoint: RolloutEndpoint, problem_statement: str, config: AgentConfig) -> Launch:
        gold = self.gold.get(problem_statement)
        return Launch(
            argv=["python3", "-c", SCRIPT, str(self.delay_s.get(problem_statement, 0.0)), _PATCH],
            env={"OPENAI_BASE_URL": endpoint.base_url, "OPENAI_MODEL": endpoint.model},
            files={_PATCH: gold.encode()} if gold is not None else {},
            secret_env="OPENAI_API_KEY",
        )
