"""Data parallelism under ``torchrun``: process group, global counts, gradient sums.

The design keeps the data-parallel update equal to the single-process update on the
same batch:

1. each rank samples whole groups from its own shard of the prompts, so group-relative
   advantages never cross ranks;
2. each rank splits its rows into the same number K of mini-batches; mini-batch k of the
   step is the union of every rank's part k;
3. the objective is normalised by the *global* token (and sequence) count of the
   mini-batch, all-reduced before the loss;
4. gradients are *summed* across ranks (not averaged), so the sum of the ranks' losses is
   exactly the full mini-batch's loss.

Without ``torchrun`` (``WORLD_SIZE`` unset) everything here is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str = "cpu") -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment (gloo on CPU,
    nccl on CUDA); a single process without it."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of ``x`` over ranks (a new tensor; ``x`` is left alone)."""
    x = x.detach().clone()
    if info.enabled:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def sum_gradients(params: list[torch.nn.Parameter], info: DistInfo) -> None:
    """grad <- sum over ranks of grad, in one flat all-reduce. Missing grads count as 0."""
    if not info.enabled:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_parameters(model: torch.nn.Module, info: DistInfo) -> None:
    """Start every rank from rank 0's weights."""
    if info.enabled:
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
