"""Synthetic token-id corpora with known topics, for tests, benchmarks and smoke runs."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def topic_corpus(
    sizes: Sequence[int] | int = 8,
    *,
    docs_per_topic: int = 40,
    vocab_per_topic: int = 50,
    length: tuple[int, int] = (16, 80),
    shared_vocab: int = 0,
    shared_rate: float = 0.0,
    seed: int = 0,
) -> tuple[list[np.ndarray], np.ndarray]:
    """Documents drawn from topics with disjoint token vocabularies.

    Topic t uses token ids ``[shared_vocab + t*vocab_per_topic, ... + vocab_per_topic)``
    with a Zipf-like distribution (like real text); with ``shared_rate > 0`` each token
    is instead drawn from a common pool ``[0, shared_vocab)`` with that probability.

    Args:
        sizes: number of topics (each with ``docs_per_topic`` documents), or an explicit
            list of documents per topic (for skewed corpora).
        length: (min, max) document length in tokens (inclusive min, exclusive max).

    Returns:
        (documents as int64 arrays, topic label of each document), in topic order.
    """
    if isinstance(sizes, int):
        sizes = [docs_per_topic] * sizes
    if shared_rate > 0 and shared_vocab < 1:
        raise ValueError("shared_rate > 0 needs shared_vocab >= 1")
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab_per_topic + 1)
    weights /= weights.sum()
    docs: list[np.ndarray] = []
    labels: list[int] = []
    for t, count in enumerate(sizes):
        base = shared_vocab + t * vocab_per_topic
        for _ in range(int(count)):
            n = int(rng.integers(length[0], length[1]))
            toks = base + rng.choice(vocab_per_topic, size=n, p=weights)
            if shared_rate > 0:
                mask = rng.random(n) < shared_rate
                toks[mask] = rng.integers(0, shared_vocab, size=int(mask.sum()))
            docs.append(toks.astype(np.int64))
            labels.append(t)
    return docs, np.asarray(labels, np.int64)


def hierarchical_corpus(
    super_topics: int = 2,
    sub_topics: int = 4,
    *,
    docs_per_topic: int = 30,
    vocab_per_topic: int = 40,
    super_rate: float = 0.5,
    length: tuple[int, int] = (24, 64),
    shared_sub_topics: bool = False,
    seed: int = 0,
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """A two-level topic hierarchy: ``super_topics`` super-topics of ``sub_topics`` topics each.

    Each token of a document of topic (s, t) is drawn, with probability ``super_rate``,
    from super-topic s's vocabulary (shared by its sub-topics) and otherwise from topic
    (s, t)'s own vocabulary; all vocabularies are disjoint. Sibling topics are therefore
    closer to each other than to any topic of another super-topic. With
    ``shared_sub_topics`` sub-topic t's vocabulary is the same in every super-topic (a
    second factor across domains, e.g. a genre): topic (s, t) then mixes super-topic s and
    sub-topic t.

    Returns:
        (documents, super-topic label, leaf label ``s * sub_topics + t``), in leaf order.
    """
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, vocab_per_topic + 1)
    weights /= weights.sum()
    docs: list[np.ndarray] = []
    supers: list[int] = []
    leaves: list[int] = []
    for s in range(super_topics):
        super_base = s * vocab_per_topic
        for t in range(sub_topics):
            leaf = s * sub_topics + t
            leaf_base = (super_topics + (t if shared_sub_topics else leaf)) * vocab_per_topic
            for _ in range(docs_per_topic):
                n = int(rng.integers(length[0], length[1]))
                toks = leaf_base + rng.choice(vocab_per_topic, size=n, p=weights)
                shared = rng.random(n) < super_rate
                toks[shared] = super_base + rng.choice(vocab_per_topic, size=int(shared.sum()), p=weights)
                docs.append(toks.astype(np.int64))
                supers.append(s)
                leaves.append(leaf)
    return docs, np.asarray(supers, np.int64), np.asarray(leaves, np.int64)


__all__ = ["topic_corpus", "hierarchical_corpus"]
