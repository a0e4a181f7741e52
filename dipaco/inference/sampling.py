"""Choosing the next token from one row's logits: greedy, or seeded sampling with
temperature, top-k and top-p (nucleus). One-prompt generation and the batched engine call
the same function per row with the row's own generator, so a sample depends only on the
row's logits and seed, never on the other rows of a batch."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Raise ``ValueError`` (one line) for settings outside their domain."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")


def sample_token(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
                 generator: Optional[torch.Generator]) -> torch.Tensor:
    """The next token id (a 0-d long tensor on ``logits``' device) from one row's ``logits [V]``.

    ``temperature == 0`` is greedy (the first of equal maxima), and so is a temperature so
    small that ``logits / temperature`` overflows float64 (5e-324): greedy is its limit,
    where sampling would draw from NaN. Otherwise: scale by
    ``1/temperature`` in float64, keep the ``top_k`` likeliest tokens, then the smallest
    set of the likeliest whose probability reaches ``top_p`` (the likeliest always stays),
    and draw one with ``generator``.
    """
    if temperature == 0:
        return logits.argmax()
    scaled = logits.double() / temperature
    if bool((torch.isinf(scaled) & torch.isfinite(logits)).any()):
        return logits.argmax()
    if top_k is not None:
        kth = torch.topk(scaled, min(int(top_k), scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        probs, order = torch.sort(F.softmax(scaled, dim=-1), descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the likelier tokens
        drop = torch.zeros_like(scaled, dtype=torch.bool).scatter(0, order, before >= top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator)[0]
