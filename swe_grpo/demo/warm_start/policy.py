"""The cached build of the warm-started policy (`build_warm_policy`), the shipped copy of it (`ship`) and
the command line (`python -m swe_grpo.demo.warm_start build|ship|capture`)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from swe_grpo.demo.warm_start.build import EpisodeBuilder
from swe_grpo.demo.warm_start.capture import capture_pi_requests
from swe_grpo.demo.warm_start.data import (
    BUILDER_VERSION,
    CAPTURE_PATH,
    METADATA_FILE,
    SHIPPED_DIR,
    WarmStartError,
    load_capture,
)
from swe_grpo.demo.warm_start.evaluate import evaluate_policy
from swe_grpo.demo.warm_start.sft import Progress, WarmStartSpec, fine_tune
from swe_grpo.extras.tiny_model import build_tiny_model
from swe_grpo.paths import cache_root

log = logging.getLogger(__name__)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside, its previous thread count restored after. For work beside other busy
    processes (the demo's vLLM and agents, a test run, other users): oversubscribed OpenMP threads
    spin-wait on each other, and one thread is then much faster than several."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _cache_key(spec: WarmStartSpec, tiny_model_dir: Path, capture_path: Path) -> str:
    import transformers

    h = hashlib.sha256(f"{BUILDER_VERSION}/{transformers.__version__}".encode())
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    for path in sorted(p for p in tiny_model_dir.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(capture_path.read_bytes())
    return h.hexdigest()[:16]


def build_warm_policy(
    spec: WarmStartSpec = WarmStartSpec(),  # noqa: B008 (frozen, so one shared default is safe)
    *,
    tiny_model_dir: Path | None = None,
    capture_path: Path = CAPTURE_PATH,
    cache_dir: Path | None = None,
    progress: Progress | None = None,
    shipped: Path | None = SHIPPED_DIR,
) -> Path:
    """Build (or reuse) the warm-started policy; returns its directory: the `shipped` one when it is what
    this build would make (the same cache key), else the cached build, else a new build. `progress`
    sees how far a build is (see `Progress`), and nothing when the policy is reused.

    The directory is a Hugging Face checkpoint of the tiny model (default: `build_tiny_model()`) with
    the same tokenizer and chat template, fine-tuned as `swe_grpo.demo.warm_start` says; vLLM and
    transformers load it like the tiny model. `warm_start.json` in it records the spec, the loss curve's
    ends, the build time and the rates measured at temperature 1 after fine-tuning (see
    `evaluate_policy`). A policy whose valid-call or closing rate falls below the spec's minimum is not
    cached: WarmStartError.
    The cache key covers the tiny model's files, the capture, the spec and BUILDER_VERSION. Safe to call
    from several processes at once: one builds, the others wait for it and reuse the result.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny_model_dir = Path(tiny_model_dir) if tiny_model_dir else build_tiny_model()
    root = Path(cache_dir) if cache_dir else cache_root()
    key = _cache_key(spec, tiny_model_dir, capture_path)
    if shipped is not None and _metadata(shipped).get("key") == key:
        return shipped
    target = root / f"warm-{key}"
    if (target / METADATA_FILE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".warm-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a build takes minutes: wait for another process's instead
        if (target / METADATA_FILE).is_file():
            return target
        started = time.monotonic()
        tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        capture = load_capture(capture_path)
        builder = EpisodeBuilder(tokenizer, capture)
        progress = progress or (lambda done, total, detail: None)
        total = spec.steps + len(builder.instance_ids)
        with one_torch_thread():
            losses = fine_tune(model, builder, spec, tokenizer.pad_token_id, progress)
            trained_s = time.monotonic() - started
            stats = evaluate_policy(
                model,
                builder,
                samples_per_task=spec.eval_samples,
                seed=spec.seed,
                on_task=lambda k, s: progress(spec.steps + k, total, f"evaluated {s.instance_id}"),
            )
        valid = sum(s.valid for s in stats) / sum(s.samples for s in stats)
        closed = sum(s.closed for s in stats) / sum(s.closings for s in stats)
        summaries = [s.summary() for s in stats]
        if valid < spec.min_valid_rate or closed < spec.min_closed_rate:
            raise WarmStartError(f"the fine-tuned policy is too weak to start RL from: {summaries}")
        metadata = {
            "builder_version": BUILDER_VERSION,
            "key": key,
            "spec": asdict(spec),
            "tiny_model": str(tiny_model_dir),
            "pi_version": capture["pi_version"],
            "loss_first": losses[0],
            "loss_last": losses[-1],
            "train_s": round(trained_s, 1),
            "build_s": round(time.monotonic() - started, 1),
            "eval": {"valid_rate": valid, "closed_rate": closed, "tasks": summaries},
        }
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        staging.chmod(0o755)  # sandboxed agents and servers running as other users read it
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            # Written last: its presence is what marks a finished build.
            (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    log.info("warm start built in %.0f s: %s", metadata["build_s"], target)
    return target


def _metadata(policy: Path) -> dict[str, Any]:
    """A built policy's `warm_start.json`, or {} where there is none."""
    path = policy / METADATA_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def ship(target: Path = SHIPPED_DIR) -> Path:
    """Build the policy from the repository (or take the cached build: never the shipped one) and put
    its files in `target`, replacing what was there."""
    built = build_warm_policy(shipped=None)
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for path in sorted(built.iterdir()):
        shutil.copyfile(path, target / path.name)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m swe_grpo.demo.warm_start build` prints the policy's directory and its measured rates;
    `... ship` rebuilds the shipped policy (`SHIPPED_DIR`) from the repository; `... capture` re-captures
    Pi's requests into the shipped file (needs root, bubblewrap and Pi, as the `local` sandbox does)."""
    parser = argparse.ArgumentParser(prog="python -m swe_grpo.demo.warm_start")
    parser.add_argument("command", choices=["build", "ship", "capture"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command in ("build", "ship"):
        path = build_warm_policy() if args.command == "build" else ship()
        print(path)
        print((path / METADATA_FILE).read_text())
        return 0

    async def capture() -> dict[str, Any]:
        from transformers import AutoTokenizer

        from swe_grpo.agents.pi import PiBundle
        from swe_grpo.sandbox.local import LocalBackend

        backend = LocalBackend()
        await backend.start()
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
        return await capture_pi_requests(tokenizer, backend, PiBundle.default())

    CAPTURE_PATH.write_text(json.dumps(asyncio.run(capture()), indent=1, ensure_ascii=False) + "\n")
    print(CAPTURE_PATH)
    return 0
