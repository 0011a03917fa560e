"""The demo's learning, simulated in minutes: GRPO on the warm policy's first turn, without Pi, vLLM or sandboxes.

What. A real demo run takes 10-15 minutes and one seed says little, so tuning its learning (lr, schedule,
group sizes, task sampling, temperature) by real runs is slow. This replays what decides a demo rollout's
reward: the policy's first turn on each bundled task, sampled at the demo's temperature from the shipped
warm policy plus a LoRA adapter shaped as the demo's (torch, one thread), rewarded 1 when it is exactly
the fixing candidate call (`tasks/warm_start/candidates.json`) and 0 otherwise, as grading would. A
sampled candidate goes on with its captured tool result and the closing turn, as Pi would. Then the
demo's trainer step: groups drawn by the demo's `TaskSampler` until `--groups` have mixed rewards (the
others are dropped, as the worker drops them, up to `--max-zero-variance-drops` in a row), advantages as
the worker computes them, TRL's clipped token loss over the step's trained tokens, AdamW and the HF lr
schedule; samples come from the policy `--staleness` versions behind.

Reported (one JSON line): per-step resolved rate over every rollout drawn (the demo's
`rollout/resolved_rate`), its last-two-steps mean, the final policy's resolved rate per task over
`--eval` samples (and their mean: the rate a uniform task draw would see), and the rollouts drawn per
step: what a real run's wall time follows once the policy is good, since groups all solved are dropped.

Not simulated: Pi's own failures, malformed turns after the first, vLLM's batching and the timing of the
asynchronous pipeline (staleness is fixed here). On 2026-11-24 it reproduced the demo's plateau: last two
steps 0.83-0.88 with the defaults, `strutil` ending at ~0.82 (real runs: 0.87-0.93, `strutil` the failures).

Run: `.venv/bin/python benchmarks/demo_learning.py --seed 0` (~4-8 CPU-minutes for 20 steps; run seeds
side by side on separate cores); `--help` for the knobs.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from swe_grpo.demo.run import DemoConfig
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.demo.warm_start import (
    SHIPPED_DIR,
    Episode,
    EpisodeBuilder,
    bash_command,
    load_capture,
    padded,
    prefix_cache,
    sample,
)
from swe_grpo.worker.task_sampling import TaskSampler

LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # as the demo's


def token_log_probs(
    lm: Any, prompt: list[int], rows: list[list[int]], pad: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob at `temperature` of every token of each row after `prompt` under `lm` (as TRL's trainer and
    vLLM's processed log-probs compute it), and the mask of real tokens."""
    cache = prefix_cache(lm, prompt[:-1], len(rows))
    ids, real = padded([[prompt[-1], *row] for row in rows], pad)
    positions = len(prompt) - 1 + torch.arange(ids.shape[1]).expand(len(rows), -1)
    mask = torch.cat([torch.ones(len(rows), len(prompt) - 1, dtype=torch.long), real], dim=1)
    hidden = lm.model(input_ids=ids, past_key_values=cache, position_ids=positions, attention_mask=mask)
    log_probs = (lm.lm_head(hidden.last_hidden_state[:, :-1]).float() / temperature).log_softmax(-1)
    return log_probs.gather(-1, ids[:, 1:, None])[..., 0], real[:, 1:].bool()


def main() -> None:
    demo = DemoConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=demo.max_steps)
    parser.add_argument("--lr", type=float, default=demo.learning_rate)
    parser.add_argument("--lr-scheduler", default=demo.lr_scheduler)
    parser.add_argument("--min-lr-rate", type=float, default=demo.min_lr_rate)
    parser.add_argument("--groups", type=int, default=demo.groups_per_step)
    parser.add_argument("--generations", type=int, default=demo.num_generations)
    parser.add_argument("--task-sampling", default=demo.task_sampling)
    parser.add_argument("--staleness", type=int, default=demo.max_staleness)
    parser.add_argument("--max-zero-variance-drops", type=int, default=demo.max_zero_variance_drops)
    parser.add_argument("--lora-rank", type=int, default=demo.lora_rank)
    parser.add_argument("--temperature", type=float, default=demo.temperature)
    parser.add_argument("--epsilon", type=float, default=0.2, help="TRL's clip range (its default)")
    parser.add_argument("--eval", type=int, default=64, help="samples per task for the final policy's rates")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_DIR)
    builder = EpisodeBuilder(tokenizer, load_capture())
    tools = builder.capture["tools"]
    eos, pad = builder.template.eos_token_id, tokenizer.pad_token_id
    episodes: dict[str, list[Episode]] = {}
    for episode in builder.episodes:
        episodes.setdefault(episode.instance_id, []).append(episode)

    lora = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0, target_modules=LORA_MODULES)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32), lora)
    policy = model.base_model.model  # the LoRA layers are inside it: its `.model` and `.lm_head` go through them
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    kwargs = {"min_lr_rate": args.min_lr_rate} if "min_lr" in args.lr_scheduler else {}
    scheduler = get_scheduler(
        args.lr_scheduler, optimizer, 0, args.steps, scheduler_specific_kwargs=kwargs
    )  # fmt: skip
    served = copy.deepcopy(policy)  # what vLLM would serve: the policy `staleness` versions behind
    versions = [{k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k}]
    sampler = TaskSampler(demo_tasks(), args.task_sampling, seed=args.seed, group_size=args.generations)
    tasks = sampler.stream()
    generator = torch.Generator().manual_seed(args.seed)

    def draw(lm: Any, instance_id: str, n: int, temperature: float) -> list[tuple[list[int], Episode | None]]:
        """`n` first turns sampled from `lm`, each with the candidate it is exactly (None: none)."""
        mine = episodes[instance_id]
        prompt = mine[0].prompt_ids
        longest = max(len(e.action_ids) for e in mine)
        out = []
        for ids in sample(
            lm, prompt, n, max_new_tokens=2 * longest, eos_token_id=eos, generator=generator, temperature=temperature
        ):
            command = bash_command(builder.parser.parse(ids, prompt, "stop", tools).message)
            out.append((ids, next((e for e in mine if ids[-1] == eos and command == e.command), None)))
        return out

    history, drawn_per_step = [], []
    drops = 0  # all-equal groups dropped in a row (the worker's count runs across steps too)
    for _ in range(args.steps):
        served.load_state_dict(versions[max(0, len(versions) - 1 - args.staleness)], strict=False)
        drawn = resolved = 0
        groups = []
        while len(groups) < args.groups:
            task = next(tasks)
            turns = draw(served, task.instance_id, args.generations, args.temperature)
            rewards = torch.tensor([float(e is not None and e.resolves) for _, e in turns])
            for reward in rewards.tolist():
                sampler.record(task.instance_id, reward)
            drawn, resolved = drawn + len(turns), resolved + int(rewards.sum())
            if rewards.std() > 0 or drops == args.max_zero_variance_drops:  # all equal: dropped, up to the limit
                advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
                groups.append((episodes[task.instance_id][0].prompt_ids, turns, advantages))
                drops = 0
            else:
                drops += 1
        history.append(resolved / drawn)
        drawn_per_step.append(drawn)

        batch = []
        for prompt, turns, advantages in groups:
            rows = [ids + (e.tool_ids + e.closing_ids if e else []) for ids, e in turns]
            trained = [
                [1] * len(ids) + ([0] * len(e.tool_ids) + [1] * len(e.closing_ids) if e else []) for ids, e in turns
            ]
            batch.append((prompt, rows, padded(trained, 0)[0].bool(), advantages[:, None]))
        tokens = sum(int(trained.sum()) for _, _, trained, _ in batch)
        optimizer.zero_grad(set_to_none=True)
        for prompt, rows, trained, advantages in batch:
            with torch.no_grad():
                old, _ = token_log_probs(served, prompt, rows, pad, args.temperature)
            new, real = token_log_probs(policy, prompt, rows, pad, args.temperature)
            ratio = torch.exp(new - old)
            clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon)
            loss = -torch.min(ratio * advantages, clipped * advantages)
            ((loss * (real & trained)).sum() / tokens).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        versions.append({k: v.clone() for k, v in policy.state_dict().items() if "lora_" in k})

    with torch.no_grad():
        final = {
            instance_id.split("__")[1]: sum(
                bool(e and e.resolves) for _, e in draw(policy, instance_id, args.eval, args.temperature)
            )
            / args.eval
            for instance_id in episodes
        }
    print(
        json.dumps(
            {
                "args": vars(args),
                "resolved_rate_last_two_steps": round(sum(history[-2:]) / 2, 3),
                "final_resolved_rate_per_task": final,
                "final_resolved_rate_mean": round(sum(final.values()) / len(final), 3),
                "resolved_rate_per_step": [round(rate, 3) for rate in history],
                "rollouts": sum(drawn_per_step),
                "rollouts_per_step": drawn_per_step,
            }
        )
    )


if __name__ == "__main__":
    main()
