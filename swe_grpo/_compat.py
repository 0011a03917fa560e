"""Module paths from before the package layout of 0.2, and those that moved within 0.2, keep working until 0.3,
with a DeprecationWarning.

`swe_grpo.chain` is now `swe_grpo.tokens.chain`, `swe_grpo.serving.door` is `swe_grpo.sandbox.door`, and so on
(`MOVED`). Importing an old path returns the new module itself, so a name patched through either path is
patched for both.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

MOVED = {
    "swe_grpo.chain": "swe_grpo.tokens.chain",
    "swe_grpo.responses": "swe_grpo.tokens.responses",
    "swe_grpo.interception": "swe_grpo.serving.interception",
    "swe_grpo.openai_wire": "swe_grpo.serving.openai_wire",
    "swe_grpo.serving_limits": "swe_grpo.serving.limits",
    "swe_grpo.vllm_client": "swe_grpo.serving.vllm_client",
    "swe_grpo.door": "swe_grpo.sandbox.door",
    "swe_grpo.serving.door": "swe_grpo.sandbox.door",  # moved beside the sandbox after 0.2.0
    "swe_grpo.rollout_hosts": "swe_grpo.worker.hosts",
    "swe_grpo.ray_hosts": "swe_grpo.worker.ray_hosts",
    "swe_grpo.groups": "swe_grpo.worker.groups",
    "swe_grpo.group_queue": "swe_grpo.worker.group_queue",
    "swe_grpo.task_sampling": "swe_grpo.worker.task_sampling",
    "swe_grpo.worker_config": "swe_grpo.worker.config",
    "swe_grpo.cpu": "swe_grpo.extras.cpu",
    "swe_grpo.vllm_server": "swe_grpo.extras.vllm_server",
    "swe_grpo.tiny_model": "swe_grpo.extras.tiny_model",
    "swe_grpo.sandbox._common": "swe_grpo.sandbox.process",
    # back beside the backends after 0.2.0: `local` and `docker` sandboxes and the grader share it
    "swe_grpo.sandbox.local.seccomp": "swe_grpo.sandbox.seccomp",
}
# Names that left a module which stayed: {old module: {name: new module}}.
_PI_CAPTURE = ("CapturedRequests", "PiRun", "ScriptedGenerator", "capture_pi_run", "completion_ids", "recording_hop")
MOVED_NAMES = {
    "swe_grpo.tasks": {name: "swe_grpo.demo.tasks" for name in ("demo_tasks", "demo_tasks_path")},
    "swe_grpo.demo.warm_start": {name: "swe_grpo.testing.pi_capture" for name in _PI_CAPTURE},
}
# Of those, the modules of the data path: `install` gives them their `__getattr__` (the others write their own).
_GIVEN_BACK_HERE = ("swe_grpo.tasks",)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes in 0.3", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed under its new name


def moved_name(module: str, name: str) -> object:
    """For a module's `__getattr__`: a name that moved out of `module`, from its new home."""
    new = MOVED_NAMES.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} moved to {new}.{name}; the old path goes in 0.3", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(new), name)


def _getattr_of(module: str) -> Callable[[str], object]:
    def __getattr__(name: str) -> object:
        return moved_name(module, name)

    return __getattr__


def install() -> None:
    """Let the old module paths import, and the modules of the data path that lost names (`MOVED_NAMES`) give
    them (idempotent). Those modules import nothing by a string themselves (tests/test_layers.py): each is
    imported here and given a module `__getattr__`, so `swe_grpo` installs this before anyone can ask."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
    for module in _GIVEN_BACK_HERE:
        vars(importlib.import_module(module))["__getattr__"] = _getattr_of(module)
