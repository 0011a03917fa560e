"""`swe-grpo check-model`, run as a user runs it before renting a GPU (a subprocess, as on a fresh CI box): one line a
finding; exit 0 when served exactly, 1 when refused with the template's own defect named, 2 for what cannot be
checked. Tokenizers are the families' tiny ones saved to a directory, as a downloaded model's is."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import tiny_tokenizer
from test_cli_output import SWE_GRPO, fresh_box_env

# A layout of one's own (`swe_grpo.tokens.layouts`): Hermes calls in `<tool_call>` blocks after a think block, read with
# the parts a layout may use; and one that reads nothing, as a layout that does not fit the template.
_LAYOUTS = """
from swe_grpo.tokens.call_values import Reading
from swe_grpo.tokens.calls_tagged import read_tagged


class Hermes:
    reasoning = ("<think>", "</think>")

    def read(self, text, types):
        return read_tagged(text, types)


class Blind:
    reasoning = None

    def read(self, text, types):
        return Reading([], 0, text)
"""


def _check(tmp_path: Path, template: str, *flags: str) -> tuple[int, list[str], str]:
    model = tmp_path / template
    tiny_tokenizer(template).save_pretrained(model)
    (tmp_path / "my_layouts.py").write_text(_LAYOUTS)
    env = fresh_box_env(PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([*SWE_GRPO, "check-model", str(model), *flags], capture_output=True, text=True, env=env,
                         stdin=subprocess.DEVNULL, timeout=300)  # fmt: skip
    return run.returncode, run.stdout.splitlines(), run.stderr


def test_a_served_family_says_its_template_layout_end_tokens_and_round_trip(tmp_path: Path) -> None:
    rc, lines, err = _check(tmp_path, "gptoss")
    assert rc == 0, err
    expected = [
        r"template: TRL's gptoss, served with TRL's training variant gptoss_training \(prefix-preserving\)",
        r"layout: harmony",
        r"end token: <\|return\|> \(closes a plain reply: the turn's last token\)",
        r"end token: <\|call\|> \(closes a tool call: the turn's last token\)",
        r"round trip: a call written by the template reads back exactly \(\d+ tokens\)",
        r"round trip: the next prompt extends the held tokens and equals a fresh render \(\+\d+ tokens\)",
        r"round trip: a final answer reads back as its text",
        r"served exactly",
    ]
    assert len(lines) == len(expected) + 1 and all(map(re.fullmatch, expected, lines[1:])), "\n".join(lines)


def test_a_refused_family_names_the_templates_defect_and_exits_1(tmp_path: Path) -> None:
    rc, lines, err = _check(tmp_path, "deepseekv3")
    assert rc == 1, err
    assert lines[-1].startswith(
        "refused: TemplateNotPrefixPreservingError: the chat template renders a reply that does not start with its own "
        "generation prompt"
    )


def test_the_templates_kwargs_reach_the_check(tmp_path: Path) -> None:
    """Nemotron 3 with thinking off closes the think block in the generation prompt (the matrix checks it on)."""
    rc, lines, err = _check(tmp_path, "nemotron_3_nano", "--chat-template-kwargs", '{"enable_thinking": false}')
    assert rc == 0 and lines[-1] == "served exactly", err + "\n".join(lines)


def test_a_layout_of_ones_own_is_checked_alone(tmp_path: Path) -> None:
    rc, lines, err = _check(tmp_path, "qwen3", "--layout", "my_layouts:Hermes")
    assert rc == 0 and "layout: Hermes (a layout of your own)" in lines and lines[-1] == "served exactly", err
    rc, lines, err = _check(tmp_path, "qwen3", "--layout", "my_layouts:Blind")
    assert rc == 1 and lines[-1].startswith("refused: UnsupportedTemplateError: tool calls written by this chat "), err
    assert "{'Blind': []}" in lines[-1]


def test_what_cannot_be_checked_exits_2_on_one_line(tmp_path: Path) -> None:
    rc, _, err = _check(tmp_path, "qwen3", "--layout", "my_layouts:Missing")
    assert rc == 2 and err.splitlines() == ["error: tool-call layout 'my_layouts:Missing': module 'my_layouts' has no "
                                            "attribute 'Missing'"]  # fmt: skip
    rc, _, err = _check(tmp_path, "qwen3", "--chat-template-kwargs", "[1]")
    assert rc == 2 and err.splitlines() == ["error: --chat-template-kwargs must be a JSON object"]


def test_the_workers_layout_reaches_the_parser_of_every_rollout(tmp_path: Path, monkeypatch) -> None:
    """`WorkerConfig.tool_call_layout` is refused by name at configuration when it does not import; the rollout
    host's InterceptionServer (what `engine` builds with the config's layout) probes it alone."""
    from swe_grpo.serving.interception import InterceptionServer
    from swe_grpo.worker.config import WorkerConfig

    (tmp_path / "my_layouts.py").write_text(_LAYOUTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="tool-call layout 'my_layouts:Missing': module 'my_layouts' has no attribute"):
        WorkerConfig(tool_call_layout="my_layouts:Missing")
    config = WorkerConfig(tool_call_layout="my_layouts:Hermes")
    server = InterceptionServer(None, tiny_tokenizer("qwen3"), tool_call_layout=config.tool_call_layout)  # type: ignore[arg-type]
    assert server.parser.layout == "Hermes"
    with pytest.raises(ValueError, match=r"no layout reads back \(\{'Blind': \[\]\}\)"):
        InterceptionServer(None, tiny_tokenizer("qwen3"), tool_call_layout="my_layouts:Blind")  # type: ignore[arg-type]


def test_end_tokens_are_told_where_a_reply_needs_reasoning(tmp_path: Path) -> None:
    """Nemotron 3 with thinking on: a reply starts inside the think block the generation prompt opened, so the end
    tokens are found on replies written with reasoning (they were missing from the report before)."""
    from swe_grpo.tokens.model_check import check_model

    tiny_tokenizer("nemotron_3_nano").save_pretrained(tmp_path / "nemotron")
    report = check_model(str(tmp_path / "nemotron"))
    assert report.refused is None
    assert report.end_tokens == [
        ("<|im_end|>", "closes a plain reply: the turn's last token; closes a tool call: the turn's last token")
    ]
