"""One path of a grid as an ordinary ``nn.Module``: embed → level modules → head.

A ``PathModel`` holds the grid's module objects themselves, not copies: an optimiser
stepping a ``PathModel`` updates the grid's modules, and two paths that share a module
share its parameters. ``.parameters()`` yields each of the path's parameters exactly
once (with tied embeddings the embed weight also serves as the output projection).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .grid import ModuleGrid
from .kv_cache import KVCache
from .layers import rotary_tables


class PathModel(nn.Module):
    """The language model of path ``path_id`` of ``grid``.

    Attributes:
        path_id: the path's id in ``[0, grid.num_paths)``.
        path: the module index per level, ``grid.path_of(path_id)``.
        module_ids: the path's module ids in forward order.
        embed, levels, head: the grid's module objects (shared, not copied).
    """

    def __init__(self, grid: ModuleGrid, path_id: int) -> None:
        super().__init__()
        self.cfg = grid.cfg
        self.path_id = path_id
        self.path = grid.path_of(path_id)
        self.module_ids: list[str] = grid.module_ids_of_path(path_id)
        # Registering the grid's own objects (not copies) is what makes the sharing work.
        self.embed = grid.module(self.module_ids[0])
        self.levels = nn.ModuleList(grid.module(mid) for mid in self.module_ids[1:-1])
        self.head = grid.module(self.module_ids[-1])
        self.num_layers = grid.num_levels * self.cfg.layers_per_level
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device=grid.device)
        # Not persistent: derived from the config, so state_dict() holds module weights only.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def path_modules(self) -> dict[str, nn.Module]:
        """``module_id → module`` for this path, in forward order."""
        return dict(zip(self.module_ids, [self.embed, *self.levels, self.head]))

    def num_parameters(self) -> int:
        """Number of parameters of this path (each counted once)."""
        return sum(p.numel() for p in self.parameters())

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty cache for ``batch_size`` sequences of up to ``max_len`` positions
        (default and upper bound: ``cfg.max_seq_len``)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        if max_len > self.cfg.max_seq_len:
            raise ValueError(f"max_len {max_len} exceeds ModelConfig.max_seq_len {self.cfg.max_seq_len}")
        weight = self.embed.weight
        return KVCache(
            self.num_layers, batch_size, self.cfg.n_heads, self.cfg.head_dim, max_len,
            dtype=weight.dtype, device=weight.device,
        )

    def forward(self, idx: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """Token ids ``idx [B, T]`` → logits ``[B, T, vocab_size]``.

        With ``kv_cache``, ``idx`` continues the cached sequences: its tokens take
        positions ``kv_cache.length …`` and the cache advances by ``T``.
        """
        if idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"idx must be integer token ids of shape [batch, time], got {idx.dtype} {tuple(idx.shape)}")
        B, T = idx.shape
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None:
            kv_cache.check_fits(B, T)
        if start + T > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {start + T} positions exceeds ModelConfig.max_seq_len {self.cfg.max_seq_len}; "
                f"truncate the input or raise max_seq_len"
            )
        # Checking ids on CPU costs nothing; on an accelerator it would force a sync per step.
        if idx.device.type == "cpu" and idx.numel() and not (0 <= int(idx.min()) and int(idx.max()) < self.cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.cfg.vocab_size}), got range [{int(idx.min())}, {int(idx.max())}]")

        cos = self.rope_cos[start : start + T]  # [T, head_dim/2]
        sin = self.rope_sin[start : start + T]
        x = self.embed(idx)  # [B, T, C]
        for i, level_module in enumerate(self.levels):
            x = level_module(x, cos, sin, kv_cache, i * self.cfg.layers_per_level)
        logits = self.head(x, tied_weight=self.embed.weight if self.cfg.tie_embeddings else None)  # [B, T, V]
        if kv_cache is not None:
            kv_cache.advance(T)
        return logits

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue ``idx [B, T]`` by ``max_new_tokens`` tokens → ``[B, T + max_new_tokens]``.

        ``temperature=0`` is greedy decoding; ``top_k`` keeps the k likeliest tokens.
        Runs the prompt once, then one token per step through a KV cache.
        """
        B, T = idx.shape
        if T == 0:
            raise ValueError("generate needs a prompt of at least one token")
        if T + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds ModelConfig.max_seq_len "
                f"{self.cfg.max_seq_len}"
            )
        cache = self.new_kv_cache(B, T + max_new_tokens)
        out = [idx]
        logits = self(idx, cache)[:, -1, :]  # [B, V]
        for step in range(max_new_tokens):
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)  # [B, 1]
            else:
                scaled = logits / temperature
                if top_k is not None:
                    kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator)  # [B, 1]
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits = self(nxt, cache)[:, -1, :]
        return torch.cat(out, dim=1)
