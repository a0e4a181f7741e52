"""FSDP2 inside a worker group (``launcher.group_parallel=fsdp``): the one place that
touches ``torch.distributed.fsdp`` and DTensor.

With ``fsdp`` each of the G ranks of a worker group keeps rows ``r·n/G … (r+1)·n/G`` of
dim 0 of every parameter of every module it holds (FSDP2's ``Shard(0)``; the validation
requires dim 0 to divide by G, so shards are even and carry no padding). FSDP2
all-gathers a module's parameters for its forward and backward and reduce-scatters (and
averages) its gradients, so gradients and AdamW moments are sharded too.

Every module (embed, each level module and each of its blocks, head) is wrapped on its
own, never a whole ``PathModel``: a worker group trains several paths in turn and paths
SHARE module objects, so the unit that is sharded must be the shared module. Each
wrapped module is then its own FSDP root; FSDP2 handles several roots.

The *shard layout* of a module's flat vector (what :class:`dipaco.sync.sharded.ShardedCollectiveModuleSync`
holds): the concatenation, in parameter order, of each parameter's rows of this rank.
:func:`shard_flat` / :func:`unshard_flat` convert between it and the full flat layout of
:func:`dipaco.sync.module_core.flatten_params` (what checkpoints store), so a checkpoint
does not depend on G or on ``group_parallel``.

Who must call what: :func:`full_module_state` and :func:`gather_flat` are collectives
over the worker group; every rank of the group calls them for the same modules in the
same order.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

# FSDP2 is imported where it is used, not here: importing torch.distributed.fsdp pulls in
# DTensor, torch.fx and sympy (about 1 s on 2 cores), and every spawned rank and every
# inference process imports this module while only launcher.group_parallel=fsdp shards.
_FSDP_MODULE = "torch.distributed.fsdp"
_DTENSOR_MODULE = "torch.distributed.tensor"

__all__ = [
    "FSDP_MISSING",
    "apply_fsdp",
    "fsdp_available",
    "full_module_state",
    "full_optimizer_state",
    "full_value",
    "gather_flat",
    "is_sharded",
    "load_module_state",
    "local_shard",
    "shard_flat",
    "shard_optimizer_state",
    "unshard_flat",
    "worker_mesh",
]

FSDP_MISSING = "torch.distributed.fsdp.fully_shard (FSDP2) is not in this torch; install torch>=2.6"


def fsdp_available() -> bool:
    """Whether this torch has FSDP2 (``torch.distributed.fsdp.fully_shard``, public in torch
    >= 2.6; the library floor is older). Looked up on disk: asking importlib for the
    submodule would import ``torch.distributed.fsdp``, which is what this module avoids."""
    return os.path.isdir(os.path.join(os.path.dirname(dist.__file__), "fsdp", "_fully_shard"))


def _fully_shard() -> Any:
    if not fsdp_available():
        raise RuntimeError(FSDP_MISSING)
    from torch.distributed.fsdp import fully_shard

    return fully_shard


def _dtensor() -> Any:
    """``torch.distributed.tensor`` if something has imported it, else ``None``: a DTensor
    can only exist once its module is loaded, so an unloaded module means nothing is sharded."""
    return sys.modules.get(_DTENSOR_MODULE)


def worker_mesh(group: Any, device: torch.device) -> "DeviceMesh":
    """A 1-D DeviceMesh over the worker group's process group (its ranks, ascending)."""
    _fully_shard()  # FSDP2 present, or one line saying what to install
    from torch.distributed.device_mesh import DeviceMesh

    kind = torch.device(device).type
    if kind == "cuda" and dist.get_backend(group) != "nccl":
        # ranks sharing a GPU fall back to gloo (dipaco/runtime/device.py), which FSDP2 cannot use on CUDA
        raise RuntimeError("launcher.group_parallel=fsdp on GPUs needs one GPU per rank (nccl); "
                           "use launcher.nproc <= the number of GPUs, or launcher.group_parallel=replicate")
    return DeviceMesh.from_group(group, device_type=kind)


def apply_fsdp(modules: dict[str, nn.Module], mesh: "DeviceMesh") -> None:
    """Shard every module in place (its blocks first, when it has ``blocks``).

    Call it before any optimiser or sync object takes the modules' parameters: FSDP2
    replaces each parameter by a DTensor parameter.
    """
    fully_shard = _fully_shard()
    for module in modules.values():
        for block in getattr(module, "blocks", ()):
            fully_shard(block, mesh=mesh)
        fully_shard(module, mesh=mesh)


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2 parameter, gradient or AdamW moment)."""
    tensor_mod = _dtensor()
    return tensor_mod is not None and isinstance(t, tensor_mod.DTensor)


def local_shard(p: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded tensor (a view: writing it writes the parameter);
    ``p`` itself when it is not sharded."""
    return p.to_local() if is_sharded(p) else p


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective over the mesh for a DTensor; ``t`` otherwise)."""
    return t.full_tensor() if is_sharded(t) else t


# ------------------------------------------------------------------ flat layouts
def shard_flat(full: torch.Tensor, shapes: Sequence[torch.Size], shards: int, index: int) -> torch.Tensor:
    """Full flat vector (parameters in order) → this rank's shard layout (see module doc)."""
    parts, off = [], 0
    for shape in shapes:
        n = int(torch.Size(shape).numel())
        rows = full[off : off + n].view(shape)
        parts.append(rows.chunk(shards, dim=0)[index].reshape(-1))
        off += n
    if off != full.numel():
        raise ValueError(f"flat vector of {full.numel()} values for parameters of {off} values")
    return torch.cat(parts) if parts else full.new_zeros(0)


def unshard_flat(shards: Sequence[torch.Tensor], shapes: Sequence[torch.Size]) -> torch.Tensor:
    """Inverse of :func:`shard_flat`: the G ranks' shards (rank order) → the full flat vector."""
    G = len(shards)
    parts, offs = [], [0] * G
    for shape in shapes:
        shape = torch.Size(shape)
        n = int(shape.numel()) // G
        rows = [s[o : o + n].view(shape[0] // G, *shape[1:]) for s, o in zip(shards, offs)]
        parts.append(torch.cat(rows, dim=0).reshape(-1))
        offs = [o + n for o in offs]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


def gather_flat(shard: torch.Tensor, shapes: Sequence[torch.Size], group: Any, size: int,
                device: torch.device) -> torch.Tensor:
    """All-gather a shard-layout vector over the worker group → the full flat vector (CPU)."""
    staged = shard.to(device).contiguous()
    parts = [torch.empty_like(staged) for _ in range(size)]
    dist.all_gather(parts, staged, group=group)
    return unshard_flat([p.cpu() for p in parts], shapes)


# ------------------------------------------------------------------ checkpoints
def full_module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every sharded tensor gathered whole (a collective)."""
    return {k: full_value(v).detach() for k, v in module.state_dict().items()}


@torch.no_grad()
def load_module_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full tensors into a (possibly sharded) module: each rank keeps its rows."""
    own = module.state_dict()
    missing = sorted(set(own) ^ set(state))
    if missing:
        raise ValueError(f"state dict keys {missing} do not match the module")
    for k, dst in own.items():
        src = state[k]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"{k}: checkpoint shape {tuple(src.shape)}, module {tuple(dst.shape)}")
        if is_sharded(dst):
            mesh = dst.device_mesh
            src = src.chunk(mesh.size(), dim=0)[mesh.get_local_rank()]
        local_shard(dst).copy_(src)


def full_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimiser ``state_dict()`` with every sharded moment gathered whole (a collective)."""
    per_param = {i: {k: full_value(v) if torch.is_tensor(v) else v for k, v in s.items()}
                 for i, s in state["state"].items()}
    return {**state, "state": per_param}


def shard_optimizer_state(state: dict[str, Any], params: Iterable[torch.Tensor]) -> dict[str, Any]:
    """Inverse of :func:`full_optimizer_state` for this rank: a full moment of a sharded
    parameter becomes the DTensor of this rank's rows (scalars such as ``step`` stay)."""
    params = list(params)
    out = {}
    for i, s in state["state"].items():
        p = params[int(i)]
        row = {}
        for k, v in s.items():
            if is_sharded(p) and torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape):
                mesh = p.device_mesh
                local = v.chunk(mesh.size(), dim=0)[mesh.get_local_rank()].to(local_shard(p).device)
                from torch.distributed.tensor import DTensor, Shard

                v = DTensor.from_local(local.contiguous(), mesh, [Shard(0)], run_check=False)
            row[k] = v
        out[i] = row
    return {**state, "state": out}
