"""EM re-sharding's M step (router/em.py): balanced assignment by per-path losses."""
from __future__ import annotations

import numpy as np
import pytest

from router import (
    Router,
    capacity_per_path,
    compare_assignments,
    expand_replicas,
    loss_assign,
    mean_assigned_loss,
    read_assignments,
    reshard_assignments,
    write_shards,
)
from router.synthetic import topic_corpus


@pytest.fixture(scope="module")
def corpus():
    docs, topics = topic_corpus(8, docs_per_topic=30, seed=0)
    return docs, topics


def fitted(docs, *, top_k: int = 1, capacity_factor: float = 1.25, balance: str = "hard") -> Router:
    return Router.fit(docs, [2, 4], method="flat", seed=0, top_k=top_k, capacity_factor=capacity_factor,
                      balance=balance)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_m_step_respects_capacity_and_top_k(corpus, seed: int, top_k: int) -> None:
    docs, _ = corpus
    router = fitted(docs, top_k=top_k)
    rng = np.random.default_rng(seed)
    # skewed losses: most documents prefer path 0, which cannot hold them all
    losses = rng.random((100, 8)) + np.where(np.arange(8) == 0, -1.0, 0.0)
    shards = loss_assign(router, losses)
    assert all(len(p) == top_k == len(set(p)) for p in shards)
    sizes = np.bincount([q for p in shards for q in p], minlength=8)
    assert sizes.max() <= capacity_per_path(100, 8, top_k, 1.25)
    assert (sizes > 0).all()  # no path starved to nothing
    # each document's paths best first by its own losses
    assert all(list(p) == sorted(p, key=lambda q, i=i: losses[i, q]) for i, p in enumerate(shards))
    assert loss_assign(router, losses) == shards  # deterministic


@pytest.mark.parametrize("top_k", [1, 2])
def test_m_step_takes_the_lowest_losses_when_capacity_allows(corpus, top_k: int) -> None:
    docs, _ = corpus
    rng = np.random.default_rng(3)
    losses = rng.random((64, 8))
    roomy = fitted(docs, top_k=top_k, capacity_factor=8.0)  # capacity >= every document
    want = np.argsort(losses, axis=1)[:, :top_k].tolist()
    assert loss_assign(roomy, losses) == want
    # balanced preferences fit under the default capacity too: each path is someone's best
    best = np.repeat(np.arange(8), 8)
    planted = np.full((64, 8), 2.0)
    planted[np.arange(64), best] = 1.0
    assert [p[0] for p in loss_assign(fitted(docs), planted)] == best.tolist()


def test_m_step_refuses_bad_losses(corpus) -> None:
    router = fitted(corpus[0])
    with pytest.raises(ValueError, match=r"\[n, 8\]"):
        loss_assign(router, np.zeros((4, 3)))
    with pytest.raises(ValueError, match="NaN"):
        loss_assign(router, np.full((4, 8), np.nan))


def planted(topics: np.ndarray, target: np.ndarray, seed: int) -> np.ndarray:
    losses = 2.0 + 0.1 * np.random.default_rng(seed).standard_normal((topics.size, 8))
    losses[np.arange(topics.size), target[topics]] = 1.0
    return losses


def test_loss_mode_keeps_the_scored_documents_m_step(corpus) -> None:
    docs, topics = corpus
    target = np.array([5, 2, 7, 0, 3, 6, 1, 4])
    scored = np.arange(0, len(docs), 2)  # half the documents were scored
    losses = planted(topics[scored], target, seed=1)
    router = fitted(docs)
    shards, info = reshard_assignments(router, docs, scored, losses, mode="loss")
    assert info["fitted"] and router.uses_discriminative
    assert info["label_is_lowest_loss"] == 1.0  # one topic per path: balance never overrides
    m_step = loss_assign(router, losses)
    assert [shards[i] for i in scored] == m_step
    # the unscored half is routed by the classifier learnt from the M step: same topics, same paths
    rest = np.setdiff1d(np.arange(len(docs)), scored)
    assert np.mean([shards[i][0] == target[topics[i]] for i in rest]) >= 0.95
    again, _ = reshard_assignments(fitted(docs), docs, scored, losses, mode="loss")
    assert again == shards  # deterministic


def test_loss_mode_balances_where_the_classifier_mode_would_not(corpus) -> None:
    docs, topics = corpus
    target = np.array([0, 0, 0, 0, 1, 2, 3, 4])  # half the documents' best path is 0
    everyone = np.arange(len(docs))
    losses = planted(topics, target, seed=2)
    cap = capacity_per_path(len(docs), 8, 1, 1.25)
    loss_shards, info = reshard_assignments(fitted(docs), docs, everyone, losses, mode="loss")
    sizes = np.bincount([p[0] for p in loss_shards], minlength=8)
    assert sizes.max() <= cap and sizes[0] == cap  # path 0 full; 120 - cap documents moved off it
    assert info["label_is_lowest_loss"] <= (cap + 120) / len(docs)
    clf_router = fitted(docs)
    clf_shards, info = reshard_assignments(clf_router, docs, everyone, losses, mode="classifier")
    assert info == {"fitted": True}
    assert np.bincount([p[0] for p in clf_shards], minlength=8).max() <= cap  # balanced by assignment
    # ... but the classifier itself learnt the unbalanced argmin: path 0 for half the documents
    assert np.mean(clf_router.route_batch(docs) == 0) >= 0.45


def test_classifier_mode_keeps_the_shards_when_no_classifier_fits(corpus) -> None:
    docs, _ = corpus
    losses = np.full((len(docs), 8), 2.0)
    losses[:, 3] = 1.0
    with pytest.warns(UserWarning, match="k-means"):
        shards, info = reshard_assignments(fitted(docs), docs, np.arange(len(docs)), losses, mode="classifier")
    assert shards is None and info == {"fitted": False}
    with pytest.raises(ValueError, match="mode"):
        reshard_assignments(fitted(docs), docs, np.arange(len(docs)), losses, mode="kmeans")


def test_compare_and_objective() -> None:
    new, old = [[0, 1], [2, 3], [1, 0]], [[1, 0], [2, 0], [3, 2]]
    assert compare_assignments(new, old) == {"reassigned": pytest.approx(2 / 3), "agreement": pytest.approx(3 / 6)}
    losses = np.array([[1.0, 3.0, 0, 0], [0, 0, 2.0, 4.0], [5.0, 1.0, 0, 0]])
    assert mean_assigned_loss(new, losses) == pytest.approx((2.0 + 3.0 + 3.0) / 3)
    with pytest.raises(ValueError, match="compared"):
        compare_assignments(new, old[:2])


@pytest.mark.parametrize("replicas", [1, 3])
def test_read_assignments_inverts_write_shards(tmp_path, replicas: int) -> None:
    docs = [[i, i + 1, i + 2] for i in range(20)]
    rng = np.random.default_rng(0)
    paths = [sorted(rng.choice(4, size=2, replace=False).tolist()) for _ in docs]
    write_shards(docs, expand_replicas(paths, replicas, seed=0), 4 * replicas, tmp_path / "s")
    assert read_assignments(tmp_path / "s", replicas) == paths
