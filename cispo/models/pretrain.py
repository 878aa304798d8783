"""Pretrain the tiny built-in base model on a task's corpus, and measure what it does.

The base model must show the behaviour CISPO is about (MiniMax-M1, arXiv 2506.13585,
section 3): a reflective fork token that it samples *rarely* (~1–5% of completions at
temperature 1) but that, when sampled, makes the answer far more often correct.
`measure_base_model` checks exactly that.

Departures from a plain LM pretraining, in plain words:

1. Loss only on completion tokens (the prompt is given, never predicted), and not on
   the guesses before a fork (half of them are deliberately wrong) nor on most fork
   tokens (see `cispo.data.tasks.arithmetic.corpus`): the model practises many derivations,
   yet learns to *choose* the fork with frequency `fork_fraction` only.
2. Every step draws a fixed share of direct and of forked examples and runs them as two
   micro-batches (their lengths differ ~4x), one loss normalised by their total number
   of loss tokens.
3. A corpus may weight loss tokens (a `loss_mask` entry other than 0 or 1, e.g. the
   `chain_hidden_sharp` corpus's rare carry pairs); the loss is then sum(w * loss) / sum(w).

Deterministic: the same config and seed give bit-identical weights on the same machine
(`torch.manual_seed`, a `torch.Generator` for batches, CPU ops only; 1 and 2 threads
were observed to agree bit for bit too). On busy cores one thread is much faster.

    python -m cispo.models.builtin --seed 0 --out /tmp/base0 --measure 4000
"""

from __future__ import annotations

import inspect
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cispo.models.pretrain_config import PretrainConfig

# --------------------------------------------------------------------------- data


def _encode(examples, vocab: dict[str, int], eos_id: int, pad_id: int):
    """Right-padded ``(input_ids, labels)`` [N, T]; labels -100 where no loss.

    Vectorised over the whole corpus: the tokenizer is character-level, so each text is
    mapped through a byte -> id lookup table (``\x01`` stands for EOS, ``\x00`` for pad).
    """
    import numpy as np

    lut = np.full(256, -1, dtype=np.int64)
    for ch, i in vocab.items():
        if len(ch) == 1:
            lut[ord(ch)] = i
    lut[0], lut[1] = pad_id, eos_id
    seqs = [ex.prompt + ex.completion + "\x01" for ex in examples]              # + EOS
    # the label of position t is token t+1; the prompt's last position predicts completion[0]
    masks = ["0" * (len(ex.prompt) - 1) + "".join("1" if m else "0" for m in ex.loss_mask)
             for ex in examples]
    T = max(len(q) for q in seqs)
    chars = np.frombuffer("".join(q.ljust(T, "\x00") for q in seqs).encode("latin-1"),
                          dtype=np.uint8).reshape(len(seqs), T)
    tokens = lut[chars]                                                          # [N, T]
    if (tokens < 0).any():
        raise ValueError("corpus has characters outside the tokenizer's vocabulary")
    keep = np.frombuffer("".join(m.ljust(T - 1, "0") for m in masks).encode("latin-1"),
                         dtype=np.uint8).reshape(len(seqs), T - 1) == ord("1")   # [N, T-1]
    input_ids = torch.from_numpy(tokens[:, :-1].copy())
    labels = torch.from_numpy(np.where(keep, tokens[:, 1:], -100))
    return input_ids, labels


def _loss_weights(examples, T: int):
    """[N, T-1] float loss weights aligned with `_encode`'s labels, or None when every
    `loss_mask` entry is 0 or 1 (the plain masked loss: nothing to weight)."""
    import numpy as np

    if all(m in (0, 1) for ex in examples for m in ex.loss_mask):
        return None
    w = np.zeros((len(examples), T - 1), dtype=np.float32)
    for i, ex in enumerate(examples):
        start = len(ex.prompt) - 1                          # the label of the prompt's last position
        w[i, start: start + len(ex.loss_mask)] = ex.loss_mask
    return torch.from_numpy(w)


def build_dataset(cfg: PretrainConfig, tokenizer):
    """``{"direct": (ids, labels, weights), "forked": (...)}`` from the task's corpus (`cfg`
    resolved), or ``{"all": (ids, labels, weights)}`` for a task without a `stratified_corpus`;
    ``weights`` is None unless the corpus weights some loss tokens (`_loss_weights`)."""
    from cispo.data.tasks import get_task

    task = get_task(cfg.task)
    examples = task.corpus(cfg.seed, cfg.corpus_size, fork_fraction=cfg.fork_fraction,
                           derivation_fraction=cfg.derivation_fraction,
                           wrong_guess_fraction=cfg.wrong_guess_fraction)
    vocab = tokenizer.get_vocab()

    def encoded(part):
        ids, labels = _encode(part, vocab, tokenizer.eos_token_id, tokenizer.pad_token_id)
        return ids, labels, _loss_weights(part, ids.shape[1] + 1)

    if not task.stratified_corpus:
        return {"all": encoded(examples)}
    out = {}
    for kind in ("direct", "forked"):
        part = [ex for ex in examples if ex.forked == (kind == "forked")]
        if part:
            out[kind] = encoded(part)
    return out


def _length_sorted_halves(ids, labels, weights=None):
    """``[(ids, labels, weights), (...)]``: the rows sorted by length, split in two, each cut
    to its longest row (right padding carries no loss and, causally, changes no logit)."""
    lengths = (labels != -100).long().cumsum(1).argmax(1) + 1                   # [B] last loss position + 1
    order = torch.argsort(lengths, stable=True)
    out = []
    for part in (order[: len(order) // 2], order[len(order) // 2:]):
        if len(part):
            t = int(lengths[part].max())
            out.append((ids[part, :t], labels[part, :t], None if weights is None else weights[part, :t]))
    return out


def _lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


# --------------------------------------------------------------------------- pretrain


def pretrain(cfg: PretrainConfig, out_dir, progress: bool = True, callback=None, callback_every: int = 100):
    """Pretrain the base model for `cfg` and save it (`cispo.models.loading.save_policy`) to `out_dir`.

    Returns ``(model, tokenizer)``. Also writes ``pretrain_config.json`` and
    ``pretrain_log.json`` (loss curve, wall time) into `out_dir`. `callback(step, model,
    tokenizer)`, if given, runs every `callback_every` steps (e.g. to measure the model).
    """
    from tqdm.auto import tqdm

    from cispo.data.tasks import get_task
    from cispo.models.loading import build_model, build_tokenizer, num_parameters, save_policy

    t0 = time.perf_counter()
    cfg = cfg.resolved()
    task = get_task(cfg.task)
    tokenizer = build_tokenizer(task.alphabet, task.max_positions)
    data = build_dataset(cfg, tokenizer)
    model = build_model(tokenizer, cfg.model_size, seed=cfg.seed, max_positions=task.max_positions)
    model.train()

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=cfg.betas, eps=1e-8)
    gen = torch.Generator().manual_seed(cfg.seed)
    n_forked = round(cfg.batch_size * cfg.derivation_fraction) if "forked" in data else 0
    share = {"direct": cfg.batch_size - n_forked, "forked": n_forked, "all": cfg.batch_size}

    log = []
    bar = tqdm(range(cfg.steps), desc=f"pretrain {cfg.task} seed {cfg.seed}", disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        batches = []
        for kind, (ids, labels, weights) in data.items():
            if share[kind] == 0:
                continue
            idx = torch.randint(len(ids), (share[kind],), generator=gen)
            w = None if weights is None else weights[idx]
            if kind == "all":  # one mixed-length corpus: two length-sorted, trimmed micro-batches
                batches += _length_sorted_halves(ids[idx], labels[idx], w)
            else:
                batches.append((ids[idx], labels[idx], w))
        n_tokens = sum(int((lab != -100).sum()) if w is None else float(w.sum()) for _, lab, w in batches)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for ids, labels, w in batches:
            logits = model(input_ids=ids).logits.float()                       # [B, T, V]
            if w is None:   # sum over loss tokens / their number
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                       reduction="sum") / n_tokens
            else:           # weighted: sum(w * loss) / sum(w)
                loss = (F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                        reduction="none") * w.flatten()).sum() / n_tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append(total)
        if callback is not None and (step + 1) % callback_every == 0:
            callback(step + 1, model, tokenizer)
            model.train()
        if step % 10 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{total:.4f}")
    model.eval()
    wall = time.perf_counter() - t0

    out_dir = Path(out_dir)
    save_policy(model, tokenizer, out_dir)
    with open(out_dir / "pretrain_config.json", "w") as f:
        json.dump(asdict(cfg), f, indent=2, sort_keys=True)
    with open(out_dir / "pretrain_log.json", "w") as f:
        json.dump({"loss": log, "wall_s": wall, "num_parameters": num_parameters(model),
                   "threads": torch.get_num_threads()}, f)
    return model, tokenizer


# --------------------------------------------------------------------------- measure


@torch.no_grad()
def sample_completions(model, tokenizer, prompts: list[str], max_new_tokens: int,
                       temperature: float = 1.0, seed: int = 0, batch_size: int = 512,
                       steer=None) -> list[str]:
    """Sample one completion per prompt (KV cache); ``temperature == 0`` is greedy.

    Completions are decoded up to, not including, EOS. Prompts are grouped by token
    length so no padding is needed. Seeded by its own `torch.Generator`.
    `steer(prompt_index, completion_so_far, token) -> token`, if given, may replace each
    sampled token (a character, or the EOS token's text) before it is fed back: a policy
    forced at chosen decisions (e.g. a recheck after exactly the steps that need one).
    """
    from transformers import DynamicCache

    # transformers >= 5.x names the KV cache argument `cache`; older versions `past_key_values`
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    enc = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    order = sorted(range(len(prompts)), key=lambda i: (len(enc[i]), i))
    out = [""] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        # split the chunk further so every sub-batch has one prompt length
        by_len: dict[int, list[int]] = {}
        for i in chunk:
            by_len.setdefault(len(enc[i]), []).append(i)
        for rows in by_len.values():
            ids = torch.tensor([enc[i] for i in rows], device=device)         # [B, P]
            cache = DynamicCache()
            logits = model(input_ids=ids, use_cache=True, **{cache_kw: cache}).logits[:, -1]
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            new = []
            texts = [""] * len(rows)
            for _ in range(max_new_tokens):
                logits = logits.float()
                if temperature == 0:
                    tok = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / temperature, dim=-1)
                    tok = torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(1).to(device)
                tok = torch.where(done, torch.full_like(tok, eos), tok)
                if steer is not None:
                    tok = _steer(steer, rows, texts, tok, done, tokenizer)
                new.append(tok)
                done |= tok == eos
                if bool(done.all()):
                    break
                logits = model(input_ids=tok[:, None], use_cache=True, **{cache_kw: cache}).logits[:, -1]
            new = torch.stack(new, 1).tolist()                                  # [B, T]
            for i, toks in zip(rows, new):
                toks = toks[: toks.index(eos)] if eos in toks else toks
                out[i] = tokenizer.decode(toks, skip_special_tokens=False)
    return out


def _steer(steer, rows, texts, tok, done, tokenizer):
    """Apply `steer` to the sampled tokens [B] of the rows not done; extend `texts`."""
    ids = tok.tolist()
    for j, i in enumerate(rows):
        if bool(done[j]):
            continue
        ch = tokenizer.convert_ids_to_tokens(ids[j])
        ch = steer(i, texts[j], ch)
        ids[j] = tokenizer.convert_tokens_to_ids(ch)
        texts[j] += "" if ids[j] == tokenizer.eos_token_id else ch
    return torch.tensor(ids, device=tok.device)


@dataclass
class BaseModelReport:
    """What the base model does on held-out prompts (rates in [0, 1])."""

    n: int
    temperature: float
    accuracy: float
    """Sampled accuracy, all completions."""
    fork_rate: float
    """Fraction of sampled completions that contain the fork token."""
    accuracy_fork: float
    """Sampled accuracy among completions that used the fork (nan if none)."""
    accuracy_no_fork: float
    """Sampled accuracy among completions that did not."""
    n_fork: int
    greedy_accuracy: float
    greedy_fork_rate: float
    mean_length: float
    """Mean sampled completion length in characters (= tokens, EOS excluded)."""
    forced_fork_accuracy: float
    """Sampled accuracy when the fork token is forced right after the greedy direct guess."""

    @property
    def fork_gain(self) -> float:
        """accuracy_fork - accuracy_no_fork."""
        return self.accuracy_fork - self.accuracy_no_fork

    def to_dict(self) -> dict:
        return {**asdict(self), "fork_gain": self.fork_gain}


def measure_base_model(model, tokenizer=None, task="addition", n: int = 2000, temperature: float = 1.0,
                       seed: int = 0, batch_size: int = 512) -> BaseModelReport:
    """Sample `n` held-out prompts once each at `temperature` (and greedily) and report.

    `model` is a model (then pass `tokenizer`) or a folder for `cispo.models.loading.load_policy`.
    `task` is a name or a `cispo.data.tasks.Task`.
    """
    from cispo.data.tasks import get_task
    from cispo.models.loading import load_policy

    if isinstance(model, (str, Path)):
        model, tokenizer = load_policy(model)
    task = get_task(task) if isinstance(task, str) else task
    was_training = model.training
    model.eval()
    samples = task.eval_samples(seed, n)
    prompts = [s["prompt"] for s in samples]

    def score(completions):
        rewards = [task.reward(s["prompt"], c, answer=s["answer"]) for s, c in zip(samples, completions)]
        forks = [task.used_fork(c) for c in completions]
        return rewards, forks

    comps = sample_completions(model, tokenizer, prompts, task.max_new_tokens, temperature, seed, batch_size)
    rewards, forks = score(comps)
    greedy = sample_completions(model, tokenizer, prompts, task.max_new_tokens, 0.0, seed, batch_size)
    g_rewards, g_forks = score(greedy)
    fork = task.fork_tokens[0]  # the character the corpus plants
    guesses = [g.split(fork)[0] + fork for g in greedy]
    forced = sample_completions(model, tokenizer, [p + g for p, g in zip(prompts, guesses)],
                                task.max_new_tokens, temperature, seed + 1, batch_size)
    f_rewards, _ = score([g + c for g, c in zip(guesses, forced)])
    model.train(was_training)

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    with_fork = [r for r, f in zip(rewards, forks) if f]
    without = [r for r, f in zip(rewards, forks) if not f]
    return BaseModelReport(
        n=n, temperature=temperature, accuracy=mean(rewards), fork_rate=mean(forks),
        accuracy_fork=mean(with_fork), accuracy_no_fork=mean(without), n_fork=len(with_fork),
        greedy_accuracy=mean(g_rewards), greedy_fork_rate=mean(g_forks),
        mean_length=mean([len(c) for c in comps]), forced_fork_accuracy=mean(f_rewards),
    )


# --------------------------------------------------------------------------- chain task


def chain_recheck_policy(numbers_of, rule: str, bugs=None):
    """A `steer` for `sample_completions` on the `chain` task that decides every
    "recheck or go on" token (right after a step's direct result) by `rule`:

    * ``"carry"``: recheck exactly the steps whose written operands the base model gets wrong
      (`chain.is_buggy` with `bugs`; chain: those that carry) (the policy the length budget
      favours; its accuracy estimates the best achievable);
    * ``"never"`` / ``"always"``: no recheck / a recheck after every step.

    Everything else is the model's own sample. `numbers_of(i)` gives prompt i's numbers.
    """
    import re

    from cispo.data.tasks import chain

    step_end = re.compile(r"(?:^|;)([0-9]+)\+([0-9]+)=([0-9]+)$")
    eos = "<eos>"

    def steer(i, text, tok):
        if tok not in (";", chain.FORK_TOKEN, eos):
            return tok
        m = step_end.search(text)
        if m is None:                                   # not right after a direct result
            return tok
        a, b = int(m.group(1)), int(m.group(2))
        if rule == "always" or (rule == "carry" and chain.is_buggy(a, b, bugs)):
            return chain.FORK_TOKEN
        if tok != chain.FORK_TOKEN:
            return tok
        return ";" if text.count(";") + 1 < len(numbers_of(i)) - 1 else eos
    return steer


def measure_chain_model(model, tokenizer=None, n: int = 1000, seed: int = 0, batch_size: int = 512,
                        task_name: str = "chain") -> dict:
    """The `chain` task's base-model properties on `n` held-out prompts:

    * ``accuracy`` / ``greedy_accuracy``: sampled (T=1) and greedy, as the task rewards them;
    * ``recheck_rate``: W per opportunity (per step's direct result) in sampled completions;
      ``rechecks_per_response``; ``accuracy_with_recheck`` / ``_without``: sampled
      completions that rechecked at least once vs never;
    * ``carry_step_value_correct_with_recheck`` / ``_without``: on steps whose written
      operands the base model gets wrong (`chain.is_buggy` with the task's `chain.TASK_BUGS`;
      chain: those that carry), how often the value the chain goes on from is right;
    * ``step_error_rate``: direct results that are wrong (all steps);
    * ``accuracy_forced_{carry,never,always}``: sampled, with every recheck decision forced
      (`chain_recheck_policy`); ``answer_correct_forced_always``: the answer is right, the
      budget aside.
    """
    from cispo.data.tasks import chain, get_task
    from cispo.models.loading import load_policy

    if isinstance(model, (str, Path)):
        model, tokenizer = load_policy(model)
    task = get_task(task_name)  # chain, or a variant of it (chain_sparse, chain_hidden)
    bugs = chain.TASK_BUGS.get(task_name)
    was_training = model.training
    model.eval()
    samples = task.eval_samples(seed, n)
    prompts = [s["prompt"] for s in samples]
    numbers = [chain.parse_prompt(p) for p in prompts]
    rew = lambda comps: [task.reward(s["prompt"], c, answer=s["answer"]) for s, c in zip(samples, comps)]  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731

    comps = sample_completions(model, tokenizer, prompts, task.max_new_tokens, 1.0, seed, batch_size)
    greedy = sample_completions(model, tokenizer, prompts, task.max_new_tokens, 0.0, seed, batch_size)
    r, rg = rew(comps), rew(greedy)
    checks = [chain.count_reflections(c) for c in comps]
    steps = [chain.parse_steps(c) or [] for c in comps]
    opportunities = sum(len(chain.strip_completion(c).split(chain.STEP_SEP)) for c in comps)  # one per step
    carry_with, carry_without, wrong_direct = [], [], []
    for ss in steps:
        for st in ss:
            wrong_direct.append(st.result != st.a + st.b)
            if chain.is_buggy(st.a, st.b, bugs):
                (carry_with if st.corrected is not None else carry_without).append(st.value == st.a + st.b)
    out = {
        "n": n, "accuracy": mean(r), "greedy_accuracy": mean(rg),
        "well_formed": mean([bool(s) for s in steps]),
        "recheck_rate": sum(checks) / max(1, opportunities),
        "rechecks_per_response": mean(checks),
        "accuracy_with_recheck": mean([x for x, c in zip(r, checks) if c]),
        "accuracy_without_recheck": mean([x for x, c in zip(r, checks) if not c]),
        "n_with_recheck": sum(1 for c in checks if c),
        "carry_step_value_correct_with_recheck": mean(carry_with),
        "carry_step_value_correct_without_recheck": mean(carry_without),
        "n_carry_steps_rechecked": len(carry_with),
        "step_error_rate": mean(wrong_direct),
        "mean_length": mean([len(c) for c in comps]),
        "optimal_rechecks_per_response": mean([len(chain.buggy_steps(ns, bugs)) for ns in numbers]),
    }
    for rule in ("carry", "never", "always"):
        forced = sample_completions(model, tokenizer, prompts, task.max_new_tokens, 1.0, seed + 1, batch_size,
                                    steer=chain_recheck_policy(lambda i: numbers[i], rule, bugs))
        out[f"accuracy_forced_{rule}"] = mean(rew(forced))
        if rule == "always":
            out["answer_correct_forced_always"] = mean([chain.extract_answer(c) == s["answer"]
                                                        for c, s in zip(forced, samples)])
        if rule == "carry":
            out["mean_length_forced_carry"] = mean([len(c) for c in forced])
    model.train(was_training)
    return out

