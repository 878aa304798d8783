"""Sampling beside training, one step off policy (``rollout.async_steps=1``; docs/async.md).

While the trainer updates on batch n, a second thread samples batch n+1 (`cispo.training.sampling.StepSampler`,
unchanged: episodes, rewards, refills, retirement) with the **behaviour policy** θ_{n-1}, so batch n+1 is one
update older than the weights that train on it. With the torch sampler the behaviour policy is a copy of the
model, loaded with the trainer's weights at the start of step n; with a separate engine that holds its own
weights (vLLM, ``Sampler.own_weights``) it is the engine itself, whose weights the trainer pushes after the
join (``update_weights``, as in the synchronous loop), so they are θ_{n-1} while it samples batch n+1:

    step n:   [take held batch n] -> copy θ_{n-1} to the behaviour copy (vLLM: it has them) -> start sampling n+1
              -> logp_old, K updates on batch n (θ_{n-1} -> θ_n) -> join: hold batch n+1 -> (vLLM: push θ_n)

Nothing runs beside the trainer outside a step: the thread is joined before the step returns
(`cispo.training.rl_step`), so the held-out evaluation, checkpoints and stop signals see a quiet run. A
checkpoint keeps the held batch (`rollout_state` / `load_rollout`: ids, log-probs, rewards, episodes, and each
prompt's index in the stream), so a resumed run trains on exactly the batch the uninterrupted one would have.

On a CPU the two sides share the cores: torch's intra-op pool is one per process, so each side runs its ops
on one thread of its own (`split_threads`); the update passes then run beside the decoding instead of after it.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cispo.config.engine import ConfigError
from cispo.data.prompts import FillReport, PromptStream
from cispo.foundations.distributed import DistInfo
from cispo.foundations.experience import Completion
from cispo.models.policy import Policy
from cispo.training.held_batch import DTYPES, TENSORS
from cispo.training.logp_old import not_same_policy
from cispo.training.sampling import StepRollout


class Prefetch:
    """The behaviour policy and the batch it sampled for the next step (``held``; None before the first)."""

    def __init__(self, policy: Policy) -> None:
        self.engine = policy.sampler.own_weights  # vLLM: the engine is the behaviour policy
        if self.engine:
            self.behaviour = policy
        else:
            model = copy.deepcopy(policy.model).eval()
            for p in model.parameters():
                p.requires_grad_(False)
            sampler = policy.sampler.for_model(model)
            if sampler is None:
                raise ValueError(f"rollout.async_steps=1 needs a sampler with its own weights (vLLM) or one that "
                                 f"can sample from a copy of the model (torch), not {type(policy.sampler).__name__}")
            self.behaviour = dataclasses.replace(policy, model=model, sampler=sampler, ref_model=None,
                                                 train_body=None, grad_scaler=None)
        self.held: StepRollout | None = None
        self.wait_s = 0.0  # the trainer's wait for the last batch
        self.sample_s = 0.0  # the sampler thread's time on it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cispo-sampler")
        self._before: tuple = (None, None)  # the stream's and the sample generator's states at the last start

    def start(self, policy: Policy, sample, stream: PromptStream | None = None,
              generator: torch.Generator | None = None) -> Future:
        """Load the trainer's weights into the behaviour copy (a separate engine already has them: the last
        push) and sample the next batch beside the trainer: ``sample(behaviour_policy) -> StepRollout`` in the
        sampler thread. ``stream`` and ``generator`` (what the sampler advances) are noted first, for
        `drop_failed`."""
        self._before = (None if stream is None else stream.state_dict(),
                        None if generator is None else generator.get_state())
        if not self.engine:
            copy_weights(policy.model, self.behaviour.model)
        return self._pool.submit(self._timed, sample)

    def drop_failed(self, stream: PromptStream, generator: torch.Generator) -> bool:
        """A stop signal came: a held batch with failed reward calls (perhaps killed by that signal, as in
        `cispo.training.rl_step.StepInterrupted`) is not kept for a resume; the stream and ``generator`` go back
        to before it was drawn, so the resumed run samples it anew (with the checkpoint's weights: one update newer than
        the uninterrupted run's, the one place a resume differs from it). True if it dropped one."""
        if self.held is None or not self.held.errors or self._before[0] is None:
            return False
        stream.load_state_dict(self._before[0])
        generator.set_state(self._before[1])
        self.held = None
        print("cispo: the batch sampled ahead had failed reward calls during the stop: not kept; the resumed run "
              "samples it again", file=sys.stderr)
        return True

    def _timed(self, sample) -> StepRollout:
        t0 = time.perf_counter()
        try:
            return sample(self.behaviour)
        finally:
            self.sample_s = time.perf_counter() - t0

    def take(self) -> StepRollout:
        """The held batch, no longer held."""
        rollout, self.held = self.held, None
        return rollout

    def join(self, pending: Future) -> None:
        """Wait for the next batch and hold it (an exception in the sampler thread is raised here)."""
        t0 = time.perf_counter()
        try:
            self.held = pending.result()
        finally:
            self.wait_s = time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def set_up_prefetch(cfg, policy: Policy, device: torch.device, dist_info: DistInfo) -> Prefetch | None:
    """``rollout.async_steps=1``: the behaviour policy's copy and its thread (`cispo.training.prefetch`), the
    torch threads split between the two sides on a CPU. Refused under torchrun (not built) and where
    ``algo.logp_old=rollout`` would fall back to the recomputed pass (`not_same_policy`): the staleness would
    then reach neither the ratio nor a correction."""
    if cfg.rollout.async_steps == 0:
        return None
    if dist_info.enabled:
        raise ConfigError("rollout.async_steps=1 is not built for torchrun yet (one process only); set "
                          "rollout.async_steps=0")
    if cfg.algo.logp_old == "rollout" and (why := not_same_policy(policy)) is not None:
        raise ConfigError(f"rollout.async_steps=1 with algo.logp_old=rollout needs the behaviour policy's log-probs "
                          f"to be the policy's, but {why}; set algo.logp_old=recompute with a rollout correction "
                          "(algo.rollout_is or algo.tis_cap)")
    split_threads(device)
    return Prefetch(policy)


def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """dst's parameters and buffers := src's (same architecture), without autograd."""
    with torch.no_grad():
        for a, b in zip(src.state_dict(keep_vars=True).values(), dst.state_dict(keep_vars=True).values(), strict=True):
            b.copy_(a)


def split_threads(device: torch.device) -> int | None:
    """On a CPU, give each side (sampler thread, trainer) its own core's worth: torch's intra-op threads
    halved (at least 1), said in one line. Returns the new count (None off a CPU, or already 1)."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n <= 1:
        return None
    torch.set_num_threads(max(1, n // 2))
    print(f"cispo: rollout.async_steps=1: torch threads {n} -> {max(1, n // 2)} per side (sampler thread "
          "and trainer run at once)", file=sys.stderr)
    return max(1, n // 2)


# --------------------------------------------------------------------------- the held batch in a checkpoint


def rollout_state(rollout: StepRollout, stream: PromptStream) -> dict:
    """The held batch as plain JSON data: each completion's tensors as lists (float32 values round-trip
    exactly through JSON's doubles) and its prompt as the index of its sample in ``stream``."""
    return {"groups": [[completion_state(c, stream) for c in g] for g in rollout.groups],
            "sampled": [[completion_state(c, stream) for c in g] for g in rollout.sampled],
            "report": dataclasses.asdict(rollout.report), "errors": list(rollout.errors)}


def load_rollout(state: dict, stream: PromptStream) -> StepRollout:
    """`rollout_state`'s inverse over the same data (``stream`` holds the same samples); a checkpoint's is
    checked first (`cispo.training.held_batch.check_held_batch`, from the checkpoint's check)."""
    groups = [[load_completion(c, stream) for c in g] for g in state["groups"]]
    sampled = [[load_completion(c, stream) for c in g] for g in state["sampled"]]
    return StepRollout(groups, FillReport(**state["report"]), list(state["errors"]), sampled)


def completion_state(c: Completion, stream: PromptStream) -> dict:
    """One completion as JSON data (`rollout_state`)."""
    out = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
    out["sample"] = stream.index_of(c.sample)
    out["prompt_ids"] = [int(t) for t in c.prompt_ids]
    for name in TENSORS:
        t = out[name]
        out[name] = None if t is None else {"data": t.tolist(), "dtype": str(t.dtype).removeprefix("torch.")}
    out["reward_extras"] = [list(pair) for pair in c.reward_extras]
    out["continuations"] = [completion_state(r, stream) for r in c.continuations]
    return out


def load_completion(state: dict, stream: PromptStream) -> Completion:
    """`completion_state`'s inverse (dtypes only from `DTYPES`; a field with a default may be absent)."""
    s = dict(state)
    s["sample"] = stream.samples[s["sample"]]
    for name in TENSORS:
        t = s.get(name)
        s[name] = None if t is None else torch.tensor(t["data"], dtype=DTYPES[t["dtype"]])
    s["reward_extras"] = tuple(tuple(pair) for pair in s.get("reward_extras", ()))
    s["continuations"] = [load_completion(r, stream) for r in s.get("continuations", ())]
    return Completion(**s)
