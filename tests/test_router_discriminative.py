"""Discriminative re-routing: a classifier learns the path that measured losses prefer."""
from __future__ import annotations

import numpy as np
import pytest

from router import Router
from router.discriminative import UNSEEN_PATH_COST, fit_discriminative
from router.synthetic import topic_corpus


def planted_losses(labels: np.ndarray, target: np.ndarray, num_paths: int, seed: int) -> np.ndarray:
    """Loss 1.0 on the planted path of each document's topic, ~2.0 (noisy) elsewhere."""
    rng = np.random.default_rng(seed)
    losses = 2.0 + 0.1 * rng.standard_normal((labels.size, num_paths))
    losses[np.arange(labels.size), target[labels]] = 1.0
    return losses


@pytest.fixture(scope="module")
def setup():
    train, train_y = topic_corpus(8, docs_per_topic=30, seed=0)
    test, test_y = topic_corpus(8, docs_per_topic=20, seed=7)
    router = Router.fit(train, [2, 4], method="flat", seed=0)
    # A known path per topic that k-means has no way to guess (its cluster ids are arbitrary).
    target = np.array([5, 2, 7, 0, 3, 6, 1, 4])
    return router, train, train_y, test, test_y, target


def test_discriminative_learns_a_planted_mapping_and_beats_kmeans(tmp_path, setup):
    router, train, train_y, test, test_y, target = setup
    kmeans_acc = (router.route_batch(test) == target[test_y]).mean()
    kmeans_costs = router.costs(test)
    assert router.fit_discriminative(planted_losses(train_y, target, 8, seed=1), train)
    assert router.uses_discriminative
    disc_acc = (router.route_batch(test) == target[test_y]).mean()
    assert disc_acc >= 0.95, disc_acc
    assert disc_acc > kmeans_acc + 0.3, (disc_acc, kmeans_acc)
    # k-means stays available as the fallback.
    np.testing.assert_array_equal(router.method_costs(test), kmeans_costs)
    # The head survives save/load (arrays, no pickle).
    router.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r")
    assert loaded.uses_discriminative
    np.testing.assert_allclose(loaded.costs(test), router.costs(test))
    with np.load(tmp_path / "r" / "discriminative.npz", allow_pickle=False) as z:
        assert set(z.files) == {"coef", "intercept", "classes"}
    router.head = None


def test_fallback_keeps_kmeans_when_one_path_wins_everything(setup):
    router, train, train_y, test, _, _ = setup
    losses = np.full((len(train), 8), 2.0)
    losses[:, 3] = 1.0
    before = router.costs(test)
    with pytest.warns(UserWarning, match="k-means"):
        assert not router.fit_discriminative(losses, train)
    assert not router.uses_discriminative
    np.testing.assert_array_equal(router.costs(test), before)
    with pytest.warns(UserWarning, match="min_docs"):
        assert fit_discriminative(np.zeros((3, 4)), np.eye(3, 8)[:, :8], min_docs=8) is None


def test_binary_problem_and_unseen_paths():
    rng = np.random.default_rng(0)
    x = np.vstack([rng.normal(-1, 0.3, (20, 2)), rng.normal(1, 0.3, (20, 2))]).astype(np.float32)
    losses = np.full((40, 5), 3.0)
    losses[:20, 1] = 1.0
    losses[20:, 4] = 1.0
    head = fit_discriminative(x, losses)
    c = head.costs(x, tie_break=np.tile(np.arange(5.0), (40, 1)))
    assert c.shape == (40, 5)
    assert (c[:20].argmin(1) == 1).all() and (c[20:].argmin(1) == 4).all()
    # Never-seen paths cost more than any seen path, ordered by the tie-break.
    assert (c[:, [0, 2, 3]] >= UNSEEN_PATH_COST).all()
    assert (np.diff(c[:, [0, 2, 3]], axis=1) > 0).all()


def test_bad_losses_are_refused(setup):
    router, train, *_ = setup
    with pytest.raises(ValueError, match="losses"):
        router.fit_discriminative(np.zeros((len(train), 3)), train)
    with pytest.raises(ValueError, match="exactly one"):
        router.fit_discriminative(np.zeros((len(train), 8)))
