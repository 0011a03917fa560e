"""The arithmetic of an evaluation: pass@k, confidence intervals, and the report of a set of attempts.

Pure functions over plain attempt records (the dicts `swe-grpo eval` writes to attempts.jsonl), so the
report of a run can be recomputed, and tested, without a model.

- `pass_at_k(n, c, k)`: the unbiased estimator of Chen et al. (2021), 1 - C(n-c, k) / C(n, k), for one
  task with `n` scored attempts of which `c` resolved; a run's pass@k is its mean over the tasks that have
  at least k scored attempts.
- `wilson_interval(successes, n)`: the Wilson score interval, used for the resolved rate (attempts as
  independent trials; attempts of one task are correlated, so it is narrower than the truth when k > 1).
- `bootstrap_interval(values)`: a percentile bootstrap over tasks (fixed seed: the same records give the
  same interval), used for every pass@k.
- `is_infra(record)`: an attempt that says nothing about the model (the host's failure, no verdict): it
  is reported by outcome but kept out of every denominator.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Outcomes that are the host's failure, not the model's, when they carry no reward: what our own components
# witnessed (vLLM, a sandbox, our code: `rollout_error`), a task that cannot be set up, a run that ended before
# the policy's first turn or without a verdict. Whatever the policy's run chose after its first turn (a stall,
# the wall clock, the context, an exit status, a grading `timeout` its patch's tests caused) earns 0.0 and is
# an unresolved attempt (swe_grpo/rollout.py); so is a `context_overflow` before it (the model's context is
# the model's).
INFRA_OUTCOMES = frozenset({"infra_error", "timeout", "setup_failed", "rollout_error"})
Z_95 = 1.959963984540054  # the standard normal's 97.5th percentile
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of `k` attempts drawn without replacement from `n` (of which `c`
    resolved) resolved: 1 - C(n-c, k) / C(n, k). Exact for integers (Python's big-int division rounds once)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float] | None:
    """The Wilson score interval of a binomial proportion (95% by default); None for n = 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes}/{n}")
    if n == 0:
        return None
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    # At 0 or n successes the bound is exactly 0 or 1 (the arithmetic leaves a rounding error).
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def bootstrap_interval(
    values: Sequence[float],
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the mean of `values` (one per task, resampled with
    replacement); None for no values. Deterministic for a given seed."""
    if not values:
        return None
    rng = random.Random(seed)
    count = len(values)
    means = sorted(sum(rng.choices(values, k=count)) / count for _ in range(resamples))
    tail = (1 - level) / 2
    low = means[math.floor(tail * resamples)]
    high = means[min(resamples - 1, math.ceil((1 - tail) * resamples) - 1)]
    return low, high


def is_infra(record: Mapping[str, Any]) -> bool:
    """An attempt the host failed (no reward and an infrastructure outcome): excluded from the denominators."""
    return record.get("outcome") in INFRA_OUTCOMES and record.get("reward") is None


def _rounded(interval: tuple[float, float] | None) -> list[float] | None:
    return None if interval is None else [round(interval[0], 6), round(interval[1], 6)]


def _per_resolved(total: float, resolved: int) -> float | None:
    return round(total / resolved, 3) if resolved else None


def build_report(records: Iterable[Mapping[str, Any]], k: int, instance_ids: Sequence[str] | None = None) -> dict:
    """The report of a run: `records` are its attempt records (the latest one per (instance_id, attempt)),
    `k` the attempts asked per task (pass@j is reported for every j in 1..k), `instance_ids` the tasks asked
    for (default: those the records name; a task without records counts as having none scored)."""
    by_task: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for record in records:
        by_task[record["instance_id"]].append(record)
    ids = list(dict.fromkeys(instance_ids)) if instance_ids is not None else sorted(by_task)
    outcomes: Counter[str] = Counter()
    per_task, scored_counts = [], []
    for instance_id in ids:
        attempts = sorted(by_task.get(instance_id, []), key=lambda r: r["attempt"])
        scored = [r for r in attempts if not is_infra(r)]
        resolved = sum(r["outcome"] == "resolved" for r in scored)
        outcomes.update(r["outcome"] for r in attempts)
        scored_counts.append((len(scored), resolved))
        per_task.append(
            {
                "instance_id": instance_id,
                "attempts": len(attempts),
                "scored": len(scored),
                "resolved": resolved,
                "infra": len(attempts) - len(scored),
                "outcomes": dict(Counter(r["outcome"] for r in attempts).most_common()),
            }
        )
    all_records = [r for instance_id in ids for r in by_task.get(instance_id, [])]
    scored_total = sum(n for n, _ in scored_counts)
    resolved_total = sum(c for _, c in scored_counts)
    pass_at = {}
    for j in range(1, k + 1):
        values = [pass_at_k(n, c, j) for n, c in scored_counts if n >= j]
        pass_at[str(j)] = {
            "value": round(sum(values) / len(values), 6) if values else None,
            "ci95": _rounded(bootstrap_interval(values)),
            "tasks": len(values),
        }
    sandbox_s = sum(float(r.get("sandbox_s") or 0.0) for r in all_records)
    generated = sum(int(r.get("completion_tokens") or 0) for r in all_records)
    return {
        "k": k,
        "tasks": len(ids),
        "tasks_scored": sum(n > 0 for n, _ in scored_counts),
        "tasks_resolved": sum(c > 0 for _, c in scored_counts),
        "attempts": len(all_records),
        "attempts_scored": scored_total,
        "infra_failures": len(all_records) - scored_total,
        "resolved": resolved_total,
        "resolved_rate": round(resolved_total / scored_total, 6) if scored_total else None,
        "resolved_rate_ci95_wilson": _rounded(wilson_interval(resolved_total, scored_total)),
        "pass_at_k": pass_at,
        "pass_at_k_ci": f"percentile bootstrap over tasks, {BOOTSTRAP_RESAMPLES} resamples, seed {BOOTSTRAP_SEED}",
        "outcomes": dict(outcomes.most_common()),
        "cost": {
            "sandbox_s": round(sandbox_s, 3),
            "generated_tokens": generated,
            "prompt_tokens": sum(int(r.get("prompt_tokens") or 0) for r in all_records),
            "sandbox_s_per_resolved": _per_resolved(sandbox_s, resolved_total),
            "generated_tokens_per_resolved": _per_resolved(generated, resolved_total),
        },
        "per_task": per_task,
    }
