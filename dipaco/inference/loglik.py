"""Routed log-likelihood of token requests, batched by path (what the lm-eval adapter scores with).

A :class:`TokenRequest` is one forward pass: the model reads ``tokens[:-1]`` and the last
``num_scored`` targets of ``tokens[1:]`` are scored. Which path scores it is decided by
``route_ids`` alone (its first ``prefix_tokens`` tokens, by the run's router), never by
the scored tokens, so requests that share a context share a path.

Requests are grouped by path and, inside a path, sorted longest first, so each path's
model is fetched once (a :class:`~dipaco.inference.run.PathLoader` with ``cache_size`` =
``max_loaded_paths`` bounds memory) and a batch pads little. A request longer than the
model's window is left-truncated (the model sees at most ``max_seq_len`` input tokens,
as lm-eval's Hugging Face model does); the scored tokens must fit in that window.

The scores are those of :func:`dipaco.rounds.evaluate.score_documents`: the same model,
right padding (causal attention, so padding never reaches a scored position) and fp32
log-softmax of the logits.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from dipaco.runtime.device import model_device, to_device


@dataclass
class TokenRequest:
    """One forward pass to score.

    Attributes:
        route_ids: tokens whose first ``prefix_tokens`` choose the path (the request's context).
        tokens: the model's input followed by the last target (``len ≥ 2``).
        num_scored: how many of the last targets carry a score (``1 ≤ num_scored < len(tokens)``).
    """

    route_ids: Sequence[int]
    tokens: Sequence[int]
    num_scored: int


@dataclass
class TokenScore:
    """The score of one :class:`TokenRequest`.

    Attributes:
        logprob: sum of the scored targets' log-probabilities (natural log).
        greedy: every scored target is the model's argmax at its position.
        path: the path that scored it.
        token_logprobs: each scored target's log-probability, in order.
    """

    logprob: float
    greedy: bool
    path: int
    token_logprobs: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))


class ModelSource(Protocol):
    """Where models come from: a router plus a path-at-a-time loader, or one dense model."""

    max_len: int

    def route(self, contexts: Sequence[Sequence[int]]) -> list[int]:
        """The path of each context (by its first routing-prefix tokens)."""

    def get(self, path: int) -> nn.Module:
        """The model of ``path`` (eval mode)."""


class RoutedModels:
    """The run's routed model: its router chooses, its :class:`PathLoader` loads (LRU bound)."""

    def __init__(self, run: Any, max_loaded_paths: int = 1) -> None:
        self.run = run
        self.loader = run.loader(cache_size=max_loaded_paths)
        self.max_len = int(run.cfg.model.max_seq_len)

    def route(self, contexts: Sequence[Sequence[int]]) -> list[int]:
        p = self.run.prefix_tokens
        if not contexts:
            return []
        paths = self.run.router.route_batch([np.asarray(list(c)[:p], dtype=np.int64) for c in contexts])
        return [int(x) for x in paths]

    def get(self, path: int) -> nn.Module:
        return self.loader.get(path)


class DenseModel:
    """One model for every request (the run's same-size dense baseline): "path" 0."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model.eval()
        self.max_len = int(model.cfg.max_seq_len)

    def route(self, contexts: Sequence[Sequence[int]]) -> list[int]:
        return [0] * len(contexts)

    def get(self, path: int) -> nn.Module:
        return self.model


def truncate_left(req: TokenRequest, max_len: int) -> TokenRequest:
    """``req`` with at most ``max_len + 1`` tokens (the oldest dropped); its routing context is kept.

    Raises ``ValueError`` when the scored tokens alone do not fit in the model's window.
    """
    n = len(req.tokens)
    if not 1 <= req.num_scored < n:
        raise ValueError(f"a request scores between 1 and len(tokens)-1 targets, got {req.num_scored} of {n - 1}")
    if req.num_scored > max_len:
        raise ValueError(f"a continuation of {req.num_scored} tokens does not fit the model's window "
                         f"(model.max_seq_len {max_len}): it cannot be scored in one pass")
    if n <= max_len + 1:
        return req
    return TokenRequest(route_ids=req.route_ids, tokens=list(req.tokens)[-(max_len + 1):], num_scored=req.num_scored)


@torch.no_grad()
def score_requests(requests: Sequence[TokenRequest], models: ModelSource, *, batch_size: int = 16,
                   paths: Optional[Sequence[int]] = None) -> list[TokenScore]:
    """Score every request with its path's model; results in input order.

    Args:
        requests: the forward passes to score.
        models: routes contexts and hands out models.
        batch_size: requests per forward pass.
        paths: each request's path when already known (e.g. one routing for all the
            windows of a document); default: ``models.route`` of the ``route_ids``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    reqs = [truncate_left(r, models.max_len) for r in requests]
    if paths is None:
        paths = models.route([r.route_ids for r in reqs])
    by_path: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(paths):
        by_path[int(p)].append(i)
    out: list[Optional[TokenScore]] = [None] * len(reqs)
    for path in sorted(by_path):
        model = models.get(path)
        device = model_device(model)
        # longest first: the batches pad little, and the first batch is the largest (an
        # out-of-memory shows at once)
        idxs = sorted(by_path[path], key=lambda i: (-len(reqs[i].tokens), i))
        for start in range(0, len(idxs), batch_size):
            chunk = idxs[start:start + batch_size]
            for i, score in zip(chunk, _score_batch([reqs[i] for i in chunk], model, device)):
                score.path = path
                out[i] = score
    return [s for s in out if s is not None]


def _score_batch(reqs: Sequence[TokenRequest], model: nn.Module, device: Any) -> list[TokenScore]:
    T = max(len(r.tokens) for r in reqs) - 1
    x = torch.zeros(len(reqs), T, dtype=torch.long)
    for b, r in enumerate(reqs):
        x[b, :len(r.tokens) - 1] = torch.as_tensor(list(r.tokens)[:-1], dtype=torch.long)
    logits = model(to_device(x, device))  # [B, T, V] on the model's device
    scores = []
    for b, r in enumerate(reqs):
        n = len(r.tokens) - 1  # input positions of this request
        # only the positions predicting the scored targets: fp32 log-softmax, then to the CPU
        rows = F.log_softmax(logits[b, n - r.num_scored:n].float(), dim=-1).cpu()
        target = torch.as_tensor(list(r.tokens)[-r.num_scored:], dtype=torch.long)
        tok = rows.gather(1, target[:, None])[:, 0].double()
        scores.append(TokenScore(logprob=float(tok.sum()), greedy=bool((rows.argmax(-1) == target).all()),
                                 path=-1, token_logprobs=tok.numpy()))
    return scores
