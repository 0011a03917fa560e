"""Sandbox backends behind one interface (`base.SandboxBackend`, `base.Sandbox`).

`make_backend(name, **options)` builds one: a name of `BACKENDS` (`local`, `docker`, `hf`), or a backend
class of one's own as a dotted path (`mypkg.mod:MyBackend`, a subclass of `SandboxBackend`):

    backend = make_backend("docker", network="bridge")
    backend = make_backend("mypkg.sandboxes:MyBackend", region="eu")

Only the backend asked for is imported.
"""

from __future__ import annotations

from typing import Any

from swe_grpo.plugins import load_choice
from swe_grpo.sandbox.base import ExecResult, Mount, Sandbox, SandboxBackend, SandboxError

#: The built-in backends: name -> "module:Class".
BACKENDS = {
    "local": "swe_grpo.sandbox.local:LocalBackend",
    "docker": "swe_grpo.sandbox.docker:DockerBackend",
    "hf": "swe_grpo.sandbox.hf:HFBackend",
}


def make_backend(name: str, **options: Any) -> SandboxBackend:
    """The backend `name` (one of `BACKENDS`, or "package.module:Class"), built with `options`. Raises
    `ValueError` naming the problem for an unknown name or a path that does not lead to a `SandboxBackend`
    subclass (`swe_grpo.plugins.load_object`)."""
    backend: SandboxBackend = load_choice(name, BACKENDS, "sandbox backend", base=SandboxBackend)(**options)
    return backend


__all__ = ["BACKENDS", "ExecResult", "Mount", "Sandbox", "SandboxBackend", "SandboxError", "make_backend"]
