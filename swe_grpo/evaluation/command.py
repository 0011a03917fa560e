"""`swe-grpo eval`: run each task k times, grade every attempt, and report pass@k (docs/evaluation.md).

The command takes `swe-grpo rollout`'s flags (tasks, vLLM, sandbox, agent, sampling, limits, door: the
same actions, so the two commands cannot drift apart) but its outputs: `-k` attempts per task into
`--out DIR` (see `swe_grpo.evaluation.store`). `swe_grpo.cli` registers it with `add_eval_parser`, handing
over its rollout parser and the function that turns those flags into a `RolloutConfig`.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from swe_grpo.console import make_console, progress, resolved_so_far

if TYPE_CHECKING:
    from swe_grpo.rollout import RolloutConfig

console = make_console()

MakeConfig = Callable[[argparse.Namespace, int], "RolloutConfig"]
# Rollout flags eval does not take: its outputs are its own (-k, --out, --save-trajectories).
_NOT_FROM_ROLLOUT = frozenset({"help", "num_rollouts", "output", "save_trajectories"})
# What a re-run into the same --out must share with the attempts already there.
_SETTINGS = ("model", "passthrough", "lora", "lora_name", "tokenizer", "agent", "temperature", "top_p", "max_tokens")


def add_eval_parser(sub: Any, rollout: argparse.ArgumentParser, make_config: MakeConfig) -> argparse.ArgumentParser:
    """Add `eval` to the subcommands `sub`, with `rollout`'s flags (the same argparse actions) and its own."""
    parser = sub.add_parser(
        "eval",
        help="run each task k times, grade every attempt, report pass@k (resumable)",
        description="Run each task k times, grade each attempt in a fresh sandbox, report pass@k (docs/evaluation.md)",
    )
    own = {"vllm_url": _optional, "agent": _one_agent}
    for action in rollout._actions:  # argparse's `parents=` does the same, but takes every flag or none
        if action.dest not in _NOT_FROM_ROLLOUT:
            parser._add_action(own.get(action.dest, lambda action: action)(action))
    parser.add_argument("-k", "--attempts", type=_positive, default=1, help="attempts per task (pass@1..k)")
    parser.add_argument("--out", required=True, help="output directory; a re-run with the same one resumes")
    parser.add_argument("--lora", help="a LoRA adapter directory the vLLM server can read; generations use it")
    parser.add_argument("--lora-name", help="the adapter's served name (default eval-<directory name>)")
    parser.add_argument(
        "--name", help="model_name_or_path in predictions.jsonl (default MODEL, or MODEL+LORA_NAME with an adapter)"
    )
    parser.add_argument(
        "--passthrough",
        metavar="URL",
        help="instead of --vllm-url: any OpenAI-compatible endpoint (.../v1; key from OPENAI_API_KEY) serving "
        "MODEL; the agent's calls are forwarded and logged to OUT/passthrough/, no token ids",
    )
    parser.add_argument("--save-trajectories", action="store_true", help="one JSON per attempt in OUT/trajectories/")
    parser.add_argument(
        "--retry-infra",
        action="store_true",
        help="re-run the attempts whose latest record is an infra failure (by default a re-run skips them)",
    )
    parser.set_defaults(func=lambda args: cmd_eval(args, make_config))
    return parser


def _optional(action: argparse.Action) -> argparse.Action:
    """A copy of `action` that may be left out (rollout's own stays required)."""
    action = copy.copy(action)
    action.required = False
    action.help = "the vLLM server (required unless --passthrough)"
    return action


def _one_agent(action: argparse.Action) -> argparse.Action:
    """A copy of rollout's `--agent` that refuses a mix: a report's pass@k is one agent's."""
    from swe_grpo.agents import AGENTS, check_mix

    action = copy.copy(action)
    rollouts = action.type
    assert callable(rollouts)

    def one(text: str) -> str:
        if isinstance(check_mix(text), dict):
            raise argparse.ArgumentTypeError(
                f"eval runs one agent, not a mix ({text!r}): run it once per agent, each into an --out of its own"
            )
        return rollouts(text)

    action.type = one
    action.metavar = "{" + ",".join(AGENTS) + ",module:Class}"
    action.help = f"the agent: {', '.join(AGENTS)} (default pi), or a class of your own as package.module:Class"
    return action


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in _SETTINGS}


def model_name(args: argparse.Namespace) -> str:
    if args.name:
        return args.name
    if args.lora or args.lora_name:
        return f"{args.model}+{args.lora_name or 'eval-' + Path(args.lora).resolve().name}"
    return args.model


def cmd_eval(args: argparse.Namespace, make_config: MakeConfig) -> int:
    from swe_grpo.evaluation.store import EvalSetupError
    from swe_grpo.serving.stack import AdapterNotServed
    from swe_grpo.serving.vllm_client import VLLMError

    try:
        report = asyncio.run(evaluate(args, make_config))
    # Settings that differ from OUT's; an adapter the server lacks, with no path to it.
    except (EvalSetupError, AdapterNotServed) as e:
        console.print(str(e), style="red", markup=False)
        return 2
    except VLLMError as e:  # the server is unusable from the start (report.json covers what was done before)
        console.print(f"vLLM at {args.vllm_url}: {type(e).__name__}: {e}", style="red", markup=False)
        return 1
    print_report(report)
    console.print(f"report: {Path(args.out) / 'report.json'}")
    return 0 if report["attempts_scored"] else 1


async def evaluate(args: argparse.Namespace, make_config: MakeConfig) -> dict[str, Any]:
    """Run the attempts OUT does not hold yet, then write predictions.jsonl and report.json (also when
    interrupted: they cover the attempts finished so far). Returns the report."""
    from swe_grpo.evaluation.store import AttemptLog, EvalSetupError, check_settings, done
    from swe_grpo.tasks import load_tasks

    if not args.vllm_url and not args.passthrough:
        raise EvalSetupError("eval needs --vllm-url (token-exact, as in training) or --passthrough URL")
    if args.passthrough and (args.lora or args.lora_name):
        raise EvalSetupError("--lora is for a vLLM server (--vllm-url); a --passthrough endpoint serves what it serves")
    out = Path(args.out)
    tasks = load_tasks(args.tasks, args.split, args.instance_ids)
    check_settings(out, run_settings(args))
    ids = [task.instance_id for task in tasks]
    with AttemptLog(out / "attempts.jsonl") as attempts:
        skip = done(attempts.records, retry_infra=args.retry_infra)
        jobs = [(task, i) for i in range(args.attempts) for task in tasks if (task.instance_id, i) not in skip]
        try:
            if jobs:
                await _run(args, make_config, jobs, attempts, total=len(ids) * args.attempts)
            else:
                console.print(f"{out}: all {len(ids) * args.attempts} attempts already done")
        finally:
            report = write_outputs(out, attempts.records, args.attempts, ids, model_name(args))
    return report


def _serving(args: argparse.Namespace) -> Any:
    """The serving stack of this run, as an async context manager of (server, context window)."""
    from swe_grpo.evaluation.passthrough import passthrough_server
    from swe_grpo.serving.stack import token_exact_server
    from swe_grpo.serving.vllm_client import SamplingParams

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    where = {"host": args.host, "port": args.port, "public_url": args.public_url}
    if args.passthrough:
        return passthrough_server(
            args.passthrough, args.model, sampling, log_dir=Path(args.out) / "passthrough", **where
        )
    return token_exact_server(
        args.vllm_url, args.model, sampling, tokenizer=args.tokenizer, lora_path=args.lora, lora_name=args.lora_name,
        **where,
    )  # fmt: skip


async def _run(args: argparse.Namespace, make_config: MakeConfig, jobs: list, attempts: Any, total: int) -> None:
    from swe_grpo.agents import make_agent
    from swe_grpo.evaluation.run import run_attempts
    from swe_grpo.evaluation.store import TRAJECTORIES, latest
    from swe_grpo.sandbox import hf_network_options, make_backend

    agent = make_agent(args.agent)
    backend = make_backend(args.sandbox, **hf_network_options(args.sandbox, args.hf_accept_network))
    async with _serving(args) as (server, context_window):
        config = make_config(args, context_window)
        if args.passthrough:  # the door is the InterceptionServer's: the agent uses the backend's network
            config = replace(config, door=False, allow=())
        await backend.start()
        try:
            with progress(console) as shown:
                bar = shown.add_task("attempts", total=total, completed=total - len(jobs))

                def finished(record: Mapping[str, Any]) -> None:
                    current = latest(attempts.records).values()  # a retried attempt counts once
                    resolved = sum(r["outcome"] == "resolved" for r in current)
                    shown.update(bar, advance=1, detail=resolved_so_far(resolved, len(current)))

                await run_attempts(
                    jobs,
                    server=server,
                    backend=backend,
                    agent=agent,
                    config=config,
                    attempts=attempts,
                    concurrency=args.concurrency,
                    save_dir=Path(args.out) / TRAJECTORIES if args.save_trajectories else None,
                    on_done=finished,
                )
        finally:
            await backend.close()


def write_outputs(
    out: Path, records: list[dict[str, Any]], k: int, instance_ids: list[str], name: str
) -> dict[str, Any]:
    """predictions.jsonl and report.json from the attempts of `instance_ids` numbered below `k`."""
    from swe_grpo.evaluation.metrics import build_report
    from swe_grpo.evaluation.store import PREDICTIONS, REPORT, latest, predictions, write_atomic

    wanted = set(instance_ids)
    current = [r for (iid, attempt), r in latest(records).items() if iid in wanted and attempt < k]
    report = build_report(current, k, instance_ids)
    report["model_name_or_path"] = name
    lines = [json.dumps(p) for p in predictions(current, name)]
    write_atomic(out / PREDICTIONS, "".join(line + "\n" for line in lines))
    write_atomic(out / REPORT, json.dumps(report, indent=2) + "\n")
    return report


def _interval(ci: list[float] | None) -> str:
    return "" if ci is None else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _value(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_report(report: Mapping[str, Any]) -> None:
    """The report as a table on the console."""
    table = Table(title=f"Evaluation: {report.get('model_name_or_path', '')}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("95% CI", justify="right")
    table.add_column("over", overflow="fold")
    scored, infra = report["attempts_scored"], report["infra_failures"]
    table.add_row("resolved rate", _value(report["resolved_rate"]), _interval(report["resolved_rate_ci95_wilson"]),
                  f"{report['resolved']}/{scored} scored attempts (Wilson)")  # fmt: skip
    for k, entry in report["pass_at_k"].items():
        table.add_row(
            f"pass@{k}", _value(entry["value"]), _interval(entry["ci95"]), f"{entry['tasks']} tasks (bootstrap)"
        )
    table.add_row("tasks resolved", str(report["tasks_resolved"]), "", f"of {report['tasks']} tasks")
    table.add_row("infra failures", str(infra), "", "not counted in any denominator")
    cost = report["cost"]
    table.add_row(
        "sandbox-s per resolved", _value(cost["sandbox_s_per_resolved"]), "", f"{cost['sandbox_s']:.1f} s in all"
    )
    table.add_row("generated tokens per resolved", _value(cost["generated_tokens_per_resolved"]), "",
                  f"{cost['generated_tokens']} in all")  # fmt: skip
    table.add_row("outcomes", "", "", ", ".join(f"{name} {count}" for name, count in report["outcomes"].items()))
    console.print(table)
