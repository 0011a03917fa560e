"""Episodes from a capture: each captured (task, candidate) conversation replayed through the TokenChain
and ResponseParser the InterceptionServer uses, so the fine-tuning tokens are exactly the tokens a
rollout puts in its training row."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from swe_grpo.demo.warm_start.data import CLOSING_MESSAGE, WarmStartError, action_message
from swe_grpo.testing.pi_capture import completion_ids
from swe_grpo.tokens.chain import TokenChain, TrainingTemplate
from swe_grpo.tokens.responses import ResponseParser


@dataclass(frozen=True)
class Episode:
    """One two-turn conversation as a rollout's TokenChain holds it: `prompt_ids` (Pi's first request),
    `action_ids` (the candidate's tool call, generated, ends with EOS), `tool_ids` (the tool result and
    the next generation prompt), `closing_ids` (CLOSING_TEXT, generated, ends with EOS)."""

    instance_id: str
    command: str
    resolves: bool
    prompt_ids: list[int]
    action_ids: list[int]
    tool_ids: list[int]
    closing_ids: list[int]

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.action_ids + self.tool_ids + self.closing_ids

    @property
    def completion_mask(self) -> list[int]:
        lengths = (len(self.prompt_ids), len(self.action_ids), len(self.tool_ids), len(self.closing_ids))
        return [0] * lengths[0] + [1] * lengths[1] + [0] * lengths[2] + [1] * lengths[3]


class EpisodeBuilder:
    """Replays a capture through a TokenChain and ResponseParser, as the InterceptionServer would serve
    it: `episodes` holds every (task, candidate) conversation, in capture order."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, capture: dict[str, Any]):
        self.template = TrainingTemplate(tokenizer)
        self.parser = ResponseParser(tokenizer)
        self.capture = capture
        try:
            self.closing_ids = completion_ids(self.template, CLOSING_MESSAGE)
        except ValueError as error:  # a template that cannot script an assistant turn
            raise WarmStartError(str(error)) from error
        self.episodes = self._replay()

    @property
    def instance_ids(self) -> list[str]:
        return [task["instance_id"] for task in self.capture["tasks"]]

    def _replay(self) -> list[Episode]:
        """Each conversation replayed turn by turn through a fresh TokenChain. Raises WarmStartError when
        the replay does not go as a rollout's would: the action not parsed back to the candidate's call,
        or the second turn forking the chain."""
        tools = self.capture["tools"]
        out = []
        for task in self.capture["tasks"]:
            for candidate in task["candidates"]:
                chain = TokenChain(self.template)
                first = chain.prepare(task["messages"], tools)
                action = completion_ids(self.template, action_message(candidate["command"]))
                parsed = self.parser.parse(action, first.prompt_ids, "stop", tools)
                if bash_command(parsed.message) != candidate["command"]:
                    raise WarmStartError(f"the scripted action {candidate['command']!r} does not parse back to it")
                chain.commit(first, action, [0.0] * len(action), 0, parsed.message, parsed.finish_reason)
                second = chain.prepare(task["messages"] + candidate["then"], tools)
                if second.fork:
                    raise WarmStartError(f"replaying {candidate['command']!r}: the second turn forks the chain")
                out.append(
                    Episode(
                        task["instance_id"],
                        candidate["command"],
                        candidate["resolves"],
                        first.prompt_ids,
                        action,
                        second.new_ids,
                        self.closing_ids,
                    )
                )
        return out


def bash_command(message: dict[str, Any]) -> str | None:
    """The command of `message` when it is exactly one `bash` call with only a command; else None."""
    calls = message.get("tool_calls") or []
    if len(calls) != 1 or calls[0]["function"]["name"] != "bash":
        return None
    try:
        arguments = json.loads(calls[0]["function"]["arguments"])
    except json.JSONDecodeError:
        return None
    if not isinstance(arguments, dict) or set(arguments) != {"command"} or not isinstance(arguments["command"], str):
        return None
    return arguments["command"]
