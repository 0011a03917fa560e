"""The TokenChain: exact prompt token ids for every turn of an agent's conversation.

An agent re-sends its whole history every turn, as OpenAI chat messages. Re-rendering that history with
a chat template and sending the result to vLLM looks harmless but is not: the agent re-serialises tool
arguments, drops empty text, and the template may render an earlier assistant turn differently from the
tokens the model actually produced. The trainer would then score tokens under a context vLLM never saw.

The chain avoids this by construction ("bridge-exact"). It holds every prompt token it sent and every
token the model produced, untouched. When the next request's history extends what it holds (compared with
`same_message`), the next prompt is the held chain followed by the *interstitial* of the training template
(`TrainingTemplate.interstitial_ids`: tool results, the next generation prompt). When the history does not
extend what the chain holds (the agent compacted, truncated or edited it), the chain FORKS: the current
training row is closed and a new one starts from a fresh render. Every turn is recorded as clean or fork, a fork with
its named cause (`TurnRecord.fork_cause`: what the agent changed, `swe_grpo.tokens.messages.fork_cause`).

A turn is a transaction: `prepare` changes nothing, and `commit` validates the reply completely (it
normalises, and the training template renders it) before it touches the chain, so a failure leaves the
chain as it was. A request that says again what the last committed turn's request said (the agent retrying: it
never received that reply, or never used it) REPLACES that turn: a reply the agent never received is never trained
on. "Says again" is decided by what was said, not by bytes: the same conversation (text parts joined or not, JSON
re-serialised, numbers respelled) counts, whatever the system prompt or tool list; when those changed, the retry's
prompt is a fresh render (a fork), else it is the replaced turn's prompt and does not fork.

Usage: one `TokenChain(template)` per rollout; per request `turn = chain.prepare(messages, tools)`, generate
from `turn.prompt`, then `chain.commit(turn, output_ids, log_probs, version, reply, finish_reason)`. The
training data is `chain.rows` (`TrainingRow`), the per-turn story `chain.turns` (`TurnRecord`). The template and
message helpers are re-exported here from `swe_grpo.tokens.template` and `swe_grpo.tokens.messages`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, Literal

from swe_grpo.tokens.messages import (
    Message,
    MessageFormatError,
    fork_cause,
    normalize_message,
    same_json,
    same_message,
)
from swe_grpo.tokens.template import TemplateNotPrefixPreservingError, TemplateRefusedError, TrainingTemplate

__all__ = [
    "Message",
    "MessageFormatError",
    "PreparedTurn",
    "TemplateNotPrefixPreservingError",
    "TemplateRefusedError",
    "TokenChain",
    "TrainingRow",
    "TrainingTemplate",
    "TurnPlan",
    "TurnRecord",
    "fork_cause",
    "normalize_message",
    "oldest_version",
    "same_json",
    "same_message",
]

# --------------------------------------------------------------------------- records


@dataclass
class TrainingRow:
    """One training sequence: prompt and completion tokens, aligned masks and vLLM log-probs.

    `completion_mask[i]` is 1 where the model produced `input_ids[i]`; `old_log_probs[i]` is vLLM's
    log-prob of that token (0.0 elsewhere). `model_version` is the oldest policy version that produced
    any of the row's tokens. Stored as typed arrays, not lists: 13 bytes a token (int32, int8, float64) and
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
        memcpy, whatever the size of the tool output it holds."""
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
    `drift_tokens` is how many held tokens the fork's fresh render did not reproduce; `fork_cause` names why it forked
    (`fork_cause`'s names, or `no_interstitial` when the history extends the chain but the template writes nothing
    that follows the held turn's last token); `retries` is how many earlier generations for this same request were
    replaced (the agent re-sent it)."""

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
    fork_cause: str = ""


@dataclass(frozen=True)
class PreparedTurn:
    """A prompt ready to send; becomes part of the chain only through `TokenChain.commit`. `replaces`:
    the request repeats the last committed turn's, whose commit it will replace.

    `prompt` holds the prompt ids packed as the rows hold them (`array("i")`: the held tokens are copied as bytes,
    and `VLLMClient` writes them to JSON from the buffer); `prompt_ids` is the same as a list, made when asked for.
    """

    prompt: array
    new_ids: list[int]  # what this turn adds to the row (the interstitial, or the whole fresh render): the prompt's end
    fork: bool
    messages: list[Message]
    raw_messages: list[Any]
    tools: list | None
    drift_tokens: int
    replaces: bool = False
    fork_cause: str = ""  # why it forks (`TurnRecord.fork_cause`); empty when it does not

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt.tolist()

    @property
    def packed_new_ids(self) -> array:
        """`new_ids` as the row stores them: the end of `prompt`."""
        return self.prompt[len(self.prompt) - len(self.new_ids) :]


@dataclass(frozen=True)
class TurnPlan:
    """How `TokenChain.prepare` serves a request (`TokenChain.plan`), decided once: `kind` is "retry", "replace",
    "extend" or "fresh" (`TokenChain.plan`), `messages` the request's normalised. Good until the chain's next
    commit (`commits`)."""

    kind: Literal["retry", "replace", "extend", "fresh"]
    messages: list[Message]
    raw_messages: list[Any]
    tools: list | None
    commits: int

    @property
    def renders_whole_history(self) -> bool:
        """Whether `prepare` renders the whole conversation (a first turn, a fork, a retry whose prompt changed)
        instead of only what is new, so that a caller can run it off its event loop."""
        return self.kind in ("fresh", "replace")


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
        # The template's rendering of the last assistant message (`check_reply`), which the next turn's
        # interstitial starts from; and the latest `reply_message`'s answer, which `commit` then need not redo.
        self._held_text: str | None = None
        self._replied: tuple[PreparedTurn, Message, Message, str] | None = None
        self._commits = 0  # a `TurnPlan` is good while this is what it was

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

    def prepare(self, messages: list[Any], tools: list | None = None, plan: TurnPlan | None = None) -> PreparedTurn:
        """The prompt ids for a request. Raises MessageFormatError for malformed messages (its subclass
        TemplateRefusedError when the template refuses the conversation). Changes nothing. `plan`: `self.plan` of
        the same request, when the caller asked for it first (its work is not redone; ValueError when a commit came
        between)."""
        if plan is None:
            plan = self.plan(messages, tools)
        elif plan.commits != self._commits or plan.raw_messages is not messages or plan.tools is not tools:
            raise ValueError("the plan is not this chain's plan of this request as it is now")
        kind, norm = plan.kind, plan.messages
        if kind == "retry":
            return self._retry(norm, messages)
        if kind == "extend":
            held, chain = self._held, self.rows[-1].input_ids
            new_ids = self.template.interstitial_ids(held[-1], norm[len(held) :], tools, chain[-1], self._held_text)
            if new_ids is not None:
                return PreparedTurn(chain + array("i", new_ids), new_ids, False, norm, messages, tools, 0)
        replaces = kind == "replace"
        prompt = self.template.prompt_ids(norm, tools)
        chain = self._chain_before_last() if replaces else self.rows[-1].input_ids if self.rows else None
        drift, cause = 0, ""
        if chain is not None:
            common = next((i for i, (a, b) in enumerate(zip(chain, prompt, strict=False)) if a != b), None)
            drift = len(chain) - (min(len(chain), len(prompt)) if common is None else common)
            # A retry is compared with what its replaced turn asked; anything else with the history through the reply.
            held = self._held[:-1] if replaces else self._held
            cause = fork_cause(held, self._tools, norm, tools) or "no_interstitial"
        return PreparedTurn(
            array("i", prompt), prompt, chain is not None, norm, messages, tools, drift, replaces, cause
        )

    def plan(self, messages: list[Any], tools: list | None = None) -> TurnPlan:
        """How `prepare` will serve a request, and its normalised messages: "retry" (it asks again what the last
        committed turn asked: the same prompt, replacing that turn), "replace" (it says the same as the last
        turn's request, but with another system prompt or tool list: a fresh render, replacing that turn),
        "extend" (it extends the chain) or "fresh" (first turn or fork). Raises as `prepare` does; changes nothing."""
        kind, norm = self._plan(messages, tools)
        return TurnPlan(kind, norm, messages, tools, self._commits)

    def _plan(
        self, messages: list[Any], tools: list | None
    ) -> tuple[Literal["retry", "replace", "extend", "fresh"], list[Message]]:
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
            prompt=ids[: start + last.new_prompt_tokens],
            new_ids=ids[start : start + last.new_prompt_tokens].tolist(),
            fork=last.kind == "fork",
            messages=messages,
            raw_messages=raw_messages,
            tools=self._tools,
            drift_tokens=last.drift_tokens,
            replaces=True,
            fork_cause=last.fork_cause,
        )

    def size_after(self, turn: PreparedTurn) -> tuple[int, int]:
        """The rows and the tokens the chain would hold with `turn` committed, its output not counted (for a cap on
        what one rollout may hold: `swe_grpo.serving.limits`)."""
        rows, tokens = len(self.rows), sum(len(row.input_ids) for row in self.rows)
        if turn.replaces and self._undo is not None:  # the last committed turn is taken back first
            last = len(self.rows[-1].input_ids)
            rows, tokens = (
                (rows - 1, tokens - last) if self._undo.new_row else (rows, tokens - last + self._undo.length)
            )
        return rows + (turn.fork or rows == 0), tokens + len(turn.new_ids)

    def reply_message(self, turn: PreparedTurn, message: Message) -> Message:
        """`message` (the assistant reply to `turn`) as the chain will hold it: normalised, and rendered by
        the training template as the next turn's interstitial will render it. Raises MessageFormatError
        (TemplateRefusedError when the template refuses it); changes nothing the chain holds (`commit` reuses its work
        for the same `turn` and `message` objects)."""
        held = normalize_message(message, len(turn.messages))
        text = self.template.check_reply(held, turn.tools)
        self._replied = (turn, message, held, text)
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
        replied = self._replied
        if replied is None or replied[0] is not turn or replied[1] is not assistant_message:
            self.reply_message(turn, assistant_message)
            replied = self._replied
        assert replied is not None
        _, _, held, text = replied
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
        self._commits += 1
        row.extend_prompt(turn.packed_new_ids)
        row.extend_completion(output_ids, log_probs, model_version)
        self._held = [*turn.messages, held]
        self._held_text, self._replied = text, None
        self._raw = turn.raw_messages
        self._tools = turn.tools
        record = TurnRecord(
            turn=len(self.turns),
            row=len(self.rows) - 1,
            kind="fork" if turn.fork else "clean",
            prompt_tokens=len(turn.prompt),
            new_prompt_tokens=len(turn.new_ids),
            output_tokens=len(output_ids),
            model_version=model_version,
            finish_reason=finish_reason,
            drift_tokens=turn.drift_tokens,
            retries=retries,
            fork_cause=turn.fork_cause,
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
