"""A FAKE agent for the held-out eval tests (tests/test_heldout_eval.py), in a module of its own so that it
pickles by name into a rollout host (a spawned process) without importing a test module there.

`GoldOrNothing` makes one real model request through its rollout's endpoint (the real InterceptionServer,
answered by the real vLLM), so each attempt is served at its rollout's sampling and recorded with the policy
version that served it; then, on the tasks it is given the gold patch of, it applies that patch, and on the
others it leaves the repository as it is. Grading is the real thing: gold attempts resolve, the others do
not. It needs no model that can write code, which is why it stands in for Pi here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import aiohttp

from swe_grpo.agents.base import AgentConfig, AgentResult
from swe_grpo.sandbox.base import Mount, Sandbox
from swe_grpo.sandbox.door import Door
from swe_grpo.types import RolloutEndpoint


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

    async def run(
        self,
        sandbox: Sandbox,
        endpoint: RolloutEndpoint,
        problem_statement: str,
        config: AgentConfig,
        last_activity: Callable[[], float],
        door: Door | None = None,
    ) -> AgentResult:
        assert door is None, "run it with WorkerConfig(door=False): it calls its endpoint from the host"
        start = time.monotonic()
        body = {"model": endpoint.model, "messages": [{"role": "user", "content": problem_statement}], "max_tokens": 4}
        headers = {"Authorization": f"Bearer {endpoint.token}"}
        url = f"{endpoint.base_url}/chat/completions"
        async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=headers) as reply:
            assert reply.status == 200, await reply.text()
        await asyncio.sleep(self.delay_s.get(problem_statement, 0.0))
        if problem_statement in self.gold:
            await sandbox.put_file("/tmp/gold.patch", self.gold[problem_statement].encode())
            applied = await sandbox.exec("git apply /tmp/gold.patch", timeout_s=60, cwd=sandbox.workdir)
            assert applied.exit_code == 0, applied
        return AgentResult(0, False, False, time.monotonic() - start, "", "")
