"""One decoding step for many sequences at once, each row bit-identical to decoding it alone.

:meth:`PathModel.forward` with a :class:`KVCache` decodes a batch whose rows share one
position. A serving batch holds rows at different positions (different prompt lengths,
rows joining as others leave), so :class:`RowCache` keeps one slot per row, each with its
own length, and :func:`decode_rows` places each row's rotary angles at its own position.

Why care about bits: on CPU a matrix product over ``M`` rows does not give a row the bits
it gets alone (the BLAS blocks the reduction differently for ``M = 1``), and SDPA's result
for a row depends on its key length and on the other rows of the call. Greedy decoding turns
such an ulp into a different token at a near-tie, so a prompt's answer would depend on which
other prompts shared its batch. Here:

* every linear layer is one ``bmm`` over a stride-0 view of the weight: each row's
  product runs as a batch-1 product does (the same kernel, the same reduction);
* attention is :func:`layers.decode_attention` with a length mask, the function a batch-1
  decode with a :class:`KVCache` uses too, over the first positions of the buffer that cover
  the longest row, in whole blocks of ``DECODE_SPAN_BLOCK`` (a span of whole blocks gives a
  row the bits the whole buffer gives it; the rest of the buffer is never read);
* embedding, norms, rotary, SwiGLU's gate and residuals are per-row (elementwise or
  row-wise reductions), so batching does not touch them.

``tests/test_engine.py`` checks the result token for token against one-prompt generation.
The mirror of ``layers.py`` below must follow any change to a block's forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .kv_cache import KVCache
from .layers import apply_rotary, decode_attention

if TYPE_CHECKING:
    from .path_model import PathModel


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` for ``x [B, 1, K]``, each row computed as a batch of one."""
    return torch.bmm(x, weight.t().unsqueeze(0).expand(x.shape[0], -1, -1))


def _attention(attn: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: "RowCache", layer: int, rows: torch.Tensor, pos: torch.Tensor, live: int,
               linear=_linear) -> torch.Tensor:
    """:class:`layers.Attention` for one new token per row, row ``i`` in slot ``i`` of ``cache``."""
    B, T, C = x.shape
    q, k, v = linear(x, attn.qkv.weight).split(C, dim=2)
    q = q.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)  # [B, H, 1, hd]
    k = k.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    v = v.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    keys, values = cache.k[layer, :B], cache.v[layer, :B]  # [B, H, max_len, hd]
    keys[rows, :, pos] = k[:, :, 0]
    values[rows, :, pos] = v[:, :, 0]
    y = decode_attention(q, keys, values, pos + 1, live)
    y = y.transpose(1, 2).contiguous().view(B, T, C)
    return linear(y, attn.proj.weight)


class RowCache:
    """Keys and values of up to ``slots`` rows of one path, each row at its own length.

    Buffers are ``[num_layers, slots, H, max_len, head_dim]`` like a :class:`KVCache`'s; the
    rows being decoded occupy slots ``0 … n-1`` (:meth:`move` keeps them packed), so a step
    reads a view, never a gathered copy. ``lengths[i]`` is slot ``i``'s positions stored.
    """

    def __init__(self, model: "PathModel", slots: int) -> None:
        shape = (model.num_layers, slots, model.cfg.n_heads, model.cfg.max_seq_len, model.cfg.head_dim)
        weight = model.embed.weight
        self.k = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.max_len = model.cfg.max_seq_len
        self.lengths = [0] * slots
        self.rows = torch.arange(slots, device=weight.device)  # slot indices, made once
        # a batch-1 cache for encoding one row's context (prefill) before it joins a slot
        self.scratch = KVCache(model.num_layers, 1, model.cfg.n_heads, model.cfg.head_dim, self.max_len,
                               dtype=weight.dtype, device=weight.device)

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def fill(self, slot: int, scratch: KVCache, row: int = 0, n: int | None = None) -> None:
        """Slot ``slot`` takes the first ``n`` positions (default: all) of ``scratch``'s row ``row``."""
        n = scratch.length if n is None else int(n)
        self.k[:, slot, :, :n] = scratch.k[:, row, :, :n]
        self.v[:, slot, :, :n] = scratch.v[:, row, :, :n]
        self.lengths[slot] = n

    def move(self, src: int, dst: int) -> None:
        """Slot ``dst`` takes slot ``src``'s positions (to keep the live rows packed)."""
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n


@torch.no_grad()
def decode_rows(model: "PathModel", ids: torch.Tensor, cache: RowCache, exact: bool = True) -> torch.Tensor:
    """Logits ``[B, vocab]`` of the token after each row: ``ids [B]`` are the newest tokens of
    the rows in slots ``0 … B-1`` (on the model's device); each slot's length is its new
    token's position, and advances by one.

    ``exact=False`` runs each linear layer as one matrix product over the batch (what a
    padded-batch ``generate`` does): faster, but a row's float bits may then depend on the
    other rows, so a greedy near-tie can pick another token than batch-1 decoding."""
    linear = _linear if exact else F.linear  # F.linear: one matrix product over the batch
    B = int(ids.shape[0])
    if not 0 < B <= cache.slots:
        raise ValueError(f"decode_rows needs 1 to {cache.slots} rows, got {B}")
    longest = max(cache.lengths[:B])
    if longest >= cache.max_len:
        raise ValueError(f"a row is full ({cache.max_len} positions): re-encode its trailing window first")
    pos = torch.tensor(cache.lengths[:B], dtype=torch.long, device=ids.device)
    rows = cache.rows[:B]
    cos = model.rope_cos[pos].view(B, 1, 1, -1)  # broadcast over heads, as [1, hd/2] does
    sin = model.rope_sin[pos].view(B, 1, 1, -1)
    x = model.embed(ids.view(B, 1))  # [B, 1, C]
    layer = 0
    for level in model.levels:
        for block in level.blocks:
            x = x + _attention(block.attn, block.attn_norm(x), cos, sin, cache, layer, rows, pos, longest + 1,
                               linear)
            h, mlp = block.mlp_norm(x), block.mlp
            x = x + linear(F.silu(linear(h, mlp.gate.weight)) * linear(h, mlp.up.weight), mlp.down.weight)
            layer += 1
    x = model.head.norm(x)
    weight = model.embed.weight if model.cfg.tie_embeddings else model.head.proj.weight
    cache.lengths[:B] = [n + 1 for n in cache.lengths[:B]]
    return linear(x, weight)[:, 0]
