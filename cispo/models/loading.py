"""Build, save and load policies: the tiny built-in model, or any local Hugging Face causal LM.

* `build_tokenizer` / `build_model`: a character-level tokenizer and a small
  `LlamaForCausalLM` for the built-in tasks (`cispo.data.tasks`).
* `save_policy` / `load_policy`: the standard Hugging Face folder layout
  (``config.json``, ``model.safetensors``, ``tokenizer.json``), so the built-in model and
  real checkpoints load the same way.

The built-in base models (shipped, cached or pretrained on first use) are picked in
`cispo.models.builtin`, which imports this module and `cispo.models.pretrain`, never the reverse.
"""

from __future__ import annotations

import json
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


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _as_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    out = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(out, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}: use float32, bfloat16 or float16")
    return out


def saved_dtype(path) -> torch.dtype | None:
    """The dtype a checkpoint folder's ``config.json`` declares (``dtype`` / ``torch_dtype``), or None."""
    try:
        meta = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = meta.get("dtype") or meta.get("torch_dtype")
    if not isinstance(name, str):
        return None
    try:
        return _as_dtype(name)
    except ValueError:
        return None


def precision(dtype, saved=None, master_weights: bool = True) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(parameter dtype to load, autocast dtype or None)`` for compute dtype ``dtype``
    (None: the checkpoint's ``saved`` dtype).

    A low-precision compute dtype (bfloat16, float16) with ``master_weights`` (the default)
    keeps the parameters, their gradients and the optimizer state in float32 and runs the
    forward passes under ``torch.autocast`` in that dtype: small updates (lr 1e-6) are not
    rounded away. Without ``master_weights`` the parameters themselves are low precision
    (half the weight memory; updates below the weight's rounding step are lost)."""
    want = _as_dtype(dtype) or _as_dtype(saved)
    if want in LOW_PRECISION and master_weights:
        return torch.float32, want
    return _as_dtype(dtype), None


def disable_dropout(config) -> list[str]:
    """Set every dropout probability of a Hugging Face config (and of its sub-configs) to 0:
    the fields named ``*dropout*`` or ``*pdrop*`` that hold a positive number. Returns the
    names it changed (``text_config.attention_dropout``, ...)."""
    from transformers import PretrainedConfig

    changed = []
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            changed += [f"{name}.{n}" for n in disable_dropout(value)]
        elif (("dropout" in name or "pdrop" in name) and isinstance(value, (int, float))
              and not isinstance(value, bool) and value > 0):
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def load_policy(path, dtype=None, device=None, *, dropout: bool = True):
    """``(model, tokenizer)`` from a local causal-LM folder (built-in or any HF checkpoint).

    `dtype` is a `torch.dtype` or a name ("float32", "bfloat16"); None keeps the saved one.
    ``dropout=False`` sets every dropout probability to 0 (config fields before the model is
    built, and any ``torch.nn.Dropout`` after). The model is returned in eval mode.

    Raises ValueError when the weights in the folder do not match its config (missing,
    unexpected or mis-shaped tensors, e.g. a LoRA model's adapter names under a plain config):
    nothing is silently initialised at random.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cispo.foundations.hub import hub_kwargs

    config = from_pretrained(AutoConfig, path)
    kwargs = hub_kwargs(path)
    if kwargs:  # transformers 5's AutoModel looks for a PEFT adapter without its local_files_only
        kwargs["adapter_kwargs"] = dict(kwargs)
    if not dropout:
        disable_dropout(config)
    dtype = _as_dtype(dtype)
    kwargs.update({} if dtype is None else {"dtype": dtype})
    model, info = AutoModelForCausalLM.from_pretrained(str(path), config=config, output_loading_info=True, **kwargs)
    problems = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if any(problems.values()):
        detail = "; ".join(f"{k.replace('_', ' ')}: {', '.join(map(str, v[:5]))}{' ...' if len(v) > 5 else ''}"
                           f" ({len(v)})" for k, v in problems.items() if v)
        raise ValueError(f"{path}: the weights do not match config.json ({type(model).__name__}): {detail}. "
                         "A LoRA checkpoint's model/ must hold merged weights (cispo.models.lora.merge_and_save); "
                         "refusing to initialise these weights at random")
    if not dropout:
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
    tokenizer = from_pretrained(AutoTokenizer, path)
    check_vocab_fits(model, tokenizer, path)
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def from_pretrained(loader, path):
    """``loader.from_pretrained(path)`` (``AutoConfig``, ``AutoTokenizer``); an ``OSError`` or
    ``ValueError`` (a hub id that cannot be fetched, an unreadable or unknown ``config.json``)
    becomes a one-line ``ConfigError`` naming ``path``, not a transformers traceback. A hub id
    without network is read from the Hugging Face cache (`cispo.foundations.hub`)."""
    from cispo.foundations.hub import hub_kwargs, hub_unreachable

    kwargs = hub_kwargs(path)
    try:
        return loader.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as e:
        from cispo.config.train import ConfigError

        if kwargs:
            raise ConfigError(f"{path}: not in the Hugging Face cache, and the hub cannot be reached "
                              f"({hub_unreachable()}); download it where there is network "
                              f"(`hf download {path}`) or give a local model folder") from None
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{path}: cannot load it as a model ({loader.__name__}: {reason[:300]})") from None


def check_vocab_fits(model, tokenizer, path) -> None:
    """ConfigError if the tokenizer can produce ids the model has no embedding row for (a tokenizer
    from another model: the first such id would end in an ``IndexError`` inside the embedding)."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        from cispo.config.train import ConfigError

        raise ConfigError(f"{path}: the tokenizer has {len(tokenizer)} tokens but the model's embedding only {rows} "
                          f"rows: the tokenizer belongs to another model (or tokens were added without "
                          f"model.resize_token_embeddings); put the model's own tokenizer in the folder")


TURN_PROBE = "cispo-turn-end-probe"
"""The assistant text `turn_end_id` renders through a chat template, to find what closes the turn."""


def stop_token_ids(model, tokenizer, templated: bool) -> list[int]:
    """The ids a response of ``model`` stops at (each once, in this order): the tokenizer's EOS, every id
    of the model's generation config ``eos_token_id`` (an int or a list: ``generation_config.json``, or
    ``config.json`` without one; Llama-3-Instruct lists ``<|end_of_text|>``, ``<|eom_id|>`` and
    ``<|eot_id|>``), and with ``templated`` prompts the chat template's end of turn (`turn_end_id`:
    ChatML's ``<|im_end|>`` where the EOS is ``<|endoftext|>``), so that a chat model that ends its
    turn without its EOS is not sampled on to ``max_new_tokens``."""
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    listed = [listed] if isinstance(listed, int) else list(listed or [])
    turn = turn_end_id(tokenizer) if templated else None
    return list(dict.fromkeys([tokenizer.eos_token_id, *listed, *([turn] if turn is not None else [])]))


def turn_end_id(tokenizer) -> int | None:
    """The special token that closes an assistant turn in ``tokenizer``'s chat template (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``, ``</s>``): a user turn and an assistant turn whose
    text is `TURN_PROBE` are rendered, and the first token of the text after the probe is taken if it is
    a special (added) token. Reading the template itself finds the token of any template, where a list
    of known names would miss new ones. None without a template, when the two turns do not render
    (a template is code, and may refuse them), or when plain text follows the turn (a template that
    ends a turn with a newline: no token to stop at)."""
    if not tokenizer.chat_template:
        return None
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": TURN_PROBE}]
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False)
    except Exception:  # noqa: BLE001 — whatever the template raises: no turn end found
        return None
    at = text.rfind(TURN_PROBE) if isinstance(text, str) else -1
    ids = tokenizer.encode(text[at + len(TURN_PROBE):], add_special_tokens=False) if at >= 0 else []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


def check_chat_template(path) -> None:
    """ConfigError unless the tokenizer in folder ``path`` has a chat template (for
    ``model.chat_template=true``; checked before the data is loaded)."""
    from transformers import AutoTokenizer

    from cispo.config.train import ConfigError

    if not from_pretrained(AutoTokenizer, path).chat_template:
        raise ConfigError(f"model.chat_template=true, but the tokenizer of {path} has no chat template (a base "
                          "model?): set model.chat_template=false, or add a chat_template to its tokenizer_config.json")
