"""Starting ranks: in-process (local), on this host (spawn), or under torchrun.

The Hydra process resolves the config once and prepares everything that must happen
before ranks exist (tokenizer, router fit: faiss must not run in a process forked after
its OpenMP threads started: docs/design.md, "Processes"). It then calls :func:`launch`, which runs
``fn(cfg, run, rank, world_size, *args)`` on every rank and returns rank 0's result.

``slurm`` is torchrun's case with the rank env made from SLURM's (:mod:`dipaco.slurm`).

``spawn`` uses torch.distributed's elastic launch API: the agent watches its workers and,
when one dies, stops the others and raises, so a killed rank ends the run in bounded
time (the monitor interval plus the collective timeout) instead of hanging it.
"""
from __future__ import annotations

import datetime as _dt
import os
import socket
import uuid
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from dipaco.config import Config, to_config
from dipaco.run_dir import RunDir


class LaunchError(RuntimeError):
    """A rank failed; the message says which and where its log is."""


def free_port() -> int:
    """A TCP port on localhost that is free right now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_backend(name: str) -> str:
    """``auto`` → nccl when CUDA is present, else gloo."""
    if name == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if name == "nccl" and not torch.cuda.is_available():
        raise ValueError("launcher.backend=nccl needs CUDA; use launcher.backend=gloo on CPU")
    return name


def init_distributed(backend: str, timeout_s: float) -> tuple[int, int]:
    """Join the process group described by the env (RANK, WORLD_SIZE, MASTER_*)."""
    backend = resolve_backend(backend)
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=_dt.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _set_threads(cfg: Config, local_world: int) -> None:
    """Share the host's cores among its ranks (two 1-thread ranks ≈ one 2-thread process)."""
    if cfg.trainer.threads:
        torch.set_num_threads(int(cfg.trainer.threads))
    elif local_world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))


def _rank_entry(fn: Callable[..., Any], cfg_dict: dict, run: RunDir, args: tuple) -> Any:
    """Body of one spawned or torchrun rank."""
    cfg = to_config(cfg_dict)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    _set_threads(cfg, local_world)
    rank, world = init_distributed(cfg.launcher.backend, cfg.launcher.timeout_s)
    try:
        return fn(cfg, run, rank, world, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], cfg: Config, run: RunDir, *args: Any) -> Any:
    """Run ``fn(cfg, run, rank, world_size, *args)`` on every rank; return rank 0's value.

    ``local``: one call in this process with ``rank=None`` (the local backend plays every
    worker group). ``spawn``: ``launcher.nproc`` processes on this host. ``torchrun``
    and ``slurm``: this process is already one rank; the env says which.
    """
    name = cfg.launcher.name
    if name == "local":
        _set_threads(cfg, 1)
        return fn(cfg, run, None, 1, *args)
    cfg_dict = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    if name in ("torchrun", "slurm"):  # slurm: dipaco.slurm exported the torchrun env
        if "RANK" not in os.environ:
            raise LaunchError("launcher=torchrun but RANK is not set: start with `torchrun ... dipaco-train ...`")
        if dist.is_initialized():  # train() joined the group already (rank 0 prepared)
            return fn(cfg, run, dist.get_rank(), dist.get_world_size(), *args)
        return _rank_entry(fn, cfg_dict, run, args)
    if name != "spawn":
        raise LaunchError(f"unknown launcher {name!r}")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = free_port()
    extra = {"log_line_prefix_template": "[rank${rank}] "} if _supports_prefix() else {}
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.launcher.nproc,
        run_id=f"dipaco-{uuid.uuid4().hex[:8]}",
        rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}",
        rdzv_configs={"rank": 0, "timeout": int(cfg.launcher.timeout_s)},
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
        **extra,
    )
    try:
        results = elastic_launch(lc, entrypoint=_rank_entry)(fn, cfg_dict, run, args)
    except ChildFailedError as e:
        failures = "; ".join(
            f"rank {r} exited with {f.exitcode} ({f.message or 'no message'})"
            for r, f in sorted(e.failures.items())
        )
        raise LaunchError(f"a rank failed: {failures}") from None
    return results[0]


def _supports_prefix() -> bool:
    import inspect

    from torch.distributed.launcher.api import LaunchConfig

    return "log_line_prefix_template" in inspect.signature(LaunchConfig).parameters

