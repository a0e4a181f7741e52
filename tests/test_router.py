"""Router: fitting, path ids, routing, balanced/top-k assignment, re-routing, save/load."""
from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from router import CallableFeaturizer, Router, balanced_assign, routing_report
from router.synthetic import topic_corpus

REPO = Path(__file__).resolve().parents[1]
GOLDEN_V3 = REPO / "tests" / "golden" / "routers_v3"  # routers saved before the registry


@pytest.fixture(scope="module")
def corpus():
    return topic_corpus(8, docs_per_topic=40, seed=0)


@pytest.fixture(scope="module")
def flat8(corpus):
    docs, _ = corpus
    return Router.fit(docs, [8], method="flat", seed=0)


@pytest.fixture(scope="module")
def product44(corpus):
    docs, _ = corpus
    return Router.fit(docs, [4, 4], method="product", seed=0, top_k=2)


# ----------------------------------------------------------------------------- boundaries
@pytest.mark.multiprocess
def test_router_never_imports_torch_dipaco_or_modules():
    code = (
        "import importlib, pkgutil, sys, router\n"
        "for info in pkgutil.walk_packages(router.__path__, 'router.'):\n"
        "    importlib.import_module(info.name)\n"
        "bad = [m for m in ('torch', 'dipaco', 'modules') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_faiss_is_imported_by_kmeans_only():
    importers = sorted(p.name for p in (REPO / "router").glob("*.py") if "import faiss" in p.read_text())
    assert importers == ["kmeans.py"]


# ----------------------------------------------------------------------------- path ids
def test_path_ids_are_mixed_radix_level0_most_significant(corpus, product44):
    docs, _ = corpus
    assert product44.path_id((2, 1)) == 9
    assert product44.path_tuple(9) == (2, 1)
    feats = product44.features(docs[:20])
    d0, d1 = product44.routing.level_costs(feats)
    costs = product44.costs(docs[:20])
    for a in range(4):
        for b in range(4):
            np.testing.assert_allclose(costs[:, 4 * a + b], d0[:, a] + d1[:, b], rtol=1e-5, atol=1e-6)


def test_level_with_one_module_contributes_nothing(corpus):
    docs, _ = corpus
    r = Router.fit(docs, [1, 4], method="product", seed=0)
    d0, d1 = r.routing.level_costs(r.features(docs[:10]))
    assert d0.shape == (10, 1) and np.all(d0 == 0)
    np.testing.assert_allclose(r.costs(docs[:10]), d1, rtol=1e-6)


# ----------------------------------------------------------------------------- fitting
@pytest.mark.parametrize("method", ["flat", "product"])
def test_fit_is_deterministic_for_a_fixed_seed(corpus, method):
    docs, _ = corpus
    a = Router.fit(docs, [2, 4], method=method, seed=3)
    b = Router.fit(docs, [2, 4], method=method, seed=3)
    for ca, cb in zip(a.routing.arrays().values(), b.routing.arrays().values()):
        np.testing.assert_array_equal(ca, cb)
    np.testing.assert_array_equal(a.costs(docs), b.costs(docs))
    assert a.assign(docs, top_k=2) == b.assign(docs, top_k=2)


@pytest.mark.parametrize("method", ["flat", "product"])
def test_eight_planted_topics_are_recovered(corpus, method):
    docs, labels = corpus
    r = Router.fit(docs, [8], method=method, seed=0)
    rep = routing_report(r.route_batch(docs), num_paths=8, labels=labels)
    assert rep["nmi"] >= 0.9, rep
    assert rep["purity"] >= 0.9, rep


def test_fit_rejects_bad_arguments(corpus):
    docs, _ = corpus
    with pytest.raises(ValueError, match="docs"):
        Router.fit(docs[:5], [8], method="flat")
    with pytest.raises(ValueError, match="grid"):
        Router.fit(docs, [4, 0])
    with pytest.raises(ValueError, match="method"):
        Router.fit(docs, [4], method="hierarchical")
    with pytest.raises(ValueError, match="capacity_factor"):
        Router.fit(docs, [4], capacity_factor=0.5)
    with pytest.raises(ValueError, match="token ids"):
        Router.fit([["a", "b"]] * 10, [2])


# ----------------------------------------------------------------------------- routing
def test_route_topk_gives_k_distinct_paths_best_first(corpus, product44):
    docs, _ = corpus
    paths, costs = product44.route_topk(docs, 5)
    assert paths.shape == costs.shape == (len(docs), 5)
    assert paths.dtype == np.int64 and costs.dtype == np.float32
    assert all(len(set(row)) == 5 for row in paths.tolist())
    assert np.all(np.diff(costs, axis=1) >= 0)
    np.testing.assert_array_equal(paths[:, 0], product44.route_batch(docs))
    full = product44.costs(docs)
    np.testing.assert_allclose(costs, np.sort(full, axis=1)[:, :5])


def test_routing_uses_only_the_prefix(corpus, flat8):
    docs, labels = corpus
    a, b = docs[0][:32], docs[labels.tolist().index(5)]
    assert len(a) == 32
    # Tokens after the prefix (here: another topic) do not change the path.
    assert flat8.route(np.concatenate([a, b])) == flat8.route(a)


def test_short_and_empty_prefixes_still_route(corpus, flat8):
    docs, labels = corpus
    full = flat8.route_batch(docs)
    short = flat8.route_batch([d[:6] for d in docs])
    assert (short == full).mean() >= 0.8  # 6 tokens already say which topic
    assert flat8.route([]) == flat8.fallback_path
    assert flat8.route(np.zeros(0, np.int64)) == flat8.fallback_path
    sizes = np.bincount(full, minlength=8)
    assert sizes[flat8.fallback_path] == sizes.max()  # fallback = largest shard
    paths, _ = flat8.route_topk([[], docs[0]], 3)
    assert len(set(paths[0].tolist())) == 3


def test_reroute_windows_follows_a_topic_change(corpus, flat8):
    docs, labels = corpus
    li = labels.tolist()
    a = np.concatenate([d for d, t in zip(docs, li) if t == 1])[:64]
    b = np.concatenate([d for d, t in zip(docs, li) if t == 6])[:64]
    doc = np.concatenate([a, b])
    pa, pb = flat8.route(a), flat8.route(b)
    assert pa != pb
    # Re-routing on the last 32 tokens before each window (reroute_context=32) follows the
    # change one window late: window 2 (tokens 64..95) is routed by tokens 32..63 (topic 1).
    sliding = copy.copy(flat8)
    sliding.reroute_context = P = flat8.prefix_tokens
    assert sliding.reroute_windows(doc, 32) == [pa, pa, pa, pb]
    # The documented rule, token for token.
    W = 24
    expected = [flat8.route(doc[:P])] + [
        flat8.route(doc[max(0, j * W - P) : j * W]) for j in range(1, math.ceil(len(doc) / W))
    ]
    assert sliding.reroute_windows(doc, W) == expected
    # The default reads everything before the window: window 3 still sees 64 tokens of
    # topic 1 beside 32 of topic 6, so it follows the change later, if at all.
    assert flat8.reroute_context is None
    assert flat8.reroute_windows(doc, 32)[:3] == [pa, pa, pa]
    assert flat8.reroute_windows(doc, 32) == [flat8.route(doc[:P])] + [
        int(flat8.route_contexts([doc[: j * 32]])[0]) for j in range(1, 4)]
    assert flat8.reroute_windows([], 32) == []
    with pytest.raises(ValueError, match="W"):
        flat8.reroute_windows(doc, 0)


# ----------------------------------------------------------------------------- assignment
def test_balanced_assignment_caps_skewed_shards():
    sizes = [320, 80, 40, 40, 40, 40, 40, 40]  # N = 640, P = 8 → capacity 100 at 1.25
    docs, labels = topic_corpus(sizes, seed=1)
    r = Router.fit(docs, [8], method="flat", seed=0)
    unbalanced = routing_report(r.route_batch(docs), num_paths=8)
    assert unbalanced["imbalance"] > 1.25  # the skew is real, so the cap has work to do
    shards = r.assign(docs, top_k=1, capacity_factor=1.25)
    rep = routing_report(shards, num_paths=8, labels=labels)
    assert all(len(s) == 1 for s in shards)
    assert rep["imbalance"] <= 1.25 + 1e-9, rep
    assert rep["empty_shards"] == []
    # top-2 overlap: two distinct paths per document, still within the cap.
    shards2 = r.assign(docs, top_k=2, capacity_factor=1.25)
    assert all(len(set(s)) == 2 for s in shards2)
    assert routing_report(shards2, num_paths=8)["imbalance"] <= 1.25 + 1e-9


def test_balanced_assignment_keeps_confident_documents_and_orders_paths():
    # 6 documents all prefer path 0; capacity 2 per path (factor 1, P = 3).
    costs = np.array(
        [[0.0, 5.0, 6.0], [0.0, 1.0, 2.0], [0.0, 9.0, 9.5], [0.0, 0.1, 3.0], [0.0, 4.0, 4.0], [0.0, 0.2, 0.3]]
    )
    out = balanced_assign(costs, top_k=1, capacity_factor=1.0)
    assert sorted(i for i, s in enumerate(out) if s == [0]) == [0, 2]  # largest margins keep path 0
    assert np.bincount([s[0] for s in out], minlength=3).max() == 2
    out2 = balanced_assign(costs, top_k=2, capacity_factor=1.0)
    for row, s in zip(costs, out2):
        assert len(set(s)) == 2 and row[s[0]] <= row[s[1]]
    with pytest.raises(ValueError, match="top_k"):
        balanced_assign(costs, top_k=4)


def test_no_shard_below_half_the_mean_when_enough_documents():
    """Hard balance has a floor too: half the mean shard (here 40 / 8 / 2 = 2 documents),
    filled with the documents nearest to the unwanted path."""
    rng = np.random.default_rng(0)
    costs = rng.random((40, 8))
    costs[:, 0] -= 10.0  # everyone prefers path 0 ...
    costs[:, 7] += 10.0  # ... and nobody wants path 7
    out = balanced_assign(costs, top_k=1, capacity_factor=8.0)  # cap 40: no balancing pressure
    sizes = np.bincount([s[0] for s in out], minlength=8)
    assert sizes.min() == 2 and sizes.sum() == 40, sizes
    moved = [i for i, s in enumerate(out) if s == [7]]
    assert moved == sorted(np.argsort(costs[:, 7], kind="stable")[:2].tolist())  # its nearest documents


@pytest.mark.parametrize("seed", range(5))
def test_hard_floor_leaves_shards_above_it_alone(seed):
    """The floor only lifts shards below half the mean: natural clusters above it keep
    their documents exactly (property test, fixed seeds)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(6, 4)) * 4
    sizes = [90, 80, 70, 60, 55, 45]  # every cluster above half the mean (400 / 6 / 2 = 33)
    pts = np.concatenate([c + rng.normal(size=(n, 4)) for c, n in zip(centres, sizes)])
    costs = ((pts[:, None, :] - centres[None]) ** 2).sum(-1)
    out = balanced_assign(costs, top_k=1, capacity_factor=2.0)
    assert [s[0] for s in out] == np.argmin(costs, axis=1).tolist()


# ----------------------------------------------------------------------------- persistence
def test_save_load_round_trip_gives_identical_assignments(tmp_path, corpus, product44):
    docs, _ = corpus
    product44.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r", expected_grid=[4, 4])
    np.testing.assert_array_equal(loaded.costs(docs), product44.costs(docs))
    assert loaded.assign(docs) == product44.assign(docs)
    assert loaded.fallback_path == product44.fallback_path
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["grid"] == [4, 4] and m["method"] == "product" and m["settings"]["prefix_tokens"] == 32
    assert m["settings"]["top_k"] == 2 and m["method_settings"] == {"niter": 20} and m["featurizer"]["kind"] == "token_tfidf"
    assert set(m["files"]) == {"method.npz", "router.npz", "featurizer.npz"}
    assert not list((tmp_path / "r").glob("*.tmp"))  # atomic writes leave no temp files
    for f in m["files"]:
        np.load(tmp_path / "r" / f, allow_pickle=False)


def test_load_refuses_corrupt_missing_or_foreign(tmp_path, flat8):
    d = tmp_path / "r"
    flat8.save(d)
    with pytest.raises(ValueError, match="grid"):
        Router.load(d, expected_grid=[4, 4])
    blob = bytearray((d / "method.npz").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (d / "method.npz").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="method.npz"):
        Router.load(d)
    flat8.save(d)
    (d / "featurizer.npz").unlink()
    with pytest.raises(ValueError, match="featurizer.npz"):
        Router.load(d)
    with pytest.raises(ValueError, match="manifest.json"):
        Router.load(tmp_path / "nothing-here")


def test_callable_featurizer_is_passed_again_on_load(tmp_path, corpus):
    docs, labels = corpus

    def lm_features(prefixes):  # stand-in for the trainer's mean hidden state
        out = np.zeros((len(prefixes), 8), np.float32)
        for i, p in enumerate(prefixes):
            np.add.at(out[i], p // 50 % 8, 1.0)
        return out

    r = Router.fit(docs, [8], method="flat", featurizer=CallableFeaturizer(lm_features, 8), seed=0)
    assert routing_report(r.route_batch(docs), num_paths=8, labels=labels)["nmi"] >= 0.9
    r.save(tmp_path / "r")
    with pytest.raises(ValueError, match="featurizer_fn"):
        Router.load(tmp_path / "r")
    loaded = Router.load(tmp_path / "r", featurizer_fn=lm_features)
    np.testing.assert_array_equal(loaded.route_batch(docs), r.route_batch(docs))
    with pytest.raises(ValueError, match="expected"):
        CallableFeaturizer(lambda ps: np.zeros((len(ps), 3)), 8).transform(docs[:2])


def test_random_routing_control_ignores_content() -> None:
    """method="random": deterministic per prefix, spread over paths, blind to topics."""
    from router.synthetic import topic_corpus

    docs, topics = topic_corpus(4, docs_per_topic=100, seed=0)
    r = Router.fit(docs, [2, 2], prefix_tokens=16, method="random", seed=0)
    paths = r.route_batch(docs)
    assert np.array_equal(paths, r.route_batch(docs))
    assert np.bincount(paths, minlength=4).min() > 60  # roughly uniform over 4 paths
    from sklearn.metrics import normalized_mutual_info_score

    assert normalized_mutual_info_score(topics, paths) < 0.1


# ----------------------------------------------------------------------------- cluster_tokens
def _boilerplate_corpus(seed: int, topics: int = 4, per_topic: int = 40, head: int = 16):
    """Documents that all open with the same ``head`` tokens (a licence header, say),
    then carry their topic: a router fitted on the opening alone sees no topics."""
    docs, labels = topic_corpus(topics, docs_per_topic=per_topic, length=(48, 80), shared_vocab=8, seed=seed)
    opening = np.arange(head, dtype=np.int64) % 8
    order = np.random.default_rng(seed).permutation(len(docs))  # ties must not follow topic order
    return [np.concatenate([opening, docs[i]]) for i in order], labels[order]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cluster_tokens_clusters_on_more_than_the_routing_prefix(seed):
    from sklearn.metrics import normalized_mutual_info_score as nmi

    docs, labels = _boilerplate_corpus(seed)
    short = Router.fit(docs, [4], method="flat", prefix_tokens=16, seed=seed)
    long = Router.fit(docs, [4], method="flat", prefix_tokens=16, cluster_tokens=64, seed=seed)
    assert long.cluster_tokens == 64 and short.cluster_tokens == 16
    first = lambda assignment: [p[0] for p in assignment]  # noqa: E731
    # every opening is the same 16 tokens: shards on them carry no topic, shards on 64 do
    assert nmi(labels, first(short.assign(docs))) < 0.1
    assert nmi(labels, first(long.assign(docs))) > 0.9
    # a prompt is still routed on prefix_tokens: tokens after them change nothing
    d = docs[0]
    assert long.route(d) == long.route(d[:16]) == long.route(np.concatenate([d[:16], docs[-1]]))


def test_reroute_context_reads_the_last_tokens_before_the_window():
    docs, labels = _boilerplate_corpus(0)
    r = Router.fit(docs, [4], method="flat", prefix_tokens=16, cluster_tokens=64, seed=0, reroute_context=64)
    doc = np.concatenate([docs[0], docs[-1]])
    W = 24
    expected = [r.route(doc[:16])] + [
        int(r.route_contexts([doc[max(0, j * W - 64) : j * W]])[0]) for j in range(1, math.ceil(len(doc) / W))
    ]
    assert r.reroute_windows(doc, W) == expected
    # the context is read whole, not cut to the 16-token routing prefix
    ctx = doc[: 64]
    assert r.route_contexts([ctx])[0] == r.shard_costs([ctx]).argmin()
    # the last window's context lies inside the second document: it routes to its topic
    assert r.reroute_windows(doc, W)[-1] == r.shard_costs([docs[-1]]).argmin()


def test_reroute_context_default_is_everything_read_so_far():
    docs, _ = _boilerplate_corpus(0)
    r = Router.fit(docs, [4], method="flat", prefix_tokens=16, seed=0)
    assert r.reroute_context is None
    doc = np.concatenate([docs[0], docs[-1]])
    W = 24
    n = math.ceil(len(doc) / W)
    assert [len(r.window_context(doc, j, W)) for j in range(n)] == [16] + [j * W for j in range(1, n)]
    expected = [r.route(doc[:16])] + [int(r.route_contexts([doc[: j * W]])[0]) for j in range(1, n)]
    assert r.reroute_windows(doc, W) == expected
    with pytest.raises(ValueError, match="reroute_context must be >= 1"):
        Router.fit(docs, [4], method="flat", prefix_tokens=16, seed=0, reroute_context=0)


def test_cluster_tokens_is_saved_and_checked(tmp_path):
    docs, _ = _boilerplate_corpus(0)
    r = Router.fit(docs, [2, 2], method="product", prefix_tokens=16, cluster_tokens=48, seed=0)
    r.save(tmp_path / "r")
    loaded = Router.load(tmp_path / "r")
    assert loaded.cluster_tokens == 48 and loaded.prefix_tokens == 16
    assert loaded.assign(docs) == r.assign(docs)
    assert loaded.reroute_context is None  # everything read so far, saved as such
    Router.fit(docs, [2, 2], prefix_tokens=16, seed=0, reroute_context=40).save(tmp_path / "r40")
    assert Router.load(tmp_path / "r40").reroute_context == 40
    # a manifest written before cluster_tokens existed (a version 3 one, flat keys, with
    # both keys removed) clusters on the routing prefix
    old = tmp_path / "old"
    shutil.copytree(GOLDEN_V3 / "product", old)
    m = json.loads((old / "manifest.json").read_text())
    del m["cluster_tokens"], m["reroute_context"]
    (old / "manifest.json").write_text(json.dumps(m))
    assert Router.load(old).cluster_tokens == m["prefix_tokens"] == 8
    # ... and re-routed on the cluster_tokens before each window, as it did then
    assert Router.load(old).reroute_context == 8
    with pytest.raises(ValueError, match="cluster_tokens"):
        Router.fit(docs, [2, 2], prefix_tokens=32, cluster_tokens=16)
