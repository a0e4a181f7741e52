"""Choosing the next token from one row's logits: greedy, or seeded sampling with
temperature, min-p, top-k and top-p (nucleus); and the rules that reshape a row's logits
before that choice (:func:`shape_logits`: a logit bias, repetition, presence and frequency
penalties, and the end tokens held back until ``min_tokens``). One-prompt generation and
the batched engine call the same functions per row with the row's own generator, so a
sample depends only on the row's logits, its own tokens and its seed, never on the other
rows of a batch."""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def mixed_seed(seed: int, index: int) -> int:
    """A seed for draw ``index`` under ``seed`` (a prompt of ``generate --file``, a choice of a
    server request with ``n > 1``): mixed, not added, so neighbours get unrelated streams."""
    return int(np.random.SeedSequence([int(seed), int(index)]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float],
                   min_p: Optional[float] = None) -> None:
    """Raise ``ValueError`` (one line) for settings outside their domain."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p!r}")
    if min_p is not None and not (isinstance(min_p, (int, float)) and 0 <= min_p <= 1):
        raise ValueError(f"min_p must lie in [0, 1], got {min_p!r}")


def _finite(name: str, value: Any, low: float = -math.inf, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high:
        raise ValueError(f"{name} must be a finite number in [{low}, {high}], got {value!r}")


def check_shaping(req: Any, vocab_size: int) -> None:
    """``ValueError`` (one line) for a request's logit rules outside their domain (the fields
    of :class:`~dipaco.inference.engine_rows.Request` that :func:`shape_logits` reads)."""
    def token(name: str, t: Any) -> None:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{name} holds {t!r}, not a token id in [0, {vocab_size})")

    if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int) or req.min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {req.min_tokens!r}")
    for t in req.stop_ids:
        token("stop_ids", t)
    _finite("repetition_penalty", req.repetition_penalty, *REPETITION_PENALTY_RANGE)
    _finite("presence_penalty", req.presence_penalty, -2, 2)
    _finite("frequency_penalty", req.frequency_penalty, -2, 2)
    for t, bias in (req.logit_bias or {}).items():
        token("logit_bias", t)
        _finite(f"logit_bias[{t}]", bias, -100, 100)
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(req, name)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= vocab_size):
            raise ValueError(f"{name} must be an integer in [0, {vocab_size}], got {n!r}")


def shapes_logits(req: Any) -> bool:
    """Whether ``req`` asks :func:`shape_logits` for anything (most rows do not: they skip it)."""
    return bool(req.logit_bias or req.repetition_penalty != 1 or req.presence_penalty or req.frequency_penalty
                or (req.min_tokens and (req.stop_at_eos or req.stop_ids)))


def shape_logits(logits: torch.Tensor, req: Any, prompt: Sequence[int], generated: Sequence[int],
                 eos: Optional[int]) -> torch.Tensor:
    """One row's logits ``[V]`` (on the CPU) reshaped by its request's rules, in this order:

    * ``logit_bias``: added to its tokens' logits (OpenAI's rule);
    * ``repetition_penalty`` ``r`` over every token of the prompt and the generated text: a
      positive logit is divided by ``r``, a negative one multiplied (the rule of the CTRL
      paper, as vLLM and ``transformers`` apply it);
    * ``presence_penalty`` and ``frequency_penalty`` over the generated tokens: a token's
      logit loses ``presence`` once if it appeared and ``frequency`` per appearance (OpenAI's);
    * until ``min_tokens`` tokens are generated, the end-of-text token (when the row stops
      at it) and the ``stop_ids`` cannot be chosen.
    """
    out = logits.clone()
    if req.logit_bias:
        ids = torch.tensor(list(req.logit_bias), dtype=torch.long)
        out[ids] += torch.tensor(list(req.logit_bias.values()), dtype=out.dtype)
    if req.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(prompt) | set(generated)), dtype=torch.long)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / req.repetition_penalty, vals * req.repetition_penalty)
    if (req.presence_penalty or req.frequency_penalty) and generated:
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=out.numel())[:out.numel()]
        out -= req.frequency_penalty * counts.to(out.dtype) + req.presence_penalty * (counts > 0).to(out.dtype)
    if len(generated) < req.min_tokens:
        held = list(req.stop_ids) + ([eos] if req.stop_at_eos and eos is not None else [])
        if held:
            out[torch.tensor(held, dtype=torch.long)] = float("-inf")
    return out


def token_logprobs(logits: torch.Tensor, chosen: Sequence[int], top: int) -> list[tuple[float, list[tuple[int, float]]]]:
    """For each row of ``logits [N, V]``: the log-probability (fp32 log-softmax, the model's own
    distribution, before any sampling rule) of its ``chosen`` token, and the ``top`` likeliest
    tokens with theirs (likeliest first; ``top`` 0: none)."""
    logp = F.log_softmax(logits.float(), dim=-1).cpu()
    mine = logp.gather(1, torch.tensor(list(chosen), dtype=torch.long)[:, None])[:, 0].tolist()
    if top <= 0:
        return [(lp, []) for lp in mine]
    vals, ids = torch.topk(logp, min(int(top), logp.shape[-1]), dim=-1)
    return [(lp, list(zip(i, v))) for lp, i, v in zip(mine, ids.tolist(), vals.tolist())]


# a temperature below this is greedy (vLLM's rule): dividing by a subnormal one overflowed the
# logits to inf, and the softmax of inf - inf is NaN, which failed the engine's whole step
GREEDY_BELOW = 1e-5
# repetition_penalty's domain: dividing or multiplying a logit by a number outside it could
# overflow it, or make every seen token -inf
REPETITION_PENALTY_RANGE = (0.01, 100.0)


def sample_token(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
                 generator: Optional[torch.Generator], min_p: Optional[float] = None) -> torch.Tensor:
    """The next token id (a 0-d long tensor on ``logits``' device) from one row's ``logits [V]``.

    ``temperature`` below :data:`GREEDY_BELOW` (0 among them) is greedy (the first of equal
    maxima). Otherwise: scale by
    ``1/temperature`` in float64, keep the tokens whose probability is at least ``min_p``
    times the likeliest's, then the ``top_k`` likeliest, then the smallest set of the
    likeliest whose probability reaches ``top_p`` (the likeliest always stays), and draw one
    with ``generator``.
    """
    if temperature < GREEDY_BELOW:
        return logits.argmax()
    scaled = logits.double() / temperature
    if min_p:
        probs = F.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k is not None:
        kth = torch.topk(scaled, min(int(top_k), scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        probs, order = torch.sort(F.softmax(scaled, dim=-1), descending=True)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the likelier tokens
        drop = torch.zeros_like(scaled, dtype=torch.bool).scatter(0, order, before >= top_p)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=generator)[0]
