"""The `hf` backend's own behaviour against `FakeHubSandbox` (tests/sandbox_helpers.py), a FAKE of
`huggingface_hub.Sandbox`: nothing here talks to Hugging Face. The fake runs commands for real
(bubblewrap, root) so that the backend's own shell work (bundle clone, /testbed checks, tree kill, diff)
is exercised; what it does not exercise is listed in `swe_grpo/sandbox/hf.py`. What every backend
promises (exec, files, diff, timeouts, destroy, ...) is tests/test_backend_contract.py's, which runs on
`hf` over the same fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest
from sandbox_helpers import (
    CALC,
    FakeHubSandbox,
    assert_fake_hub_sandbox_gone,
    calc_task,
    hf_backend,  # noqa: F401  (fixture: `backend`)
    host_pids,
    make_repo,
    marker,
)

from swe_grpo.sandbox import hf
from swe_grpo.sandbox.base import Mount, SandboxError
from swe_grpo.sandbox.hf import DEFAULT_IMAGE, LABEL, HFBackend, HFSandbox
from swe_grpo.tasks import Task, swe_gym_image


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_repo(tmp_path_factory.mktemp("origin"))


@pytest.fixture(scope="module")
def task(repo: Path) -> Task:
    return calc_task(repo)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> HFBackend:
    """The module's `hf_backend` (tests/sandbox_helpers.py), over the fake."""
    return request.getfixturevalue("hf_backend")


@pytest.fixture
async def sandbox(backend: HFBackend, task: Task) -> AsyncIterator[HFSandbox]:
    sandbox = await backend.create(task)
    box = FakeHubSandbox.created[-1]
    try:
        yield sandbox
    finally:
        await sandbox.destroy()
    assert_fake_hub_sandbox_gone(box)


async def run_ok(sandbox: HFSandbox, command: str | list[str], **kwargs: object) -> str:
    result = await sandbox.exec(command, timeout_s=30, **kwargs)  # type: ignore[arg-type]
    assert result.exit_code == 0, result
    return result.stdout


async def test_created_with_its_options_from_a_bundle_that_is_then_removed(sandbox: HFSandbox) -> None:
    """(The repository at the base commit, without the future: tests/test_backend_contract.py.)"""
    box = FakeHubSandbox.created[-1]
    assert (box.image, box.options["flavor"], box.options["idle_timeout"]) == (DEFAULT_IMAGE, "cpu-upgrade", "5m")
    assert box.options["labels"] == {LABEL: "1"}
    assert await run_ok(sandbox, "cat calc.py; ls /tmp") == CALC  # the uploaded bundle is gone


async def test_a_long_command_keeps_its_sandbox_alive(sandbox: HFSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf, "KEEPALIVE_S", 0.2)
    await run_ok(sandbox, "sleep 1.1")
    assert FakeHubSandbox.created[-1].keepalives >= 4


async def test_the_fake_like_hf_spares_setsid_children_on_timeout() -> None:
    """The reason for the backend's own tree kill: the server's timeout reaches the process group only."""
    box = FakeHubSandbox.create("any")
    m = marker()
    try:
        result = box.run(f"setsid sleep {m} & sleep 100", timeout=1, check=False)
        assert result.timed_out
        assert host_pids(f"sleep\0{m}") != []
    finally:
        box.kill()
    assert_fake_hub_sandbox_gone(box)


async def test_a_missing_file_is_the_apis_404(sandbox: HFSandbox) -> None:
    """(Putting and getting files: tests/test_backend_contract.py.)"""
    with pytest.raises(SandboxError, match="404"):
        await sandbox.get_file("/testbed/missing.txt")


async def test_read_only_mounts_are_uploaded_writable_ones_refused(
    backend: HFBackend, task: Task, tmp_path: Path
) -> None:
    (tmp_path / "agent" / "bin").mkdir(parents=True)
    (tmp_path / "agent" / "bin" / "pi").write_text("#!/bin/sh\necho pi\n")
    (tmp_path / "agent" / "bin" / "pi").chmod(0o755)
    sandbox = await backend.create(task, [Mount(tmp_path / "agent", "/opt/agent")])
    try:
        assert await run_ok(sandbox, "/opt/agent/bin/pi; ls /tmp") == "pi\n"
    finally:
        await sandbox.destroy()
    before = len(FakeHubSandbox.created)
    with pytest.raises(SandboxError, match="writable"):
        await backend.create(task, [Mount(tmp_path, "/opt/out", writable=True)])
    assert len(FakeHubSandbox.created) == before


async def test_a_swe_gym_image_without_the_repository_is_refused_and_killed(backend: HFBackend, task: Task) -> None:
    """(An unknown base commit: tests/test_backend_contract.py.)"""
    before = len(FakeHubSandbox.created)
    with pytest.raises(SandboxError, match="no git repository at /testbed"):  # the (fake) SWE-Gym image is empty
        await backend.create(replace(task, repo="owner/name"))
    for box in FakeHubSandbox.created[before:]:
        assert_fake_hub_sandbox_gone(box)
    assert FakeHubSandbox.created[-1].image == swe_gym_image(task.instance_id)
    assert backend.live == set()


async def test_no_network_is_refused_unless_the_backend_accepts_hfs_network(task: Task) -> None:
    """HF sandboxes cannot cut their network: a sandbox asked for none (grading's) is refused, before any is
    made, naming the opt-in; with `accept_network=True` it is made (and keeps HF's network)."""
    refusing = HFBackend(create_sandbox=FakeHubSandbox.create)
    before = len(FakeHubSandbox.created)
    for network in ({}, {"network": False}):
        with pytest.raises(SandboxError, match=r"cannot cut a sandbox's network.*accept_network=True"):
            await refusing.create(task, **network)
    assert len(FakeHubSandbox.created) == before
    await (await refusing.create(task, network=True)).destroy()  # asked for the network: no refusal
    accepting = HFBackend(create_sandbox=FakeHubSandbox.create, accept_network=True)
    sandbox = await accepting.create(task, network=False)
    try:
        assert (await sandbox.exec("true", timeout_s=30)).exit_code == 0
    finally:
        await sandbox.destroy()
    await refusing.close()
    await accepting.close()


def test_the_command_lines_opt_in_builds_an_accepting_hf_backend() -> None:
    """`--hf-accept-network` on `rollout`, `eval` and `grade` gives the options they build their backend with;
    asked with another backend it is refused, naming it."""
    from swe_grpo.cli import parse_args
    from swe_grpo.sandbox import hf_network_options, make_backend

    commands = {
        "rollout": ["--tasks", "demo", "--vllm-url", "http://x", "--model", "m"],
        "eval": ["--tasks", "demo", "--vllm-url", "http://x", "--model", "m", "--out", "o"],
        "grade": ["--tasks", "demo", "--predictions", "p.jsonl", "--output", "o.jsonl"],
    }
    for command, required in commands.items():
        args = parse_args([command, *required, "--sandbox", "hf", "--hf-accept-network"])
        backend = make_backend(args.sandbox, **hf_network_options(args.sandbox, args.hf_accept_network))
        assert isinstance(backend, HFBackend) and backend.accept_network, command
        assert parse_args([command, *required, "--sandbox", "hf"]).hf_accept_network is False
    assert hf_network_options("hf", False) == {}
    with pytest.raises(ValueError, match="accepting HF's network is an option of sandbox hf, not of 'docker'"):
        hf_network_options("docker", True)


def test_the_worker_builds_hf_with_its_sandbox_options(task: Task) -> None:
    """`WorkerConfig.sandbox_options` reach the backend the engine builds by name (in each rollout host)."""
    from conftest import tiny_tokenizer

    from swe_grpo.worker.config import WorkerConfig
    from swe_grpo.worker.engine import RolloutEngine

    def engine(config: WorkerConfig) -> RolloutEngine:
        return RolloutEngine(
            [task], tiny_tokenizer("qwen3"), vllm_url="http://x", model="m", outlet=None, sandbox="hf", config=config
        )  # type: ignore[arg-type]  (no outlet: nothing runs)

    accepting = engine(WorkerConfig(sandbox_options={"accept_network": True})).backend
    assert isinstance(accepting, HFBackend) and accepting.accept_network
    assert engine(WorkerConfig()).backend.accept_network is False  # type: ignore[attr-defined]
