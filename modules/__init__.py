"""torch.nn building blocks of DiPaCo: the module grid and paths assembled from it.

This package imports torch only (never ``dipaco`` or ``router``); :mod:`modules.config` not even torch.

    >>> cfg = ModelConfig(vocab_size=64, d_model=32)
    >>> grid = ModuleGrid(cfg, [4, 4], seed=0)      # 16 paths, modules built lazily
    >>> model = PathModel(grid, grid.path_id_of((2, 1)))  # path 9: embed, L0.2, L1.1, head
"""
from importlib import import_module
from typing import Any

from .config import ModelConfig

# name -> the module defining it, imported on first use: ``modules.config`` (the model's
# shape, which dipaco's config schema holds) stays importable without torch
_LAZY = {"ModuleGrid": "grid", "init_grid_from_dense": "grid", "module_seed": "grid", "KVCache": "kv_cache",
         "set_activation_checkpointing": "layers", "PathModel": "path_model"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'modules' has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value

__all__ = ["KVCache", "ModelConfig", "ModuleGrid", "PathModel", "init_grid_from_dense", "module_seed",
           "set_activation_checkpointing"]
