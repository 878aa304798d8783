"""Length-sorted micro-batches: how a mini-batch is cut into forward/backward calls.

A mini-batch's rows are sorted by length and cut into parts of similar lengths, each trimmed
to its own longest row (``Experience.select``), so padding costs little; the objective is
normalised by the whole mini-batch's counts, so the cut never changes the gradient (up to
float summation order).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from cispo.foundations.experience import Experience

if TYPE_CHECKING:
    from cispo.config.train import AlgoConfig


def row_order(n_rows: int, group_size: int, algo: AlgoConfig, generator: torch.Generator,
              group_of: torch.Tensor | None = None) -> torch.Tensor:
    """An epoch's shuffled rows [n_rows]: a random permutation (``algo.minibatch_order=random``), or the
    groups in a random order with each group's ``group_size`` rows together (``by_group``; the batch's
    rows are whole groups, laid out group by group, ``cispo.training.trainer.Trainer.experience``).
    ``group_of`` [n_rows]: each row's group where a group holds more rows than episodes (an episode of
    several training rows, ``cispo.envs.rows``; ``exp.extras["group_of"]``): ``by_group`` keeps those together."""
    if algo.minibatch_order == "by_group" and group_of is not None:
        groups = torch.randperm(int(group_of.max()) + 1 if len(group_of) else 0, generator=generator)  # [n_groups]
        return torch.cat([(group_of.cpu() == g).nonzero().flatten() for g in groups.tolist()] or
                         [torch.zeros(0, dtype=torch.long)])  # [n_rows]
    if algo.minibatch_order == "by_group" and n_rows % group_size == 0:
        groups = torch.randperm(n_rows // group_size, generator=generator)  # [n_groups]
        return (groups[:, None] * group_size + torch.arange(group_size)).flatten()  # [n_rows]
    return torch.randperm(n_rows, generator=generator)


def minibatches(order: torch.Tensor, algo: AlgoConfig, full_rows: int, kept_rows: int) -> list[torch.Tensor]:
    """The epoch's mini-batches: ``order`` (this rank's rows, shuffled) cut into K_eff parts.

    ``fixed_updates``: K_eff = K (``algo.updates_per_batch``) whatever the batch holds, so a batch
    that dynamic sampling left short gives smaller mini-batches (the original rule, kept for comparison).
    ``fixed_size``: the mini-batch keeps its configured size, ``full_rows / K`` rows (``full_rows``:
    the batch as configured, prompts x G, over every rank), and a short batch gives fewer
    updates: K_eff = max(1, kept_rows // size), ``kept_rows`` the rows kept over every rank. Every
    part then holds at least ``size`` rows (globally) unless the whole kept batch is smaller."""
    k = algo.updates_per_batch
    if algo.minibatch_policy == "fixed_size":
        size = max(1, full_rows // k)  # the configured mini-batch, in rows
        k = max(1, min(k, kept_rows // size))
    return list(order.tensor_split(k))


def micro_batches(exp: Experience, rows: torch.Tensor, algo: AlgoConfig, share: bool = False) -> list[torch.Tensor]:
    """The forward/backward calls over ``rows`` of ``exp``: length-sorted micro-batches cut where
    a cut saves more than ``algo.micro_batch_split_cost`` padded positions, each of at most
    ``algo.micro_batch_size`` rows; with the split cost None, consecutive chunks of
    ``micro_batch_size`` rows (all of them when None); [] when ``rows`` is empty. ``share``: the
    passes run each distinct prompt of a call once (``Policy.share_prompts``), which the cut's cost counts."""
    size, split_cost = algo.micro_batch_size, algo.micro_batch_split_cost
    if len(rows) == 0:
        return []
    if split_cost is None:
        return [rows] if not size else list(rows.split(size))
    return length_micro_batches(exp, rows, size, split_cost, share)


def _prompt_keys(exp: Experience, rows: torch.Tensor) -> list[int]:
    """For each of ``rows``, an id of its prompt (equal ids: the same prompt ids in the same columns)."""
    P = exp.input_ids.shape[1] - exp.response_mask.shape[1]
    prompts = exp.input_ids[rows, :P].masked_fill(exp.attention_mask[rows, :P] == 0, -1)  # [m, P]
    return torch.unique(prompts, dim=0, return_inverse=True)[1].tolist()


MAX_CUT_POINTS = 128  # candidate cuts considered by ``length_micro_batches``: bounds its time


def length_micro_batches(exp: Experience, rows: torch.Tensor, max_rows: int | None = None,
                         split_cost: float = 0.0, share: bool = False) -> list[torch.Tensor]:
    """``rows`` of ``exp`` sorted by length and cut into micro-batches of similar lengths.

    Rows are sorted by response length, then prompt length (a stable sort: ties keep the order
    of ``rows``). A micro-batch of n rows whose longest prompt and response are P and T costs
    n x (P + T - 1) decoder positions once ``Experience.select`` has trimmed it (with ``share``, each of
    its U distinct prompts once: U x P + n x (T - 1)), plus ``split_cost`` positions for the call
    itself (the fixed cost of one more forward/backward).
    The cuts minimise the total over the places where the response length changes (at most
    ``MAX_CUT_POINTS`` of them, spread evenly over the rows when there are more), by dynamic
    programming; a part of more than ``max_rows`` rows (None: no limit) is then cut into
    near-equal consecutive chunks, each costed at the part's widest. Every row is in exactly
    one micro-batch; none when ``rows`` is empty.
    """
    if len(rows) == 0:
        return []
    T_full = exp.response_mask.shape[1]
    resp = exp.response_spans[rows].long().cpu()  # [b] (observations before the last policy token take columns too)
    prompt = exp.attention_mask[:, :-T_full].sum(-1)[rows].long().cpu()  # [b]
    order = torch.argsort(resp * (int(prompt.max()) + 1) + prompt, stable=True)
    rows = rows[order.to(rows.device)]
    t, p = resp[order].clamp(min=1), prompt[order]  # select keeps >= 1 response column
    m = len(rows)
    bounds = [0] + ((t.diff() != 0).nonzero().flatten() + 1).tolist() + [m]  # blocks of equal response length
    if len(bounds) > MAX_CUT_POINTS + 1:
        bounds = sorted({bounds[round(k * (len(bounds) - 1) / MAX_CUT_POINTS)] for k in range(MAX_CUT_POINTS + 1)})
    longest_response = [int(t[b - 1]) for b in bounds[1:]]  # of each block (t is sorted)
    longest_prompt = [int(p[a:b].max()) for a, b in zip(bounds, bounds[1:])]
    prompt_of = _prompt_keys(exp, rows) if share else None  # [m] which distinct prompt each sorted row has
    d = len(bounds) - 1
    best, start = [0.0] + [math.inf] * d, [0] * (d + 1)  # cost of blocks 0..j-1; where its last part starts
    for j in range(1, d + 1):
        prompt_len, prompts = 0, set()
        for i in range(j - 1, -1, -1):  # the last part: blocks i .. j-1
            prompt_len = max(prompt_len, longest_prompt[i])
            n = bounds[j] - bounds[i]
            if prompt_of is not None:
                prompts.update(prompt_of[bounds[i] : bounds[i + 1]])
            runs = len(prompts) if prompt_of is not None else n  # prompt rows each call runs
            part = ((-(-n // max_rows) if max_rows else 1) * split_cost + runs * prompt_len
                    + n * (longest_response[j - 1] - 1))
            if part >= best[j]:  # best[i] >= 0 and part only grows as i decreases
                break
            if best[i] + part < best[j]:
                best[j], start[j] = best[i] + part, i
    parts, j = [], d
    while j > 0:
        a, b = bounds[start[j]], bounds[j]
        chunks = -(-(b - a) // max_rows) if max_rows else 1
        parts = list(rows[a:b].tensor_split(chunks)) + parts
        j = start[j]
    return parts
