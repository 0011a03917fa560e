"""How a policy acts at temperature 1: `sample` draws completions as vLLM samples for a rollout, and
`evaluate_policy` counts, per task, the valid and resolving first turns and the closing second turns."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from swe_grpo.demo.warm_start.build import EpisodeBuilder, bash_command
from swe_grpo.demo.warm_start.data import CLOSING_TEXT
from swe_grpo.demo.warm_start.sft import prefix_cache

if TYPE_CHECKING:
    import torch


def sample(
    model: Any,
    prompt_ids: list[int],
    n: int,
    *,
    max_new_tokens: int,
    eos_token_id: int,
    generator: torch.Generator,
    temperature: float = 1.0,
) -> list[list[int]]:
    """`n` completions of `prompt_ids` sampled from `model` (a Hugging Face causal LM) at `temperature`
    with nothing else changing the distribution (no top-p/top-k), as vLLM samples for a rollout. Each
    ends at its first EOS token (included) or after `max_new_tokens`."""
    import torch

    with torch.no_grad():
        cache = prefix_cache(model, prompt_ids[:-1], n)
        last = torch.full((n, 1), prompt_ids[-1])
        outputs: list[list[int]] = [[] for _ in range(n)]
        open_rows = set(range(n))
        for step in range(max_new_tokens):
            position = torch.full((n, 1), len(prompt_ids) - 1 + step)
            hidden = model.model(input_ids=last, past_key_values=cache, position_ids=position).last_hidden_state
            probs = torch.softmax(model.lm_head(hidden[:, -1]).float() / temperature, dim=-1)
            last = torch.multinomial(probs, 1, generator=generator)
            for row in list(open_rows):
                token = int(last[row, 0])
                outputs[row].append(token)
                if token == eos_token_id:
                    open_rows.discard(row)
            if not open_rows:
                break
    return outputs


@dataclass(frozen=True)
class TaskStats:
    """How a policy acts on one task at temperature 1. `valid`: first turns that are exactly one of the
    task's candidate calls, ended by EOS; `correct`: those that are the resolving candidate; `closed`:
    second turns (after each candidate's tool result) that are exactly CLOSING_TEXT, ended by EOS."""

    instance_id: str
    samples: int
    valid: int
    correct: int
    closings: int
    closed: int

    @property
    def valid_rate(self) -> float:
        return self.valid / self.samples

    @property
    def correct_rate(self) -> float:
        return self.correct / self.samples

    @property
    def closed_rate(self) -> float:
        return self.closed / self.closings

    def summary(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "valid_rate": round(self.valid_rate, 4),
            "correct_rate": round(self.correct_rate, 4),
            "closed_rate": round(self.closed_rate, 4),
        }


def evaluate_policy(
    model: Any,
    builder: EpisodeBuilder,
    *,
    samples_per_task: int = 64,
    seed: int = 0,
    on_task: Callable[[int, TaskStats], None] | None = None,
) -> list[TaskStats]:
    """Sample `model` at temperature 1 on every captured task's first prompt and on every candidate's
    second prompt; count what it does (see TaskStats). `on_task(k, stats)` sees the k-th task's stats as
    they come."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    eos = builder.template.eos_token_id
    tools = builder.capture["tools"]
    episodes = builder.episodes
    stats = []
    for instance_id in builder.instance_ids:
        mine = [e for e in episodes if e.instance_id == instance_id]
        resolving = {e.command for e in mine if e.resolves}
        prompt = mine[0].prompt_ids
        longest = max(len(e.action_ids) for e in mine)
        valid = correct = 0
        for ids in sample(
            model, prompt, samples_per_task, max_new_tokens=2 * longest, eos_token_id=eos, generator=generator
        ):
            command = bash_command(builder.parser.parse(ids, prompt, "stop", tools).message)
            if ids[-1] == eos and command in {e.command for e in mine}:
                valid += 1
                correct += command in resolving
        per_candidate = math.ceil(samples_per_task / len(mine))
        closed = 0
        for e in mine:
            second = e.prompt_ids + e.action_ids + e.tool_ids
            for ids in sample(
                model,
                second,
                per_candidate,
                max_new_tokens=4 * len(e.closing_ids),
                eos_token_id=eos,
                generator=generator,
            ):
                message = builder.parser.parse(ids, second, "stop", tools).message
                closed += ids[-1] == eos and not message.get("tool_calls") and message["content"] == CLOSING_TEXT
        stats.append(TaskStats(instance_id, samples_per_task, valid, correct, per_candidate * len(mine), closed))
        if on_task is not None:
            on_task(len(stats), stats[-1])
    return stats
