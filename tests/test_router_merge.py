"""Routing by merged clusters (method="merge") and the prompt classifier, as specification.

Fixed seeds throughout (faiss's property-test style): each property is checked on several
seeded corpora where the right answer is known by construction.
"""
from __future__ import annotations

import numpy as np
import pytest

from dipaco.run.fingerprint import _matches
from router import Router, routing_report
from router.methods.merge import fit_merge, merge_costs, ward_groups
from router.synthetic import hierarchical_corpus, topic_corpus

SEEDS = (0, 1, 2)


# ----------------------------------------------------------------------------- ward_groups
def test_ward_merges_the_nearest_clusters_first():
    c = np.array([[0.0, 0.0], [0.1, 0.0], [5.0, 5.0], [5.1, 5.0], [0.0, 9.0]], np.float32)
    assert ward_groups(c, np.ones(5), 3).tolist() == [0, 0, 1, 1, 2]
    assert ward_groups(c, np.ones(5), 5).tolist() == [0, 1, 2, 3, 4]  # k = M: nothing merges
    assert ward_groups(c, np.ones(5), 1).tolist() == [0] * 5


def test_ward_weighs_clusters_by_size():
    # B sits between A and C, a little nearer A; Ward's cost n_x n_y / (n_x + n_y) d^2
    # makes merging the heavy A with B dearer than merging the light C with B
    c = np.array([[0.0], [1.0], [2.2]], np.float32)
    assert ward_groups(c, np.array([1.0, 1.0, 1.0]), 2).tolist() == [0, 0, 1]
    assert ward_groups(c, np.array([1000.0, 1.0, 1.0]), 2).tolist() == [0, 1, 1]


def test_ward_refuses_more_groups_than_clusters():
    with pytest.raises(ValueError, match="cannot merge 2 clusters into 3 groups"):
        ward_groups(np.zeros((2, 3), np.float32), np.ones(2), 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_ward_recovers_blobs_split_into_many_fine_centroids(seed):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(3, 8)) * 10
    fine = np.concatenate([c + rng.normal(size=(int(rng.integers(3, 9)), 8)) * 0.3 for c in centres])
    owner = np.argmin(((fine[:, None] - centres[None]) ** 2).sum(-1), axis=1)
    groups = ward_groups(fine.astype(np.float32), rng.integers(1, 50, size=len(fine)).astype(float), 3)
    # the partition is the blobs' (group ids are arbitrary)
    assert len({(o, g) for o, g in zip(owner, groups)}) == 3


# ----------------------------------------------------------------------------- fit_merge
@pytest.mark.parametrize("grid", [[2], [4], [2, 2], [4, 4], [2, 1, 3]])
def test_fit_merge_gives_every_path_a_sorted_set_of_fine_clusters(grid):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 6)).astype(np.float32)
    p = int(np.prod(grid))
    cents, paths = fit_merge(x, grid, max(p, 24), seed=0)
    assert cents.shape[0] == paths.shape[0] >= max(p, 24) and cents.dtype == np.float32
    assert (np.diff(paths) >= 0).all() and np.array_equal(np.unique(paths), np.arange(p))


def test_fit_merge_splits_a_node_with_fewer_fine_clusters_than_children():
    # fine_clusters = P on a skewed corpus: Ward leaves a level-0 group with one fine
    # cluster, which must still feed K_1 paths
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(size=(500, 4)), rng.normal(size=(20, 4)) + 30]).astype(np.float32)
    cents, paths = fit_merge(x, [2, 2], 4, seed=0)
    assert np.array_equal(np.unique(paths), np.arange(4))


def test_fit_merge_refuses_too_few_fine_clusters():
    with pytest.raises(ValueError, match="fine_clusters=3 must lie in \\[4, 100\\]"):
        fit_merge(np.zeros((100, 2), np.float32), [2, 2], 3)


def test_merge_costs_are_the_distance_to_the_nearest_fine_centroid_of_each_path():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 5)).astype(np.float32)
    cents = rng.normal(size=(7, 5)).astype(np.float32)
    paths = np.array([0, 0, 1, 2, 2, 2, 3])
    d = ((x[:, None] - cents[None]) ** 2).sum(-1)
    want = np.stack([d[:, paths == p].min(axis=1) for p in range(4)], axis=1)
    np.testing.assert_allclose(merge_costs(x, cents, paths, 4), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_merge_router_recovers_a_hierarchy_with_modules_shared_by_siblings(seed):
    docs, supers, leaves = hierarchical_corpus(2, 2, super_rate=0.6, docs_per_topic=60, seed=seed)
    r = Router.fit(docs, [2, 2], method="merge", fine_clusters=16, seed=seed)
    best = r.route_batch(docs)
    rep = routing_report(best, num_paths=4, labels=leaves, grid=[2, 2])
    assert rep["nmi"] >= 0.9, rep
    # the two paths under level-0 module m hold one super-topic
    level0 = routing_report(best, num_paths=4, labels=supers, grid=[2, 2])["levels"][0]
    assert level0["nmi"] >= 0.95, level0


@pytest.mark.parametrize("seed", SEEDS)
def test_merge_keeps_unequal_natural_clusters_whole_where_one_k_means_of_p_cuts_them(seed):
    # topics of 240, 240, 60 and 60 documents on 4 paths, one path per document, no cap
    # on the first choice: each topic's documents should all go to one path
    docs, topic = topic_corpus([240, 240, 60, 60], seed=seed)
    r = Router.fit(docs, [4], method="merge", fine_clusters=32, seed=seed)
    best = r.route_batch(docs)
    for t in range(4):
        assert np.bincount(best[topic == t]).max() >= 0.95 * (topic == t).sum(), (t, np.bincount(best[topic == t]))


def test_merge_router_saves_and_loads_with_its_cluster_paths(tmp_path):
    docs, _ = topic_corpus(4, seed=0)
    r = Router.fit(docs, [2, 2], method="merge", fine_clusters=12, top_k=2)
    r.save(tmp_path / "r")
    back = Router.load(tmp_path / "r")
    assert back.method == "merge" and back.routing.config.fine_clusters == 12
    np.testing.assert_array_equal(back.routing.cluster_paths, r.routing.cluster_paths)
    np.testing.assert_array_equal(back.costs(docs), r.costs(docs))
    assert back.manifest()["version"] == 4


def test_a_merge_router_without_cluster_paths_is_refused(tmp_path):
    docs, _ = topic_corpus(4, seed=0)
    r = Router.fit(docs, [2, 2], method="merge", fine_clusters=12)
    r.routing.cluster_paths = np.zeros_like(r.routing.cluster_paths)  # every fine cluster on path 0
    r.save(tmp_path / "r")
    with pytest.raises(ValueError, match="covering all 4 paths; refit the router"):
        Router.load(tmp_path / "r")


# ----------------------------------------------------------------------------- prompt classifier
@pytest.mark.parametrize("seed", SEEDS)
def test_prompt_classifier_routes_a_short_prefix_to_the_shard_of_its_document(seed):
    # documents are clustered on 48 tokens; their prompts carry 6. A classifier of the
    # 6-token view (half its tokens from a pool every topic shares) must send far more
    # prompts than chance (1/4) to the shard their document trained in, and at least as
    # many as nearest-centroid routing of the short view does.
    docs, _ = topic_corpus(4, docs_per_topic=80, length=(48, 80), shared_vocab=40, shared_rate=0.5, seed=seed)
    kw = dict(method="merge", fine_clusters=24, prefix_tokens=6, cluster_tokens=48, seed=seed)
    with_head = Router.fit(docs, [2, 2], prompt_classifier=True, **kw)
    without = Router.fit(docs, [2, 2], **kw)
    assert with_head.uses_discriminative and not without.uses_discriminative
    shard = np.array([a[0] for a in without.assign(docs)])
    agree_head = (with_head.route_batch(docs) == shard).mean()
    agree_centroids = (without.route_batch(docs) == shard).mean()
    assert agree_head >= 0.6 and agree_head >= agree_centroids, (agree_head, agree_centroids)


def test_prompt_classifier_survives_save_and_load(tmp_path):
    docs, _ = topic_corpus(4, seed=0)
    r = Router.fit(docs, [2, 2], method="product", prompt_classifier=True, prefix_tokens=8, cluster_tokens=16)
    r.save(tmp_path / "r")
    back = Router.load(tmp_path / "r")
    assert back.prompt_classifier and back.uses_discriminative
    np.testing.assert_array_equal(back.route_batch(docs), r.route_batch(docs))


def test_prompt_classifier_is_refused_with_random_routing():
    docs, _ = topic_corpus(4, seed=0)
    with pytest.raises(ValueError, match="prompt_classifier=False with method='random'"):
        Router.fit(docs, [2, 2], method="random", prompt_classifier=True)


# ----------------------------------------------------------------------------- run directories
def test_a_fingerprint_from_before_the_merge_options_matches_them_off():
    want = {"router.method": "product", "router.fine_clusters": None, "router.prompt_classifier": False}
    old = {"router.method": "product"}
    assert _matches(old, want)
    assert not _matches(old, dict(want, **{"router.prompt_classifier": True}))
    assert not _matches(old, dict(want, **{"router.fine_clusters": 64}))
