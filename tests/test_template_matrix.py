"""Every chat template TRL ships that writes tool calls: served exactly, or refused at start with its defect named.

Each template gets a tokenizer of its own family (`swe_grpo.extras.tiny_model.token_family`: the family's special
tokens as single tokens, as its released tokenizer has them), built once per template; no model, no vLLM. A served
template must carry a whole Pi conversation exactly (`chain_driver.assert_conversation_exact`); a refused one must
be refused by `TrainingTemplate` or `ResponseParser` with the reason in `MATRIX`. A template TRL adds shows up
here as a failure until it is placed in the table.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
from chain_driver import assert_conversation_exact
from conftest import tiny_tokenizer

from swe_grpo.tokens.chain import TrainingTemplate
from swe_grpo.tokens.responses import ResponseParser

SERVED = "served"
_NOT_READ_BACK = "do not parse back exactly"
_PROMPT_MISMATCH = "renders a reply that does not start with its own generation prompt"
# template -> SERVED, or the start of the reason it is refused for (a regular expression).
MATRIX: dict[str, str] = {
    "qwen2_5": SERVED,
    "qwen3": SERVED,
    "qwen3_instruct_2507": SERVED,
    "qwen3_vl": SERVED,
    "qwen3_5_think": SERVED,
    "qwen3_5_nothink": SERVED,
    "qwen3_6": SERVED,
    "qwen3_8": SERVED,
    "llama3_1": SERVED,
    "llama3_2": SERVED,
    # harmony: `<|channel|>commentary to=functions.NAME ... <|message|>{json}<|call|>`
    "gptoss": SERVED,
    # `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>`
    "glm4moe": SERVED,
    # `<|tool_call>call:NAME{k:<|"|>v<|"|>}<tool_call|>`
    "gemma4": SERVED,
    "gemma4_v2": SERVED,
    "gemma4_v3": SERVED,
    "gemma4_v4": SERVED,
    "gemma4_v5": SERVED,
    # after a tool result it writes no generation prompt, then renders the next turn with `<|turn>model\n`
    "diffusion_gemma": "has a model write a reply after a tool result otherwise than after a user turn",
    # Qwen3.5 XML calls; the generation prompt opens `<think>\n` (with thinking on), so a reply has reasoning
    "nemotron_3_nano": SERVED,
    "nemotron_3_super": SERVED,
    "nemotron_3_ultra": SERVED,
    "nemotron_3_5_lightning": SERVED,
    # the generation prompt opens `<think>\n` but a rendered assistant turn never does (and after tool results the
    # template writes no generation prompt at all)
    "deepseekv3": _PROMPT_MISMATCH,
    # pythonic `<|tool_call_start|>[NAME(k='v')]<|tool_call_end|>`: LFM2 v2 and LFM2.5-VL escape strings; LFM2.5
    # writes them raw between single quotes, so a call with two string arguments reads more than one way
    # (tests/test_responses.py shows it)
    "lfm2_v2": SERVED,
    "lfm2_2_5": _NOT_READ_BACK,
    "lfm2_2_5_v2": _NOT_READ_BACK,
    "lfm2_2_5_vl": SERVED,
    # ATEM: `<|start|>assistant to=NAME<|message|><atem:function_calls>...`, values raw between their tags
    "muse_glimmer": SERVED,
}
_TEMPLATE_DIR = Path(trl.__file__).parent / "chat_templates"
_CALL = {"id": "call_0", "type": "function", "function": {"name": "matrix_probe", "arguments": {"k": "v"}}}


def _writes_tool_calls(chat_template: str) -> bool:
    """Whether `chat_template` writes an assistant's tool call (with arguments as an object, or as the JSON string
    some templates concatenate). Rendered with any tokenizer: only the text matters."""
    tokenizer = tiny_tokenizer("qwen3")
    for arguments in ({"k": "v"}, '{"k": "v"}'):
        call = {**_CALL, "function": {**_CALL["function"], "arguments": arguments}}
        messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False)
        except Exception:  # a template's own refusal (roles, content shapes): it writes no call like this
            continue
        if "matrix_probe" in text:
            return True
    return False


def test_the_matrix_holds_every_template_trl_ships_that_writes_tool_calls() -> None:
    originals = sorted(p for p in _TEMPLATE_DIR.glob("*.jinja") if not p.stem.endswith("_training"))
    writers = {p.stem for p in originals if _writes_tool_calls(p.read_text(encoding="utf-8"))}
    assert writers == set(MATRIX)
    assert len(MATRIX) == 28


def _serve(template: str) -> None:
    tokenizer = tiny_tokenizer(template)
    TrainingTemplate(tokenizer)
    ResponseParser(tokenizer)


@pytest.mark.parametrize("template", sorted(MATRIX, key=lambda name: (MATRIX[name] != SERVED, name)))
def test_template_is_served_exactly_or_refused_with_its_defect(template: str) -> None:
    expected = MATRIX[template]
    if expected != SERVED:
        with pytest.raises(ValueError, match=expected):
            _serve(template)
        return
    _serve(template)
    assert_conversation_exact(template)


@pytest.mark.parametrize(
    ("template", "kwargs"),
    [("nemotron_3_nano", {"enable_thinking": False}), ("qwen3", {"enable_thinking": False})],
)
def test_the_templates_kwargs_reach_the_probe_and_every_render(template: str, kwargs: dict) -> None:
    """With thinking off, the generation prompt closes the think block itself: the parser's probe, the prompts and
    the interstitials all render so, and a whole conversation is exact."""
    training = TrainingTemplate(tiny_tokenizer(template), **kwargs)
    assert training.render([{"role": "user", "content": "."}], generation_prompt=True).rstrip().endswith("</think>")
    assert_conversation_exact(template, **kwargs)
