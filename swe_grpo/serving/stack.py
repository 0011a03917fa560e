"""The token-exact serving stack: a `VLLMClient` (prompt ids in, ids and log-probs out) behind an
`InterceptionServer`, with the tokenizer of the model vLLM loaded. `swe-grpo rollout` and `swe-grpo eval`
serve their agents with it. With a LoRA adapter, every generation names the adapter (`Policy.model`),
loaded onto the server first unless it serves it already."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from swe_grpo.serving.interception import InterceptionServer
from swe_grpo.serving.vllm_client import SamplingParams, VLLMClient
from swe_grpo.types import Policy


class AdapterNotServed(ValueError):
    """A LoRA adapter named for the run that the server does not serve, with no path to load it from."""


async def serve_adapter(client: VLLMClient, lora_path: str | None, lora_name: str | None) -> str | None:
    """The model name generations use for the LoRA adapter at `lora_path` (named `lora_name`, default
    `eval-<directory name>`), loaded onto the server unless it already serves that name; None: no adapter."""
    if not lora_path and not lora_name:
        return None
    name = lora_name or f"eval-{Path(lora_path or '').resolve().name}"
    if name in await client.served_models():
        return name
    if not lora_path:
        raise AdapterNotServed(f"the server does not serve an adapter named {name!r}, and no --lora path was given")
    await client.load_lora_adapter(name, str(Path(lora_path).resolve()))
    return name


@asynccontextmanager
async def token_exact_server(
    vllm_url: str,
    model: str,
    sampling: SamplingParams,
    *,
    tokenizer: str | None = None,
    lora_path: str | None = None,
    lora_name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    public_url: str | None = None,
) -> AsyncIterator[tuple[InterceptionServer, int]]:
    """A started InterceptionServer in front of the vLLM server at `vllm_url`, and the model's context length."""
    from transformers import AutoTokenizer

    client = VLLMClient(vllm_url, model, api_key=os.environ.get("VLLM_API_KEY"))
    try:  # not `async with`: a start that fails must close the client's session too
        await client.start()
        loaded = AutoTokenizer.from_pretrained(tokenizer or client.model_root or model)
        client.stop_token_ids = [loaded.eos_token_id]
        adapter = await serve_adapter(client, lora_path, lora_name)
        server = InterceptionServer(
            client,
            loaded,
            model_name=model,
            sampling=sampling,
            host=host,
            port=port,
            public_base_url=public_url,
            policy=(lambda: Policy(model=adapter)) if adapter else Policy,
        )
        async with server:
            yield server, client.max_model_len
    finally:
        await client.close()
