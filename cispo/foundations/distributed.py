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

Two ways to hold the weights (``model.fsdp``):

* replicated (the default): every rank holds the whole model, gradients and optimizer
  state; ``sum_gradients`` all-reduces the gradients in one flat buffer;
* sharded with FSDP2 (``shard_model``): every decoder layer, then the rest of the model
  (embeddings, final norm, LM head), is a ``fully_shard`` unit. Each rank keeps 1/N of
  every parameter, gradient and optimizer state; a layer's full weights exist only while
  it runs (all-gathered before, freed after), and gradients are reduce-scattered —
  *summed*, not averaged (``set_gradient_divide_factor(1)``). FSDP's collectives run inside
  every forward and backward, so every rank must run the same number of them: the
  sampler stops when every rank's rows have stopped (``any_rank``), a rank with enough
  groups joins the others' refill rounds with throw-away ones, a rank with fewer
  micro-batches runs empty ones (``max_over_ranks``), and every rank evaluates.

Without ``torchrun`` (``WORLD_SIZE`` unset) everything here is a no-op.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

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


def rank_seed(seed: int, info: DistInfo) -> int:
    """This rank's seed: ``seed + 1000 * rank`` (each rank samples its own groups; rank 0 keeps
    ``seed``, so a single process is unchanged)."""
    return seed + 1000 * info.rank


def close_distributed(synchronize: bool = False) -> None:
    """Leave the process group `init_distributed` joined, if any (torch asks every process to
    destroy it before exit; NCCL warns and may hang at exit otherwise). ``synchronize``: wait for
    every rank first (after a run that ended well on all of them), so that no rank tears its
    connections down while another still uses them (gloo's threads can abort the process at exit:
    "terminate called without an active exception"); not after a failure, where a rank may never come."""
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Sum of ``x`` over ranks (a new tensor; ``x`` is left alone)."""
    x = x.detach().clone()
    if info.enabled:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def sum_gradients(params: list[torch.nn.Parameter], info: DistInfo) -> None:
    """grad <- sum over ranks of grad, in one flat all-reduce. Missing grads count as 0.
    A no-op for FSDP-sharded parameters (DTensors): FSDP has already summed them."""
    if not info.enabled or any(_is_dtensor(p) for p in params):
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
    """Start every rank from rank 0's weights (before ``shard_model``; a CPU model under NCCL
    goes through the GPU one tensor at a time)."""
    if not info.enabled:
        return
    device = comm_device()
    for t in model.state_dict().values():
        if t.device == device or device.type == "cpu":
            dist.broadcast(t, src=0)
        else:
            buf = t.to(device)
            dist.broadcast(buf, src=0)
            t.copy_(buf)


def comm_device() -> torch.device:
    """Where small tensors for a collective live: the current GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when ``flag`` is True on at least one rank."""
    return max_over_ranks(int(flag), info) > 0


def max_over_ranks(n: int, info: DistInfo) -> int:
    """The largest of the ranks' ``n`` (on every rank)."""
    if not info.enabled:
        return n
    t = torch.tensor([n], dtype=torch.long, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ---------------------------------------------------------------------------------------
# FSDP2: sharded weights, gradients and optimizer state
# ---------------------------------------------------------------------------------------


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # older torch: no FSDP2 either
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), else ``t`` itself."""
    return t.to_local() if _is_dtensor(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of ``t``: an FSDP2 shard (a DTensor) is all-gathered from every rank, through the
    collective's device (``comm_device``: a CPU-offloaded shard goes to the GPU under NCCL), so
    every rank must call it for the same tensors in the same order; any other tensor as it is."""
    if not _is_dtensor(t):
        return t
    device = comm_device()
    return (t if t.device == device else t.to(device)).full_tensor()


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``shard_model`` has sharded ``model`` (FSDP2)."""
    return hasattr(model, "cispo_sharded_call")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model: the modules whose class is one of its
    ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules "
                         f"({sorted(names)}); cannot shard it layer by layer")
    return layers


def shard_model(model: torch.nn.Module, info: DistInfo, device: torch.device,
                reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None,
                offload: bool = False) -> torch.nn.Module:
    """Shard ``model`` in place across the ranks with FSDP2 (``fully_shard``) and return it.

    One unit per decoder layer, then the root (embeddings, final norm, LM head: tied
    embeddings stay in one unit). The model may sit on the CPU: each unit is moved to
    ``device`` as it is sharded, so the full model never has to fit one GPU. Gradients are
    reduce-scattered as sums over ranks (the objective is normalised by the global token
    count). Build the optimizer afterwards: it must hold the sharded parameters.
    ``reshard_after_forward=False`` keeps every layer's full weights between forward and
    backward (less communication, more memory).

    ``param_dtype`` (the compute dtype of mixed precision, e.g. bfloat16 over FP32 parameters):
    the decoder layers all-gather their weights in it and reduce-scatter gradients in FP32
    (``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)``, as verl's FSDP2 workers do), so
    no FP32 copy of a gathered layer is held and autocast has nothing left to cast. The root unit
    keeps FP32 weights: the trainer's FP32 LM head then multiplies by the FP32 master weight, as
    without FSDP. ``offload``: the shards (parameters, gradients, and so the optimizer state and
    step) live in CPU memory (``CPUOffloadPolicy``, pinned on CUDA), copied to ``device`` per unit."""
    from torch.distributed.device_mesh import init_device_mesh

    try:
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            fully_shard,
            register_fsdp_forward_method,
        )
    except ImportError as e:  # torch < 2.6
        raise ImportError(f"model.fsdp needs FSDP2 (torch >= 2.6; this is {torch.__version__})") from e
    if not info.enabled:
        raise ValueError("shard_model needs torchrun with more than one process")
    mesh = init_device_mesh(device.type, (info.world_size,))
    common = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                  offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy())
    layers = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None \
        else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=layers, **common)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(), **common)  # the root: FP32 (embeddings, norm, head)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not average
            if hasattr(m, "set_force_sum_reduction_for_comms"):  # plain SUM: gloo has no PREMUL_SUM
                m.set_force_sum_reduction_for_comms(True)
    # the trainer reads the LM head's weight directly (cispo.objective.logprobs); run that code inside the
    # root's forward hooks so the root's parameters are gathered then and their gradients reduced
    model.cispo_sharded_call = types.MethodType(lambda self, fn: fn(), model)
    register_fsdp_forward_method(model, "cispo_sharded_call")
    return model


T = TypeVar("T")


def sharded_call(model: torch.nn.Module, fn: Callable[[], T]) -> T:
    """``fn()`` with the root unit's full parameters gathered on a sharded model (for code
    that uses ``model``'s submodules or weights without calling ``model`` itself); just
    ``fn()`` otherwise."""
    call = getattr(model, "cispo_sharded_call", None)
    return fn() if call is None else call(fn)
