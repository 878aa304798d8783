"""Build, save and load policies: the tiny built-in model, or any local Hugging Face causal LM.

* `build_tokenizer` / `build_model`: a character-level tokenizer and a small
  `LlamaForCausalLM` for the built-in tasks (`cispo.tasks`).
* `save_policy` / `load_policy`: the standard Hugging Face folder layout
  (``config.json``, ``model.safetensors``, ``tokenizer.json``), so the built-in model and
  real checkpoints load the same way.

The built-in base models (shipped, cached or pretrained on first use) are picked in
`cispo.builtin_model`, which imports this module and `cispo.pretrain`, never the reverse.
"""

from __future__ import annotations

from pathlib import Path

import torch

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)
"""Special tokens, in id order: ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2."""

MODEL_SIZES = {
    # name: (hidden, layers, heads, intermediate)
    "default": (96, 3, 4, 256),   # 0.34M parameters: the built-in base model
    "large": (128, 4, 4, 384),    # 0.86M parameters
    "tiny": (32, 2, 2, 64),       # for tests
}
"""Built-in Llama shapes (hidden size, layers, heads, MLP size)."""

MAX_POSITIONS = 128


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer(chars: str, max_positions: int = MAX_POSITIONS):
    """A character-level `PreTrainedTokenizerFast` over `chars` plus the special tokens.

    Ids: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then `chars` in order. Every character
    encodes to exactly one id; no special token is added on encode; decode joins the
    characters back without spaces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "".join(dict.fromkeys(chars))  # de-duplicate, keep order
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
        model_max_length=max_positions, padding_side="left",
    )


# --------------------------------------------------------------------------- model


def build_model(tokenizer, size: str = "default", seed: int = 0, max_positions: int = MAX_POSITIONS):
    """A small seeded `LlamaForCausalLM` for `tokenizer` (see `MODEL_SIZES`) with a context
    of `max_positions` tokens (RoPE: the weights do not depend on it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter = MODEL_SIZES[size]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=inter,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def num_parameters(model) -> int:
    """Number of parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def save_policy(model, tokenizer, path) -> Path:
    """Save `model` (safetensors) and `tokenizer` (``tokenizer.json``) into folder `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def load_policy(path, dtype=None, device=None):
    """``(model, tokenizer)`` from a local causal-LM folder (built-in or any HF checkpoint).

    `dtype` is a `torch.dtype` or a name ("float32", "bfloat16"); None keeps the saved one.
    The model is returned in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    kwargs = {} if dtype is None else {"dtype": dtype}
    model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer
