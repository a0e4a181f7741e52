"""Key/value cache for generating with one path, one token at a time.

The cache is preallocated (``[num_layers, B, H, max_len, head_dim]`` for keys and for
values) so a decoding step only writes one slice. ``length`` is the number of positions
already processed; it is also the position of the next token, which is how
``PathModel`` places rotary angles. A cache belongs to one path: after re-routing to
another path, start a new cache (keys computed by other modules are meaningless there).
"""
from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every block of one path, for a batch of ``batch_size`` sequences."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        n_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers < 1 or batch_size < 1 or max_len < 1:
            raise ValueError(
                f"KVCache needs num_layers, batch_size and max_len ≥ 1, got "
                f"{num_layers}, {batch_size}, {max_len}"
            )
        shape = (num_layers, batch_size, n_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch_size = batch_size
        self.max_len = max_len
        self.num_layers = num_layers
        self.length = 0  # positions already stored (= position of the next token)

    def check_fits(self, batch_size: int, num_new: int) -> None:
        """Raise ``ValueError`` before a forward that would not fit this cache."""
        if batch_size != self.batch_size:
            raise ValueError(f"KVCache was made for batch size {self.batch_size}, got a batch of {batch_size}")
        if self.length + num_new > self.max_len:
            raise ValueError(
                f"KVCache is full: {self.length} cached + {num_new} new positions > max_len "
                f"{self.max_len}; make a larger cache (max_len) or re-encode a shorter context"
            )

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys/values ``[B, H, T, hd]`` of block ``layer`` at positions
        ``length … length+T-1`` and return all keys/values so far, ``[B, H, length+T, hd]``.

        ``length`` itself only moves in :meth:`advance`, once every block has written.
        """
        start, end = self.length, self.length + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, num_new: int) -> None:
        """Mark ``num_new`` more positions as stored (called once per forward)."""
        self.length += num_new

    def reset(self) -> None:
        """Forget every position (the buffers are reused, not freed)."""
        self.length = 0
