"""Transformer building blocks: RMSNorm, rotary embeddings, attention, SwiGLU, pre-norm block.

Also the three kinds of grid module: a *level* module (a stack of blocks), the *head*
(final norm + LM projection) and the *embed* (a plain ``nn.Embedding``).

Rotary tables are not stored in any module: the caller (``PathModel``) owns them and
passes ``cos``/``sin`` already sliced to the positions being processed. That keeps every
module's state dict made of trainable parameters only, so DiLoCo can sync a module by
iterating its state dict.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig

if TYPE_CHECKING:  # only for type hints; kv_cache imports nothing from here at run time
    from .kv_cache import KVCache


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned gain (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so low-precision activations do not lose the small mean square.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


# ---------------------------------------------------------------------------- rotary


def rotary_tables(
    head_dim: int, max_len: int, theta: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings, each ``[max_len, head_dim // 2]`` (fp32).

    Channel pair ``i`` of a head rotates by angle ``pos · theta^(-2i/head_dim)``.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    pos = torch.arange(max_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)  # [max_len, head_dim/2]
    # Computed in fp64 then rounded once, so tables are identical whatever max_len is.
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, T, head_dim]`` by position; ``cos``/``sin`` are ``[T, head_dim/2]``.

    Uses the "split halves" layout: channel ``i`` pairs with channel ``i + head_dim/2``.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # each [B, H, T, hd/2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # broadcast over [B, H]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


# ---------------------------------------------------------------------------- block parts


# Positions a decode step reads, in blocks of this many: any multiple of it gives a row
# the same bits as the whole buffer (measured on AVX2 CPUs: the softmax and the
# probability-value product reduce in 32-wide lanes, and masked lanes add exact zeros;
# a 16-wide span did change bits). tests/test_engine.py checks it on this machine.
DECODE_SPAN_BLOCK = 64


def decode_span(live: int, buffer: int) -> int:
    """Cache positions a decode step reads when the longest row has ``live`` of them:
    ``live`` rounded up to :data:`DECODE_SPAN_BLOCK`, at most ``buffer``."""
    return min(buffer, -(-int(live) // DECODE_SPAN_BLOCK) * DECODE_SPAN_BLOCK)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                     live: int | None = None) -> torch.Tensor:
    """Attention of one new token per row over a cache buffer: ``q [B, H, 1, hd]``,
    ``keys``/``values`` ``[B, H, max_len, hd]`` (whole buffers), row ``b`` sees positions
    ``[0, lengths[b])``. ``live`` (host int, ``>= max(lengths)``): read only the first
    :func:`decode_span` positions instead of the whole buffer; the bits do not change.

    Why not SDPA over ``keys[:, :, :length]``: its result for a row depends on the key length
    and on the other rows of the call (its kernel blocks both), so a row would decode to
    different bits in a batch than alone. Plain matmuls over a span that is a whole number
    of blocks reduce the same way for every row, batch size and span; masked positions
    weigh exactly zero.
    """
    if live is not None:
        span = decode_span(live, keys.shape[2])
        keys, values = keys[:, :, :span], values[:, :, :span]
    scores = torch.matmul(q, keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5)  # [B, H, 1, span]
    seen = torch.arange(keys.shape[2], device=q.device) < lengths.view(-1, 1)
    scores = scores.float().masked_fill(~seen.view(q.shape[0], 1, 1, -1), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions and an optional KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        """``x [B, T, C]`` → ``[B, T, C]``. With a cache, ``x`` holds the tokens at positions
        ``kv_cache.length … kv_cache.length + T - 1`` and ``cos``/``sin`` match them."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # each [B, T, C]
        # [B, T, C] → [B, T, H, hd] → [B, H, T, hd]
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        if kv_cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            start = kv_cache.length
            k, v = kv_cache.update(layer, k, v)  # [B, H, start + T, hd]
            if start == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            elif T == 1:
                # One new token per row: attend over the whole cache buffer with a length mask,
                # as a serving batch does (modules/row_decode.py), so a row decodes to the same
                # bits alone or beside others.
                lengths = torch.full((B,), start + 1, dtype=torch.long, device=x.device)
                y = decode_attention(q, kv_cache.k[layer], kv_cache.v[layer], lengths, start + 1)
            else:
                # SDPA's is_causal aligns the mask top-left, which is wrong when queries
                # start at `start`; query i (absolute start+i) may see keys 0..start+i.
                mask = torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # [B, H, T, hd] → [B, T, C]
        return self.proj(y)


class SwiGLU(nn.Module):
    """Gated MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_dim
        self.gate = nn.Linear(cfg.d_model, hidden, bias=False)
        self.up = nn.Linear(cfg.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv_cache, layer)
        return x + self.mlp(self.mlp_norm(x))


# ---------------------------------------------------------------------------- grid modules


class LevelModule(nn.Module):
    """One module of a level: ``layers_per_level`` blocks applied in order."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers_per_level))
        # Recompute each block's activations in backward instead of keeping them
        # (set_activation_checkpointing): memory per block drops to its input.
        self.activation_checkpointing = False

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache | None = None,
        first_layer: int = 0,
    ) -> torch.Tensor:
        """``x [B, T, C]`` → ``[B, T, C]``; ``first_layer`` is this module's first block's
        index among all blocks of the path (it picks the block's KV-cache slot)."""
        recompute = self.activation_checkpointing and kv_cache is None and torch.is_grad_enabled()
        for i, block in enumerate(self.blocks):
            if recompute:
                x = checkpoint(block, x, cos, sin, None, first_layer + i, use_reentrant=False)
            else:
                x = block(x, cos, sin, kv_cache, first_layer + i)
        return x


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> int:
    """Turn per-block activation checkpointing on or off in every level module of ``model``.

    Works on a grid module, a ``PathModel`` or anything holding level modules; returns
    how many level modules were set. Paths share modules, so this is a per-run setting.
    """
    levels = [m for m in model.modules() if isinstance(m, LevelModule)]
    for m in levels:
        m.activation_checkpointing = bool(enabled)
    return len(levels)


class LMHead(nn.Module):
    """Final RMSNorm + output projection to the vocabulary.

    With tied embeddings the head holds only the norm, and the caller passes the embed
    weight as ``tied_weight``; that way the tied weight belongs to exactly one module.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.proj = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        """``x [B, T, C]`` → logits ``[B, T, V]``."""
        x = self.norm(x)
        if self.proj is not None:
            return self.proj(x)
        if tied_weight is None:
            raise ValueError("this head is tied to the embedding: pass tied_weight=embed.weight")
        return F.linear(x, tied_weight)


# ---------------------------------------------------------------------------- init


@torch.no_grad()
def init_parameters_(module: nn.Module, generator: torch.Generator, std: float) -> None:
    """Initialise every parameter of ``module`` in place from ``generator`` only.

    Linear and embedding weights ~ N(0, std), norm gains = 1, biases = 0. There is no
    depth-scaled (GPT-2 style) init on purpose: it would make a module's weights depend
    on how many levels the grid has, and a module must depend on (seed, module id) only.
    Modules are visited in registration order, so the result depends on the generator's
    seed alone. Raises ``TypeError`` for a parameter no rule covers (it would otherwise
    keep the uninitialised memory it was allocated with).
    """
    done: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            sub.weight.normal_(0.0, std, generator=generator)
            done.add(id(sub.weight))
            if sub.bias is not None:
                sub.bias.zero_()
                done.add(id(sub.bias))
        elif isinstance(sub, nn.Embedding):
            sub.weight.normal_(0.0, std, generator=generator)
            done.add(id(sub.weight))
        elif isinstance(sub, RMSNorm):
            sub.weight.fill_(1.0)
            done.add(id(sub.weight))
    missed = [name for name, p in module.named_parameters() if id(p) not in done]
    if missed:
        raise TypeError(f"init_parameters_ has no rule for parameters {missed}")

