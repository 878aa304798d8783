"""Observations as token ids: the text an environment answers with, rendered and tokenized, at most a given
number of tokens (`fit_observation`); a chat turn rendered by the policy's own chat template
(`chat_observation`: the text by which the conversation with the new turns extends the one without, after
the assistant turn the policy ended); and an observation of any kind an `Env` returns (`observation_ids`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from cispo.envs.call_formats import assistant_message

__all__ = ["CUT_NOTE", "MIN_RESULT_TOKENS", "chat_observation", "fit_observation", "kept_results", "dropped_note",
           "observation_ids", "defuse", "special_spellings"]

CUT_NOTE = " [cut]"
"""What a result cut to fit an observation ends with."""


def chat_observation(tokenizer, calls: list[dict], tool_messages: list[dict], stop_text: str, content: str = "") -> str:
    """The observation text of a chat tool turn: what the template puts after the assistant turn's end
    (``stop_text``, the stop token the policy sampled: ``"\\n"`` after ``<|im_end|>``; nothing where
    ``stop_text`` is not in the rendering), then the tool turn(s) and the next assistant turn's opening
    — the text by which ``history + [assistant] + tool_messages`` rendered with the generation prompt
    extends ``history + [assistant]``, the assistant turn making ``calls`` (TRL's ``_get_tool_suffix_ids``:
    a minimal history, one user message, so that no template renders it differently once a tool turn
    follows; ``content``: the assistant turn's text, empty by default). A template that takes one call per turn
    (Llama 3.1 raises on more) is given the first call only: the tool turns that follow it do not depend on the
    calls. ValueError where it does not extend it."""
    def render(made: list[dict]) -> tuple[str, str]:
        messages = [{"role": "user", "content": "dummy"}, assistant_message(content, made)]
        return (tokenizer.apply_chat_template(messages, tokenize=False),
                tokenizer.apply_chat_template([*messages, *tool_messages], tokenize=False, add_generation_prompt=True))

    try:
        before, after = render(calls)
    except Exception:  # noqa: BLE001 - a template's own refusal of several calls in one turn
        if len(calls) < 2:
            raise
        before, after = render(calls[:1])
    if not after.startswith(before):
        raise ValueError("the chat template renders the assistant turn differently once a tool turn follows it")
    end = before.rfind(stop_text) if stop_text else -1
    closing = before[end + len(stop_text):] if end >= 0 else ""
    return closing + after[len(before):]


def fit_observation(tokenizer, render: Callable[[list[str]], str], contents: list[str], cap: int) -> list[int]:
    """The ids of ``render(contents)``, at most ``cap`` of them, the rendering's own text (a template's closing
    ``</tool_response>``, the next turn's opening) always whole where it fits at all. Where it is longer: the
    trailing results that leave no room are dropped whole (`kept_results`), the last kept one saying how many
    (`dropped_note`); each kept content is cut to an equal share of what the rendering's own text leaves (its
    first tokens, then `CUT_NOTE`; smaller where the rendering grows it). Only where the rendering of one
    result with nothing in it is itself longer than ``cap`` are the ids cut at ``cap``."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = encode(render(contents))
    if len(ids) <= cap:
        return ids
    kept = kept_results(tokenizer, render, contents, cap)
    if kept == 0:
        return ids[:cap]
    note = dropped_note(len(contents) - kept)
    contents = contents[:kept]
    whole = encode(render([*contents[:-1], contents[-1] + note]))
    if len(whole) <= cap:  # the kept results fit whole
        return whole
    share = max(0, (cap - len(encode(render(_with_note([CUT_NOTE] * kept, note))))) // kept)
    for _ in range(8):  # the rendering may grow a content (escaping): shrink the share by what is over
        cut = [tokenizer.decode(encode(c)[:share]) + CUT_NOTE if len(encode(c)) > share else c for c in contents]
        ids = encode(render(_with_note(cut, note)))
        if len(ids) <= cap or share == 0:
            break
        share = max(0, share - max(1, math.ceil((len(ids) - cap) / kept)))
    return ids if len(ids) <= cap else ids[:cap]


MIN_RESULT_TOKENS = 8
"""The fewest tokens of a result `kept_results` keeps room for (a shorter result: all of it)."""


def dropped_note(n: int) -> str:
    """What the last kept result of an observation says of the ``n`` results dropped after it ("" for none)."""
    return "" if n == 0 else f" [{n} more tool result{'s' if n > 1 else ''} cut: the observation's limit]"


def _with_note(contents: list[str], note: str) -> list[str]:
    return [*contents[:-1], contents[-1] + note] if contents else contents


def kept_results(tokenizer, render: Callable[[list[str]], str], contents: list[str], cap: int) -> int:
    """How many leading results of ``contents`` an observation of ``cap`` ids keeps: the most whose rendering,
    each cut to `MIN_RESULT_TOKENS` tokens (then `CUT_NOTE`) and the last saying how many were dropped
    (`dropped_note`), fits ``cap`` (a binary search: a rendering grows with its results); 0 where not even one
    does (a template's own text longer than ``cap``)."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    heads = [encode(c) for c in contents]
    floor = [c if len(h) <= MIN_RESULT_TOKENS else tokenizer.decode(h[:MIN_RESULT_TOKENS]) + CUT_NOTE
             for c, h in zip(contents, heads)]
    lo, hi = 0, len(contents)
    while lo < hi:
        k = (lo + hi + 1) // 2
        if len(encode(render(_with_note(floor[:k], dropped_note(len(contents) - k))))) <= cap:
            lo = k
        else:
            hi = k - 1
    return lo


def defuse(text: str, specials: tuple[str, ...]) -> str:
    """``text`` with every special token's spelling in ``specials`` (``<|im_end|>``) broken by a zero-width
    space after its first character, so that an environment's text cannot end a turn or open one when
    tokenized."""
    for special in specials:
        if special in text:
            text = text.replace(special, f"{special[0]}\u200b{special[1:]}")
    return text


def special_spellings(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens of more than one character (what `defuse` breaks)."""
    return tuple(t for t in getattr(tokenizer, "all_special_tokens", ()) if len(t) > 1)


def observation_ids(tokenizer, observation, stop_text: str, cap: int) -> list[int]:
    """The ids of an `Env`'s observation (``cispo.envs.base.Observation``), at most ``cap``: token ids as they
    are (cut at ``cap``); text tokenized without special tokens, its special tokens' spellings defused, cut
    with `CUT_NOTE` (`fit_observation`); chat messages (``{"role", "content"}`` dicts: a user turn, tool turns)
    rendered by the chat template after the assistant turn the policy ended with ``stop_text``
    (`chat_observation`), each content defused and cut to fit. TypeError for anything else."""
    specials = special_spellings(tokenizer)
    if isinstance(observation, str):
        return fit_observation(tokenizer, lambda t: t[0], [defuse(observation, specials)], cap)
    if isinstance(observation, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool)
                                                      for i in observation):
        return list(observation)[:cap]
    if isinstance(observation, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in observation):
        messages = list(observation)
        contents = [defuse(str(m.get("content") or ""), specials) for m in messages]

        def render(texts: list[str]) -> str:
            return chat_observation(tokenizer, [], [{**m, "content": t} for m, t in zip(messages, texts)], stop_text)

        return fit_observation(tokenizer, render, contents, cap)
    raise TypeError(f"an observation must be text, chat messages or token ids, got {type(observation).__name__}")
