"""One turn of a rollout as a transaction: prepare -> generate -> parse -> validate -> deliver -> commit.

`TurnTransaction.run` serves one chat request whose body was read and checked, while its rollout's lock is held:

- prepare: the rollout's TokenChain turns the messages into exact prompt ids (`TokenChain.prepare`), off the event
  loop (`PrepareThreads`) unless the request brings little: tokenising its new content releases the GIL, so it runs
  beside the loop. A request that brings more than `BULK_BYTES` of new content (a big tool output), or makes the
  chain render a long history whole (a fork), is prepared in threads of lower CPU priority, so that one rollout's
  megabyte-sized history does not stall the others; one under `THREAD_BYTES`, on the loop (cheaper than a hop).
- generate: the `Generator` (vLLM) produces token ids and log-probs under the live policy (`Policy`, read when the
  generation starts; its version is committed with the tokens). While it runs, a streaming answer sends an SSE
  keep-alive every `keepalive_s` (its headers went out when the prompt was ready, so that agent idle timeouts
  never fire during long generations), and a non-streaming one looks at the connection as often; an agent that
  went away abandons the generation (cancelling it makes vLLM abort the request).
- parse and validate: the output is parsed into an assistant message and validated as the chain will hold it
  (normalised, rendered by the training template); a reply that fails validation goes back as plain text, its
  tool calls counted as malformed.
- deliver, then commit: the reply is committed to the chain only once it was written whole to the agent's
  connection. An agent that disconnects first leaves no turn (recorded "client_disconnected"); one that re-sends
  the last committed request gets a new generation from the same prefix that replaces that turn
  (`TurnRecord.retries`). A reply the agent never received is never trained on.

Every failure is recorded on the rollout as a named `RequestError` and raised as an `APIError` (bad messages or a
template refusal 400, a turn past the rollout's caps of rows or tokens 400 `rollout_budget_exceeded`, context
overflow 400 `context_length_exceeded`, backend unavailable 503, backend error 502, rollout closed meanwhile 410),
with the chain unchanged; the caller answers it through the `Answer`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web

from swe_grpo.serving.limits import ServingLimits
from swe_grpo.serving.openai_wire import Answer, APIError
from swe_grpo.serving.session import RolloutSession
from swe_grpo.serving.vllm_client import (
    ROUTING_KEY,
    ContextOverflowError,
    Generation,
    Generator,
    SamplingParams,
    ServerUnavailableError,
    VLLMError,
)
from swe_grpo.tokens.chain import PreparedTurn, TokenChain
from swe_grpo.tokens.messages import MessageFormatError
from swe_grpo.tokens.responses import ParsedResponse, ResponseParser
from swe_grpo.types import Policy

log = logging.getLogger(__name__)

# A request that brings more new bytes than this (a big tool output, or a rollout's first request with a long
# history) is prepared in `PrepareThreads.bulk`.
BULK_BYTES = 32 * 1024
# One that brings more than this (a turn's tool results, usually) is prepared in `PrepareThreads.turns`; below it, the
# thread hops cost the event loop more than they take off it.
THREAD_BYTES = 1024
_BULK_THREADS = 4
_BULK_NICE = 10
_TURN_THREADS = 2


@dataclass(frozen=True, slots=True)
class PrepareThreads:
    """Where turns are prepared off the event loop, theirs alone (not the loop's default threads, which sandbox work
    may hold for seconds). `turns`: threads at normal priority for a turn's usual new content. `bulk`: threads for big
    requests; Linux nice values are per thread, and these yield the CPU to the event loop and to the other rollouts'
    turns, so a big request takes longer instead of slowing everyone down."""

    turns: ThreadPoolExecutor
    bulk: ThreadPoolExecutor

    @classmethod
    def start(cls) -> PrepareThreads:
        bulk = ThreadPoolExecutor(_BULK_THREADS, "interception-bulk", initializer=os.nice, initargs=(_BULK_NICE,))
        return cls(ThreadPoolExecutor(_TURN_THREADS, "interception-turn"), bulk)

    def shutdown(self) -> None:
        for pool in (self.turns, self.bulk):
            pool.shutdown(wait=False, cancel_futures=True)


def requested_sampling(body: dict[str, Any], base: SamplingParams) -> SamplingParams:
    """The rollout's sampling `base`, with the fewer tokens the request may ask for (`max_completion_tokens` or
    `max_tokens`); 400 for a limit that is not a positive integer. The agent may ask for fewer tokens, never for
    other sampling: the trainer's log-probs assume the rollout's temperature and top_p."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        return base
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise APIError(400, "'max_tokens' must be a positive integer")
    return replace(base, max_tokens=min(limit, base.max_tokens or limit))


@dataclass(frozen=True, slots=True)
class TurnTransaction:
    """One turn of `rollout`, answered through `answer` (see the module docstring). `threads`: where it is prepared
    off the event loop (None: the loop's default threads)."""

    rollout: RolloutSession
    answer: Answer
    generator: Generator
    parser: ResponseParser
    policy: Callable[[], Policy]
    keepalive_s: float
    threads: PrepareThreads | None
    limits: ServingLimits

    async def run(self, body: dict[str, Any], size: int, params: SamplingParams) -> web.StreamResponse:
        """Serve the request `body` (`size` bytes): nothing reaches the chain until the reply was delivered."""
        rollout, answer = self.rollout, self.answer
        chain = rollout.chain
        turn_index = len(chain.turns)
        turn = await self._prepare(body, size)
        self._check_budget(turn, params)
        await answer.start(len(turn.prompt))
        policy = self.policy()
        params = replace(params, stop_token_ids=chain.template.stop_token_ids)  # every token that ends a turn
        generation = await self._generate(turn, params, rollout.model or policy.model)
        delivered = generation is not None and await answer.send(
            self._reply(chain, turn, generation), len(turn.prompt), len(generation.token_ids)
        )
        if not delivered:
            rollout.record_error("client_disconnected", "the agent went away before its reply was sent", turn_index)
            return answer.abandoned()
        parsed = answer.parsed
        chain.commit(
            turn, generation.token_ids, generation.log_probs, policy.version, parsed.message, parsed.finish_reason
        )
        rollout.malformed_tool_calls += parsed.malformed_tool_calls
        return answer.response

    async def _prepare(self, body: dict[str, Any], size: int) -> PreparedTurn:
        """The chain's prepared turn for the request. Agents re-send the whole history: what a request brings is,
        roughly, how much it grew. A request that brings much, or makes the chain render a long history whole (a
        fork), is prepared in the bulk threads, one that brings little on the loop, any other in the turn threads; the
        rollout's lock is held meanwhile (its requests stay in order)."""
        rollout = self.rollout
        chain = rollout.chain
        messages, tools = body.get("messages"), body.get("tools")
        grew, rollout.body_bytes = size - rollout.body_bytes, size
        try:
            plan = chain.plan(messages, tools)  # decided once: normalising and comparing a long history costs
            bulk = grew > BULK_BYTES or (size > BULK_BYTES and plan.renders_whole_history)
            prepare = functools.partial(chain.prepare, messages, tools, plan)
            if not bulk and grew <= THREAD_BYTES:
                return prepare()
            threads = self.threads and (self.threads.bulk if bulk else self.threads.turns)
            return await asyncio.get_running_loop().run_in_executor(threads, prepare)
        except MessageFormatError as e:
            rollout.record_error("bad_request", str(e), len(chain.turns))
            raise APIError(400, str(e)) from None

    def _check_budget(self, turn: PreparedTurn, params: SamplingParams) -> None:
        """Refuse `turn` if, committed with a reply of `params.max_tokens`, it would take the rollout past its caps
        of training rows or tokens (`swe_grpo.serving.limits`)."""
        rows, tokens = self.rollout.chain.size_after(turn)
        tokens += params.max_tokens or 0
        limits = self.limits
        if rows > limits.rollout_rows or tokens > limits.rollout_tokens:
            message = (
                f"this request would make the rollout hold {rows} training rows of {tokens} tokens: its caps are "
                f"{limits.rollout_rows} rows and {limits.rollout_tokens} tokens"
            )
            self.rollout.record_error("rollout_budget", message, len(self.rollout.chain.turns))
            raise APIError(400, message, code="rollout_budget_exceeded", retry=False)

    async def _generate(self, turn: PreparedTurn, params: SamplingParams, model: str | None) -> Generation | None:
        """The generation for `turn`, keeping the agent's connection alive meanwhile; None when the agent
        went away (the generation is then abandoned: cancelling it makes vLLM abort the request)."""
        rollout = self.rollout
        turn_index = len(rollout.chain.turns)
        started = rollout.generating_since = time.monotonic()
        ROUTING_KEY.set(rollout.endpoint.rollout_id)  # the generation task inherits it (VLLMClient.routing_header)
        generating = asyncio.ensure_future(self.generator.generate(turn.prompt, params, model))
        try:
            while not (await asyncio.wait({generating}, timeout=self.keepalive_s))[0]:
                if not await self.answer.keep_alive():
                    return None
            generation = generating.result()
        except ContextOverflowError as e:
            rollout.record_error("context_overflow", str(e), turn_index)
            raise APIError(400, str(e), "invalid_request_error", "context_length_exceeded") from None
        except ServerUnavailableError as e:
            rollout.record_error("server_unavailable", str(e), turn_index)
            raise APIError(503, f"generation backend unavailable: {e}", "server_error") from None
        except VLLMError as e:  # BadResponseError and anything else the client raises
            rollout.record_error("bad_response", str(e), turn_index)
            raise APIError(502, f"generation backend error: {e}", "server_error") from None
        finally:
            rollout.generation_s += time.monotonic() - started
            rollout.generating_since = None
            if not generating.done():
                generating.cancel()
                await asyncio.wait({generating})
        if rollout.closed:
            raise APIError(410, "rollout was closed during generation")
        return generation

    def _reply(self, chain: TokenChain, turn: PreparedTurn, generation: Generation) -> ParsedResponse:
        """The generation as the reply to send: parsed, and validated as the chain will hold it. A parse
        the chain cannot hold (tool-call arguments that are not a JSON object, a message the template
        refuses) degrades to plain text, its calls counted as malformed."""
        ids, finish = generation.token_ids, generation.finish_reason
        parsed = self.parser.parse(ids, turn.prompt, finish, turn.tools)
        try:
            chain.reply_message(turn, parsed.message)
        except MessageFormatError as e:
            calls = len(parsed.message.get("tool_calls") or [])
            log.info("reply degraded to plain text (%d tool calls counted as malformed): %s", calls, e)
            parsed = self.parser.plain_text(ids, finish, parsed.malformed_tool_calls + calls)
            chain.reply_message(turn, parsed.message)
        return parsed
