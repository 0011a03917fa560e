"""The CPU fallbacks for `AsyncGRPOTrainer`: tree-packed log-probs equal a per-sample forward, and the
trainer's peak-FLOPs lookup no longer needs CUDA.

The packed batch is built by TRL's own `TreeRow` and `DataCollatorForRollout` and fed to the model the way
the trainer's `compute_loss` does, so the attention under test is exactly what a CPU training step runs.
CUDA is reported absent in these tests, so they exercise the fallbacks on any machine.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, Gemma2Config, PretrainedConfig, Qwen3Config
from trl.experimental.async_grpo import async_grpo_trainer
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow
from trl.trainer import utils as trl_utils
from trl.trainer.utils import add_fused_lm_head

from swe_grpo.extras.cpu import PEAK_FLOPS_ENV, peak_flops_per_device, tree_attention_cpu, use_cpu_fallbacks

VOCAB = 64
SLIDING_WINDOW = 4  # well below the samples' lengths (up to 27 tokens), so the window cuts most paths
TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")

# Larger than the usual 0.02 so attention is far from uniform and a token seeing the wrong keys shows.
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "initializer_range": 0.2,
}
MIXED_LAYERS = ["sliding_attention", "full_attention"]
CONFIGS: dict[str, PretrainedConfig] = {
    "qwen3-full": Qwen3Config(**TINY),
    "qwen3-sliding": Qwen3Config(
        **TINY, use_sliding_window=True, sliding_window=SLIDING_WINDOW, layer_types=MIXED_LAYERS
    ),
    # Gemma2 adds attention softcapping and a non-default `scaling` on top of mixed sliding/full layers.
    "gemma2-softcap": Gemma2Config(
        **TINY,
        sliding_window=SLIDING_WINDOW,
        layer_types=MIXED_LAYERS,
        attn_logit_softcapping=2.0,
        query_pre_attn_scalar=16,
    ),
}


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CUDA reported absent; the trainer module's bindings and the attention registry restored afterwards."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("register_tree_attention", "get_peak_flops_per_device"):
        monkeypatch.setattr(async_grpo_trainer, name, getattr(async_grpo_trainer, name))
    yield
    monkeypatch.undo()
    # Leave the registry as the restored trainer module would set it up, so test order does not matter.
    async_grpo_trainer.register_tree_attention()


def make_sample(parts: list[tuple[list[int], bool]], group_id: int) -> dict[str, Any]:
    """A rollout sample as the trainer queues it, from (tokens, trained) parts."""
    input_ids = [token for tokens, _ in parts for token in tokens]
    completion_mask = [int(trained) for tokens, trained in parts for _ in tokens]
    return {
        "input_ids": torch.tensor(input_ids),
        "completion_mask": torch.tensor(completion_mask),
        "old_log_probs": torch.zeros(len(input_ids)),
        "advantage": 1.0,
        "group_id": group_id,
        "metrics": {},
    }


def make_samples() -> list[dict[str, Any]]:
    """Samples covering every shape of sharing the trie produces.

    Group 0 shares a prompt; two of its multi-turn samples share a reply and a tool result and then fork;
    one sample is an exact duplicate. Group 1 shares nothing with group 0 (distinct first token), and one of
    its samples is a strict prefix of another.
    """
    generator = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=generator).tolist()

    prompt, reply, tool = [1, *tokens(9)], tokens(6), tokens(4)
    other_prompt, other_reply = [2, *tokens(5)], tokens(9)
    forked = [make_sample([(prompt, False), (reply, True), (tool, False), (tokens(n), True)], 0) for n in (5, 7)]
    return [
        make_sample([(prompt, False), (tokens(8), True)], 0),
        *forked,
        copy.deepcopy(forked[1]),
        make_sample([(other_prompt, False), (other_reply, True)], 1),
        make_sample([(other_prompt, False), (other_reply[:4], True)], 1),
    ]


def packed_log_probs(model: torch.nn.Module, samples: list[dict[str, Any]]) -> tuple[torch.Tensor, int]:
    """Log-probs of every trained token from one tree-packed forward, and the number of tokens forwarded.

    Packs with TRL's `TreeRow` and `DataCollatorForRollout`, then strips and feeds the batch exactly as
    `AsyncGRPOTrainer.compute_loss` does.
    """
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    batch = DataCollatorForRollout(pad_token_id=0)([[row]])

    keep = batch["attention_mask"].bool()
    tree_kwargs: dict[str, Any] = {key: batch[key][batch[key] >= 0] for key in TREE_KEYS}
    tree_kwargs["tree_max_seqlen_q"], tree_kwargs["tree_max_seqlen_k"] = batch["tree_max_seqlens"][0].tolist()
    outputs = model(
        input_ids=batch["input_ids"][keep].unsqueeze(0),
        position_ids=batch["position_ids"][keep].unsqueeze(0),
        shift_labels=batch["shift_labels"][keep].unsqueeze(0),
        fused_lm_head=True,
        **tree_kwargs,
    )
    token_index = batch["token_index"][batch["token_index"] >= 0]
    return outputs.log_probs.flatten()[token_index], int(keep.sum())


def unpacked_log_probs(model: torch.nn.Module, samples: list[dict[str, Any]]) -> torch.Tensor:
    """Log-probs of every trained token, one ordinary forward per sample, in the packer's order."""
    per_sample = []
    for sample in samples:
        input_ids = sample["input_ids"]
        log_probs = model(input_ids=input_ids.unsqueeze(0)).logits[0, :-1].log_softmax(dim=-1)
        log_probs = log_probs.gather(1, input_ids[1:, None]).squeeze(1)
        per_sample.append(log_probs[sample["completion_mask"][1:].bool()])
    return torch.cat(per_sample)


# float32 results computed in another order (one packed forward vs one per sample; and CPU kernels reduce in
# different orders, AVX-512 vs AVX2) differ by rounding that grows with the length of each sum and the size of
# its terms, not with the element's own value: an element that is a near-cancelling sum may be off by far more
# than eps times itself. So an element's tolerance is relative to its tensor's scale (its largest magnitude).
# Measured (2026-11, this 2-core Xeon): at worst 3.4e-7 of scale for log-probs and 1.6e-6 for gradients; the
# AVX-512 EPYC that failed the former per-element bound was off by 2.1e-5 on a gradient of scale ~31 (6.8e-7).
# A wrong mask is off by about 1 of scale (test_a_wrong_mask_fails_the_comparison).
LOG_PROB_TOL = 1e-5  # ~84 float32 eps of scale
GRAD_TOL = 1e-4  # gradients sum over every token and position: longer reductions


def mismatches(model_name: str) -> list[str]:
    """What differs beyond float32 rounding between a tree-packed forward+backward of the samples (with the
    attention registered under TREE_ATTENTION) and one eager forward+backward per sample: "log_probs"
    and the names of the parameters whose gradients differ."""
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(CONFIGS[model_name], attn_implementation="eager")
    packed_model = copy.deepcopy(reference)
    packed_model.set_attn_implementation(TREE_ATTENTION)
    add_fused_lm_head(packed_model)

    samples = make_samples()
    packed, forwarded = packed_log_probs(packed_model, samples)
    expected = unpacked_log_probs(reference, samples)
    # The trie really shared tokens, so positions, paths and the end-aligned mask were all exercised.
    assert forwarded < sum(len(sample["input_ids"]) for sample in samples)
    # Training needs the gradients to agree too, not only the forward.
    packed.sum().backward()
    expected.sum().backward()
    compared = [("log_probs", packed.detach(), expected.detach(), LOG_PROB_TOL)]
    for (name, packed_param), reference_param in zip(
        packed_model.named_parameters(), reference.parameters(), strict=True
    ):
        compared.append((name, packed_param.grad, reference_param.grad, GRAD_TOL))
    return [name for name, actual, wanted, tol in compared if not float32_close(actual, wanted, tol)]


def float32_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    """Every element within `tol` times the tensor's scale (its largest magnitude) of the expected one."""
    return torch.allclose(actual, expected, rtol=0.0, atol=tol * expected.abs().max().item())


def test_the_tolerance_is_float32_rounding_at_the_tensors_scale() -> None:
    """The AVX-512 EPYC's difference (2.1e-5 on a near-zero element of a gradient of scale ~31) is rounding
    and passes, where a per-element bound (rtol 1e-4, atol 1e-5) failed it; 0.1 % of the scale does not."""
    grad = torch.linspace(-31.0, 31.0, 4096).reshape(64, 64)
    grad[0, 0] = 1e-7  # a near-cancelling sum
    epyc = grad.clone()
    epyc[0, 0] += 2.1e-5
    assert float32_close(epyc, grad, GRAD_TOL)
    assert not torch.allclose(epyc, grad, rtol=1e-4, atol=1e-5)  # the former bound
    wrong = grad.clone()
    wrong[0, 0] += 1e-3 * 31.0
    assert not float32_close(wrong, grad, GRAD_TOL)


@pytest.fixture
def cpu_tree_attention(cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's attention set up as on a CPU box: `tree_attention_cpu` under TREE_ATTENTION."""
    assert use_cpu_fallbacks()
    async_grpo_trainer.register_tree_attention()  # what the trainer's __init__ does
    assert AttentionInterface()[TREE_ATTENTION] is tree_attention_cpu
    # Any attempt to load the FA3 kernel from the Hub now fails loudly instead of downloading.
    monkeypatch.setitem(sys.modules, "kernels", None)


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_packed_log_probs_and_grads_equal_per_sample_forward(config_name: str, cpu_tree_attention: None) -> None:
    assert mismatches(config_name) == []


def window_off_by_one(*args: Any, sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A classic masking bug: every query sees one key more than its sliding window allows."""
    return tree_attention_cpu(*args, sliding_window=sliding_window + 1 if sliding_window else None, **kwargs)


def window_everywhere(*args: Any, sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Another: the sliding window applied to full-attention layers too."""
    return tree_attention_cpu(*args, sliding_window=SLIDING_WINDOW, **kwargs)


@pytest.mark.parametrize(
    ("config_name", "wrong_attention"), [("qwen3-sliding", window_off_by_one), ("qwen3-full", window_everywhere)]
)
def test_a_wrong_mask_fails_the_comparison(config_name: str, wrong_attention: Any, cpu_tree_attention: None) -> None:
    """The tolerances above are loose enough for any CPU's float32 rounding, and still far too tight for a
    masking bug: the log-probs and the gradients both fail."""
    AttentionInterface.register(TREE_ATTENTION, wrong_attention)  # the cpu_only fixture restores the registry
    failed = mismatches(config_name)
    assert "log_probs" in failed
    assert len(failed) > len(dict(AutoModelForCausalLM.from_config(CONFIGS[config_name]).named_parameters())) // 2


def test_use_cpu_fallbacks_is_idempotent(cpu_only: None) -> None:
    assert use_cpu_fallbacks()
    installed = (async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device)
    assert use_cpu_fallbacks()
    assert (async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device) == installed
    async_grpo_trainer.register_tree_attention()
    assert AttentionInterface()[TREE_ATTENTION] is tree_attention_cpu


def test_use_cpu_fallbacks_leaves_cuda_machines_alone(cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = (async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device)
    assert not use_cpu_fallbacks()
    assert (async_grpo_trainer.register_tree_attention, async_grpo_trainer.get_peak_flops_per_device) == original


def test_trainer_peak_flops_lookup_is_cpu_safe(cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    use_cpu_fallbacks()
    on_cpu = SimpleNamespace(device=torch.device("cpu"))
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    assert async_grpo_trainer.get_peak_flops_per_device(on_cpu, "float32") is None

    monkeypatch.setenv(PEAK_FLOPS_ENV, "2.5e12")
    assert async_grpo_trainer.get_peak_flops_per_device(on_cpu, "float32") == 2.5e12

    for bad in ("fast", "0", "-1", "nan", "inf"):
        monkeypatch.setenv(PEAK_FLOPS_ENV, bad)
        with pytest.raises(ValueError, match=PEAK_FLOPS_ENV):
            async_grpo_trainer.get_peak_flops_per_device(on_cpu, "float32")


def test_peak_flops_delegates_to_trl_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEAK_FLOPS_ENV, raising=False)
    monkeypatch.setattr(trl_utils, "get_peak_flops_per_device", lambda accelerator, dtype: 9.9e14)
    assert peak_flops_per_device(SimpleNamespace(device=torch.device("cuda")), "bfloat16") == 9.9e14
