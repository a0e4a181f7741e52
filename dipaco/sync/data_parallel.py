"""Data parallelism inside a worker group (the G ranks that train one path together).

Why not ``DistributedDataParallel``: one process holds several PathModels that SHARE
module objects (a worker group trains its paths in turn, and paths share modules). DDP
registers per-parameter autograd hooks on the parameters of the model it wraps; with
shared parameters, the hooks of one path's DDP wrapper would fire during another path's
backward and all-reduce (or wait for) the wrong buckets. Instead, the path learner calls
:func:`allreduce_gradients` explicitly after each backward, on the current path's
parameters only. (FSDP2, ``launcher.group_parallel=fsdp``, does work: it is applied
per shared module, not per path, :mod:`dipaco.sync.fsdp`; this module is then unused.)

Who must call what: every rank of the worker group calls these functions with the same
parameter list (same order, same shapes) at the same step; a ``None`` gradient is
treated as zeros (and materialised) so that every rank sends the same buffer sizes.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from dipaco.plan.comm_plan import ring_allreduce_bytes

__all__ = ["allreduce_gradients", "broadcast_parameters"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@torch.no_grad()
def allreduce_gradients(
    params: Iterable[torch.nn.Parameter],
    group: Any,
    group_size: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Average gradients over the worker group with bucketed flat all-reduces.

    Args:
        params: the current path's parameters (same order on every rank of the group).
        group: the worker group's process group (``ProcessGroups.worker_group()``); with
            ``group_size == 1`` or ``group is None`` nothing is sent.
        group_size: G.
        bucket_bytes: target bucket size.

    Returns:
        Bytes this rank sent (ring all-reduce formula of :mod:`dipaco.plan.comm_plan`).
    """
    plist = [p for p in params if p.requires_grad]
    if group_size <= 1 or group is None or not plist:
        return 0
    for p in plist:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    sent = 0
    nccl = dist.get_backend(group) == "nccl"
    # bucket by dtype and device, in parameter order
    bucket: list[torch.nn.Parameter] = []
    size = 0

    def flush() -> int:
        if not bucket:
            return 0
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        if flat.is_cuda and not nccl:
            # gloo (ranks sharing a GPU, dipaco/runtime/device.py) reduces through CPU memory
            staged = flat.cpu()
            dist.all_reduce(staged, group=group)
            flat.copy_(staged)
        else:
            dist.all_reduce(flat, group=group)
        flat.div_(group_size)
        off = 0
        for p in bucket:
            n = p.grad.numel()
            p.grad.copy_(flat[off : off + n].view_as(p.grad))
            off += n
        return ring_allreduce_bytes(group_size, flat.numel() * flat.element_size())

    for p in plist:
        if bucket and (
            p.grad.dtype != bucket[0].grad.dtype
            or p.grad.device != bucket[0].grad.device
            or size + p.grad.numel() * p.grad.element_size() > bucket_bytes
        ):
            sent += flush()
            bucket, size = [], 0
        bucket.append(p)
        size += p.grad.numel() * p.grad.element_size()
    sent += flush()
    return sent


@torch.no_grad()
def broadcast_parameters(params: Iterable[torch.Tensor], group: Any, src: int) -> None:
    """Copy parameters from global rank ``src`` to the other ranks of ``group``.

    Every member must call it with the same parameter list. ``group=None`` with a
    one-rank group is a no-op; pass ``dist.group.WORLD`` explicitly for the world.
    """
    if group is None:
        return
    for p in params:
        dist.broadcast(p.data, src=src, group=group)
