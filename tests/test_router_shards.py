"""Shards on disk (memory-mapped token files) and the routing report."""
from __future__ import annotations

import json
import warnings

import datasets
import numpy as np
import pytest

from router import (Router, TokenFileError, assign_in_batches, load_shard, open_token_docs, routing_report,
                    write_shards, write_token_docs)
from router.synthetic import topic_corpus


@pytest.fixture(scope="module")
def routed():
    docs, labels = topic_corpus(4, docs_per_topic=15, seed=0)
    ds = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs], "label": labels.tolist()})
    router = Router.fit(docs, [2, 2], method="flat", seed=0)
    return ds, router, docs


def test_shards_round_trip_with_top2_overlap(tmp_path, routed):
    ds, router, docs = routed
    shards = router.assign(docs, top_k=2)
    manifest = write_shards(ds, shards, router.num_paths, tmp_path / "s")
    on_disk = json.loads((tmp_path / "s" / "shards.json").read_text())
    assert on_disk == manifest
    total = 0
    for p in range(router.num_paths):
        shard = load_shard(tmp_path / "s", p)
        expect = [i for i, s in enumerate(shards) if p in s]
        assert isinstance(shard.tokens, np.memmap)  # read by offset, not loaded
        assert [d.tolist() for d in shard] == [ds[i]["input_ids"] for i in expect]
        assert manifest["documents_per_path"][p] == len(expect)
        assert manifest["tokens_per_path"][p] == sum(len(docs[i]) for i in expect)
        total += len(shard)
    assert total == 2 * len(ds)  # overlap: every row in two shards, stored once
    assert manifest["num_rows"] == len(ds) and manifest["empty_shards"] == []
    assert manifest["imbalance"] == pytest.approx(max(manifest["documents_per_path"]) / (total / 4))
    with pytest.raises(ValueError, match="path_id"):
        load_shard(tmp_path / "s", 4)


def test_empty_shard_is_reported_not_fatal(tmp_path, routed):
    ds, _, _ = routed
    shards = [[0] if i % 2 else [2] for i in range(len(ds))]
    shards[0] = []  # a row with no path is left out
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = write_shards(ds, shards, 4, tmp_path / "s")
    assert [str(w.message).split(":")[0] for w in caught] == ["shard 1 is empty", "shard 3 is empty"]
    assert manifest["empty_shards"] == [1, 3]
    assert len(manifest["warnings"]) == 2 and "path 3" in manifest["warnings"][1]
    assert len(load_shard(tmp_path / "s", 1)) == 0
    assert manifest["num_rows"] == len(ds) - 1
    with pytest.raises(ValueError, match="assignments"):
        write_shards(ds, shards[:-1], 4, tmp_path / "t")
    with pytest.raises(ValueError, match="outside"):
        write_shards(ds, [[9]] * len(ds), 4, tmp_path / "t")


def test_corrupt_shard_index_is_refused(tmp_path, routed):
    ds, router, docs = routed
    write_shards(ds, router.assign(docs), 4, tmp_path / "s")
    blob = bytearray((tmp_path / "s" / "shard_index.npz").read_bytes())
    blob[-30] ^= 0xFF
    (tmp_path / "s" / "shard_index.npz").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="shard_index.npz"):
        load_shard(tmp_path / "s", 0)


def test_routing_report_fields():
    rep = routing_report([0, 0, 1, 1, 1, 3], num_paths=4, labels=["a", "a", "b", "b", "a", "c"])
    assert rep["num_documents"] == 6
    assert rep["shard_sizes"] == [2, 3, 0, 1]
    assert rep["imbalance"] == pytest.approx(3 / 1.5)
    assert rep["empty_shards"] == [2]
    assert rep["purity"] == pytest.approx(5 / 6)
    assert 0 < rep["nmi"] < 1
    perfect = routing_report([2, 2, 0, 0], num_paths=3, labels=[1, 1, 0, 0])
    assert perfect["nmi"] == pytest.approx(1.0) and perfect["purity"] == 1.0
    # top-k lists: sizes count memberships, NMI uses the best path
    lists = routing_report([[0, 1], [1, 0]], num_paths=2, labels=[0, 1])
    assert lists["shard_sizes"] == [2, 2] and lists["nmi"] == pytest.approx(1.0)
    json.dumps(rep)
    with pytest.raises(ValueError, match="path ids"):
        routing_report([5], num_paths=4)


# --------------------------------------------------------------------------- token files


def test_token_docs_round_trip_and_views(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, size=int(n)) for n in rng.integers(0, 20, size=50)]
    td = write_token_docs(tmp_path / "t", iter(docs), batch_size=7)  # several batches
    assert isinstance(td.tokens, np.memmap) and len(td) == 50
    assert [d.tolist() for d in td] == [d.tolist() for d in docs]
    assert td.num_tokens == sum(len(d) for d in docs)
    assert [d.tolist() for d in td.select([4, 4, 0])] == [docs[i].tolist() for i in (4, 4, 0)]
    assert [d.tolist() for d in td.prefixes(3)] == [d[:3].tolist() for d in docs]
    assert [d.tolist() for d in td[10:13]] == [d.tolist() for d in docs[10:13]]
    assert len(write_token_docs(tmp_path / "e", [])) == 0  # an empty corpus opens too


@pytest.mark.parametrize("damage", ["missing_tokens", "missing_offsets", "truncated", "garbage_offsets"])
def test_bad_token_files_get_one_line_naming_the_file(tmp_path, damage):
    write_token_docs(tmp_path / "t", [[1, 2, 3], [4, 5]])
    tokens, offsets = tmp_path / "t" / "tokens.bin", tmp_path / "t" / "offsets.npy"
    if damage == "missing_tokens":
        tokens.unlink()
    elif damage == "missing_offsets":
        offsets.unlink()
    elif damage == "truncated":
        tokens.write_bytes(tokens.read_bytes()[:-4])
    else:
        offsets.write_bytes(b"not a numpy file")
    before = sorted(p.name for p in (tmp_path / "t").iterdir())
    with pytest.raises(TokenFileError) as err:
        open_token_docs(tmp_path / "t", fix="rerun routing")
    msg = str(err.value)
    named = tokens if damage in ("missing_tokens", "truncated") else offsets
    assert str(named) in msg and msg.endswith("Fix: rerun routing") and "\n" not in msg
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == before  # nothing deleted


def test_load_shard_refuses_damaged_or_old_shards(tmp_path, routed):
    ds, router, docs = routed
    write_shards(ds, router.assign(docs), 4, tmp_path / "s")
    (tmp_path / "s" / "tokens" / "tokens.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"tokens\.bin.*Fix: route again"):
        load_shard(tmp_path / "s", 0)
    manifest = json.loads((tmp_path / "s" / "shards.json").read_text())
    manifest["version"] = 1  # written by the HF-dataset layout
    (tmp_path / "s" / "shards.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="shards format 1.*Fix: route again"):
        load_shard(tmp_path / "s", 0)


def test_assign_in_batches_matches_assign_on_memmapped_docs(tmp_path, routed):
    _, router, docs = routed
    td = write_token_docs(tmp_path / "t", docs)
    want = router.assign(docs)
    assert assign_in_batches(router, td, batch_size=7) == want
    assert assign_in_batches(router, list(docs), batch_size=5) == want
    # a shard written from the memmap holds the same documents as one written from lists
    write_shards(td, want, 4, tmp_path / "a")
    write_shards(list(docs), want, 4, tmp_path / "b")
    for p in range(4):
        assert [d.tolist() for d in load_shard(tmp_path / "a", p)] == \
            [d.tolist() for d in load_shard(tmp_path / "b", p)]


def test_path_arrays_give_what_path_lists_give(tmp_path, routed) -> None:
    """The [N, k] int arrays of the large-corpus path (assign_in_batches(as_array=True))
    write the same shards, report and replicas as per-document lists."""
    from router import expand_replicas

    ds, router, docs = routed
    lists = assign_in_batches(router, docs, batch_size=7)
    array = assign_in_batches(router, docs, batch_size=7, as_array=True)
    assert array.dtype == np.int8 and array.tolist() == lists
    a = write_shards(docs, array, router.num_paths, tmp_path / "a")
    b = write_shards(docs, lists, router.num_paths, tmp_path / "b")
    assert a == b and (tmp_path / "a" / "shard_index.npz").read_bytes() == (tmp_path / "b" / "shard_index.npz").read_bytes()
    codes = np.unique(np.asarray(ds["label"]), return_inverse=True)[1].astype(np.int32)  # as label_codes()
    assert routing_report(array, num_paths=4, labels=codes, grid=[2, 2]) == \
        routing_report(lists, num_paths=4, labels=list(ds["label"]), grid=[2, 2])
    assert expand_replicas(array, 3, seed=5).tolist() == expand_replicas(lists, 3, seed=5)
    # a row with fewer paths (-1) is padding; a bad path or a repeat is refused in one line
    ragged = np.array([[0, 1]] * (len(docs) - 1) + [[2, -1]])
    manifest = write_shards(docs, ragged, 4, tmp_path / "c", warn_empty=False)
    assert manifest["documents_per_path"] == [len(docs) - 1] * 2 + [1, 0]
    with pytest.raises(ValueError, match=r"assignments\[0\] repeats a path"):
        write_shards(docs, np.array([[1, 1]] * len(docs)), 4, tmp_path / "d")
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        write_shards(docs, np.array([[1, 7]] * len(docs)), 4, tmp_path / "e")


def test_progress_bars_follow_the_terminal_rule(monkeypatch) -> None:
    """router may not import dipaco.runtime.progress; its bars follow the same rule: none when
    asked not to, none for small inputs by default, none when stderr is not a terminal."""
    import sys

    from router.features import progress_bar

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    assert progress_bar(10**6, True, "featurize") is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress_bar(10**6, False, "featurize") is None and progress_bar(10, None, "featurize") is None
    bar = progress_bar(10**6, None, "featurize")
    assert bar is not None
    bar.close()
