"""Reflective ("fork") strings — ``Wait``, ``However``, ``Let me check`` — found in responses, in the
token ids the trainer updates and in the text that evaluation and ``samples.jsonl`` see.

A string is matched as a **whole word in either case of its first letter**: ``Wait`` stands for
``Wait`` and ``wait``, ``Let me check`` for ``Let me check`` and ``let me check``, not inside a
longer word (``Waiter``: the letter after it continues the word; ``Hmmm`` is not ``Hmm``). A string
of one character (the built-in tasks' ``W``) is a symbol, matched wherever it is.

In token ids (`ForkTokens`), a string is **every token sequence that spells one of its forms**:

1. each case form with and without a leading space, encoded by the tokenizer (its canonical BPE
   spelling: ``" Let me check"`` -> ``[" Let", " me", " check"]``; ``"Hmm"`` -> ``["H", "mm"]``),
   kept when it decodes back to the form;
2. every single token whose text, stripped of whitespace, is a case form (``"Wait"``,
   ``"ĠWait"``, ``"▁Wait"``, a token ``"\\nWait"``), whatever the tokenizer's canonical spelling is.

A non-canonical spelling of more than one token (``"Wa" + "it"``) is not matched (a sampler
rarely produces one; the text matcher would count it).

**The first token of a match carries the string's diagnostics** (its probability, IS ratio, capped
and PPO-dropped flags): it is where the policy decides to reflect; the tokens after it spell out a
decision already taken. A token that starts matches of several strings is labelled with the
longest (``Let me check`` over ``Let``); a token inside one match may start another string's match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import torch

OTHER = "other"
"""The name under which the response tokens that start no match are reported."""


def core(string: str) -> str:
    """The string without surrounding whitespace (a leading space is a form, not the string)."""
    return string.strip()


def case_forms(string: str) -> tuple[str, ...]:
    """The string with its first letter upper- and lower-case, in that order, without repeats:
    ``"wait"`` -> ``("Wait", "wait")``; ``"double-check"`` -> ``("Double-check", "double-check")``."""
    c = core(string)
    return tuple(dict.fromkeys((c[:1].upper() + c[1:], c[:1].lower() + c[1:])))


def slug(string: str) -> str:
    """The string's name in metric keys: lower case, every run of other characters than letters
    and digits one ``_`` (``"Let me check"`` -> ``let_me_check``)."""
    return re.sub(r"[^0-9a-z]+", "_", core(string).lower()).strip("_")


def normalise(strings) -> tuple[str, ...]:
    """``strings`` without the ones that repeat an earlier one's case forms (``" wait"`` after
    ``"Wait"``), stripped. ValueError, naming them, for a string with no letter or digit, for
    ``"other"``, or for two different strings that would share a metric name."""
    by_slug: dict[str, str] = {}  # metric name -> the string kept
    for s in strings:
        if not isinstance(s, str) or not slug(s):
            raise ValueError(f"fork string {s!r} has no letter or digit to match")
        if slug(s) == OTHER:
            raise ValueError(f"fork string {s!r}: 'other' names the tokens that are no fork string's")
        kept = by_slug.setdefault(slug(s), core(s))
        if case_forms(kept) != case_forms(s):
            raise ValueError(f"fork strings {kept!r} and {core(s)!r} would share the metric name "
                             f"fork/{slug(s)}/; keep one")
    return tuple(by_slug.values())


# --------------------------------------------------------------------------- in text

_LETTER = r"[^\W\d_]"


@lru_cache(maxsize=64)
def _pattern(string: str) -> re.Pattern:
    """The regular expression of ``string``: its case forms, as a whole word unless it is one character."""
    c = core(string)
    body = "|".join(map(re.escape, case_forms(c)))
    before = f"(?<!{_LETTER})" if len(c) > 1 and c[0].isalpha() else ""
    after = f"(?!{_LETTER})" if len(c) > 1 and c[-1].isalpha() else ""
    return re.compile(f"{before}(?:{body}){after}")


def count_in_text(strings, text: str) -> list[int]:
    """Occurrences of each of ``strings`` in ``text`` (non-overlapping, left to right)."""
    return [len(_pattern(s).findall(text)) for s in strings]


def used_any(strings, text: str) -> bool:
    """Whether ``text`` contains any of ``strings`` (a task's ``used_fork``)."""
    return any(_pattern(s).search(text) for s in strings)


# --------------------------------------------------------------------------- in token ids


@dataclass(frozen=True)
class ForkTokens:
    """Every token sequence that spells each of ``names`` in one tokenizer (``from_tokenizer``), and
    the matcher over response ids (``index``)."""

    names: tuple[str, ...]
    """The tracked strings (``normalise`` d), in the order of their index."""
    sequences: tuple[tuple[int, tuple[int, ...]], ...]
    """``(string index, token ids)`` for every spelling of every string."""
    word_start: torch.Tensor
    """[V] bool: the token's text starts with a letter (it would continue a word just before it)."""
    word_end: torch.Tensor
    """[V] bool: the token's text ends with a letter."""

    @property
    def slugs(self) -> tuple[str, ...]:
        return tuple(map(slug, self.names))

    def spellings(self, string: str) -> set[tuple[int, ...]]:
        """The token sequences that spell ``string`` (one of ``names``)."""
        i = self.names.index(core(string))
        return {ids for j, ids in self.sequences if j == i}

    @staticmethod
    def from_tokenizer(tokenizer, strings) -> ForkTokens:
        """The spellings of ``strings`` (module docstring) in ``tokenizer`` (a Hugging Face one)."""
        names = normalise(strings)
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)
        by_text: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            by_text.setdefault(t.strip(), []).append(i)
        sequences = []
        for index, name in enumerate(names):
            found = {}
            for form in case_forms(name):
                for spelled in (form, " " + form):
                    ids = tuple(tokenizer.encode(spelled, add_special_tokens=False))
                    if ids and tokenizer.decode(list(ids), clean_up_tokenization_spaces=False) == spelled:
                        found[ids] = None
                found.update(dict.fromkeys((i,) for i in by_text.get(form, ())))
            sequences += [(index, ids) for ids in found]
        first = torch.tensor([bool(t) and t[0].isalpha() for t in texts])
        last = torch.tensor([bool(t) and t[-1].isalpha() for t in texts])
        return ForkTokens(names, tuple(sequences), first, last)

    def missing(self) -> tuple[str, ...]:
        """The strings that no token sequence of the vocabulary spells (not tracked)."""
        spelled = {i for i, _ in self.sequences}
        return tuple(n for i, n in enumerate(self.names) if i not in spelled)

    def index(self, response_ids: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
        """For each response token, the index of the string whose match starts there, else -1.

        ``response_ids``, ``response_mask``: [B, T]. A match lies wholly inside the response
        (``response_mask`` = 1); one whose first (last) token starts (ends) with a letter counts only
        when the response token before (after) it, if any, does not end (start) with one (whole
        words), unless its string is one character.  -> [B, T] long"""
        B, T = response_ids.shape
        mask = response_mask.bool()  # [B, T]
        ids = response_ids.clamp(0, len(self.word_start) - 1).cpu()  # [B, T]
        mask = mask.cpu()
        ends_word = self.word_end[ids] & mask  # [B, T]
        starts_word = self.word_start[ids] & mask  # [B, T]
        # the token before / after each position continues a word (False at the response's edges)
        prev_letter = torch.nn.functional.pad(ends_word, (1, 0))[:, :T]  # [B, T]
        out = torch.full((B, T), -1, dtype=torch.long)
        length = torch.zeros((B, T), dtype=torch.long)
        for index, seq in self.sequences:
            n = len(seq)
            if n > T:
                continue
            windows = ids.unfold(1, n, 1)  # [B, T-n+1, n]
            hit = (windows == torch.tensor(seq)).all(-1) & mask.unfold(1, n, 1).all(-1)  # [B, T-n+1]
            if len(self.names[index]) > 1:
                if self.word_start[seq[0]]:
                    hit &= ~prev_letter[:, : T - n + 1]
                if self.word_end[seq[-1]]:
                    next_letter = torch.nn.functional.pad(starts_word[:, n:], (0, 1))  # [B, T-n+1]
                    hit &= ~next_letter
            hit = torch.nn.functional.pad(hit, (0, n - 1)) & (n > length)  # [B, T]
            out[hit], length[hit] = index, n
        return out.to(response_ids.device)
