"""Sandbox backends; `make_backend(name)` picks one by name (`local`, `docker`, `hf`)."""

from __future__ import annotations

from typing import Any

from swe_grpo.sandbox.base import ExecResult, Mount, Sandbox, SandboxBackend, SandboxError

BACKENDS = ("local", "docker", "hf")


def make_backend(name: str, **options: Any) -> SandboxBackend:
    """A backend by name; `options` go to its constructor. Imports only the backend asked for."""
    if name == "local":
        from swe_grpo.sandbox.local import LocalBackend

        return LocalBackend(**options)
    if name == "docker":
        from swe_grpo.sandbox.docker import DockerBackend

        return DockerBackend(**options)
    if name == "hf":
        from swe_grpo.sandbox.hf import HFBackend

        return HFBackend(**options)
    raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "ExecResult", "Mount", "Sandbox", "SandboxBackend", "SandboxError", "make_backend"]
