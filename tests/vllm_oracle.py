"""The installed vLLM's own parsers, as its OpenAI server composes them, run on a generated output: the oracle the
differential corpus (tests/test_parser_differential.py) compares `ResponseParser` with.

No server and no model: the parser classes only, given the tokenizer of the family (`tiny_model.token_family`), the
request after the parser's own `adjust_request` (which decides whether special tokens reach it), the output decoded
as vLLM's detokenizer decodes it, and the prompt ids for parsers that read the generation prompt's state. gpt-oss is
read from ids in harmony's own encoding, as vLLM's `HarmonyParser` reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

# TRL template -> (vLLM's `--tool-call-parser`, its `--reasoning-parser` or None): what a user serving that family
# with vLLM's OpenAI server would name.
VLLM_PARSERS: dict[str, tuple[str, str | None]] = {
    "qwen3": ("hermes", "qwen3"),
    "qwen2_5": ("hermes", None),
    "qwen3_5_think": ("qwen3_xml", "qwen3"),
    "nemotron_3_nano": ("qwen3_xml", "nemotron_v3"),
    "llama3_1": ("llama3_json", None),
    "gptoss": ("openai", "openai_gptoss"),
    "glm4moe": ("glm47", "glm45"),
    "gemma4": ("gemma4", "gemma4"),
    "gemma4_v5": ("gemma4", "gemma4"),
    "lfm2_v2": ("lfm2", None),
    "lfm2_2_5_vl": ("lfm2", None),
    "muse_glimmer": ("muse_glimmer", "muse_glimmer"),
}


@dataclass(frozen=True)
class VllmReading:
    """What vLLM's server would answer: the calls as (name, arguments read as Python's `json` reads them, or the raw
    string where they are no JSON), the content and the reasoning."""

    calls: list[tuple[str, Any]]
    content: str | None
    reasoning: str | None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def vllm_read(
    template: str, tokenizer: PreTrainedTokenizerBase, output_ids: list[int], prompt_ids: list[int], tools: list
) -> VllmReading:
    """`output_ids` read by vLLM's parsers for `template`'s family, as its OpenAI server reads them."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    tool_parser, reasoning_parser = VLLM_PARSERS[template]
    harmony = tool_parser == "openai"
    parser_cls = ParserManager.get_parser(tool_parser, reasoning_parser, enable_auto_tools=True, is_harmony=harmony)
    parser = parser_cls(tokenizer, None)
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "."}], tools=tools)
    request = parser.adjust_request(request)
    if harmony:
        from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

        text = tokenizer.decode(output_ids, skip_special_tokens=False)
        ids = get_encoding().encode(text, allowed_special="all")
    else:
        parser.set_prompt_token_ids(prompt_ids)
        ids = output_ids
        text = tokenizer.decode(output_ids, skip_special_tokens=request.skip_special_tokens)
    reasoning, content, calls = parser.parse(text, request, True, ids)
    return VllmReading([(c.name, _arguments(c.arguments)) for c in calls or []], content, reasoning)
