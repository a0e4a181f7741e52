"""EM re-sharding: re-assign documents to the paths that model them best, under balance.

After the paths have trained a while, the loss of a sample of training documents under
every path is measured (the E step, done by the caller: ``losses[n, P]``). The M step
re-assigns those documents with the *same* balanced top-k assignment as routing
(:func:`router.assign.balanced_assign`, the router's ``top_k``, ``capacity_factor`` and
``balance``), with the per-path losses as costs: each document takes its lowest-loss
paths that still have room. Documents that were not scored (and inference prompts) are
routed by a classifier on the routing features (:mod:`router.discriminative`).

``mode`` (config ``router.reshard_assign``):

* ``"loss"``: the scored documents keep their M-step paths; the classifier learns each
  one's first M-step path, then routes the rest of the training documents (balanced).
* ``"classifier"``: the classifier learns each scored document's lowest-loss path, with no
  balance, and routes every training document, scored or not (balanced by the router's
  assignment on its costs).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .router import Router
from .shards import assign_in_batches

RESHARD_ASSIGNS = ("classifier", "loss")


def loss_assign(router: Router, losses: np.ndarray) -> list[list[int]]:
    """The M step: each document's ``top_k`` lowest-loss paths under the router's balance.

    ``losses`` is float ``[n, P]`` (finite); the result is ``Router.assign_costs(losses)``
    (capacity, ``top_k`` and soft/hard balance as in routing; paths best first).
    """
    losses = np.asarray(losses, np.float64)
    if losses.ndim != 2 or losses.shape[1] != router.num_paths:
        raise ValueError(f"losses must be [n, {router.num_paths}] (one column per path), got shape {losses.shape}")
    if not np.isfinite(losses).all():
        raise ValueError("losses contains NaN or inf; drop those documents before the M step")
    return router.assign_costs(losses)


def reshard_assignments(router: Router, docs: Any, scored: np.ndarray, losses: np.ndarray, *,
                        mode: str) -> tuple[Optional[list[list[int]]], dict[str, Any]]:
    """New training assignment of every document of ``docs`` from the losses of some.

    Args:
        router: fits (or keeps, on the documented fallback) its discriminative head here.
        docs: every training document (TokenDocs or a list of token-id sequences).
        scored: int ``[n]`` rows of ``docs`` whose ``losses`` ``[n, P]`` were measured.
        mode: one of :data:`RESHARD_ASSIGNS` (module docstring).

    Returns ``(assignments, info)``: per-document path lists (None when ``mode="classifier"``
    and no classifier could be fitted: the shards stay as they are) and what happened
    (``fitted``; ``label_is_lowest_loss``: share of scored documents whose first path is
    their lowest-loss one, i.e. how often balance overrode the loss).
    """
    if mode not in RESHARD_ASSIGNS:
        raise ValueError(f"mode must be one of {RESHARD_ASSIGNS}, got {mode!r}")
    scored = np.asarray(scored, np.int64)
    losses = np.asarray(losses, np.float64)
    if losses.shape[0] != scored.size:
        raise ValueError(f"losses has {losses.shape[0]} rows for {scored.size} scored documents")
    sample = [docs[int(i)] for i in scored]
    if mode == "classifier":
        fitted = router.fit_discriminative(losses, docs=sample)
        info = {"fitted": fitted}
        return (assign_in_batches(router, docs) if fitted else None), info
    m_step = loss_assign(router, losses)
    first = np.array([paths[0] for paths in m_step], np.int64)
    fitted = router.fit_discriminative(losses, docs=sample, labels=first)
    info = {"fitted": fitted, "label_is_lowest_loss": float(np.mean(first == losses.argmin(axis=1)))}
    assignments: list[list[int]] = [[] for _ in range(len(docs))]
    for i, paths in zip(scored.tolist(), m_step):
        assignments[i] = paths
    rest = np.setdiff1d(np.arange(len(docs)), scored)
    if rest.size:
        rest_docs = docs.select(rest) if hasattr(docs, "select") else [docs[int(i)] for i in rest]
        for i, paths in zip(rest.tolist(), assign_in_batches(router, rest_docs)):
            assignments[i] = paths
    return assignments, info


def compare_assignments(new: Sequence[Sequence[int]], old: Sequence[Sequence[int]]) -> dict[str, float]:
    """How much a re-shard moved: ``reassigned`` (share of documents whose set of paths
    changed) and ``agreement`` (share of path memberships kept, ``|new ∩ old| / |new|``)."""
    if len(new) != len(old):
        raise ValueError(f"assignments of {len(new)} and {len(old)} documents cannot be compared")
    if not len(new):
        return {"reassigned": 0.0, "agreement": 1.0}
    changed = kept = total = 0
    for a, b in zip(new, old):
        sa, sb = set(map(int, a)), set(map(int, b))
        changed += sa != sb
        kept += len(sa & sb)
        total += len(sa)
    return {"reassigned": changed / len(new), "agreement": kept / max(1, total)}


def mean_assigned_loss(assignments: Sequence[Sequence[int]], losses: np.ndarray) -> float:
    """Mean over documents of their mean loss on their assigned paths (the EM objective)."""
    losses = np.asarray(losses, np.float64)
    if losses.shape[0] != len(assignments) or not len(assignments):
        raise ValueError(f"need one assignment per loss row, got {len(assignments)} for {losses.shape[0]}")
    return float(np.mean([losses[i, list(p)].mean() for i, p in enumerate(assignments)]))


__all__ = ["RESHARD_ASSIGNS", "loss_assign", "reshard_assignments", "compare_assignments", "mean_assigned_loss"]
