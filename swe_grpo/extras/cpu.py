"""CPU fallbacks that let TRL's `AsyncGRPOTrainer` train without CUDA.

The trainer assumes a CUDA GPU in two places. Its tree-packed forward runs attention through an FA3 kernel
fetched from the Hub with `kernels` (`TREE_ATTENTION`, "tree_fa3"), and its MFU metric asks
`torch.cuda.get_device_name` for the device's peak FLOPs, which raises on a machine without CUDA.
This module supplies a pure-PyTorch tree attention and a device-aware peak-FLOPs lookup, and
`use_cpu_fallbacks()` installs both.

Guarantees once installed:
- The model's attention under `TREE_ATTENTION` is `tree_attention_cpu`: every packed token sees exactly the
  tokens its own sample saw (the prefix of its trie path, limited by any sliding window), so packed
  log-probabilities equal a per-sample forward. The `kernels` package is never imported, so nothing is
  downloaded.
- The trainer's peak-FLOPs lookup returns `None` off CUDA (the trainer then skips MFU), or the number in
  `SWE_GRPO_PEAK_FLOPS` when that is set.

Call `use_cpu_fallbacks()` once, before constructing `AsyncGRPOTrainer`. On a machine with CUDA it does
nothing, and TRL's kernel path is used unchanged.
"""

from __future__ import annotations

import math
import os
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface
from transformers.integrations.flash_attention import get_target_dtype
from trl.experimental.async_grpo import async_grpo_trainer, packing
from trl.trainer import utils as trl_utils

PEAK_FLOPS_ENV = "SWE_GRPO_PEAK_FLOPS"


def tree_attention_cpu(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int,
    tree_max_seqlen_k: int,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Tree attention in plain PyTorch, a drop-in for TRL's `packing.tree_attention` on any device.

    `query` is `(1, heads, N, head_dim)` and `key`/`value` are `(1, kv_heads, N, head_dim)` over the `N`
    packed tokens of one row (grouped-query attention: `heads` a multiple of `kv_heads`). Segment `s` holds
    the packed tokens `tree_cu_seqlens_q[s]:tree_cu_seqlens_q[s + 1]`; its root-to-segment path is
    `tree_kv_index[tree_cu_seqlens_k[s]:tree_cu_seqlens_k[s + 1]]`, whose last tokens are the segment itself.
    Each query attends causally to its path, aligned at the path's end, and with `sliding_window` only to
    the last `sliding_window` path positions up to and including its own. Scores are multiplied by
    `scaling` (default `head_dim ** -0.5`), then soft-capped when `softcap` is set.

    Returns `(output, None)` with `output` shaped `(1, N, heads, head_dim)` in the dtype the FA3 path
    computes in (`get_target_dtype`, else the query's), as transformers expects from an attention
    function. `attention_mask` is ignored (TRL registers no mask for tree attention), and so are the
    kernel-only `tree_max_seqlen_*` and the attention dropout, which TRL's kernel path does not apply either.
    """
    if query.size(0) != 1:
        raise ValueError(f"tree attention runs on one packed row, got a batch of {query.size(0)}")
    dtype = get_target_dtype(query, module) or query.dtype
    query, key, value = (x[0].to(dtype) for x in (query, key, value))
    heads_per_kv = query.size(0) // key.size(0)
    scaling = query.size(-1) ** -0.5 if scaling is None else scaling

    q_bounds, k_bounds = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    outputs = []
    for (q_start, q_end), (k_start, k_end) in zip(pairwise(q_bounds), pairwise(k_bounds), strict=True):
        path = tree_kv_index[k_start:k_end]
        segment_query = query[:, q_start:q_end]
        # Query head h reads key/value head h // heads_per_kv, as transformers' `repeat_kv` lays them out.
        # Repeated here rather than SDPA's `enable_gqa`, which is slower with the causal bias below.
        path_key = key[:, path].repeat_interleave(heads_per_kv, dim=0)
        path_value = value[:, path].repeat_interleave(heads_per_kv, dim=0)
        # The segment's tokens are the last ones on its path, so the causal diagonal is aligned to the path's end.
        path_len, seg_len = k_end - k_start, q_end - q_start
        if not (sliding_window or softcap):
            # No mask tensor: SDPA's fused CPU kernel takes a lower-right causal bias as is, a faster
            # forward+backward than with a boolean mask.
            outputs.append(
                F.scaled_dot_product_attention(
                    segment_query, path_key, path_value, attn_mask=causal_lower_right(seg_len, path_len), scale=scaling
                )
            )
            continue
        query_pos = torch.arange(path_len - seg_len, path_len, device=query.device).unsqueeze(1)
        key_pos = torch.arange(path_len, device=query.device).unsqueeze(0)
        visible = key_pos <= query_pos
        if sliding_window:
            visible &= query_pos - key_pos < sliding_window
        if softcap:  # not expressible in SDPA: scores, cap, softmax in float32 as transformers' eager attention
            scores = softcap * torch.tanh(segment_query @ path_key.transpose(1, 2) * scaling / softcap)
            probs = scores.float().masked_fill(~visible, -math.inf).softmax(dim=-1).to(dtype)
            outputs.append(probs @ path_value)
        else:
            outputs.append(
                F.scaled_dot_product_attention(segment_query, path_key, path_value, attn_mask=visible, scale=scaling)
            )

    output = torch.cat(outputs, dim=1).transpose(0, 1).contiguous()
    return output.unsqueeze(0), None


def register_cpu_tree_attention() -> None:
    """Register TRL's tree-attention hooks with `tree_attention_cpu` as the attention under `TREE_ATTENTION`.

    TRL's own registration is run first so the mask hook (no mask: the attention masks itself) stays TRL's.
    """
    packing.register_tree_attention()
    AttentionInterface.register(packing.TREE_ATTENTION, tree_attention_cpu)


def peak_flops_per_device(accelerator: Accelerator, dtype: str) -> float | None:
    """Peak FLOP/s of the training device, or `None` (the trainer then skips MFU), without requiring CUDA.

    `SWE_GRPO_PEAK_FLOPS` wins when set (it must be a positive finite number); otherwise CUDA devices get
    TRL's table lookup and any other device gets `None`.
    """
    override = os.environ.get(PEAK_FLOPS_ENV)
    if override:
        try:
            peak = float(override)
        except ValueError:
            peak = math.nan
        if not (math.isfinite(peak) and peak > 0):
            raise ValueError(f"{PEAK_FLOPS_ENV} must be a positive number of FLOP/s, got {override!r}")
        return peak
    if accelerator.device.type == "cuda":
        return trl_utils.get_peak_flops_per_device(accelerator, dtype)
    return None


def use_cpu_fallbacks() -> bool:
    """Make `AsyncGRPOTrainer` usable without CUDA; call before constructing the trainer.

    Returns `False` and changes nothing when CUDA is available. Otherwise registers `tree_attention_cpu`
    under `TREE_ATTENTION` right away (for models built outside the trainer), points the trainer at it and at
    `peak_flops_per_device`, and returns `True`. Calling it again is harmless.
    """
    if torch.cuda.is_available():
        return False
    register_cpu_tree_attention()
    # The trainer module imported both names with `from ... import`, so replacing them where TRL defines them
    # would not reach it: they must be rebound on the trainer module itself. Rebinding `register_tree_attention`
    # matters because the trainer's `__init__` calls it and would otherwise put the FA3 kernel back.
    async_grpo_trainer.register_tree_attention = register_cpu_tree_attention
    async_grpo_trainer.get_peak_flops_per_device = peak_flops_per_device
    return True
