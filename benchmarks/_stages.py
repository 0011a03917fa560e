"""Where a server's CPU goes, by stage of a request: the CPU time of each synchronous step of a turn, in the thread
that ran it (`time.thread_time`: a step waiting for a core on a loaded box is not charged, nor is another thread's
work), summed over a run. A stage nested in another (the tokenising inside `chain.prepare`) is counted in both.

`StageClock.install()` wraps the steps in this process (for a benchmark's server process, never in the library):
the training template's renders and tokenising, the chain's plan/prepare/reply check/commit, the reply's parse, the
`VLLMClient`'s request JSON and reply check, and the request body's JSON. What no stage names (aiohttp on both
sides, the event loop, SSE writes, the collector) is the process's CPU less the outermost stages.
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from typing import Any

# (module, owner ("" for a module's function), name, stage); outermost stages first, nested ones after.
_STEPS = [
    ("swe_grpo.tokens.chain", "TokenChain", "plan", "chain.plan (normalise, compare)"),
    ("swe_grpo.tokens.chain", "TokenChain", "prepare", "chain.prepare (render + tokenise the interstitial)"),
    ("swe_grpo.tokens.chain", "TokenChain", "reply_message", "chain.reply_message (render the reply)"),
    ("swe_grpo.tokens.chain", "TokenChain", "commit", "chain.commit"),
    ("swe_grpo.tokens.responses", "ResponseParser", "parse", "parse the reply"),
    ("swe_grpo.serving.openai_wire", "orjson", "loads", "request body JSON"),
    ("swe_grpo.serving.vllm_client", "", "ids_json", "client: prompt ids to JSON"),
    ("swe_grpo.serving.vllm_client", "VLLMClient", "_generation", "client: reply JSON, echo check"),
    ("swe_grpo.tokens.template", "TrainingTemplate", "render", "  of which: template render (jinja)"),
    ("swe_grpo.tokens.template", "TrainingTemplate", "encode", "  of which: tokenise"),
]
OUTERMOST = [stage for *_, stage in _STEPS if not stage.startswith(" ")]


class StageClock:
    """CPU seconds and calls per stage, summed since `install` (see the module docstring)."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {stage: 0.0 for *_, stage in _STEPS}
        self.calls: dict[str, int] = dict.fromkeys(self.cpu_s, 0)

    def install(self) -> StageClock:
        import importlib

        for module_name, owner_name, name, stage in _STEPS:
            module = importlib.import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            if owner_name and isinstance(owner, types.ModuleType):  # a library it imported: timed for it alone
                owner = _Proxy(owner)
                setattr(module, owner_name, owner)
            setattr(owner, name, self._timed(getattr(owner, name), stage))
        return self

    def reset(self) -> None:
        for stage in self.cpu_s:
            self.cpu_s[stage], self.calls[stage] = 0.0, 0

    def _timed(self, step: Callable[..., Any], stage: str) -> Callable[..., Any]:
        cpu_s, calls = self.cpu_s, self.calls

        @functools.wraps(step)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.thread_time()
            try:
                return step(*args, **kwargs)
            finally:
                cpu_s[stage] += time.thread_time() - started
                calls[stage] += 1

        return timed


class _Proxy:
    """A module as one importer sees it, with attributes of its own set over it."""

    def __init__(self, module: types.ModuleType):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)
