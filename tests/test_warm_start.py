"""The warm-started tiny policy: its training tokens are what a rollout's TokenChain holds for the default
Pi's real requests, the shared-prefix loss and the sampler are exact, the built policy acts as the CPU
learning demo needs at temperature 1, the build is cached, and, with the real Pi in real `local`
sandboxes, the capture is still what Pi sends and the policy drives Pi to a graded end."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from swe_grpo.agents.base import AgentConfig
from swe_grpo.agents.pi import PiAgent
from swe_grpo.demo.tasks import demo_tasks
from swe_grpo.demo.warm_start import (
    METADATA_FILE,
    SHIPPED_DIR,
    EpisodeBuilder,
    WarmStartSpec,
    build_warm_policy,
    capture_pi_requests,
    completion_loss,
    evaluate_policy,
    load_candidates,
    load_capture,
    sample,
)
from swe_grpo.rollout import RolloutConfig, run_rollout
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import Generation, SamplingParams

# A cold build of the policy takes minutes on a busy 2-core box (then it is cached).
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def builder(tokenizer: PreTrainedTokenizerBase) -> EpisodeBuilder:
    return EpisodeBuilder(tokenizer, load_capture())


@pytest.fixture(scope="module")
def warm_policy_dir() -> Path:
    return build_warm_policy()


@pytest.fixture(scope="module")
def warm_policy(warm_policy_dir: Path):
    return AutoModelForCausalLM.from_pretrained(warm_policy_dir, dtype=torch.float32).eval()


def test_capture_covers_every_demo_task_and_candidate() -> None:
    capture, candidates = load_capture(), load_candidates()
    assert [t["instance_id"] for t in capture["tasks"]] == [t.instance_id for t in demo_tasks()]
    for task in capture["tasks"]:
        mine = candidates[task["instance_id"]]
        assert len(mine) == 4 and sum(c.resolves for c in mine) == 1
        assert [(c["command"], c["resolves"]) for c in task["candidates"]] == [(c.command, c.resolves) for c in mine]
        assert [c["outcome"] for c in task["candidates"]] == ["resolved" if c.resolves else "unresolved" for c in mine]


def test_replay_is_what_a_rollout_holds(builder: EpisodeBuilder, tokenizer) -> None:
    episodes = builder.episodes
    assert len(episodes) == 12 and len({e.command for e in episodes}) == 12
    for task in builder.capture["tasks"]:
        prompts = {tuple(e.prompt_ids) for e in episodes if e.instance_id == task["instance_id"]}
        assert len(prompts) == 1 and tokenizer.decode(list(prompts.pop())).endswith("<|im_start|>assistant\n")
    for e in episodes:
        assert e.action_ids[-1] == e.closing_ids[-1] == tokenizer.eos_token_id
        assert len(e.action_ids) < 100 and len(e.closing_ids) < 20
        assert json.dumps(e.command) in tokenizer.decode(e.action_ids)
        assert tokenizer.decode(e.closing_ids).endswith("Done.<|im_end|>")


def test_shared_prefix_loss_equals_plain_forwards(tiny_model_dir: Path, builder: EpisodeBuilder, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    episodes = builder.episodes[::3]  # every task, some sharing a prompt and some not
    total, count = 0.0, 0
    with torch.no_grad():
        shared = completion_loss(model, episodes, tokenizer.pad_token_id).item()
        for e in episodes:
            ids = torch.tensor([e.input_ids])
            trained = torch.tensor(e.completion_mask[1:], dtype=torch.bool)
            logits = model(ids).logits[0, :-1][trained]
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:][trained], reduction="sum").item()
            count += int(trained.sum())
    assert shared == pytest.approx(total / count, rel=1e-4)


def test_sampler_follows_the_model(tiny_model_dir: Path, builder: EpisodeBuilder, tokenizer) -> None:
    """At a temperature near 0 the cached sampler picks what plain forwards of the whole sequence rank
    first, so its positions and cache are right."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = builder.episodes[0].prompt_ids
    generator = torch.Generator().manual_seed(0)
    [sampled] = sample(model, prompt, 1, max_new_tokens=6, eos_token_id=-1, generator=generator, temperature=1e-4)
    greedy: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(model(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
    assert sampled == greedy


def test_warm_policy_acts_as_the_demo_needs(warm_policy, warm_policy_dir, tiny_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(warm_policy_dir)
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.get_vocab() == tiny.get_vocab() and tokenizer.chat_template == tiny.chat_template
    stats = evaluate_policy(warm_policy, EpisodeBuilder(tokenizer, load_capture()), samples_per_task=64)
    summaries = [s.summary() for s in stats]
    for s in stats:
        assert s.valid_rate >= 0.95, summaries
        assert 0.05 <= s.correct_rate <= 0.6, summaries
        assert s.closed_rate >= 0.95, summaries


def test_the_demo_uses_the_shipped_policy_and_a_fresh_build_makes_the_same(warm_policy_dir: Path) -> None:
    """The demo skips the build on a fresh machine: the shipped policy is what the repository builds. If this
    fails after a change to the capture, the spec or the builder, run `python -m swe_grpo.demo.warm_start
    ship` and commit `swe_grpo/demo/tasks/warm_start/policy/`.

    The builds are compared by what they do, not weight by weight: the same build on CPUs with other vector
    instructions drifts apart over its 250 steps (on 2026-11-24, a box without AVX-512 ended up to 0.07 from
    the shipped weights) while ending at the same loss to 0.1 % and with the same evaluation."""
    assert warm_policy_dir == SHIPPED_DIR
    fresh = build_warm_policy(shipped=None)  # minutes on a fresh machine, then cached
    assert fresh != SHIPPED_DIR
    shipped_meta, fresh_meta = (json.loads((d / METADATA_FILE).read_text()) for d in (SHIPPED_DIR, fresh))
    assert shipped_meta["key"] == fresh_meta["key"] and shipped_meta["spec"] == asdict(WarmStartSpec())
    assert fresh_meta["loss_last"] == pytest.approx(shipped_meta["loss_last"], rel=0.05)
    shipped_eval, fresh_eval = ({t["instance_id"]: t for t in m["eval"]["tasks"]} for m in (shipped_meta, fresh_meta))
    assert shipped_eval.keys() == fresh_eval.keys()
    for task, shipped_task in shipped_eval.items():  # the candidates the policy draws, as the demo starts from them
        for rate in ("valid_rate", "closed_rate", "correct_rate"):
            assert abs(fresh_eval[task][rate] - shipped_task[rate]) <= 0.1, (task, rate)
    assert (SHIPPED_DIR / "tokenizer.json").read_bytes() == (fresh / "tokenizer.json").read_bytes()
    started = time.monotonic()
    assert build_warm_policy(shipped=None) == fresh and build_warm_policy() == SHIPPED_DIR
    assert time.monotonic() - started < 5


def test_a_build_reports_its_progress_and_a_reuse_does_not(tmp_path: Path) -> None:
    """The demo shows how far the build is: every fine-tuning step, then every evaluated task, in order."""
    spec = WarmStartSpec(steps=3, eval_samples=2, min_valid_rate=0.0, min_closed_rate=0.0)  # a quick, weak build
    seen: list[tuple[int, int, str]] = []
    built = build_warm_policy(spec, cache_dir=tmp_path, progress=lambda *p: seen.append(p))
    total = spec.steps + 3
    assert [(done, n) for done, n, _ in seen] == [(k, total) for k in range(1, total + 1)]
    assert all("loss" in detail for _, _, detail in seen[: spec.steps])
    assert [detail for _, _, detail in seen[spec.steps :]] == [f"evaluated {t.instance_id}" for t in demo_tasks()]
    seen.clear()
    assert build_warm_policy(spec, cache_dir=tmp_path, progress=lambda *p: seen.append(p)) == built and seen == []


# --------------------------------------------------------------------------- with the real Pi


@pytest.fixture
def backend(tmp_path: Path, run_dir: Path) -> LocalBackend:
    return LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)


@pytest.mark.integration
async def test_pi_still_sends_what_was_captured(tokenizer, pi_bundle, backend) -> None:
    """Re-captures every request with the default Pi (and re-grades every candidate): it must be the
    shipped capture. If this fails after a Pi upgrade, run `python -m swe_grpo.demo.warm_start capture`
    and commit the file (the policy rebuilds on its own)."""
    assert await capture_pi_requests(tokenizer, backend, pi_bundle) == load_capture()


class PolicyGenerator:
    """The warm policy sampled with transformers, as a generation backend for the InterceptionServer.
    Log-probs are not computed (reported as 0.0): nothing here trains on them."""

    max_model_len = 8192

    def __init__(self, model, eos_token_id: int, seed: int):
        self.model, self.eos_token_id = model, eos_token_id
        self.generator = torch.Generator().manual_seed(seed)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, model: str | None = None) -> Generation:
        [ids] = await asyncio.to_thread(
            sample,
            self.model,
            list(prompt_ids),  # the server hands an array("i")
            1,
            max_new_tokens=params.max_tokens or 128,
            eos_token_id=self.eos_token_id,
            generator=self.generator,
        )
        return Generation(ids, [0.0] * len(ids), "stop" if ids[-1] == self.eos_token_id else "length", model or "")


@pytest.mark.integration
@pytest.mark.parametrize("task", demo_tasks(), ids=lambda t: t.instance_id)
async def test_warm_policy_drives_pi_to_a_graded_end(warm_policy, warm_policy_dir, pi_bundle, backend, task) -> None:
    """A whole rollout with the policy behind the InterceptionServer: Pi gets a candidate call, runs it,
    gets `Done.` and exits; the training row is token for token the captured episode it chose (so SFT
    and RL see the same tokens), and the grade is that candidate's."""
    tokenizer = AutoTokenizer.from_pretrained(warm_policy_dir)
    generator = PolicyGenerator(warm_policy, tokenizer.eos_token_id, seed=0)
    config = RolloutConfig(agent=AgentConfig(context_window=generator.max_model_len, max_tokens=128, timeout_s=120))
    async with InterceptionServer(generator, tokenizer, sampling=SamplingParams(max_tokens=128)) as server:
        trajectory = await run_rollout(task, server, backend, PiAgent(pi_bundle), config)
    assert trajectory.outcome in ("resolved", "unresolved"), trajectory.error
    assert trajectory.agent.exit_code == 0 and [t.kind for t in trajectory.turns] == ["clean", "clean"]
    [row] = trajectory.rows
    [episode] = [e for e in EpisodeBuilder(tokenizer, load_capture()).episodes if e.input_ids == row.input_ids.tolist()]
    assert episode.instance_id == task.instance_id
    assert row.completion_mask.tolist() == episode.completion_mask
    assert trajectory.reward == (1.0 if episode.resolves else 0.0)
