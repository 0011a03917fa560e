"""A tiny Qwen3 model and tokenizer, built offline in seconds, for tests and the CPU demo.

Nothing can be downloaded from a hub on a CI box, so tests need a model they can make themselves. This
module trains a byte-level BPE tokenizer on local text (Python standard-library sources plus the chat
template's own renderings), attaches one of TRL's shipped chat templates, and initialises a 2-layer
`Qwen3ForCausalLM` from a fixed seed. The result is deterministic for a given environment and is cached
on disk under a key that hashes every input, so a test run builds it once.

The chat-template tokens (`<tool_call>`, `<think>`, ...) are single special tokens: the chain and the
response parser rely on that, as a real Qwen tokenizer does.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from swe_grpo.paths import cache_root

BUILDER_VERSION = "2"

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Single tokens but not "special" (a real Qwen tokenizer keeps them when decoding with
# skip_special_tokens, and the response parser relies on seeing them).
CHATML_MARKUP = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<tool_response>",
    "</tool_response>",
]
LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]


@dataclass(frozen=True)
class TokenFamily:
    """The single tokens a model family's chat template writes, as its released tokenizer has them: `specials`
    (special tokens: dropped by `skip_special_tokens`), `markup` (added tokens kept in decoded text) and the
    `roles` (bos/eos/pad) they fill."""

    specials: tuple[str, ...]
    markup: tuple[str, ...]
    roles: dict[str, str]


_CHATML = TokenFamily(
    tuple(CHATML_SPECIALS), tuple(CHATML_MARKUP), {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
)
_GEMMA4 = TokenFamily(
    ("<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>", "<tool|>",
     "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|image|>", "<|audio|>",
     "<|video|>"),
    (),
    {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
)  # fmt: skip
_LFM2 = TokenFamily(
    ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|tool_list_start|>", "<|tool_list_end|>",
     "<|tool_call_start|>", "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"),
    ("<think>", "</think>", "<image>"),
    {"bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"},
)  # fmt: skip
# By template-name prefix (first match wins); any other template is ChatML (Qwen, Nemotron).
FAMILIES: dict[str, TokenFamily] = {
    "llama3": TokenFamily(
        tuple(LLAMA3_SPECIALS),
        (),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>"},
    ),
    "gptoss": TokenFamily(
        ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
         "<|return|>", "<|call|>"),
        (),
        {"bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>"},
    ),
    "glm4moe": TokenFamily(
        ("<|endoftext|>", "[gMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
        ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
         "</arg_key>", "<arg_value>", "</arg_value>"),
        {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    ),
    "gemma4": _GEMMA4,
    "diffusion_gemma": _GEMMA4,
    "deepseek": TokenFamily(
        ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        ("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
         "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
         "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"),
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
         "pad_token": "<｜end▁of▁sentence｜>"},
    ),
    "lfm2": _LFM2,
    "muse_glimmer": TokenFamily(
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start|>", "<|message|>", "<|eot|>", "<|eom|>", "<|patch|>",
         "<|video|>"),
        (),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "pad_token": "<|end_of_text|>"},
    ),
}  # fmt: skip


def token_family(chat_template: str) -> TokenFamily:
    """The family of the TRL template named `chat_template` (a file name in trl/chat_templates/, no `.jinja`)."""
    return next((f for prefix, f in FAMILIES.items() if chat_template.startswith(prefix)), _CHATML)


# Standard-library modules whose source trains the tokenizer: ordinary Python, shell and prose.
CORPUS_MODULES = [
    "argparse.py", "difflib.py", "json/decoder.py", "json/encoder.py", "pathlib.py", "shlex.py",
    "subprocess.py", "textwrap.py", "unittest/case.py", "fnmatch.py", "glob.py", "tempfile.py",
]  # fmt: skip


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build. Every field is part of the cache key."""

    chat_template: str = "qwen3"  # name of a template shipped in trl/chat_templates/
    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention has no kernel for head_dim 16
    max_position_embeddings: int = 32768
    seed: int = 0


def chat_template_text(name: str) -> str:
    """The text of a chat template shipped with TRL, by file name without `.jinja`."""
    import trl

    path = Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja"
    if not path.is_file():
        raise ValueError(f"TRL ships no chat template named {name!r} (looked for {path})")
    return path.read_text(encoding="utf-8")


def _corpus(template: str) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in CORPUS_MODULES]
    sample_tool = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}
    texts.append(template + json.dumps(sample_tool, indent=2))
    return texts


def build_tiny_tokenizer(spec: TinyModelSpec = TinyModelSpec()):
    """Train the tokenizer for `spec` (about a second). Returns a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template = chat_template_text(spec.chat_template)
    family = token_family(spec.chat_template)
    specials, markup, roles = list(family.specials), list(family.markup), family.roles
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=specials + markup,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(template), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **roles)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in roles.values()]})
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in markup])
    tokenizer.chat_template = template
    return tokenizer


def _cache_key(spec: TinyModelSpec) -> str:
    import tokenizers
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps(asdict(spec), sort_keys=True).encode())
    h.update(f"{BUILDER_VERSION}/{transformers.__version__}/{tokenizers.__version__}".encode())
    for text in _corpus(chat_template_text(spec.chat_template)):
        h.update(text.encode())
    return h.hexdigest()[:16]


def build_tiny_model(spec: TinyModelSpec = TinyModelSpec(), cache_dir: Path | None = None) -> Path:
    """Build (or reuse from cache) the tiny model for `spec`; returns its directory.

    The directory is a normal Hugging Face checkpoint (float32 safetensors, tokenizer, chat template,
    generation config) that `vllm` and `transformers` load as they would a hub model. Safe to call
    from several processes at once: each builds into a private directory and the first rename wins.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    root = Path(cache_dir) if cache_dir else cache_root()
    target = root / f"tiny-{spec.chat_template}-{_cache_key(spec)}"
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    staging.chmod(0o755)  # sandboxed agents and servers running as other users read it
    try:
        tokenizer = build_tiny_tokenizer(spec)
        vocab = (len(tokenizer) + 63) // 64 * 64
        eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        pad_id = tokenizer.convert_tokens_to_ids(tokenizer.pad_token)
        config = Qwen3Config(
            vocab_size=vocab,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            # Untied: vLLM's full-weight reload gives wrong output with tied embeddings.
            tie_word_embeddings=False,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            bos_token_id=tokenizer.bos_token_id,
            torch_dtype="float32",
        )
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
        model.generation_config = GenerationConfig(eos_token_id=[eos_id, pad_id], pad_token_id=pad_id)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
