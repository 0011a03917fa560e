"""Supervised fine-tuning of the tiny model on the episodes: `completion_loss` forwards the prefix all
prompts share once, each task's remainder once, and only the two turns once per episode, each level
reusing the key/value cache of the level before."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swe_grpo.demo.warm_start.build import Episode, EpisodeBuilder

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStartSpec:
    """How to fine-tune. Every field is part of the cache key."""

    steps: int = 250  # past where the loss flattens, so that nearly every sampled first turn is a valid call
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    final_lr_fraction: float = 0.05  # cosine decay from the peak down to this fraction of it
    max_grad_norm: float = 1.0
    seed: int = 0  # of the evaluation's sampling (fine-tuning itself draws nothing)
    # The build refuses a policy below these rates, evaluated at temperature 1 after fine-tuning. They
    # guard against a broken build: below what a good build reaches, with room for sampling noise.
    eval_samples: int = 48  # per task
    min_valid_rate: float = 0.97
    min_closed_rate: float = 0.97


def _common_prefix_len(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    for i, token in enumerate(first):
        if any(len(s) <= i or s[i] != token for s in sequences[1:]):
            return i
    return len(first)


def prefix_cache(model: Any, prefix: list[int], copies: int) -> Any:
    """The key/value cache of `prefix` (forwarded once, gradients kept), repeated for `copies` rows."""
    import torch

    cache = model.model(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
    cache.batch_repeat_interleave(copies)
    return cache


def padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` right-padded with `pad` into one tensor, and the mask of the real entries."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        real[i, : len(row)] = 1
    return ids, real


def completion_loss(model: Any, episodes: Sequence[Episode], pad_token_id: int) -> torch.Tensor:
    """Mean cross-entropy of every completion token (both turns) of `episodes` under `model`, a Hugging
    Face Qwen-style causal LM (`.model`, `.lm_head`). Equal to forwarding each episode on its own, but
    cheap: the prefix all prompts share is forwarded once, each distinct prompt's remainder once, and
    only the turns after it once per episode, each level reusing the key/value cache of the one before."""
    import torch
    import torch.nn.functional as F

    prompts = list(dict.fromkeys(tuple(e.prompt_ids) for e in episodes))
    # The last prompt token goes with the turns: then every trained token is predicted from that level.
    shared = min(_common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
    cache = prefix_cache(model, list(prompts[0][:shared]), len(prompts))
    # Each distinct prompt's remainder, right-padded; the padding stays in the cache, masked out.
    rests, rests_real = padded([p[shared:-1] for p in prompts], pad_token_id)
    if rests.shape[1]:
        positions = shared + torch.arange(rests.shape[1]).expand(len(prompts), -1)
        mask = torch.cat([torch.ones(len(prompts), shared, dtype=torch.long), rests_real], dim=1)
        model.model(input_ids=rests, past_key_values=cache, position_ids=positions, attention_mask=mask)
    rows = [prompts.index(tuple(e.prompt_ids)) for e in episodes]
    cache.batch_select_indices(torch.tensor(rows))
    turns, turns_real = padded([e.input_ids[len(e.prompt_ids) - 1 :] for e in episodes], pad_token_id)
    trained, _ = padded([e.completion_mask[len(e.prompt_ids) - 1 :] for e in episodes], 0)
    starts = torch.tensor([len(e.prompt_ids) - 1 for e in episodes])
    positions = starts[:, None] + torch.arange(turns.shape[1])
    mask = torch.cat([torch.ones(len(episodes), shared, dtype=torch.long), rests_real[rows], turns_real], dim=1)
    hidden = model.model(input_ids=turns, past_key_values=cache, position_ids=positions, attention_mask=mask)
    predicts = trained[:, 1:].bool()
    logits = model.lm_head(hidden.last_hidden_state[:, :-1][predicts])
    return F.cross_entropy(logits.float(), turns[:, 1:][predicts])


Progress = Callable[[int, int, str], None]
"""`progress(done, total, detail)`: how far a build is, in steps (fine-tuning steps, then one per evaluated task)."""


def fine_tune(
    model: Any, builder: EpisodeBuilder, spec: WarmStartSpec, pad_token_id: int, progress: Progress
) -> list[float]:
    """Fine-tune `model` in place; returns the loss of every step."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_factor(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return spec.final_lr_fraction + (1 - spec.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    total = spec.steps + len(builder.instance_ids)
    model.train()
    losses = []
    for step in range(spec.steps):
        loss = completion_loss(model, builder.episodes, pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        progress(step + 1, total, f"fine-tuning, loss {losses[-1]:.3f}")
        if step % 50 == 0 or step == spec.steps - 1:
            log.info("warm start: step %d/%d loss %.4f", step + 1, spec.steps, losses[-1])
    model.eval()
    return losses
