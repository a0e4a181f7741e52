"""Where a rank sits on its host, and what it takes there: the one function every launcher uses.

Every rank, whatever started it (``local``, ``spawn``, ``spawn`` with ``launcher.elastic``,
``torchrun``, ``slurm``), calls :func:`place_rank` with its environment before its first
CUDA or torch thread work. The answer follows from two numbers, the rank's **host rank**
(its index among the ranks of its host) and the **host's rank count**:

* device: GPU ``host_rank % gpus`` (:func:`dipaco.runtime.device.choose_device`);
* threads: ``trainer.threads`` when set, else the CPUs SLURM gave the task
  (``SLURM_CPUS_PER_TASK``), else the host's cores shared among its ranks
  (``cpu_count // host_ranks``, at least 1).

The two numbers come from :func:`host_rank`, which knows each launcher's env:

* torchrun, spawn: torch's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (one agent per host);
* spawn elastic: one torch agent *per worker group* on the same host, so torch's
  ``LOCAL_RANK`` restarts at 0 in every agent and ``LOCAL_WORLD_SIZE`` is the group's size;
  each agent tells its ranks where its block starts (:data:`HOST_RANK0_ENV`, the slot ×
  group size) and how many ranks the host runs (:data:`HOST_RANKS_ENV`)
  (:func:`agent_env`). Without that every rank would take ``cuda:0`` and every core;
* slurm: ``SLURM_LOCALID`` / ``SLURM_NTASKS_PER_NODE`` (the same numbers
  :func:`dipaco.runtime.slurm.slurm_rendezvous` exports as torch's);
* local: one process, host rank 0 of 1.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from dipaco.runtime.device import RankDevice, cuda_count, rank_device
from dipaco.runtime.hardware import cap_threads
from dipaco.runtime.progress import log

__all__ = ["HOST_RANK0_ENV", "HOST_RANKS_ENV", "Placement", "agent_env", "apply_placement", "host_rank",
           "place_rank", "placement_of"]

HOST_RANK0_ENV = "DIPACO_HOST_RANK0"  # the first host rank of an elastic agent's block
HOST_RANKS_ENV = "DIPACO_HOST_RANKS"  # how many ranks the whole host runs (every agent's)


@dataclass(frozen=True)
class Placement:
    """One rank's device, collective backend and torch thread count."""

    rank_device: RankDevice
    threads: int

    @property
    def device(self) -> torch.device:
        return self.rank_device.device

    def describe(self) -> str:
        """One line for the start-of-run log."""
        return f"{self.rank_device.describe()}, {self.threads} thread(s) per rank"


def agent_env(slot: int, group_size: int, host_ranks: int) -> dict[str, str]:
    """What the elastic agent of worker-group slot ``slot`` exports to its ranks (module doc)."""
    return {HOST_RANK0_ENV: str(int(slot) * int(group_size)), HOST_RANKS_ENV: str(int(host_ranks))}


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    m = re.match(r"\d+", env.get(key, "") or "")
    return int(m.group(0)) if m else default


def host_rank(launcher: str, env: Mapping[str, str]) -> tuple[int, int]:
    """``(host rank, ranks on the host)`` of the rank whose environment is ``env``."""
    if launcher == "local":
        return 0, 1
    if launcher == "slurm" and "SLURM_LOCALID" in env:
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
        return _int(env, "SLURM_LOCALID", 0), max(1, _int({"n": per_node}, "n", 1))
    local = _int(env, "LOCAL_RANK", 0)
    world = _int(env, "LOCAL_WORLD_SIZE", _int(env, "WORLD_SIZE", 1))
    if HOST_RANK0_ENV in env:  # an elastic agent's block of the host (module doc)
        return _int(env, HOST_RANK0_ENV, 0) + local, max(1, _int(env, HOST_RANKS_ENV, world))
    return local, max(1, world)


def _host_cpus() -> int:
    """The cores this process may run on (its affinity: a container's or cgroup's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _threads(requested: Optional[int], launcher: str, env: Mapping[str, str], host_ranks: int,
             cpu_count: int) -> int:
    if requested:  # obeyed up to the rank's share of the cores, capped with a line beyond (hardware.cap_threads)
        say = log.warning if host_rank(launcher, env)[0] == 0 else None
        return cap_threads(int(requested), host_ranks, say, cores=cpu_count)
    if launcher == "slurm" and _int(env, "SLURM_CPUS_PER_TASK", 0) > 0:
        return _int(env, "SLURM_CPUS_PER_TASK", 1)  # the CPUs SLURM gave the task (launcher.cpus_per_task)
    return max(1, int(cpu_count) // max(1, host_ranks))


def place_rank(launcher: str, env: Optional[Mapping[str, str]] = None, *, device: str = "auto",
               backend: str = "auto", threads: Optional[int] = None, device_count: Optional[int] = None,
               cpu_count: Optional[int] = None) -> Placement:
    """The placement of the rank whose environment is ``env`` (this process's by default).

    ``device_count`` and ``cpu_count`` default to this host's; tests pass fake ones.
    """
    env = os.environ if env is None else env
    r, n = host_rank(launcher, env)
    gpus = cuda_count() if device_count is None else int(device_count)
    cpus = _host_cpus() if cpu_count is None else int(cpu_count)
    rd = rank_device(device, backend, local_rank=r, local_world=n, device_count=gpus)
    return Placement(rd, _threads(threads, launcher, env, n, cpus))


def placement_of(cfg: Any, env: Optional[Mapping[str, str]] = None, *, device_count: Optional[int] = None,
                 cpu_count: Optional[int] = None) -> Placement:
    """:func:`place_rank` with a run's settings (``launcher.name``, ``trainer.device``,
    ``launcher.backend``, ``trainer.threads`` of a :class:`dipaco.config.Config`)."""
    return place_rank(cfg.launcher.name, env, device=cfg.trainer.device, backend=cfg.launcher.backend,
                      threads=cfg.trainer.threads, device_count=device_count, cpu_count=cpu_count)


def apply_placement(p: Placement) -> None:
    """Make this process use ``p``: its thread count and, on CUDA, its current device
    (before the process group exists, so nccl and the sync's staging use the right GPU)."""
    if torch.get_num_threads() != p.threads:
        torch.set_num_threads(p.threads)
    if p.device.type == "cuda":
        torch.cuda.set_device(p.device)
