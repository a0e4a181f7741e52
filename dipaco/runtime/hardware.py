"""What the hardware can do and what a process holds: for MFU and the memory metrics.

* :data:`PEAK_FLOPS`: dense peak FLOP/s of known GPUs, by a fragment of the device name,
  from the vendors' datasheets (bf16/fp16, and TF32 for fp32 training). The per-step
  metrics (:mod:`dipaco.rounds.health`) and ``benchmarks/bench_gpu.py`` read it.
* :func:`flops_per_token`: the training FLOPs of one token of a path, ``6·N + 12·L·d·T``
  (N parameters, L blocks, d width, T sequence length: the PaLM paper's appendix B
  formula, forward and backward, attention included).
* :func:`memory_snapshot`: this process's memory, read on the host without waiting for
  the device (the CUDA caching allocator keeps its statistics on the host).
* :func:`cap_threads`: ``trainer.threads`` capped at the cores a rank can have (a value in
  its domain that cannot work on this host is capped with a line, not obeyed).
* :func:`release_free_memory`: hand the C heap's free pages back to the OS (between data
  preparation's stages, after each round).
"""
from __future__ import annotations

import ctypes
import os
import resource
import sys
from typing import Callable, Optional

import torch

__all__ = ["PEAK_FLOPS", "cap_threads", "flops_per_token", "host_cores", "memory_snapshot", "peak_flops",
           "release_free_memory"]

# dense peak FLOP/s by device-name fragment: (bf16/fp16, TF32)
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H100": (989e12, 494e12), "H200": (989e12, 494e12), "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12), "A10G": (70e12, 35e12),
}


def flops_per_token(n_params: int, blocks: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs of one token: ``6·N + 12·L·d·T`` (PaLM, appendix B)."""
    return 6.0 * n_params + 12.0 * blocks * d_model * seq_len


def peak_flops(device: torch.device, precision: str, peak_tflops: Optional[float] = None) -> Optional[float]:
    """The device's dense peak FLOP/s for MFU: ``peak_tflops`` when given (``logging.peak_tflops``),
    else the datasheet figure of a GPU in :data:`PEAK_FLOPS`, else None (the CPU, an
    unknown GPU): MFU is then not reported rather than made up."""
    if peak_tflops:
        return float(peak_tflops) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, (low, tf32) in PEAK_FLOPS.items():
        if key in name:
            return tf32 if precision == "fp32" else low
    return None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's ``malloc_trim(0)``, which also
    releases whole free pages inside the heap, not only at its top). A no-op where the C
    library has none.

    glibc keeps freed memory in its arenas. Data preparation: after training the BPE on a
    64 MiB sample the process held 220 MB it no longer used, under every later stage's
    peak. Training: each path's first turn leaves holes under its AdamW moments (the
    turn's activations and gradients, freed after the moments were placed above them),
    0.6 MiB a path on ``experiment=smoke`` (docs/gpu.md); after a round they go back.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # not Linux: no current RSS, the peak still is
        return None


def memory_snapshot(device: torch.device) -> dict[str, int]:
    """This process's memory now, in bytes (no device synchronisation).

    ``rss_bytes`` / ``max_rss_bytes``: the host process's resident set now and its
    peak; ``host_total_bytes``: the host's memory (for the shares); on CUDA also
    ``device_total_bytes`` (the device's memory) and ``max_active_bytes`` / ``max_reserved_bytes``: the caching
    allocator's peaks of memory in tensors and of memory held from the driver since the
    rank started (:func:`dipaco.runtime.device.reset_peak_memory`).
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"max_rss_bytes": int(peak if sys.platform == "darwin" else peak * 1024)}  # KiB on Linux
    rss = _rss_bytes()
    if rss is not None:
        out["rss_bytes"] = rss
    host = _host_total_bytes()
    if host:
        out["host_total_bytes"] = host
    if device.type == "cuda":
        out["max_active_bytes"] = int(torch.cuda.max_memory_allocated(device))
        out["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(device))
        out["device_total_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)  # host-side
    return out


def host_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or SLURM's share)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def cap_threads(requested: int, ranks_on_host: int = 1, say: Optional[Callable[[str], None]] = None,
                cores: Optional[int] = None) -> int:
    """``trainer.threads`` as a rank can use it: at most its share of the host's cores.

    More threads than cores make every inner step wait on the others (4096 threads on 2
    cores made a round 50x slower), so a larger value is capped and ``say`` is told once.
    """
    cores = host_cores() if cores is None else cores
    share = max(1, cores // max(1, ranks_on_host))
    if requested <= share:
        return int(requested)
    if say is not None:
        say(f"trainer.threads={requested} is more than the {share} core(s) each of the {ranks_on_host} rank(s) "
            f"on this host can have ({cores} in all): using {share} threads per rank")
    return share


def _host_total_bytes() -> Optional[int]:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError, AttributeError):
        return None
