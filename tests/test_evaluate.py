"""The evaluation's token rule: padding, the unscored routing prefix, per-path sums.

Both scorers (routed perplexity, per-document losses for discriminative re-routing)
build their batches with ``padded_batch``; these tests pin the rule and check that the
two agree on the same documents.
"""
from __future__ import annotations

import numpy as np
import torch

from dipaco.rounds.evaluate import evaluate_single, padded_batch, per_document_losses


class _Bigram(torch.nn.Module):
    """A deterministic stand-in for a path model: logits depend on the current token."""

    def __init__(self, vocab: int = 17) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x]  # [B, T] → [B, T, V]


def test_padded_batch_pads_and_masks() -> None:
    x, y = padded_batch([np.array([1, 2, 3]), np.array([4, 5]), np.array([6])],
                        [np.array([True, False]), np.array([True]), np.array([], dtype=bool)])
    assert x.tolist() == [[1, 2], [4, 0], [0, 0]]
    assert y.tolist() == [[2, -100], [5, -100], [-100, -100]]


def test_per_document_losses_agree_with_the_routed_evaluation() -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 17, size=int(n)) for n in rng.integers(2, 40, size=23)]
    model = _Bigram()
    seq_len, prefix = 24, 4
    per_doc = per_document_losses(docs, model, seq_len=seq_len, prefix_tokens=prefix, batch_size=5)
    report = evaluate_single(docs, model, seq_len=seq_len, prefix_tokens=prefix, batch_size=7)
    # tokens scored per document: targets at positions prefix-1 .. min(len, seq_len+1)-2
    counts = np.array([max(0, min(len(d), seq_len + 1) - prefix) for d in docs])
    assert np.isnan(per_doc[counts == 0]).all() and not np.isnan(per_doc[counts > 0]).any()
    assert report["num_tokens"] == counts.sum() > 0
    expected = float((per_doc[counts > 0] * counts[counts > 0]).sum() / counts.sum())
    assert np.isclose(report["loss"], expected, rtol=1e-6)


def test_evaluated_rows_spread_over_the_split() -> None:
    """The evaluation's sample of a split: every row when it fits, else rows spread evenly
    (a split is sorted by domain: the first rows would be one or two domains)."""
    from dipaco.job.prepare import evaluated_rows

    assert evaluated_rows(5, None).tolist() == [0, 1, 2, 3, 4]
    assert evaluated_rows(5, 400).tolist() == [0, 1, 2, 3, 4]
    rows = evaluated_rows(1653, 400)
    assert len(rows) == len(set(rows.tolist())) == 400 and rows[0] == 0 and rows[-1] < 1653
    assert np.all(np.diff(rows) >= 1) and np.all(np.diff(rows) <= 5)  # no gap: every stretch sampled
    # five domains in corpus order, sized like the multidomain validation split: each keeps its share
    labels = np.repeat(["python", "c_cpp", "prose", "reference_docs", "structured_data"], [214, 556, 62, 725, 96])
    picked = labels[rows]
    for name, size in zip(["python", "c_cpp", "prose", "reference_docs", "structured_data"], [214, 556, 62, 725, 96]):
        assert abs((picked == name).sum() - 400 * size / 1653) <= 1
