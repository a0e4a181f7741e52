"""Routed evaluation: perplexity of held-out documents, one path per document (or window).

The rule, shared by the job's evaluation and ``dipaco-infer score`` so that the two
give the same numbers:

* a document is cut to its first ``seq_len + 1`` tokens (one forward pass);
* its first ``prefix_tokens`` tokens choose the path and carry **no loss** (the DiPaCo
  paper's protocol: the router has seen them);
* with ``reroute_every=W`` the target token at document position ``j`` is scored by the
  path of window ``j // W`` from ``router.reroute_windows`` — the same rule inference
  uses when it re-routes while generating;
* a document with no token after its prefix is skipped and counted.

``whole_documents=True`` is the long protocol (closer to the DiPaCo paper's 2,048-token
evaluation): the document is not cut; routing (once, or every W tokens by the same rule)
is decided on the whole document, then it is scored in consecutive windows of
``seq_len`` target tokens. The model's rotary positions stop at ``max_seq_len``, so a
window carries nothing across from the previous one: the first targets of each window
see a short context. Every target after the prefix is scored exactly once.

Documents are grouped by path, so each path's model is fetched once (a path-at-a-time
loader keeps memory to one path).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from dipaco.runtime.device import model_device, to_device
from dipaco.rounds.learner import lm_loss
from dipaco.runtime.progress import progress_bar


@dataclass
class ScoredDoc:
    """One document prepared for scoring."""

    tokens: np.ndarray  # [n] int64, n ≤ seq_len + 1
    token_paths: np.ndarray  # [n] path scoring each target position (−1 inside the prefix)
    window: Optional[int] = None  # long protocol: which window of its document (0 = first)


def plan_documents(
    docs: Sequence[Sequence[int]],
    *,
    seq_len: int,
    prefix_tokens: int,
    route_batch: Callable[[list[np.ndarray]], np.ndarray],
    reroute_windows: Optional[Callable[[np.ndarray, int], list[int]]] = None,
    reroute_every: Optional[int] = None,
    whole_documents: bool = False,
) -> tuple[list[ScoredDoc], int]:
    """Cut documents (unless ``whole_documents``) and decide which path scores each target
    token; return (docs, skipped)."""
    cut = [np.asarray(d if whole_documents else d[: seq_len + 1], dtype=np.int64) for d in docs]
    keep = [t for t in cut if len(t) > prefix_tokens]
    skipped = len(cut) - len(keep)
    planned: list[ScoredDoc] = []
    if not keep:
        return planned, skipped
    if reroute_every is None:
        paths = route_batch([t[:prefix_tokens] for t in keep])
    for i, t in enumerate(keep):
        token_paths = np.full(len(t), -1, dtype=np.int64)
        if reroute_every is None:
            token_paths[prefix_tokens:] = int(paths[i])
        else:
            assert reroute_windows is not None
            windows = reroute_windows(t, reroute_every)
            for j in range(prefix_tokens, len(t)):
                token_paths[j] = int(windows[j // reroute_every])
        planned.append(ScoredDoc(tokens=t, token_paths=token_paths))
    return planned, skipped


def split_windows(planned: Sequence[ScoredDoc], window: int) -> list[ScoredDoc]:
    """Each document as consecutive pieces of ``window`` targets (``window + 1`` tokens).

    Piece ``k`` holds tokens ``[k·window, (k+1)·window]``: its first token is input only
    (it was the previous piece's last target), so its path is −1. Pieces with no scored
    target (inside the prefix) are dropped.
    """
    out: list[ScoredDoc] = []
    for d in planned:
        for start in range(0, len(d.tokens) - 1, window):
            paths = d.token_paths[start : start + window + 1].copy()
            paths[0] = -1
            if (paths >= 0).any():
                out.append(ScoredDoc(tokens=d.tokens[start : start + window + 1], token_paths=paths,
                                     window=start // window))
    return out


def padded_batch(docs: Sequence[np.ndarray], scored: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token inputs and targets for documents of different lengths.

    ``docs[b]`` holds a document's tokens; ``scored[b]`` (bool, one per target position,
    ``len(docs[b]) - 1``) says which targets carry loss. Padding and unscored targets are
    -100 (ignored by ``lm_loss``). Returns ``x, y`` of shape [B, T], T = longest − 1.
    """
    T = max(1, max(len(t) for t in docs) - 1)
    x = torch.zeros(len(docs), T, dtype=torch.long)
    y = torch.full((len(docs), T), -100, dtype=torch.long)
    for b, (t, keep) in enumerate(zip(docs, scored)):
        n = len(t) - 1
        if n <= 0:
            continue
        x[b, :n] = torch.from_numpy(t[:-1])
        y[b, :n] = torch.where(torch.from_numpy(np.asarray(keep, dtype=bool)), torch.from_numpy(t[1:]),
                               torch.tensor(-100))
    return x, y


@torch.no_grad()
def score_documents(
    planned: Sequence[ScoredDoc],
    get_model: Callable[[int], nn.Module],
    *,
    batch_size: int = 16,
    progress: bool = False,
) -> dict:
    """Sum next-token NLL per path over the planned documents; return the perplexity report.

    Each path's batches go to that path's device (where its parameters are).
    """
    by_path: dict[int, list[int]] = defaultdict(list)
    for i, d in enumerate(planned):
        for p in np.unique(d.token_paths[d.token_paths >= 0]):
            by_path[int(p)].append(i)
    nll = defaultdict(float)
    ntok = defaultdict(int)
    ndoc = defaultdict(int)
    # long protocol: the first window of each document (where its routing prefix is) apart
    # from the later ones, which a path routed once sees far from what chose it
    wnll, wtok = defaultdict(float), defaultdict(int)
    items = sorted(by_path.items())
    bar = progress_bar(progress, sum(len(v) for _, v in items), "evaluate", "doc")
    for path_id, idxs in items:
        model = get_model(path_id)
        model.eval()
        device = model_device(model)
        ndoc[path_id] += len(idxs)
        for start in range(0, len(idxs), batch_size):
            chunk = [planned[i] for i in idxs[start : start + batch_size]]
            # target position j-1 predicts document token j; score only this path's tokens
            x, y = padded_batch([d.tokens for d in chunk], [d.token_paths[1:] == path_id for d in chunk])
            x, y = to_device(x, device), to_device(y, device)
            losses = lm_loss(model(x), y, reduction="none")  # [B·T], 0 where ignored
            doc_nll = losses.double().view(y.shape).sum(1).cpu()  # [B]
            doc_tok = (y != -100).sum(1).cpu()
            nll[path_id] += float(doc_nll.sum())
            ntok[path_id] += int(doc_tok.sum())
            if chunk[0].window is not None:
                for b, d in enumerate(chunk):
                    key = "first_window" if d.window == 0 else "later_windows"
                    wnll[key] += float(doc_nll[b])
                    wtok[key] += int(doc_tok[b])
            if bar is not None:
                bar.update(len(chunk))
    if bar is not None:
        bar.close()
    total_nll = sum(nll.values())
    total_tok = sum(ntok.values())
    per_path = {
        str(p): {"ppl": _ppl(nll[p], ntok[p]), "loss": nll[p] / max(1, ntok[p]),
                 "num_tokens": ntok[p], "num_documents": ndoc[p]}
        for p in sorted(ntok)
    }
    report = {
        "ppl": _ppl(total_nll, total_tok),
        "loss": total_nll / max(1, total_tok),
        "num_tokens": total_tok,
        "num_documents": len(planned),
        "per_path": per_path,
    }
    if wtok:
        report["by_window"] = {k: {"ppl": _ppl(wnll[k], wtok[k]), "loss": wnll[k] / max(1, wtok[k]),
                                   "num_tokens": wtok[k]} for k in ("first_window", "later_windows") if k in wtok}
    return report


def _ppl(nll: float, n: int) -> float:
    if not n:
        return float("nan")
    try:
        return float(math.exp(nll / n))
    except OverflowError:  # a diverged model: report inf, never crash the evaluation
        return float("inf")


def evaluate_routed(
    docs: Sequence[Sequence[int]],
    get_model: Callable[[int], nn.Module],
    *,
    seq_len: int,
    prefix_tokens: int,
    route_batch: Callable[[list[np.ndarray]], np.ndarray],
    reroute_windows: Optional[Callable[[np.ndarray, int], list[int]]] = None,
    reroute_every: Optional[int] = None,
    batch_size: int = 16,
    progress: bool = False,
    whole_documents: bool = False,
) -> dict:
    """Routed perplexity of ``docs`` (see the module docstring for the rule).

    ``whole_documents``: the long protocol, ``seq_len`` being the window length.
    """
    planned, skipped = plan_documents(
        docs, seq_len=seq_len, prefix_tokens=prefix_tokens, route_batch=route_batch,
        reroute_windows=reroute_windows, reroute_every=reroute_every, whole_documents=whole_documents)
    pieces = split_windows(planned, seq_len) if whole_documents else planned
    report = score_documents(pieces, get_model, batch_size=batch_size, progress=progress)
    report["num_documents"] = len(planned)
    report["num_windows"] = len(pieces)
    report["skipped_short"] = skipped
    report["reroute_every"] = reroute_every
    return report


def evaluate_single(
    docs: Sequence[Sequence[int]],
    model: nn.Module,
    *,
    seq_len: int,
    prefix_tokens: int,
    batch_size: int = 16,
    whole_documents: bool = False,
) -> dict:
    """Perplexity of one model on every document (dense baselines), same token rule."""
    return evaluate_routed(
        docs, lambda _p: model, seq_len=seq_len, prefix_tokens=prefix_tokens,
        route_batch=lambda prefixes: np.zeros(len(prefixes), dtype=np.int64), batch_size=batch_size,
        whole_documents=whole_documents)


@torch.no_grad()
def per_document_losses(
    docs: Sequence[Sequence[int]],
    model: nn.Module,
    *,
    seq_len: int,
    prefix_tokens: int,
    batch_size: int = 16,
) -> np.ndarray:
    """Mean next-token loss of each document under ``model`` (same token rule as above).

    Documents with no token after the prefix get ``nan``. Used to label each document
    with the path that models it best (discriminative re-routing).
    """
    out = np.full(len(docs), np.nan, dtype=np.float64)
    model.eval()
    device = model_device(model)
    for start in range(0, len(docs), batch_size):
        chunk = [np.asarray(d[: seq_len + 1], dtype=np.int64) for d in docs[start : start + batch_size]]
        # the routing prefix carries no loss: targets before position prefix_tokens-1
        x, y = padded_batch(chunk, [np.arange(max(0, len(t) - 1)) >= prefix_tokens - 1 for t in chunk])
        losses = lm_loss(model(to_device(x, device)), to_device(y, device), reduction="none").view(y.shape)
        counts = (y != -100).sum(1)
        sums = losses.double().sum(1).cpu()  # [B]
        for b in range(len(chunk)):
            if counts[b] > 0:
                out[start + b] = float(sums[b] / counts[b])
    return out
