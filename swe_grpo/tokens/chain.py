"""The TokenChain: exact prompt token ids for every turn of an agent's conversation.

An agent re-sends its whole history every turn, as OpenAI chat messages. Re-rendering that history with
a chat template and sending the result to vLLM looks harmless but is not: the agent re-serialises tool
arguments, drops empty text, and the template may render an earlier assistant turn differently from the
tokens the model actually produced. The trainer would then score tokens under a context vLLM never saw.

The chain avoids this by construction ("bridge-exact"). It holds every prompt token it sent and every
token the model produced, untouched. When the next request's history extends what it holds, the next
prompt is the held chain followed by the *interstitial*: the tokens the training chat template puts
after the last assistant message (tool results, the next generation prompt). The interstitial is
rendered from a two-message context, so its cost grows with the new messages, not with the history.
When the history does not extend what the chain holds (the agent compacted, truncated or edited it), the
chain FORKS: the current training row is closed and a new one starts from a fresh render. Every turn is
recorded as clean or fork.

A turn is a transaction: `prepare` changes nothing, and `commit` validates the reply completely (it
normalises, and the training template renders it) before it touches the chain, so a failure leaves the
chain as it was. A request that says again what the last committed turn's request said (the agent retrying: it
never received that reply, or never used it) REPLACES that turn: a reply the agent never received is never trained
on. "Says again" is decided by what was said, not by bytes: the same conversation (text parts joined or not, JSON
re-serialised, numbers respelled) counts, whatever the system prompt or tool list; when those changed, the retry's
prompt is a fresh render (a fork), else it is the replaced turn's prompt and does not fork.

The template is TRL's prefix-preserving training template (`get_training_chat_template`), verified with
`is_chat_template_prefix_preserving`; a tokenizer that cannot provide one is refused at construction.
"""

from __future__ import annotations

import copy
import json
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

Message = dict[str, Any]

# Stands in for the history before the last assistant message when rendering an interstitial. Templates
# that require a user turn somewhere in the conversation (Qwen3.5+) are satisfied by it.
_CONTEXT_USER: Message = {"role": "user", "content": "."}


class TemplateNotPrefixPreservingError(ValueError):
    """The tokenizer's chat template cannot give bridge-exact prompts."""


class MessageFormatError(ValueError):
    """A request's messages are not valid OpenAI chat messages (the caller answers 400)."""


class TemplateRefusedError(MessageFormatError):
    """The training chat template raised while rendering a conversation (e.g. Llama 3.2's refuses an
    assistant message with two tool calls)."""


# --------------------------------------------------------------------------- message normalisation


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise MessageFormatError(f"{where}: unsupported content part {kind!r} (only text is supported)")
            parts.append(part["text"])
        return "".join(parts)
    raise MessageFormatError(f"{where}: content must be a string, a list of text parts, or null")


def _tool_call(call: Any, where: str) -> Message:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise MessageFormatError(f"{where}: a tool call needs a 'function' object")
    fn = call["function"]
    if not isinstance(fn.get("name"), str):
        raise MessageFormatError(f"{where}: a tool call needs a function name")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise MessageFormatError(f"{where}: tool call arguments are not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise MessageFormatError(f"{where}: tool call arguments must be a JSON object")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def normalize_message(message: Any, index: int = 0) -> Message:
    """One OpenAI chat message, as an agent sends it, in the form chat templates render.

    Content parts are joined into one string and `null` becomes `""`; tool-call `arguments` JSON
    strings become objects, so re-serialised JSON compares equal; reasoning echoed back under
    `reasoning` or `reasoning_content` becomes `reasoning_content`; `developer` becomes `system`.
    """
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise MessageFormatError(f"{where}: must be an object")
    role = message.get("role")
    if role == "developer":
        role = "system"
    if role not in ("system", "user", "assistant", "tool"):
        raise MessageFormatError(f"{where}: unsupported role {role!r}")
    out: Message = {"role": role, "content": _text(message.get("content"), where)}
    if role == "assistant":
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if reasoning:
            out["reasoning_content"] = _text(reasoning, where)
        calls = message.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise MessageFormatError(f"{where}: tool_calls must be a list")
            out["tool_calls"] = [_tool_call(c, where) for c in calls]
    elif role == "tool":
        out["tool_call_id"] = message.get("tool_call_id")
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
    return out


def same_json(a: Any, b: Any) -> bool:
    """Whether two decoded JSON values are the same value: numbers by value (`30.0` is `30`, as a JavaScript
    agent re-serialises it), but a boolean is no number (Python's `True == 1` must not decide it)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(same_json, a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _same_assistant(held: Message, incoming: Message) -> bool:
    calls, echoed = held.get("tool_calls") or [], incoming.get("tool_calls") or []
    return (
        held["content"].strip() == incoming["content"].strip()
        and held.get("reasoning_content", "").strip() == incoming.get("reasoning_content", "").strip()
        and len(calls) == len(echoed)
        and all(
            a["function"]["name"] == b["function"]["name"]
            and same_json(a["function"]["arguments"], b["function"]["arguments"])
            for a, b in zip(calls, echoed, strict=True)
        )
    )


def same_message(held: Message, incoming: Message) -> bool:
    """Whether an incoming (normalised) message says what the held one said.

    Exact for every role but the assistant's: an agent echoing a reply back may re-serialise it (other
    tool-call ids, whitespace around text), and the chain already holds the tokens the model produced,
    so an assistant message matches when its text, reasoning, tool names and argument values (`same_json`) do.
    """
    if held is incoming:
        return True
    if held["role"] == incoming["role"] == "assistant":
        return _same_assistant(held, incoming)
    return held == incoming


# --------------------------------------------------------------------------- the training template


class TrainingTemplate:
    """A tokenizer with TRL's prefix-preserving training chat template installed.

    Holds its own copy of the tokenizer (the caller's is not modified). Refuses, with the reason,
    a tokenizer whose template cannot be made prefix-preserving or does not end an assistant turn
    with the tokenizer's EOS token (the marker the interstitial is cut at).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any):
        if not tokenizer.chat_template:
            raise TemplateNotPrefixPreservingError("the tokenizer has no chat template")
        self.tokenizer = copy.deepcopy(tokenizer)
        try:
            patched = get_training_chat_template(self.tokenizer)
        except ValueError:
            patched = None  # TRL has no training variant; the template may still be usable as it is
        if patched is not None:
            self.tokenizer.chat_template = patched
        if not is_chat_template_prefix_preserving(self.tokenizer):
            raise TemplateNotPrefixPreservingError(
                "the chat template is not prefix-preserving (rendering [user, assistant] and then "
                "[user, assistant, tool] changes the earlier tokens) and TRL has no training variant for "
                "it; bridge-exact prompts are impossible. Use a template TRL supports "
                "(trl.chat_template_utils.get_training_chat_template) or fix the template."
            )
        self.template_kwargs = template_kwargs
        # The Rust tokenizer directly: the same ids as `tokenizer.encode` without its Python overhead.
        self._backend = self.tokenizer.backend_tokenizer
        self.eos_token: str = self.tokenizer.eos_token
        self.eos_token_id: int = self.tokenizer.convert_tokens_to_ids(self.eos_token)
        probe = self.render([_CONTEXT_USER, {"role": "assistant", "content": "probe"}])
        if self.eos_token not in probe[probe.rfind("probe") :]:
            raise TemplateNotPrefixPreservingError(
                f"the chat template does not end an assistant turn with the EOS token {self.eos_token!r}"
            )

    def render(self, messages: list[Message], tools: list | None = None, generation_prompt: bool = False) -> str:
        """The template's text for `messages`. Raises TemplateRefusedError when the template raises: a
        template is code that may refuse a conversation (`raise_exception(...)`) or fail on its shape."""
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
        # The same ids as `encode`, but `encode_batch*` releases the GIL while it tokenises (a megabyte
        # takes about a second; the server's event loop keeps running meanwhile), and the `_fast` variant
        # tracks no offsets, whose deallocation alone (under the GIL) takes ~50 ms for 2 MB of text.
        return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def prompt_ids(self, messages: list[Message], tools: list | None = None) -> list[int]:
        """A full render of `messages` with the generation prompt (first turn, or a fork)."""
        return self.encode(self.render(messages, tools, generation_prompt=True))

    def interstitial_ids(
        self, last_assistant: Message, new_messages: list[Message], tools: list | None, closed: bool
    ) -> list[int] | None:
        """Tokens that follow the last assistant turn's EOS: `new_messages` and the generation prompt.

        `closed` says whether the model's output ended with the EOS token; if not (it hit max_tokens),
        the EOS is prepended, as the template would have closed the turn. Returns None when this
        conversation breaks prefix preservation (the caller forks instead).
        """
        context = [_CONTEXT_USER, last_assistant]
        before = self.render(context, tools)
        after = self.render(context + new_messages, tools, generation_prompt=True)
        if not after.startswith(before):
            return None
        cut = before.rfind(self.eos_token) + len(self.eos_token)
        text = before[cut:] + after[len(before) :]
        return self.encode(text if closed else self.eos_token + text)


# --------------------------------------------------------------------------- records


@dataclass
class TrainingRow:
    """One training sequence: prompt and completion tokens, aligned masks and vLLM log-probs.

    `completion_mask[i]` is 1 where the model produced `input_ids[i]`; `old_log_probs[i]` is vLLM's
    log-prob of that token (0.0 elsewhere). `model_version` is the oldest policy version that produced
    any of the row's tokens. Stored as typed arrays, not lists: ~13 bytes a token instead of ~50, and
    nothing for the garbage collector to walk (hundreds of rollouts hold millions of tokens); `as_dict`
    gives plain lists.
    """

    input_ids: array = field(default_factory=lambda: array("i"))
    completion_mask: array = field(default_factory=lambda: array("b"))
    old_log_probs: array = field(default_factory=lambda: array("d"))
    model_version: int | None = None
    num_turns: int = 0

    def extend_prompt(self, ids: list[int] | array) -> None:
        """Append prompt tokens. Given an `array("i")` (as `PreparedTurn.packed_new_ids`), every copy is a
        memcpy: a megabyte-sized tool output appends in a millisecond (a list takes a hundred)."""
        self.input_ids.extend(ids if isinstance(ids, array) else array("i", ids))
        self.completion_mask.frombytes(bytes(len(ids)))
        self.old_log_probs.frombytes(bytes(self.old_log_probs.itemsize * len(ids)))  # all-zero bytes are 0.0

    def extend_completion(self, ids: list[int], log_probs: list[float], model_version: int) -> None:
        if len(ids) != len(log_probs):
            raise ValueError(f"{len(ids)} output tokens but {len(log_probs)} log-probs")
        self.input_ids.extend(ids)
        self.completion_mask.extend(repeat(1, len(ids)))
        self.old_log_probs.extend(log_probs)
        self.num_turns += 1
        if self.model_version is None or model_version < self.model_version:
            self.model_version = model_version

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_ids": self.input_ids.tolist(),
            "completion_mask": self.completion_mask.tolist(),
            "old_log_probs": self.old_log_probs.tolist(),
            "model_version": self.model_version,
            "num_turns": self.num_turns,
        }


def oldest_version(rows: Iterable[TrainingRow]) -> int | None:
    """The oldest policy version that produced any token of `rows`; None when none was generated."""
    return min((r.model_version for r in rows if r.model_version is not None), default=None)


@dataclass(frozen=True)
class TurnRecord:
    """What happened at one turn. `kind` is "clean" when the prompt extended the held chain (the
    first turn of a rollout counts as clean) and "fork" when a new row started from a fresh render;
    `drift_tokens` is how many held tokens the fork's fresh render did not reproduce; `retries` is how
    many earlier generations for this same request were replaced (the agent re-sent it)."""

    turn: int
    row: int
    kind: Literal["clean", "fork"]
    prompt_tokens: int
    new_prompt_tokens: int
    output_tokens: int
    model_version: int
    finish_reason: str
    drift_tokens: int = 0
    retries: int = 0


@dataclass(frozen=True)
class PreparedTurn:
    """A prompt ready to send; becomes part of the chain only through `TokenChain.commit`. `replaces`:
    the request repeats the last committed turn's, whose commit it will replace."""

    prompt_ids: list[int]
    new_ids: list[int]  # what this turn adds to the row (the interstitial, or the whole fresh render)
    fork: bool
    messages: list[Message]
    raw_messages: list[Any]
    tools: list | None
    drift_tokens: int
    replaces: bool = False
    # `new_ids` as the row stores them, packed where `prepare` runs (a worker thread), not in `commit`
    packed_new_ids: array = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "packed_new_ids", array("i", self.new_ids))


@dataclass(frozen=True)
class _Undo:
    """How to take the last committed turn back out of its row: the row's length, oldest version and
    turn count before it (`new_row`: the turn started the row, which then goes entirely)."""

    new_row: bool
    length: int
    model_version: int | None
    num_turns: int


# --------------------------------------------------------------------------- the chain


class TokenChain:
    """The token history of one rollout. Not thread-safe: serve one request at a time per chain."""

    def __init__(self, template: TrainingTemplate):
        self.template = template
        self.rows: list[TrainingRow] = []
        self.turns: list[TurnRecord] = []
        self._held: list[Message] = []  # normalised history through the last assistant message
        self._raw: list[Any] = []  # the previous request's messages as received, for a cheap equality test
        self._tools: list | None = None
        self._undo: _Undo | None = None  # how to replace the last committed turn (see `prepare`)

    @property
    def messages(self) -> list[Message]:
        """The conversation through the latest reply, normalised (what the rows' tokens render)."""
        return list(self._held)

    def _normalize(self, messages: list[Any]) -> list[Message]:
        # Messages the agent re-sends unchanged are not normalised again: equal raw dicts reuse the
        # held normalised form, so each turn normalises only what is new.
        out = []
        for i, message in enumerate(messages):
            if i < len(self._raw) and message == self._raw[i]:
                out.append(self._held[i])
            else:
                out.append(normalize_message(message, i))
        return out

    def prepare(self, messages: list[Any], tools: list | None = None) -> PreparedTurn:
        """The prompt ids for a request. Raises MessageFormatError for malformed messages (its subclass
        TemplateRefusedError when the template refuses the conversation). Changes nothing."""
        plan, norm = self._plan(messages, tools)
        if plan == "retry":
            return self._retry(norm, messages)
        if plan == "extend":
            held, chain = self._held, self.rows[-1].input_ids
            new_ids = self.template.interstitial_ids(
                held[-1], norm[len(held) :], tools, closed=chain[-1] == self.template.eos_token_id
            )
            if new_ids is not None:
                return PreparedTurn(chain.tolist() + new_ids, new_ids, False, norm, messages, tools, 0)
        replaces = plan == "replace"
        prompt = self.template.prompt_ids(norm, tools)
        chain = self._chain_before_last() if replaces else self.rows[-1].input_ids if self.rows else None
        drift = 0
        if chain is not None:
            common = next((i for i, (a, b) in enumerate(zip(chain, prompt, strict=False)) if a != b), None)
            drift = len(chain) - (min(len(chain), len(prompt)) if common is None else common)
        return PreparedTurn(prompt, prompt, chain is not None, norm, messages, tools, drift, replaces)

    def renders_whole_history(self, messages: list[Any], tools: list | None = None) -> bool:
        """Whether `prepare` renders the whole conversation (a first turn, a fork, a retry whose prompt
        changed) instead of only what is new, so that a caller can run it off its event loop. Raises as
        `prepare` does; changes nothing."""
        return self._plan(messages, tools)[0] in ("fresh", "replace")

    def _plan(self, messages: list[Any], tools: list | None) -> tuple[str, list[Message]]:
        """How to prepare a request, and its normalised messages: "retry" (it asks again what the last
        committed turn asked: the same prompt, replacing that turn), "replace" (it says the same as the last
        turn's request, but with another system prompt or tool list: a fresh render, replacing that turn),
        "extend" (it extends the chain) or "fresh" (first turn or fork)."""
        if not isinstance(messages, list) or not messages:
            raise MessageFormatError("messages must be a non-empty list")
        if tools is not None and not isinstance(tools, list):
            raise MessageFormatError("tools must be a list")
        if self._undo is not None and messages == self._raw and tools == self._tools:
            return "retry", self._held[:-1]  # byte-identical: no need to normalise
        norm = self._normalize(messages)
        held = self._held
        if self._repeats_last_request(norm):
            asked = held[:-1]
            same = tools == self._tools and len(norm) == len(asked) and all(map(same_message, asked, norm))
            return ("retry" if same else "replace"), norm
        if self.rows and tools == self._tools and len(norm) >= len(held) and all(map(same_message, held, norm)):
            return "extend", norm
        return "fresh", norm

    def _repeats_last_request(self, norm: list[Message]) -> bool:
        """Whether `norm` is the last committed turn's request again: an agent re-sending a request whose reply
        it never used (its client gave up, or rebuilt the request: text parts joined, another tool list, a
        fresh date in its system prompt). Decided by what was said, every message but the system's (compared
        as `same_message` does), not by bytes; the reply it replaces was never part of the agent's history."""
        if self._undo is None:
            return False
        said = [m for m in norm if m["role"] != "system"]
        asked = [m for m in self._held[:-1] if m["role"] != "system"]
        return len(said) == len(asked) and all(map(same_message, asked, said))

    def _chain_before_last(self) -> array | None:
        """The tokens the chain holds without its last committed turn (None: that turn started the chain)."""
        undo = self._undo
        if not undo.new_row:
            return self.rows[-1].input_ids[: undo.length]
        return self.rows[-2].input_ids if len(self.rows) > 1 else None

    def _retry(self, messages: list[Message], raw_messages: list[Any]) -> PreparedTurn:
        """The last committed turn's prompt again, read back from its row (the same request renders the
        same prompt), to be generated from anew and to replace that turn."""
        last, undo = self.turns[-1], self._undo
        ids = self.rows[-1].input_ids
        start = 0 if undo.new_row else undo.length
        return PreparedTurn(
            prompt_ids=ids[: start + last.new_prompt_tokens].tolist(),
            new_ids=ids[start : start + last.new_prompt_tokens].tolist(),
            fork=last.kind == "fork",
            messages=messages,
            raw_messages=raw_messages,
            tools=self._tools,
            drift_tokens=last.drift_tokens,
            replaces=True,
        )

    def reply_message(self, turn: PreparedTurn, message: Message) -> Message:
        """`message` (the assistant reply to `turn`) as the chain will hold it: normalised, and rendered by
        the training template as the next turn's interstitial will render it. Raises MessageFormatError
        (TemplateRefusedError when the template refuses it); changes nothing."""
        held = normalize_message(message, len(turn.messages))
        self.template.render([_CONTEXT_USER, held], turn.tools)
        return held

    def commit(
        self,
        turn: PreparedTurn,
        output_ids: list[int],
        log_probs: list[float],
        model_version: int,
        assistant_message: Message,
        finish_reason: str,
    ) -> TurnRecord:
        """Append a generation for `turn` (which must come from this chain's latest `prepare`), replacing
        the last committed turn when `turn.replaces`.

        `assistant_message` is the OpenAI message returned to the agent; the agent's next request is
        expected to echo it back, and the comparison that decides clean vs fork is made against it.
        Everything that can fail is checked first (`reply_message`, the log-probs): on an error the chain
        is unchanged.
        """
        held = self.reply_message(turn, assistant_message)
        if len(output_ids) != len(log_probs):
            raise ValueError(f"{len(output_ids)} output tokens but {len(log_probs)} log-probs")
        retries = 0
        if turn.replaces:
            retries = self.turns.pop().retries + 1
            self._take_back(self._undo)
        if not self.rows or turn.fork:
            self.rows.append(TrainingRow())
            self._undo = _Undo(True, 0, None, 0)
        else:
            row = self.rows[-1]
            self._undo = _Undo(False, len(row.input_ids), row.model_version, row.num_turns)
        row = self.rows[-1]
        row.extend_prompt(turn.packed_new_ids)
        row.extend_completion(output_ids, log_probs, model_version)
        self._held = [*turn.messages, held]
        self._raw = turn.raw_messages
        self._tools = turn.tools
        record = TurnRecord(
            turn=len(self.turns),
            row=len(self.rows) - 1,
            kind="fork" if turn.fork else "clean",
            prompt_tokens=len(turn.prompt_ids),
            new_prompt_tokens=len(turn.new_ids),
            output_tokens=len(output_ids),
            model_version=model_version,
            finish_reason=finish_reason,
            drift_tokens=turn.drift_tokens,
            retries=retries,
        )
        self.turns.append(record)
        return record

    def _take_back(self, undo: _Undo) -> None:
        if undo.new_row:
            self.rows.pop()
            return
        row = self.rows[-1]
        del row.input_ids[undo.length :], row.completion_mask[undo.length :], row.old_log_probs[undo.length :]
        row.model_version, row.num_turns = undo.model_version, undo.num_turns
