"""torch.nn building blocks of DiPaCo: the module grid and paths assembled from it.

This package imports torch only (never ``dipaco`` or ``router``).

    >>> cfg = ModelConfig(vocab_size=64, d_model=32)
    >>> grid = ModuleGrid(cfg, [4, 4], seed=0)      # 16 paths, modules built lazily
    >>> model = PathModel(grid, grid.path_id_of((2, 1)))  # path 9: embed, L0.2, L1.1, head
"""
from .config import ModelConfig
from .grid import ModuleGrid, init_grid_from_dense, module_seed
from .kv_cache import KVCache
from .layers import set_activation_checkpointing
from .path_model import PathModel

__all__ = ["KVCache", "ModelConfig", "ModuleGrid", "PathModel", "init_grid_from_dense", "module_seed",
           "set_activation_checkpointing"]
