"""Tensors on disk: safetensors files, the only format dipaco stores weights and
optimiser state in (no pickle: docs/design.md contract 5).

:func:`save_tensors` writes a flat dict of tensors plus JSON metadata atomically
(:mod:`dipaco.storage.atomic`); :func:`save_state` any nested state (an optimiser's state
dict, a path's data position) as its tensors plus a JSON skeleton. The one wrapper of
the ``safetensors`` library.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file, save_file
from safetensors.torch import save as save_bytes

from dipaco.storage.atomic import write_atomically
from dipaco.storage.strict_json import dumps_strict


class CheckpointError(RuntimeError):
    """A checkpoint or tensor file that is missing, incomplete or corrupt; the message names the file."""


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: Optional[dict] = None) -> None:
    """Atomically save a flat dict of tensors as safetensors (plus JSON metadata)."""
    # safetensors refuses shared or non-contiguous storage; clone makes each tensor its own.
    flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    metadata = {"json": dumps_strict(meta, sort_keys=True)} if meta is not None else None
    write_atomically(path, lambda tmp: save_file(flat, str(tmp), metadata=metadata))


def tensors_to_bytes(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> bytes:
    """A flat dict of tensors as safetensors bytes in memory (a message, not a file)."""
    flat = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return save_bytes(flat, metadata=metadata)


def tensors_from_bytes(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tensors_to_bytes` (the metadata is read from the header by the caller)."""
    return load_bytes(blob)


def load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], Optional[dict]]:
    """Load tensors and metadata written by :func:`save_tensors`; never unpickles."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"missing checkpoint file {path}")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("json")
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt checkpoint file {path}: {e}") from None
    return tensors, (json.loads(raw) if raw else None)


def state_from_bytes(data: bytes, path: Path) -> Any:
    """:func:`load_state` of a file's bytes already in memory (``path`` names it in errors)."""
    try:
        tensors = load_bytes(data)
        n = int.from_bytes(data[:8], "little")
        raw = (json.loads(data[8:8 + n]).get("__metadata__") or {}).get("json")
        meta = json.loads(raw) if raw else None
    except (SafetensorError, ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"corrupt checkpoint file {path}: {e}") from None
    if not meta or "skeleton" not in meta:
        raise CheckpointError(f"checkpoint file {path} has no state skeleton")
    return unflatten_state(tensors, meta["skeleton"])


def flatten_state(state: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Split a nested state dict into (flat tensors, JSON skeleton).

    Tensors are replaced in the skeleton by ``{"__tensor__": key}``; everything else
    must be JSON (ints, floats, strings, lists, dicts with string-able keys). Optimiser
    state dicts (int keys) round-trip through :func:`unflatten_state`.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj: Any, key: str) -> Any:
        if isinstance(obj, torch.Tensor):
            if key in tensors:  # keys holding "/" could collide; refuse rather than overwrite
                raise ValueError(f"duplicate tensor key {key!r} while flattening state")
            tensors[key] = obj
            return {"__tensor__": key}
        if isinstance(obj, dict):
            return {"__dict__": [[k, walk(v, f"{key}/{k}" if key else str(k))] for k, v in obj.items()]}
        if isinstance(obj, (list, tuple)):
            return [walk(v, f"{key}/{i}" if key else str(i)) for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        raise TypeError(f"cannot checkpoint value of type {type(obj).__name__} at {key!r}")

    return tensors, walk(state, prefix)


def unflatten_state(tensors: dict[str, torch.Tensor], skeleton: Any) -> Any:
    """Inverse of :func:`flatten_state`."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        return {k: unflatten_state(tensors, v) for k, v in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [unflatten_state(tensors, v) for v in skeleton]
    return skeleton


def save_state(path: Path, state: Any) -> None:
    """Save any nested state (tensors + JSON values) as one safetensors file."""
    tensors, skeleton = flatten_state(state)
    save_tensors(path, tensors, meta={"skeleton": skeleton})


def load_state(path: Path) -> Any:
    """Load a state saved by :func:`save_state`."""
    tensors, meta = load_tensors(path)
    if not meta or "skeleton" not in meta:
        raise CheckpointError(f"checkpoint file {path} has no state skeleton")
    return unflatten_state(tensors, meta["skeleton"])


__all__ = ["CheckpointError", "flatten_state", "load_state", "load_tensors", "save_state", "save_tensors",
           "state_from_bytes", "tensors_from_bytes", "tensors_to_bytes", "unflatten_state"]
