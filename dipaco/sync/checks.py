"""Start-up checks: every copy of a module holds the same weights (docs/design.md contract 4),
and no parameter belongs to two modules.

HAZARD: the all-gathers below are collectives on the module groups; every rank must run
:func:`check_identical_modules` (members or not), visiting modules in the global order,
and errors are raised only AFTER every module has been checked and a final world
all-reduce has shared the verdict. Raising at the first mismatch would leave the other
ranks waiting in the next module's collective until the timeout.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dipaco.sync.fsdp import local_shard
from dipaco.plan.topology import Topology

__all__ = ["check_disjoint_parameters", "check_identical_modules", "module_digest"]


def check_disjoint_parameters(modules: dict[str, nn.Module]) -> None:
    """Each parameter belongs to exactly one module: one synchronised by two modules'
    syncs would be stepped twice. Raises ValueError naming both modules."""
    owner: dict[int, str] = {}
    for m, module in modules.items():
        for q in module.parameters():
            if id(q) in owner:
                raise ValueError(
                    f"modules {owner[id(q)]!r} and {m!r} share a parameter; each parameter must belong to "
                    "exactly one module (e.g. a tied embedding belongs to 'embed' only)"
                )
            owner[id(q)] = m


def module_digest(module: nn.Module) -> bytes:
    """32-byte sha256 of a module's parameters (names, dtypes, shapes, bytes); of this
    rank's shard of each when the module is FSDP-sharded."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        t = local_shard(p.detach()).to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def check_identical_modules(
    modules: dict[str, nn.Module], topology: Topology, rank: int, process_groups: Any, *,
    sharded: bool = False,
) -> dict[str, str]:
    """Compare each held module's digest across its module group's ranks.

    ``sharded`` (``launcher.group_parallel=fsdp``): each rank digests its own shard, and
    only ranks holding the same shard (the same local rank) are compared.

    Returns ``{module_id: hex digest}`` of the modules this rank holds.

    Raises:
        RuntimeError: naming each module whose copies differ and the ranks holding each
            variant (raised on every rank).
    """
    group = topology.group_of_rank(rank)
    nccl = getattr(process_groups, "backend", "gloo") == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    held = topology.modules_of_group(group)
    digests: dict[str, str] = {}
    problems: list[str] = []
    for m in topology.module_ids:  # global order, see module doc
        if m not in held:
            continue
        d = module_digest(modules[m])
        digests[m] = d.hex()
        ranks = topology.module_ranks(m)
        pg = process_groups.module_group(m)
        if pg is None or len(ranks) <= 1:
            continue
        mine = torch.frombuffer(bytearray(d), dtype=torch.uint8).to(device)
        out = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(out, mine, group=pg)
        out = [t.cpu() for t in out]
        by_digest: dict[str, list[int]] = {}
        for r, t in zip(ranks, out):
            shard = f"shard {topology.local_rank(r)} " if sharded else ""
            by_digest.setdefault(shard + bytes(t.tolist()).hex()[:12], []).append(r)
        if len(by_digest) > (topology.group_size if sharded else 1):
            variants = "; ".join(f"ranks {rs} have {h}…" for h, rs in by_digest.items())
            problems.append(f"module {m!r} differs across its module group: {variants}")
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag)  # world: every rank learns whether any rank found a mismatch
    if problems:
        raise RuntimeError(
            "modules do not start identical (seed them identically or load the same checkpoint): "
            + " | ".join(problems)
        )
    if int(flag) > 0:
        raise RuntimeError(
            f"rank {rank}: another rank found modules that do not start identical (see its error)"
        )
    return digests
