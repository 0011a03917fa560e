"""The training chat template: how a conversation becomes the exact text and token ids a policy is trained on.

`TrainingTemplate` installs TRL's prefix-preserving training template (`get_training_chat_template`, verified
with `is_chat_template_prefix_preserving`) on its own copy of a tokenizer, and refuses, with the reason, a
tokenizer that cannot provide one or whose template does not close an assistant turn with a token. A model's
end of turn is a set of tokens (`end_tokens`, found by rendering a plain reply and a tool call: ChatML's
`<|im_end|>`; harmony's `<|return|>` and `<|call|>`; GLM's `<|user|>` and `<|observation|>`, the next turn's
opener, which the model writes to end its own); generation stops at any of them (`stop_token_ids`). It renders
and tokenises whole conversations (`prompt_ids`: a first turn or a fork) and the *interstitial*
(`interstitial_ids`: the tokens between the token that closed the last assistant turn and the next generation,
rendered from a two-message context so that its cost grows with the new messages, not with the history).
`check_reply` tells whether the template renders an assistant reply at all. Messages are normalised first
(`swe_grpo.tokens.messages`); a template that raises on a conversation is reported as `TemplateRefusedError`, a
`MessageFormatError`.

TRL's template utilities import torch (through `transformers.PreTrainedModel`): ~0.5 GB and seconds of
start-up. They are imported only when a process first meets a chat template, and the verdict is remembered
per template (`training_chat_template`); a process handed the verdicts (`remember_training_chat_templates`,
as every rollout host is, by the trainer) never imports them.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from swe_grpo.tokens.messages import Message, MessageFormatError

TemplateKey = tuple[str, str, int]  # (chat template, tokenizer's name or path, vocabulary size)
_VERIFIED: dict[TemplateKey, str] = {}  # this process's verdicts: TemplateKey -> the training template

# Stands in for the history before the last assistant message when rendering an interstitial. Templates
# that require a user turn somewhere in the conversation (Qwen3.5+) are satisfied by it.
_CONTEXT_USER: Message = {"role": "user", "content": "."}
# A template that reads an assistant's reasoning from `thinking` (gpt-oss, LFM2.5), not `reasoning_content`.
_READS_THINKING = re.compile(r"""message(?:\.thinking\b|\[['"]thinking['"]\])|['"]thinking['"] in message""")


def _with_thinking(message: Message) -> Message:
    """`message` with its reasoning (normalised as `reasoning_content`) also where such a template reads it."""
    if message["role"] != "assistant" or not message.get("reasoning_content") or "thinking" in message:
        return message
    return {**message, "thinking": message["reasoning_content"]}


class TemplateNotPrefixPreservingError(ValueError):
    """The tokenizer's chat template cannot give bridge-exact prompts."""


class TemplateRefusedError(MessageFormatError):
    """The training chat template raised while rendering a conversation (e.g. Llama 3.2's refuses an
    assistant message with two tool calls)."""


def _key(tokenizer: PreTrainedTokenizerBase) -> TemplateKey:
    return (repr(tokenizer.chat_template), tokenizer.name_or_path, len(tokenizer))


def training_chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """`tokenizer`'s chat template made prefix-preserving: TRL's training variant of it, or the template as
    it is, checked with TRL's `is_chat_template_prefix_preserving`; `TemplateNotPrefixPreservingError` when
    neither is. The verdict is remembered for this process (see the module docstring)."""
    key = _key(tokenizer)
    if (known := _VERIFIED.get(key)) is not None:
        return known
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    probe = copy.deepcopy(tokenizer)  # the caller's tokenizer is never modified, not even for a moment
    try:
        template = get_training_chat_template(probe) or probe.chat_template
    except ValueError:
        template = probe.chat_template  # TRL has no training variant; the template may still be usable as it is
    probe.chat_template = template
    if not is_chat_template_prefix_preserving(probe):
        raise TemplateNotPrefixPreservingError(
            "the chat template is not prefix-preserving (rendering [user, assistant] and then "
            "[user, assistant, tool] changes the earlier tokens) and TRL has no training variant for "
            "it; bridge-exact prompts are impossible. Use a template TRL supports "
            "(trl.chat_template_utils.get_training_chat_template) or fix the template."
        )
    _VERIFIED[key] = template
    return template


def known_training_chat_templates() -> dict[TemplateKey, str]:
    """The verdicts this process has reached (`training_chat_template`), to hand to another process."""
    return dict(_VERIFIED)


def remember_training_chat_templates(known: dict[TemplateKey, str]) -> None:
    """Take verdicts another process reached with the same TRL (`known_training_chat_templates`)."""
    _VERIFIED.update(known)


class TrainingTemplate:
    """A tokenizer with TRL's prefix-preserving training chat template installed.

    Holds its own copy of the tokenizer (the caller's is not modified). Refuses, with the reason,
    a tokenizer whose template cannot be made prefix-preserving or does not close an assistant turn
    with a token (`end_tokens`: the markers the interstitial is cut at).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any):
        if not tokenizer.chat_template:
            raise TemplateNotPrefixPreservingError("the tokenizer has no chat template")
        self.tokenizer = copy.deepcopy(tokenizer)
        self.tokenizer.chat_template = training_chat_template(self.tokenizer)
        self.template_kwargs = template_kwargs
        self._reads_thinking = _READS_THINKING.search(self.tokenizer.chat_template) is not None
        # The Rust tokenizer directly: the same ids as `tokenizer.encode` without its Python overhead.
        self._backend = self.tokenizer.backend_tokenizer
        self.eos_token: str = self.tokenizer.eos_token
        self.eos_token_id: int = self.tokenizer.convert_tokens_to_ids(self.eos_token)
        self._turn_start = len(self.render([_CONTEXT_USER]))
        self._candidates = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        self.end_tokens: tuple[str, ...] = self._find_end_tokens()
        self._check_turn_after_results()
        self.end_token_ids: frozenset[int] = frozenset(self.tokenizer.convert_tokens_to_ids(list(self.end_tokens)))
        # What generation stops at: every token that closes a turn, and the EOS (a model may end with it anyway).
        self.stop_token_ids: tuple[int, ...] = tuple(sorted(self.end_token_ids | {self.eos_token_id}))

    def _find_end_tokens(self) -> tuple[str, ...]:
        """The tokens that close an assistant turn as the template renders one: a plain reply followed by a user
        turn, and a tool call followed by its result. A closer is the last token of the turn's own text (ChatML's
        `<|im_end|>`, harmony's `<|return|>` and `<|call|>`) or, for a template that writes none, the first token
        of the next turn, which the model writes to end its own (GLM's `<|user|>` and `<|observation|>`)."""
        plain: Message = {"role": "assistant", "content": "probe"}
        follow: list[tuple[Message, Message]] = [(plain, {"role": "user", "content": "."})]
        call = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": {"k": "v"}}}
        calling: Message = {"role": "assistant", "content": "", "tool_calls": [call]}
        follow.append((calling, {"role": "tool", "tool_call_id": "call_probe", "content": "."}))
        found: list[str] = []
        for i, (reply, after) in enumerate(follow):
            try:
                closer = self._closer(self.render([_CONTEXT_USER, reply]), self.render([_CONTEXT_USER, reply, after]))
            except TemplateRefusedError:
                if i == 0:
                    raise
                continue  # a template that writes no tool call this way: its plain turns decide
            if closer is None:
                if i == 0:
                    raise TemplateNotPrefixPreservingError(
                        "the chat template does not close an assistant turn with a single token: neither the turn "
                        "it renders for a reply nor the turn after it ends or starts with one"
                    )
                continue
            if closer[0] not in found:
                found.append(closer[0])
        return tuple(found)

    def _check_turn_after_results(self) -> None:
        """Refuse a template under which a model writes a reply after a tool result otherwise than after a user turn
        (DiffusionGemma: after a user turn its generation prompt opens the turn, `<|turn>model\n`; after a tool
        result it writes none and renders the next turn with that header, which the model would have to write
        itself). A reply may need reasoning to start as the generation prompt does (Nemotron's `<think>\n`)."""
        call = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": {"k": "v"}}}
        calling: Message = {"role": "assistant", "content": "", "tool_calls": [call]}
        after_user = [_CONTEXT_USER]
        after_result = [_CONTEXT_USER, calling, {"role": "tool", "tool_call_id": "call_probe", "content": "."}]

        def written(history: list[Message], reply: Message) -> str:
            prompt, turn = self.render(history, generation_prompt=True), self.render([*history, reply])
            return turn[len(prompt) :] if turn.startswith(prompt) else ""

        for reply in ({"role": "assistant", "content": "probe"}, calling):
            try:
                variants = [
                    (written(after_user, r), written(after_result, r))
                    for r in (reply, {**reply, "reasoning_content": "probe"})
                ]
            except TemplateRefusedError:
                return  # a template that writes no tool call this way
            if any(first and first == later for first, later in variants):
                continue
            first, later = variants[0]
            if not any(first for first, _ in variants):
                prompt = self.render(after_user, generation_prompt=True)
                raise TemplateNotPrefixPreservingError(
                    "the chat template renders a reply that does not start with its own generation prompt (which "
                    f"ends {prompt[-20:]!r}), with or without reasoning"
                )
            raise TemplateNotPrefixPreservingError(
                "the chat template has a model write a reply after a tool result otherwise than after a user "
                f"turn: {later[:40]!r} against {first[:40]!r}"
            )

    def _closer(self, before: str, after: str, tokens: tuple[str, ...] | None = None) -> tuple[str, str] | None:
        """(the token that closes the last assistant turn of `before`, the text after it in `after`), or None when
        no token of `tokens` (by default: any of the tokenizer's added tokens) closes it. The turn's own last token
        closes it whatever follows; only a turn that ends without one needs `after` to extend `before` (its closer
        is then the first token of what follows). See `_find_end_tokens`."""
        candidates = self._candidates if tokens is None else tokens
        tail = before[self._turn_start :]
        stripped = tail.rstrip()
        rest = after[len(before) :] if after.startswith(before) else ""
        for token in candidates:
            if stripped.endswith(token):
                return token, tail[len(stripped) :] + rest
        for token in candidates:
            if rest.startswith(token):
                return token, rest[len(token) :]
        return None

    def render(self, messages: list[Message], tools: list | None = None, generation_prompt: bool = False) -> str:
        """The template's text for `messages`. Raises TemplateRefusedError when the template raises: a
        template is code that may refuse a conversation (`raise_exception(...)`) or fail on its shape."""
        if self._reads_thinking:
            messages = [_with_thinking(m) for m in messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                **self.template_kwargs,
            )
        except Exception as e:
            raise TemplateRefusedError(f"the chat template refuses this conversation: {type(e).__name__}: {e}") from e

    def encode(self, text: str) -> list[int]:
        # The same ids as `encode`, but `encode_batch*` releases the GIL while it tokenises (the server's event
        # loop keeps running meanwhile), and the `_fast` variant tracks no offsets, whose deallocation would run
        # under the GIL.
        return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def prompt_ids(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """A full render of `messages` with the generation prompt (first turn, or a fork)."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def interstitial_ids(
        self,
        last_assistant: Message,
        new_messages: list[Message],
        tools: list | None,
        last_output_id: int,
        before: str | None = None,
    ) -> list[int] | None:
        """Tokens that follow the last assistant turn's end token: `new_messages` and the generation prompt.

        `last_output_id` is the last token the model generated for that turn. When it is not an end token (the
        output hit max_tokens), the end token the template writes for the turn is prepended, as the template would
        have closed it. Returns None when this conversation breaks prefix preservation, or the model closed the
        turn with another end token than the template writes after it (GLM's `<|user|>` after a tool call): the
        caller forks instead. `before`: `check_reply`'s rendering of `last_assistant` with `tools`, when the caller
        kept it (one render fewer per turn); rendered again when it is not a prefix of this turn's rendering (a
        template that writes the date, rendered on another day).
        """
        context = [_CONTEXT_USER, last_assistant]
        after = self.render(context + new_messages, tools, generation_prompt=True)
        if before is None or not after.startswith(before):
            before = self.render(context, tools)
        closer = self._closer(before, after, self.end_tokens) if after.startswith(before) else None
        if closer is None:
            return None
        token, text = closer
        if last_output_id in self.end_token_ids or last_output_id == self.eos_token_id:
            if self.tokenizer.convert_tokens_to_ids(token) != last_output_id:
                return None
            return self.encode(text)
        return self.encode(token + text)

    def reply_text(self, message: Message, tools: list | None = None) -> str:
        """The text a model writes for the (normalised) assistant `message`: the template's rendering of the turn
        after its generation prompt, through the token that closes it (see `end_tokens`). ValueError when the
        template writes the generation prompt differently from the start of an assistant turn."""
        prompt = self.render([_CONTEXT_USER], tools, generation_prompt=True)
        calls = message.get("tool_calls") or []
        follow: list[Message] = [{"role": "tool", "tool_call_id": c.get("id"), "content": "."} for c in calls]
        context = [_CONTEXT_USER, message]
        before = self.render(context, tools)
        after = self.render(context + (follow or [{"role": "user", "content": "."}]), tools)
        closer = self._closer(before, after, self.end_tokens)
        text = after if after.startswith(before) else before
        if not text.startswith(prompt) or closer is None:
            raise ValueError("the template writes the generation prompt differently from an assistant turn")
        return text[len(prompt) : len(text) - len(closer[1])]

    def check_reply(self, message: Message, tools: list | None = None) -> str:
        """Render the (normalised) assistant `message` as `interstitial_ids` will render it after the turn (the text,
        which the next turn's `interstitial_ids` takes as `before`); raises TemplateRefusedError when the template
        refuses it."""
        return self.render([_CONTEXT_USER, message], tools)
