"""Routing that matches module sharing (tree / grouped), soft balance, NMI per level."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from router import Router, balanced_assign, capacity_per_path, routing_report
from router.assign import _make_room
from router.synthetic import hierarchical_corpus, topic_corpus
from router.methods.grouped import grouped_layout
from router.methods.tree import fit_tree, tree_costs

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module", params=SEEDS)
def hierarchy(request):
    """4 well-separated super-topics of 4 topics each (30 documents per topic)."""
    docs, supers, leaves = hierarchical_corpus(4, 4, super_rate=0.6, seed=request.param)
    return docs, supers, leaves, request.param


@pytest.fixture(scope="module")
def tree44(hierarchy):
    docs, _, _, seed = hierarchy
    return Router.fit(docs, [4, 4], method="tree", seed=seed, top_k=2)


# ----------------------------------------------------------------------------- tree
def test_tree_recovers_the_hierarchy(hierarchy, tree44):
    docs, supers, leaves, _ = hierarchy
    rep = routing_report(tree44.route_batch(docs), num_paths=16, labels=leaves, grid=[4, 4])
    level0 = routing_report(tree44.route_batch(docs), num_paths=16, labels=supers, grid=[4, 4])["levels"][0]
    assert level0["nmi"] >= 0.95 and level0["purity"] >= 0.97, level0
    assert rep["nmi"] >= 0.9, rep
    # paths sharing a level-0 module get one super-topic: each module's documents are one super-topic
    best = tree44.route_batch(docs)
    for module in range(4):
        mine = supers[best // 4 == module]
        assert mine.size and np.bincount(mine).max() >= 0.95 * mine.size, (module, np.bincount(mine))


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_aligns_children_so_a_level1_module_serves_one_sub_topic_in_every_super_topic(seed):
    # sub-topic t's vocabulary is shared by all super-topics: module j of level 1 must get one t
    docs, supers, leaves = hierarchical_corpus(2, 2, super_rate=0.6, shared_sub_topics=True, seed=seed)
    best = Router.fit(docs, [2, 2], method="tree", seed=seed).route_batch(docs)
    level1 = routing_report(best, num_paths=4, labels=leaves % 2, grid=[2, 2])["levels"][1]
    assert level1["nmi"] >= 0.9 and level1["purity"] >= 0.97, level1


def test_tree_costs_are_the_sum_of_node_distances(hierarchy, tree44):
    docs = hierarchy[0][:25]
    feats = tree44.features(docs)
    c0, c1 = tree44.routing.centroids
    assert c0.shape == (4, feats.shape[1]) and c1.shape == (16, feats.shape[1])
    d0 = ((feats[:, None, :] - c0[None]) ** 2).sum(-1)
    d1 = ((feats[:, None, :] - c1[None]) ** 2).sum(-1)
    costs = tree44.costs(docs)
    for a in range(4):
        for b in range(4):
            np.testing.assert_allclose(costs[:, 4 * a + b], d0[:, a] + d1[:, 4 * a + b], rtol=1e-4, atol=1e-4)


def test_tree_skips_levels_with_one_module_and_is_deterministic():
    docs, _ = topic_corpus(4, docs_per_topic=20, seed=0)
    r = Router.fit(docs, [1, 4], method="tree", seed=0)
    assert r.routing.centroids[0].shape[1] == 0  # K = 1: no node, no cost
    flat = Router.fit(docs, [4], method="tree", seed=0)
    np.testing.assert_allclose(r.costs(docs), flat.costs(docs), rtol=1e-6)
    again = Router.fit(docs, [1, 4], method="tree", seed=0)
    np.testing.assert_array_equal(r.costs(docs), again.costs(docs))


def test_tree_node_with_too_few_members_still_gives_every_path_documents():
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    cents = fit_tree(x, [2, 4], niter=5, seed=0)  # a level-0 node gets fewer than 4 points
    assert [c.shape for c in cents] == [(2, 3), (8, 3)]
    assert np.isfinite(tree_costs(x, [2, 4], cents)).all()
    shards = balanced_assign(tree_costs(x, [2, 4], cents))
    assert sorted(p for s in shards for p in s) == sorted(set(p for s in shards for p in s))


def test_balanced_tree_shards_stay_within_the_factor_and_topk_is_distinct(hierarchy, tree44):
    docs = hierarchy[0]
    shards = tree44.assign(docs)
    sizes = np.bincount([p for s in shards for p in s], minlength=16)
    assert sizes.max() <= capacity_per_path(len(docs), 16, 2, 1.25) and sizes.min() > 0
    assert all(len(s) == 2 and len(set(s)) == 2 for s in shards)
    paths, costs = tree44.route_topk(docs[:30], 3)
    assert all(len(set(row)) == 3 for row in paths.tolist())
    assert np.all(np.diff(costs, axis=1) >= 0)


def test_tree_save_load_round_trip(tmp_path, hierarchy, tree44):
    docs = hierarchy[0]
    tree44.save(tmp_path / "r")
    back = Router.load(tmp_path / "r", expected_grid=[4, 4])
    assert back.method == "tree" and back.balance == "hard"
    np.testing.assert_array_equal(back.costs(docs), tree44.costs(docs))
    assert back.assign(docs) == tree44.assign(docs)


def test_version_1_router_still_loads_and_unknown_version_is_refused(tmp_path):
    docs, _ = topic_corpus(4, docs_per_topic=20, seed=0)
    # a version 3 router (tests/golden/routers_v3) made into a version 1 one
    shutil.copytree(Path(__file__).parent / "golden" / "routers_v3" / "flat", tmp_path / "r")
    mpath = tmp_path / "r" / "manifest.json"
    m = json.loads(mpath.read_text())
    m["version"] = 1
    v3 = Router.load(tmp_path / "r")
    for key in ("balance", "soft_capacity_factor"):  # version 1 had neither
        del m[key]
    mpath.write_text(json.dumps(m))
    old = Router.load(tmp_path / "r")
    assert old.balance == "hard" and old.assign(docs) == v3.assign(docs)
    m["version"] = 99
    mpath.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="version 99.*re-run routing"):
        Router.load(tmp_path / "r")


# ----------------------------------------------------------------------------- grouped
def test_grouped_layout_puts_near_centroids_on_one_module():
    # 4 tight groups of 4 centroids, shuffled: each level-0 module must get one group
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((4, 8)) * 10
    cents = (np.repeat(centres, 4, axis=0) + rng.standard_normal((16, 8)) * 0.1).astype(np.float32)
    group = np.repeat(np.arange(4), 4)
    perm = rng.permutation(16)
    order = grouped_layout(cents[perm], [4, 4], seed=0)
    assert sorted(order.tolist()) == list(range(16))
    by_module = group[perm][order].reshape(4, 4)
    assert all(len(set(row)) == 1 for row in by_module.tolist()), by_module


def test_grouped_routes_paths_as_flat_does():
    docs, _, leaves = hierarchical_corpus(4, 4, super_rate=0.6, seed=0)
    seed = 0
    flat = Router.fit(docs, [4, 4], method="flat", seed=seed)
    grouped = Router.fit(docs, [4, 4], method="grouped", seed=seed)
    a = routing_report(flat.route_batch(docs), num_paths=16, labels=leaves)
    b = routing_report(grouped.route_batch(docs), num_paths=16, labels=leaves)
    assert a["nmi"] == pytest.approx(b["nmi"], abs=1e-9)  # same clusters, other cells


# ----------------------------------------------------------------------------- soft balance
def skewed():
    """One natural cluster of 1.6x the mean shard size and three smaller ones (4 paths)."""
    docs, labels = topic_corpus([96, 48, 48, 48], seed=0)
    return docs, labels


def test_soft_balance_keeps_a_natural_cluster_the_hard_cap_splits():
    docs, labels = skewed()
    r = Router.fit(docs, [4], method="flat", seed=0)
    big = np.bincount(r.route_batch(docs)).argmax()
    hard = np.bincount([s[0] for s in r.assign(docs, balance="hard")], minlength=4)
    soft = r.assign(docs, balance="soft")
    assert hard[big] == capacity_per_path(len(docs), 4, 1, 1.25) < 96  # the hard cap splits it
    # the soft factor (2.0) allows 1.6x: every document of the big topic stays on its path
    assert all(s[0] == big for s, lab in zip(soft, labels) if lab == 0)
    rep = routing_report(soft, num_paths=4, labels=labels)
    assert rep["nmi"] >= routing_report(r.assign(docs, balance="hard"), num_paths=4, labels=labels)["nmi"]


@pytest.mark.parametrize("seed", range(30))
def test_soft_balance_stays_within_the_soft_factor_and_above_the_hard_cap_only_with_own_documents(seed):
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(20, 150)), int(rng.integers(2, 9))
    top_k = int(rng.integers(1, min(p, 3) + 1))
    centroids = rng.standard_normal((p, 4))
    skew = rng.dirichlet(np.full(p, 0.7))  # uneven natural clusters
    x = centroids[rng.choice(p, n, p=skew)] * 0.8 + rng.standard_normal((n, 4)) * 0.6
    costs = ((x[:, None, :] - centroids[None]) ** 2).sum(-1)
    shards = balanced_assign(costs, top_k=top_k, capacity_factor=1.25, balance="soft", soft_capacity_factor=2.0)
    assert all(len(s) == top_k and len(set(s)) == top_k for s in shards)
    sizes = np.bincount([q for s in shards for q in s], minlength=p)
    natural = np.bincount(np.argsort(costs, axis=1, kind="stable")[:, :top_k].ravel(), minlength=p)
    hard_cap = capacity_per_path(n, p, top_k, 1.25)
    # a path goes over the hard cap only as far as its own natural load, never past the soft factor
    assert np.all(sizes <= np.maximum(hard_cap, np.minimum(natural, capacity_per_path(n, p, top_k, 2.0))))
    # ... and no path below the mirror floor, mean / soft factor (a cluster nobody prefers still trains)
    assert np.all(sizes >= max(1, (n * top_k // p) // 2)), (sizes, n * top_k / p)


def test_soft_balance_gives_a_path_nobody_prefers_its_floor():
    # 200 documents all nearest path 0 or 1; paths 2 and 3 are nobody's choice
    rng = np.random.default_rng(0)
    costs = np.concatenate([rng.random((200, 2)), 5.0 + rng.random((200, 2))], axis=1)
    sizes = np.bincount([s[0] for s in balanced_assign(costs, balance="soft", soft_capacity_factor=2.0)],
                        minlength=4)
    assert sizes.min() >= 200 // 4 // 2 and sizes.sum() == 200


def test_balance_arguments_are_checked():
    costs = np.random.default_rng(0).random((10, 3))
    with pytest.raises(ValueError, match="balance"):
        balanced_assign(costs, balance="loose")
    with pytest.raises(ValueError, match="soft_capacity_factor"):
        balanced_assign(costs, capacity_factor=2.0, balance="soft", soft_capacity_factor=1.5)


# ----------------------------------------------------------------------------- report
def test_report_gives_nmi_and_purity_per_level():
    grid = [2, 3]
    paths = np.array([0, 1, 2, 3, 4, 5, 0, 5])
    labels = ["a", "a", "a", "b", "b", "b", "a", "b"]  # level 0 = label exactly
    rep = routing_report(paths, num_paths=6, labels=labels, grid=grid)
    l0, l1 = rep["levels"]
    assert (l0["level"], l0["modules"], l1["modules"]) == (0, 2, 3)
    assert l0["nmi"] == pytest.approx(1.0) and l0["purity"] == 1.0
    assert l1["purity"] == pytest.approx(5 / 8)  # modules 0, 1, 2 hold a-b-a, a-b, a-b-b
    lists = routing_report([[p, (p + 1) % 6] for p in paths], num_paths=6, labels=labels, grid=grid)
    assert lists["levels"] == rep["levels"]  # per level, as the path NMI, uses the best path
    with pytest.raises(ValueError, match="grid"):
        routing_report(paths, num_paths=6, labels=labels, grid=[2, 2])


def test_soft_capacities_that_leave_no_move_overshoot_by_one_document():
    # path 1 has room (soft capacity 5) but every holder of the full paths 0 and 2 holds it
    # too: no document can make room, so document 0 joins its best missing path anyway
    costs = np.array([[0.5, 0.0, 0.9], [0.0, 0.1, 0.9], [0.9, 0.1, 0.0]])
    chosen = np.array([[1, -1], [0, 1], [2, 1]])  # round 1: document 0 looks for its second path
    load = [1, 3, 1]
    _make_room(costs, np.array([1, 0, 2]), chosen, 1, load, 0, [1, 5, 1])
    assert chosen[0].tolist() == [1, 0] and load == [2, 3, 1]
    with pytest.raises(RuntimeError, match="bug"):  # with equal capacities this is impossible
        _make_room(costs, np.array([1, 0, 2]), np.array([[1, -1], [0, 1], [2, 1]]), 1, [1, 3, 1], 0, [1, 1, 1])
