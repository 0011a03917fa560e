"""The vLLM server command for the Space, derived from the training config so the two cannot disagree.

    python space_app/vllm_command.py CONFIG.yaml     # prints the arguments after `python -m vllm...main`, one a line

What the printed command guarantees, for `examples/train.py --config CONFIG.yaml`:
- it serves the config's `model_name_or_path` (at `model_revision`) under the name the rollout worker asks for
  (`served_model_name`, else the model path), in the precision the trainer computes in: bfloat16 under
  `bf16`, float16 under `fp16`, else `dtype` (a mismatch biases the importance ratio);
- it samples and scores as the trainer does: log-probs after temperature (`--logprobs-mode
  processed_logprobs`), and no sampling defaults taken from the model's generation_config.json
  (`--generation-config vllm`: Qwen3's top_k 20 / top_p 0.95 would sample from a distribution the trainer
  does not score);
- both weight-sync paths are open: the NCCL weight-transfer engine (full weights), and with `use_peft: true`
  runtime LoRA adapters up to `lora_r`, `max_staleness + 2` resident (requests may still name
  `max_staleness + 1` versions, and a sync loads the next before unloading the oldest);
- it binds 127.0.0.1 only: with `VLLM_SERVER_DEV_MODE=1` (set by start.sh) it exposes admin routes.

A key absent from the config takes TRL's default (`TRL_DEFAULTS`, checked against TRL's dataclasses by
tests/test_space_app.py: importing TRL, and with it torch and vLLM, would add seconds to a minute to every start).
Environment: `VLLM_PORT` (default 8000), `VLLM_MAX_MODEL_LEN` and `VLLM_GPU_MEMORY_UTILIZATION` (vLLM's
defaults when unset).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import yaml

#: Defaults of the keys read here, from TRL's `ModelConfig` and `AsyncGRPOConfig` (trl 1.16).
TRL_DEFAULTS: Mapping[str, Any] = {
    "model_revision": "main",
    "dtype": "float32",
    "bf16": None,
    "fp16": False,
    "use_peft": False,
    "lora_r": 16,
    "max_staleness": 4,
}


def vllm_arguments(config: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """The `vllm serve` arguments (from `serve` on) for a training `config` (a parsed YAML mapping)."""

    def get(key: str) -> Any:
        return config[key] if config.get(key) is not None else TRL_DEFAULTS.get(key)

    model = get("model_name_or_path")
    if not model:
        raise ValueError("the config names no model_name_or_path")
    args = [
        "serve", str(model),
        "--served-model-name", str(get("served_model_name") or model),
        "--host", "127.0.0.1",
        "--port", env.get("VLLM_PORT", "8000"),
        "--dtype", "bfloat16" if get("bf16") else "float16" if get("fp16") else str(get("dtype")),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--weight-transfer-config", json.dumps({"backend": "nccl"}),
        # Every intercepted turn is a request: the access log would drown the Space's log.
        "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if (revision := get("model_revision")) not in (None, "main"):
        args += ["--revision", str(revision)]
    if get("use_peft"):
        args += [
            "--enable-lora",
            "--max-lora-rank",
            str(get("lora_r")),
            "--max-loras",
            str(int(get("max_staleness")) + 2),
        ]
    if max_len := env.get("VLLM_MAX_MODEL_LEN"):
        args += ["--max-model-len", max_len]
    if utilization := env.get("VLLM_GPU_MEMORY_UTILIZATION"):
        args += ["--gpu-memory-utilization", utilization]
    return args


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        config = yaml.safe_load(f)
    if not isinstance(config, dict):
        raise SystemExit(f"{argv[0]} must hold a YAML mapping")
    print("\n".join(vllm_arguments(config, os.environ)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
