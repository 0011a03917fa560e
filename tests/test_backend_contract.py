"""The sandbox backend contract users run on their own backend (`swe_grpo.testing.backend_contract`), run on
each built-in one: `local` (bubblewrap, the real thing; needs root), `docker` (a real engine, see `docker_env`:
one already running, else a private dockerd started once for the session; under `CI=true` a missing engine
FAILS these tests, elsewhere they skip with the reason) and `hf` (over `FakeHubSandbox`, a FAKE of
`huggingface_hub.Sandbox` that runs commands for real under bubblewrap: nothing talks to Hugging Face; its
backends accept that sandboxes asked for no network keep HF's, `accept_network=True`, as the contract asks
for such sandboxes).

What this file holds is each backend's `Target`: the facts the contract needs (the sandbox user's uid, how a
put through a symlink ends, what it cannot do) and how "nothing left" is checked, against each backend's own
traces (`local`: directories, mounts and cgroups; `docker`: this process's containers, and images; `hf`: the
fake sandboxes, killed and removed). A test a fact rules out skips, naming the fact. What is one backend's own
(bwrap and cgroups, container labels and images, the HF API's shapes) is in tests/test_sandbox_<backend>.py."""

from __future__ import annotations

from typing import Any

import docker.errors
import pytest
from sandbox_helpers import (
    FakeHubSandbox,
    assert_fake_hub_sandbox_gone,
    hf_backend,  # noqa: F401  (fixture)
    local_target,
    our_containers,
)

from swe_grpo.sandbox.base import Sandbox, SandboxBackend
from swe_grpo.sandbox.docker import DockerBackend, DockerLimits
from swe_grpo.sandbox.hf import HFBackend
from swe_grpo.testing.backend_contract import BackendContract, Target

BACKENDS = ["local", "docker", "hf"]


def _local(request: pytest.FixtureRequest) -> Target:
    return local_target(request.getfixturevalue("local_backend"), request.getfixturevalue("run_dir"))


def _docker(request: pytest.FixtureRequest) -> Target:
    backend: DockerBackend = request.getfixturevalue("docker_backend")
    docker_url: str = request.getfixturevalue("docker_url")
    client = backend.client

    def gone(sandbox: Sandbox) -> None:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(sandbox.id)
        assert sandbox not in backend.live

    def alive(sandbox: Sandbox) -> bool:
        return client.containers.get(sandbox.id).status == "running"

    def leftovers() -> Any:
        return our_containers(client), {i.id for i in client.images.list()}, set(backend.live)

    def new_backend(output_bytes: int | None) -> SandboxBackend:
        limits = DockerLimits() if output_bytes is None else DockerLimits(output_bytes=output_bytes)
        return DockerBackend(base_url=docker_url, limits=limits)

    return Target(
        name="docker",
        backend=backend,
        uid=None,  # each container runs as a uid leased for it
        host_uids=backend.uid_pool.uids if backend.uid_pool else None,
        put_through_symlink_refused=False,  # it resolves inside the container
        has_curl=False,
        exec_may_raise_on_destroy=True,  # racing the removal of its sandbox
        gone=gone,
        alive=alive,
        leftovers=leftovers,
        new_backend=new_backend,
    )


def _hf(request: pytest.FixtureRequest) -> Target:
    backend: HFBackend = request.getfixturevalue("hf_backend")

    def gone(sandbox: Sandbox) -> None:
        box = FakeHubSandbox.by_id(sandbox.id)
        assert_fake_hub_sandbox_gone(box)
        assert box.kills == 1  # destroyed once, however often `destroy` was called
        assert sandbox not in backend.live

    def alive(sandbox: Sandbox) -> bool:
        box = FakeHubSandbox.by_id(sandbox.id)
        return box.kills == 0 and box.root.exists()

    def leftovers() -> Any:
        return {box.id for box in FakeHubSandbox.created if box.kills == 0 or box.root.exists()}, set(backend.live)

    def new_backend(output_bytes: int | None) -> SandboxBackend:
        options = {} if output_bytes is None else {"output_bytes": output_bytes}
        return HFBackend(create_sandbox=FakeHubSandbox.create, accept_network=True, **options)

    return Target(
        name="hf",
        backend=backend,
        uid=0,
        put_through_symlink_refused=True,  # its file API refuses symlinks
        has_curl=False,
        exec_may_raise_on_destroy=True,  # racing the removal of its sandbox
        gone=gone,
        alive=alive,
        leftovers=leftovers,
        new_backend=new_backend,
        writable_mounts=False,  # read-only mounts are uploaded copies, writable ones refused
        cuts_network=False,  # HF sandboxes keep HF's network (the backend accepts it: accept_network=True)
        reaches_host_loopback=False,  # HF's network is not this host's (the fake's is: no route to check)
    )


class TestBuiltinBackends(BackendContract):
    """The contract users run on their own backend (`swe_grpo.testing.backend_contract`), on each built-in one."""

    @pytest.fixture(scope="class", params=BACKENDS)
    @classmethod
    def target(cls, request: pytest.FixtureRequest) -> Target:
        """The backend under test (one per backend, started once)."""
        return {"local": _local, "docker": _docker, "hf": _hf}[request.param](request)


def test_the_kit_shows_the_values_of_a_failed_assert() -> None:
    """Under pytest the kit's asserts are rewritten as a test module's are (swe_grpo/testing/__init__.py), so a
    user whose backend breaks the contract sees the values, not a bare AssertionError."""
    from swe_grpo.testing import backend_contract

    assert "@py_builtins" in vars(backend_contract)
