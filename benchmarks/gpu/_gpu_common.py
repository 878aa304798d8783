"""Pieces of ``gpu_check.py``: sizes, device helpers (no-ops / None on a CPU), the random
Qwen2.5-0.5B-shaped model, its synthetic tokenizer and EOS, configs without pydantic, and the
sampler-side FP32-head shim of the torch rollout."""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, fields

import torch

PEAK_BF16_TFLOPS = (  # dense bf16 tensor-core peaks, vendor datasheets; first substring match wins
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0),
)
NO_CUDA = "no CUDA device: torch.cuda memory statistics exist only on a GPU"


class Skipped(Exception):
    """Nothing a section can measure in the time left (or here)."""


@dataclass(frozen=True)
class Sizes:
    hidden: int = 896
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    intermediate: int = 4864
    vocab: int = 151_936
    prompts: int = 32  # RL: prompts x group_size rows, max_new_tokens each, K updates
    group_size: int = 8
    max_new_tokens: int = 256
    updates: int = 8
    rl_steps: int = 2  # measured, after one warm-up step
    agree_rows: int = 64  # Figure 3: rows x new tokens sampled once per sampler head
    agree_new_tokens: int = 256
    prompt_len: int = 32
    head_tokens: int = 16_384  # lm_head: N tokens (a micro-batch of 32 rows x 512)
    head_chunk: int = 4096
    head_repeats: int = 3
    prec_rows: int = 8  # precision: rows x length per AdamW step
    prec_len: int = 512
    prec_steps: int = 3
    embed_scale: float = 1.0  # scales the (tied) embedding at init: see build_qwen
    share_rows: int = 16  # head_share: one update of rows x length tokens per setting
    share_len: int = 512
    long_rows: int = 8  # long_responses: rows with responses of long_min..long_max tokens
    long_min: int = 1024
    long_max: int = 2048
    long_micro: int = 4  # rows per forward / backward
    decode_batches: str = "1,8,32,128,256"  # decode_batch: batch sizes, decode_tokens new tokens each
    decode_tokens: int = 128


TINY = Sizes(hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64, vocab=1000, prompts=2, group_size=2,
             max_new_tokens=6, updates=2, rl_steps=1, agree_rows=4, agree_new_tokens=8, prompt_len=6,
             head_tokens=256, head_chunk=64, head_repeats=1, prec_rows=2, prec_len=16, prec_steps=2,
             embed_scale=0.1, share_rows=2, share_len=8, long_rows=2, long_min=8, long_max=16, long_micro=1,
             decode_batches="1,2,4", decode_tokens=4)


def parse_sets(items: list[str]) -> dict:
    """``["max_new_tokens=512", ...]`` -> ``{"max_new_tokens": 512}``, typed by the ``Sizes`` field."""
    types = {f.name: type(f.default) for f in fields(Sizes)}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in types:
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with FIELD one of {', '.join(types)}")
        try:
            out[key] = types[key](value)
        except ValueError:
            raise ValueError(f"--set {item!r}: {value!r} is not a {types[key].__name__}") from None
    return out


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- device helpers


class Device:
    """The device under test, with timing and memory helpers that are no-ops / None on CPU."""

    def __init__(self, name: str):
        self.device = torch.device(name)
        self.cuda = self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def allocated_gib(self) -> float | None:
        return torch.cuda.memory_allocated(self.device) / 2**30 if self.cuda else None

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated(self.device) / 2**30 if self.cuda else None

    def timed(self, fn):
        """(result, wall seconds) of ``fn()``, synchronised before and after."""
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - t0

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def peak_tflops(dev: Device, override: float | None) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOP/s, where it came from)."""
    if override:
        return override, "--peak-tflops"
    if not dev.cuda:
        return None, "CPU: no bf16 peak in the table (pass --peak-tflops)"
    name = torch.cuda.get_device_name(dev.device)
    for key, value in PEAK_BF16_TFLOPS:
        if key in name:
            return value, f"table: {key!r} in {name!r}"
    return None, f"{name!r} not in the table (pass --peak-tflops)"


# --------------------------------------------------------------------------- model and tokenizer


_TOKENIZERS: dict[int, object] = {}


def synthetic_tokenizer(vocab: int):
    """``build_tokenizer`` over the addition task's characters plus filler code points, so that
    it has exactly ``vocab`` ids (every id the model can sample decodes to one character)."""
    if vocab not in _TOKENIZERS:
        from cispo.data.tasks import get_task
        from cispo.models.loading import SPECIAL_TOKENS, build_tokenizer

        alphabet = get_task("addition").alphabet
        filler = (chr(c) for c in range(0x100, 0x30000) if not 0xD800 <= c < 0xE000)
        n = vocab - len(SPECIAL_TOKENS) - len(alphabet)
        _TOKENIZERS[vocab] = build_tokenizer(alphabet + "".join(next(filler) for _ in range(n)))
    return _TOKENIZERS[vocab]


def build_qwen(s: Sizes, dev: Device, dtype: torch.dtype, logit_std: float, seed: int = 0):
    """A random ``Qwen2ForCausalLM`` of shape ``s`` on ``dev`` in ``dtype``; the final norm is
    scaled (in fp32, before the cast) so the logits' std over the vocabulary is ``logit_std``.

    ``s.embed_scale`` < 1 shrinks the tied embedding first: in a 2-layer random model the
    residual stream is mostly the input token's embedding, so with tied weights the model
    would predict "repeat the last token" with p ~ 1 (seen at --tiny; not at 24 layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    with dev.device:
        model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(s.embed_scale)
        ids = torch.randint(3, s.vocab, (4, 64), device=dev.device)
        std = float(model(input_ids=ids).logits.float().std(-1).mean())
        model.model.norm.weight.mul_(logit_std / std)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    return model.to(dtype)


class FP32Head(torch.nn.Module):
    """An LM head that computes its logits in float32 from the same (bf16) weight: the
    sampler-side half of M1's FP32-head fix."""

    def __init__(self, head: torch.nn.Module):
        super().__init__()
        self.weight, self.bias = head.weight, head.bias

    def forward(self, h):
        b = None if self.bias is None else self.bias.float()
        return torch.nn.functional.linear(h.float(), self.weight.float(), b)


@contextlib.contextmanager
def fp32_sampler_head(model, on: bool):
    head = model.get_output_embeddings()
    if on:
        model.set_output_embeddings(FP32Head(head))
    try:
        yield model
    finally:
        model.set_output_embeddings(head)


def train_config(**sections):
    """A ``cispo.config.train.TrainConfig`` with some fields changed: ``train_config(model={"dtype": "bfloat16"},
    steps=3)``. Built with ``dataclasses.replace``, so its checks run but pydantic is not needed."""
    from dataclasses import is_dataclass, replace

    from cispo.config.train import TrainConfig

    cfg = TrainConfig()
    top = {k: v for k, v in sections.items() if not isinstance(v, dict)}
    nested = {k: replace(getattr(cfg, k), **v) for k, v in sections.items()
              if isinstance(v, dict) and is_dataclass(getattr(cfg, k))}
    return replace(cfg, **top, **nested)


@torch.no_grad()
def calibrate_eos(model, s: Sizes, dev: Device, eos: int = 1, mean_length: float | None = None) -> dict:
    """Make the random model end its responses after ~``mean_length`` tokens (default: half of
    ``s.max_new_tokens``), as a trained one does: sample a few rows, find the token sampled at the
    rate closest to 1 / mean_length, and swap its row of the (tied) embedding with EOS's. Returns what
    was swapped and the rate."""
    mean_length = mean_length or s.max_new_tokens / 2
    g = torch.Generator(device=dev.device).manual_seed(7)
    ids = torch.randint(3, s.vocab, (16, 8), device=dev.device, generator=g)
    counts = torch.zeros(s.vocab, device=dev.device)
    for _ in range(24):  # a cheap rollout without cache: the last position's distribution
        logits = model(input_ids=ids).logits[:, -1].float()
        nxt = torch.multinomial(logits.softmax(-1), 1, generator=g)  # [16, 1]
        counts += torch.bincount(nxt[:, 0], minlength=s.vocab)
        ids = torch.cat([ids[:, 1:], nxt], 1)
    rate = counts / counts.sum()
    rate[:3] = -1.0  # not pad / eos / unk themselves
    tok = int((rate - 1.0 / mean_length).abs().argmin())
    emb = model.get_input_embeddings().weight
    emb[[eos, tok]] = emb[[tok, eos]]
    return {"swapped_with": tok, "rate": float(rate[tok]), "target_rate": 1.0 / mean_length}


def num_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once
