"""Codecs for pseudo-gradients on the wire (``diloco.codec``).

A codec turns a flat fp32 tensor into a *payload* (a tuple of tensors) and back. Payload
shapes and dtypes depend only on ``numel`` (never on the values), so every rank of a
module subgroup can all-gather payloads into pre-sized buffers, and the planner can
count bytes with :meth:`Codec.nbytes_for` without data.

Error bounds (per element, x the input, d = decode(encode(x))):

* ``none``: exact.
* ``fp16``: |d - x| ≤ 2^-11·|x| for |x| in fp16's normal range; |x| > 65504 is clamped.
* ``bf16``: |d - x| ≤ 2^-8·|x|.
* ``int8``: per block of ``block_size`` entries, |d - x| ≤ absmax(block) / 254.
* ``int4``: per block, |d - x| ≤ absmax(block) / 14 (15 levels, -7..7, two per byte).
* ``fp8`` (e4m3, one fp32 scale per block mapping the block's absmax to 448):
  |d - x| ≤ 2^-4·|x| + absmax(block)·2^-10 / 448 (3 mantissa bits; the second term is
  half a step of e4m3's subnormals, for entries far below their block's absmax).
* ``topk``: the kept ``ceil(fraction·numel)`` largest-magnitude entries are exact (fp32
  values) or fp16-rounded (``value_dtype="fp16"``); the rest decode to 0.

In the default two-phase exchange (:mod:`dipaco.sync.comm`) a module's summed
pseudo-gradient passes through the codec twice: each contribution, then each reduced
chunk; so the bounds above apply twice (the second to the sum). Chunks are multiples of
:attr:`Codec.chunk_align` (the block codecs: one block), so a block never straddles two chunks.

Error feedback (the residual x - d carried to the next round) lives in ``CollectiveModuleSync``
(first encoding) and in the chunk owner's residual (second encoding).
The codecs by name, with the ``diloco.*`` keys their options read, are the registry
``dipaco.config.names.CODECS`` (docs/design.md, "Adding a codec"): a codec is its class here
(or in a module of its own) and one line there.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from dipaco.config.names import CODECS, load

__all__ = ["Codec", "CODECS", "Payload", "codec_class", "make_codec", "payload_nbytes"]

Payload = tuple[torch.Tensor, ...]

def payload_nbytes(payload: Sequence[torch.Tensor]) -> int:
    """Bytes of a payload on the wire."""
    return sum(t.numel() * t.element_size() for t in payload)


class Codec:
    """Base class. Subclasses implement ``encode``, ``decode`` and ``nbytes_for``."""

    name = "base"
    lossy = True

    def encode(self, flat: torch.Tensor) -> Payload:
        """Encode a 1-D fp32 tensor."""
        raise NotImplementedError

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        """Decode a payload back to a 1-D fp32 tensor of ``numel`` elements."""
        raise NotImplementedError

    def nbytes_for(self, numel: int) -> int:
        """Payload bytes for ``numel`` elements (exactly ``payload_nbytes(encode(x))``)."""
        raise NotImplementedError

    def payload_nbytes(self, payload: Payload) -> int:
        """Bytes of ``payload`` on the wire."""
        return payload_nbytes(payload)

    @property
    def chunk_align(self) -> int:
        """Chunk sizes of the two-phase exchange are multiples of this (1: any size).

        A property, not an attribute: ``vars(codec)`` must stay the codec's options.
        """
        return 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoneCodec(Codec):
    """fp32, exact."""
    name = "none"

    lossy = False

    def encode(self, flat: torch.Tensor) -> Payload:
        return (flat.detach().to(torch.float32).contiguous().clone(),)

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        return payload[0].to(torch.float32)[:numel]

    def nbytes_for(self, numel: int) -> int:
        return 4 * int(numel)


class _CastCodec(Codec):
    dtype: torch.dtype = torch.float16

    def encode(self, flat: torch.Tensor) -> Payload:
        x = flat.detach().to(torch.float32)
        fmax = torch.finfo(self.dtype).max
        return (x.clamp(-fmax, fmax).to(self.dtype).contiguous(),)

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        return payload[0].to(torch.float32)[:numel]

    def nbytes_for(self, numel: int) -> int:
        return 2 * int(numel)


class FP16Codec(_CastCodec):
    """IEEE half precision (values beyond ±65504 are clamped, never inf)."""
    name = "fp16"

    dtype = torch.float16


class BF16Codec(_CastCodec):
    """bfloat16: fp32's range, 8 bits of mantissa."""
    name = "bf16"

    dtype = torch.bfloat16


class Int8Codec(Codec):
    """Symmetric int8 with one fp32 absmax scale per block of ``block_size`` entries."""
    name = "int8"

    def __init__(self, block_size: int = 256) -> None:
        if int(block_size) < 1:
            raise ValueError(f"diloco.codec_kw.block_size={block_size} must be ≥ 1")
        self.block_size = int(block_size)

    def encode(self, flat: torch.Tensor) -> Payload:
        x = flat.detach().to(torch.float32).reshape(-1)
        n, b = x.numel(), self.block_size
        nb = -(-n // b)
        padded = torch.zeros(nb * b, dtype=torch.float32)
        padded[:n] = x
        blocks = padded.view(nb, b)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8).reshape(-1)[:n]
        return (q.contiguous(), scale.contiguous())

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        q, scale = payload
        n, b = int(numel), self.block_size
        nb = scale.numel()
        padded = torch.zeros(nb * b, dtype=torch.float32)
        padded[:n] = q.to(torch.float32)
        return (padded.view(nb, b) * scale[:, None]).reshape(-1)[:n]

    def nbytes_for(self, numel: int) -> int:
        return int(numel) + 4 * (-(-int(numel) // self.block_size))

    @property
    def chunk_align(self) -> int:
        """One block: chunk boundaries never split a block, so each chunk's scales are
        exactly the scales the whole slice would have had."""
        return self.block_size

    def __repr__(self) -> str:
        return f"Int8Codec(block_size={self.block_size})"


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` as fp32 rows of ``block`` entries, the last row zero-padded."""
    x = flat.detach().to(torch.float32).reshape(-1)
    n, nb = x.numel(), -(-x.numel() // block)
    padded = torch.zeros(nb * block, dtype=torch.float32)
    padded[:n] = x
    return padded.view(nb, block)


def _scales(blocks: torch.Tensor, top: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale mapping the block's absmax to ``top``, and a divisor safe for
    all-zero blocks (their scale 0 decodes every entry to exactly 0)."""
    scale = blocks.abs().amax(dim=1) / top
    return scale, torch.where(scale > 0, scale, torch.ones_like(scale))


class _BlockCodec(Codec):
    """A codec with one fp32 scale per block of ``block_size`` entries (int4, fp8)."""

    def __init__(self, block_size: int = 256) -> None:
        if int(block_size) < 1:
            raise ValueError(f"diloco.codec_block={block_size} must be ≥ 1")
        self.block_size = int(block_size)

    @property
    def chunk_align(self) -> int:
        """One block (see :class:`Int8Codec`)."""
        return self.block_size

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


class Int4Codec(_BlockCodec):
    """Symmetric 4-bit integers (-7..7) with one fp32 absmax scale per block, two per byte.

    Each entry is stored as ``q + 8`` in a nibble (entry ``2i`` low, ``2i+1`` high), so a
    payload is ``ceil(n/2)`` bytes plus the scales: about 1/8 of fp32.
    """
    name = "int4"

    def encode(self, flat: torch.Tensor) -> Payload:
        n = flat.numel()
        blocks = _blocks(flat, self.block_size)
        scale, safe = _scales(blocks, 7.0)
        q = torch.round(blocks / safe[:, None]).clamp_(-7, 7).reshape(-1)[:n].to(torch.int16) + 8
        if n % 2:
            q = torch.cat([q, q.new_full((1,), 8)])  # the odd last entry pairs with a zero
        packed = (q[0::2] | (q[1::2] << 4)).to(torch.uint8)
        return (packed.contiguous(), scale.contiguous())

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        packed, scale = payload
        n, b = int(numel), self.block_size
        p = packed.to(torch.int16)
        q = torch.stack([p & 15, p >> 4], dim=1).reshape(-1)[:n].to(torch.float32) - 8
        padded = torch.zeros(scale.numel() * b, dtype=torch.float32)
        padded[:n] = q
        return (padded.view(-1, b) * scale[:, None]).reshape(-1)[:n]

    def nbytes_for(self, numel: int) -> int:
        return -(-int(numel) // 2) + 4 * (-(-int(numel) // self.block_size))


class FP8Codec(_BlockCodec):
    """8-bit floats, e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits,
    largest 448), after dividing each block by its scale absmax/448. The values travel
    as their bytes (uint8), so no collective needs to know the fp8 dtype. torch's CPU
    cast rounds to nearest even and saturates at ±448; the clamp makes that explicit."""
    name = "fp8"

    TOP = 448.0

    def encode(self, flat: torch.Tensor) -> Payload:
        n = flat.numel()
        blocks = _blocks(flat, self.block_size)
        scale, safe = _scales(blocks, self.TOP)
        q = (blocks / safe[:, None]).clamp_(-self.TOP, self.TOP).reshape(-1)[:n].to(torch.float8_e4m3fn)
        return (q.view(torch.uint8).contiguous(), scale.contiguous())

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        q, scale = payload
        n, b = int(numel), self.block_size
        padded = torch.zeros(scale.numel() * b, dtype=torch.float32)
        padded[:n] = q.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        return (padded.view(-1, b) * scale[:, None]).reshape(-1)[:n]

    def nbytes_for(self, numel: int) -> int:
        return int(numel) + 4 * (-(-int(numel) // self.block_size))


class TopKCodec(Codec):
    """Keep the ``ceil(fraction·numel)`` largest-magnitude entries: values + int32 indices."""
    name = "topk"

    _VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}

    def __init__(self, fraction: float = 0.01, value_dtype: str = "fp32") -> None:
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"diloco.codec_kw.fraction={fraction} must be in (0, 1]")
        if value_dtype not in self._VALUE_DTYPES:
            raise ValueError(
                f"diloco.codec_kw.value_dtype={value_dtype!r} must be one of {sorted(self._VALUE_DTYPES)}"
            )
        self.fraction = float(fraction)
        self.value_dtype = value_dtype

    def k_for(self, numel: int) -> int:
        """Entries kept for a ``numel``-element tensor."""
        return min(int(numel), max(1, math.ceil(self.fraction * int(numel))))

    def encode(self, flat: torch.Tensor) -> Payload:
        x = flat.detach().to(torch.float32).reshape(-1)
        k = self.k_for(x.numel())
        idx = torch.topk(x.abs(), k, sorted=False).indices
        idx, _ = torch.sort(idx)
        vals = x[idx]
        if self.value_dtype == "fp16":
            vals = vals.clamp(-65504.0, 65504.0)
        return (vals.to(self._VALUE_DTYPES[self.value_dtype]).contiguous(), idx.to(torch.int32).contiguous())

    def decode(self, payload: Payload, numel: int) -> torch.Tensor:
        vals, idx = payload
        out = torch.zeros(int(numel), dtype=torch.float32)
        out[idx.long()] = vals.to(torch.float32)
        return out

    def nbytes_for(self, numel: int) -> int:
        vbytes = 4 if self.value_dtype == "fp32" else 2
        return self.k_for(numel) * (vbytes + 4)

    def __repr__(self) -> str:
        return f"TopKCodec(fraction={self.fraction}, value_dtype={self.value_dtype!r})"


def codec_class(name: str) -> type[Codec]:
    """The class of codec ``name`` (its registry line in ``dipaco.config.names.CODECS``)."""
    if name not in CODECS:
        raise ValueError(f"diloco.codec={name!r} is not a known codec; valid choices: {sorted(CODECS)}")
    cls = load(CODECS[name].where)
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise TypeError(f"codec {name!r}: {CODECS[name].where} is not a Codec subclass")
    return cls


def make_codec(name: str, **kw: Any) -> Codec:
    """Build a codec by name (``diloco.codec``) with options (``diloco.codec_kw``).

    Raises:
        ValueError: unknown name (lists the valid choices) or bad options.
    """
    key = str(name).lower()
    cls = codec_class(key)
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"diloco.codec_kw {sorted(kw)} not accepted by codec {key!r}: {e}") from None
