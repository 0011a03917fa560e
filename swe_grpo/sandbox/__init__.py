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


def hf_network_options(name: str, accept_network: bool) -> dict[str, Any]:
    """`make_backend(name, ...)`'s options for a command line's "hf sandboxes asked for no network keep HF's"
    (`--hf-accept-network`): `{"accept_network": True}` for `hf` (`HFBackend`), `{}` when not asked; asked
    for another backend, a `ValueError` naming it."""
    if not accept_network:
        return {}
    if name != "hf":
        raise ValueError(f"accepting HF's network is an option of sandbox hf, not of {name!r}")
    return {"accept_network": True}


__all__ = [
    "BACKENDS",
    "ExecResult",
    "Mount",
    "Sandbox",
    "SandboxBackend",
    "SandboxError",
    "hf_network_options",
    "make_backend",
]
