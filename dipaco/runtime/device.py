"""Where a rank computes and in what precision: the one place that decides it.

Every stage of a run (the rounds, the dense warm-up and baseline, evaluation, the LM
featurizer, ``dipaco-infer``, the benchmarks) asks this module for its device, instead
of deciding on its own, so that one setting (``trainer.device``) moves all of them.

The rules:

* ``trainer.device=auto`` is CUDA when a GPU is visible, else the CPU; ``cuda`` without a
  GPU is refused before any work (:func:`config_problems`).
* Rank with ``LOCAL_RANK=i`` on a host with ``n`` GPUs takes GPU ``i % n``: more ranks
  than GPUs share GPUs, so there is never an invalid device ordinal.
* Collectives use nccl only when every rank of the host owns a distinct GPU (nccl cannot
  put two ranks on one device); otherwise gloo, with CUDA tensors staged through the CPU
  by the callers (:mod:`dipaco.sync.data_parallel`, :mod:`dipaco.sync.comm`). The rule
  depends only on the host's rank and GPU counts, so every rank of a cluster of
  identical hosts makes the same choice.
* ``trainer.precision`` is autocast for compute only: parameters, AdamW state,
  pseudo-gradients and the outer optimiser stay fp32. fp16 adds a gradient scaler and is
  refused on the CPU (no fp16 autocast kernels worth having there).
"""
from __future__ import annotations

import contextlib
import os
import resource
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from dipaco.config.names import BACKENDS, DEVICES, PRECISIONS as PRECISION_NAMES

__all__ = ["DEVICES", "PRECISIONS", "RankDevice", "autocast", "choose_backend", "choose_device",
           "compile_enabled", "config_problems", "cuda_count", "grad_scaler", "local_rank_env",
           "maybe_compile", "model_device", "peak_memory_bytes", "rank_device", "reset_peak_memory",
           "set_deterministic", "to_device"]

#: trainer.precision → autocast dtype (None: plain fp32)
# the names are the registry's (dipaco.config.names.PRECISIONS), the dtypes this module's
_DTYPES: dict[str, Optional[torch.dtype]] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS: dict[str, Optional[torch.dtype]] = {n: _DTYPES[n] for n in PRECISION_NAMES}


def cuda_count() -> int:
    """Number of CUDA devices this process can see (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_device(requested: str, local_rank: int = 0, device_count: Optional[int] = None) -> torch.device:
    """The device of the rank with ``local_rank`` on a host with ``device_count`` GPUs.

    ``device_count`` defaults to the visible GPUs; tests pass fake counts.
    """
    n = cuda_count() if device_count is None else int(device_count)
    if requested not in DEVICES:
        raise ValueError(f"trainer.device={requested!r} must be one of {', '.join(DEVICES)}")
    if requested == "cpu" or (requested == "auto" and n == 0):
        return torch.device("cpu")
    if n == 0:
        raise ValueError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu")
    return torch.device("cuda", int(local_rank) % n)


def choose_backend(requested: str, device: torch.device, local_world: int, device_count: int) -> str:
    """The collective backend: nccl only if each of the host's ``local_world`` ranks owns a GPU."""
    if requested not in BACKENDS:
        raise ValueError(f"launcher.backend={requested!r} must be one of {', '.join(BACKENDS)}")
    distinct_gpus = device.type == "cuda" and 0 < int(local_world) <= int(device_count)
    if requested == "auto":
        return "nccl" if distinct_gpus else "gloo"
    if requested == "nccl" and not distinct_gpus:
        raise ValueError(f"launcher.backend=nccl needs one GPU per rank ({local_world} ranks, "
                         f"{device_count} GPUs on this host, device {device}); use launcher.backend=auto or gloo")
    return requested


@dataclass(frozen=True)
class RankDevice:
    """One rank's placement: its device and the backend of its collectives."""

    device: torch.device
    backend: str
    local_rank: int = 0
    local_world: int = 1
    gpus: int = 0  # CUDA devices visible on this host

    def describe(self) -> str:
        """One line for the start-of-run log."""
        if self.device.type == "cuda":
            # a placement computed for a fake GPU count (tests, plans) may name a GPU this host lacks
            real = torch.cuda.is_available() and (self.device.index or 0) < torch.cuda.device_count()
            name = torch.cuda.get_device_name(self.device) if real else "cuda"
            where = f"{self.device} ({name}; {self.gpus} GPU(s), {self.local_world} rank(s) on this host)"
        else:
            where = f"cpu ({self.local_world} rank(s) on this host)"
        return f"device {where}, collectives over {self.backend}"


def local_rank_env() -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` from the launcher's env; ``(0, 1)`` outside one."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return local_rank, max(1, local_world)


def rank_device(device: str = "auto", backend: str = "auto", local_rank: Optional[int] = None,
                local_world: Optional[int] = None, device_count: Optional[int] = None) -> RankDevice:
    """This rank's :class:`RankDevice`; rank numbers default to the env (:func:`local_rank_env`)."""
    env_rank, env_world = local_rank_env()
    local_rank = env_rank if local_rank is None else int(local_rank)
    local_world = env_world if local_world is None else int(local_world)
    n = cuda_count() if device_count is None else int(device_count)
    dev = choose_device(device, local_rank, n)
    return RankDevice(dev, choose_backend(backend, dev, local_world, n), local_rank, local_world, n)


# ------------------------------------------------------------------ precision


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Autocast context for ``trainer.precision`` (a no-op context for fp32)."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(device: torch.device, precision: str) -> Optional[torch.amp.GradScaler]:
    """A loss scaler for fp16 on CUDA (fp16 gradients underflow without one); else None."""
    if precision == "fp16" and device.type == "cuda":
        return torch.amp.GradScaler("cuda")
    return None


# ------------------------------------------------------------------ determinism


def set_deterministic(enabled: bool) -> None:
    """``trainer.deterministic``: bit-identical reruns and resumes on CUDA too.

    On the CPU the kernels this project uses are already deterministic for a fixed thread
    count. On CUDA some backward kernels accumulate with atomics (the embedding's gradient,
    scatter-adds), so two runs differ in the last bits and, through AdamW, visibly after a
    few hundred steps. Enabled: deterministic kernels (an error names any op without one),
    cuDNN without autotuning, and the cuBLAS workspace setting that makes its GEMMs
    repeatable. Call it in every process before its first CUDA work: cuBLAS reads
    ``CUBLAS_WORKSPACE_CONFIG`` when it starts, and spawned ranks inherit the env.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _set_kernel_determinism(bool(enabled))
    # deterministic mode would also fill every torch.empty with NaN (a guard against
    # reading uninitialised memory, which correct code never does): a write over every
    # new buffer, for no change in the numbers
    torch.utils.deterministic.fill_uninitialized_memory = not enabled
    torch.backends.cudnn.deterministic = bool(enabled)
    if enabled:
        torch.backends.cudnn.benchmark = False


def _set_kernel_determinism(enabled: bool) -> None:
    """``torch.use_deterministic_algorithms(enabled)`` for the eager kernels, without its import.

    Since torch 2.6 the public call also sets Inductor's ``deterministic`` flag, and imports
    ``torch._inductor`` to do it (Dynamo, torch.fx, sympy): 3 to 7 s in every process on 2
    cores (cProfile of a spawned rank, 4 ranks on 2 AMD EPYC cores), for a compiler that
    only ``trainer.compile`` uses. The kernel switch alone is torch's own
    ``_C._set_deterministic_algorithms``; :func:`maybe_compile` makes the public call before
    it compiles, so Inductor gets the flag. A torch without the switch, or with Inductor
    already loaded, takes the public call.
    """
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)
    if switch is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(enabled)
    else:
        switch(enabled, warn_only=False)


# ------------------------------------------------------------------ speed options


def compile_enabled(setting: Optional[bool], device: torch.device) -> bool:
    """``trainer.compile``: None means on for CUDA, off for the CPU."""
    return device.type == "cuda" if setting is None else bool(setting)


def maybe_compile(model: torch.nn.Module, enabled: bool, backend: str = "inductor") -> Callable[..., Any]:
    """The callable that runs ``model``'s forward: compiled or the model itself.

    The learner keeps the plain module for parameters and state dicts and calls this
    one; a compiled wrapper shares the module's parameters.
    """
    if not enabled:
        return model
    # the public call now, so the compiler's own determinism flag follows the kernels'
    # (set_deterministic skips it to spare processes that never compile its import)
    torch.use_deterministic_algorithms(torch.are_deterministic_algorithms_enabled(),
                                       warn_only=torch.is_deterministic_algorithms_warn_only_enabled())
    return torch.compile(model, backend=backend)


# ------------------------------------------------------------------ data and memory


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU batch to ``device``: pinned and asynchronous for CUDA, unchanged for the CPU."""
    if device.type != "cuda" or t.device == device:
        return t
    return t.pin_memory().to(device, non_blocking=True)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (the CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for :func:`peak_memory_bytes` (CUDA only: RSS peaks cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process on ``device``: CUDA allocator peak, or peak RSS on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


# ------------------------------------------------------------------ validation


def config_problems(trainer: Any, launcher: Any, device_count: Optional[int] = None) -> list[tuple[str, str, str]]:
    """Bad device/precision/speed combinations as ``(key, problem, fix)``; empty when fine.

    ``trainer`` and ``launcher`` are :class:`dipaco.config.TrainerConfig` and
    :class:`~dipaco.config.LauncherConfig` (duck-typed: this module sits below the config).
    """
    n = cuda_count() if device_count is None else int(device_count)
    t, la = trainer, launcher
    if getattr(la, "name", None) == "slurm":
        # validated on the submitting host, which may have no GPU: the job's nodes decide
        n = int(getattr(la, "gpus_per_node", 0) or 0)
    if t.device not in DEVICES:
        return [("trainer.device", f"unknown device {t.device!r}", f"use one of {', '.join(DEVICES)}")]
    if t.device == "cuda" and n == 0:
        return [("trainer.device", "cuda requested but no CUDA device is visible",
                 "use trainer.device=auto (or cpu) on this machine")]
    out: list[tuple[str, str, str]] = []
    dev = choose_device(t.device, 0, n)
    if t.precision not in PRECISIONS:
        out.append(("trainer.precision", f"unknown precision {t.precision!r}",
                    f"use one of {', '.join(PRECISIONS)}"))
    elif t.precision == "fp16" and dev.type == "cpu":
        out.append(("trainer.precision", "fp16 autocast is not supported on the CPU",
                    "use trainer.precision=bf16 (or fp32) on the CPU"))
    if compile_enabled(t.compile, dev) and t.compile_backend not in _compile_backends():
        out.append(("trainer.compile_backend", f"unknown torch.compile backend {t.compile_backend!r}",
                    "use trainer.compile_backend=inductor (or eager, aot_eager), or trainer.compile=false"))
    if la.backend not in BACKENDS:
        out.append(("launcher.backend", f"unknown backend {la.backend!r}", f"use one of {', '.join(BACKENDS)}"))
    elif la.backend == "nccl" and dev.type != "cuda":
        out.append(("launcher.backend", "nccl needs CUDA devices", "use launcher.backend=auto (gloo on the CPU)"))
    per_rank = t.batch_size // max(1, la.group_size)
    if t.micro_batches < 1 or per_rank % t.micro_batches:
        out.append(("trainer.micro_batches",
                    f"{per_rank} sequences per rank cannot be split into {t.micro_batches} micro-batches",
                    "use a divisor of trainer.batch_size / launcher.group_size"))
    return out


def _compile_backends() -> list[str]:
    from torch._dynamo import list_backends  # importing dynamo costs ~1 s: only when compile is asked for

    return list(list_backends(exclude_tags=())) + ["inductor"]
