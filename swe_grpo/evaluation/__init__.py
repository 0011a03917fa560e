"""Evaluating a policy: `swe-grpo eval` runs each task k times through the training path (the same
InterceptionServer, vLLM client and fresh-sandbox grading as `swe-grpo rollout`) and reports pass@k.

    metrics.py   pass@k (unbiased estimator), Wilson and bootstrap intervals, the report of a set of attempts
    store.py     the output directory: attempts.jsonl (the resumable state), predictions, report, settings
    run.py       the token-exact serving stack (with an optional LoRA adapter) and the attempt loop
    command.py   the `eval` subcommand (registered by `swe_grpo.cli`) and its table

docs/evaluation.md describes the command, its outputs, the estimator and how infra failures count.
"""

from swe_grpo.evaluation.metrics import (
    INFRA_OUTCOMES,
    bootstrap_interval,
    build_report,
    is_infra,
    pass_at_k,
    wilson_interval,
)

__all__ = ["INFRA_OUTCOMES", "bootstrap_interval", "build_report", "is_infra", "pass_at_k", "wilson_interval"]
