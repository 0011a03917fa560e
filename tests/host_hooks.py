"""Faults and probes that must act inside a rollout host: a host is a spawned process, which a test's
monkeypatch does not reach. Each is given to `SWERolloutWorker(host_setup=...)` (a module-level function,
or a `functools.partial` of one, so that it pickles by name) and runs in the host before its engine
starts. They patch the host's process for good: use them with rollout hosts only."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson

from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient
from swe_grpo.worker.engine import RolloutEngine
from swe_grpo.worker.groups import GroupAssembler


def break_group_assembly() -> None:
    """A defect in the worker's own code: assembling any group raises."""

    def broken(self: GroupAssembler, *args: Any) -> Any:
        raise ValueError("injected fault in group assembly")

    GroupAssembler.assemble = broken  # type: ignore[method-assign]


def block_launches() -> None:
    """A defect that blocks launching without marking progress."""

    async def stuck(self: RolloutEngine) -> None:
        await asyncio.Event().wait()

    RolloutEngine._wait_for_trainer = stuck  # type: ignore[method-assign]


def record_vllm_requests(path: str) -> None:
    """Append every request body the host sends to vLLM to `path`, one JSON object a line."""
    request_body = VLLMClient.request_body

    def spy(self: VLLMClient, prompt: Any, params: SamplingParams, model: str | None, max_tokens: int):
        body = request_body(self, prompt, params, model, max_tokens)
        with open(path, "a") as f:
            f.write(orjson.dumps(body).decode() + "\n")  # orjson: the prompt is an orjson.Fragment
        return body

    VLLMClient.request_body = spy  # type: ignore[method-assign]


def recorded_vllm_requests(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def fail_to_start() -> None:
    """A host that cannot start, for a reason with a cause of its own."""
    try:
        {}["missing"]
    except KeyError as e:
        raise ValueError("injected: the host cannot start") from e


def refuse_training_imports() -> None:
    """A host must not have loaded torch or any of TRL by now (its spec unpickled, its entry module imported):
    fail its start, naming what was loaded."""
    import sys

    loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("torch", "trl"))
    if loaded:
        raise ImportError(f"a rollout host loaded {len(loaded)} training modules: {loaded[:10]}")


def exit_leaving_a_process_behind(pid_file: str) -> None:
    """A host that dies while starting, after starting a process that inherits its descriptors (its pipes to
    the trainer among them), as a setup that launches a helper without closing them would. The helper's pid
    goes to `pid_file`; it sleeps until killed."""
    import os
    import signal

    helper = os.fork()
    if helper == 0:
        try:
            while True:
                signal.pause()
        finally:  # never back into the host's code
            os._exit(0)
    with open(pid_file, "w") as f:
        f.write(str(helper))
    os._exit(3)
