"""Streaming ingestion (issue 31): files by rule, per-record errors, own splits, datasets
folders, the text store and the tokenizer sample."""
from __future__ import annotations

import codecs
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dipaco.config import DataConfig
from dipaco.data import DataError, Documents, load_corpus
from dipaco.data.files import file_split
from dipaco.data.textstore import new_store_dir, sweep_stale


def _cfg(**kw) -> DataConfig:
    return replace(DataConfig(), **kw)


def _doc(i: int, **extra) -> dict:
    return {"text": f"document number {i} with enough words to be kept " * 2, **extra}


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- files by rule


def test_a_fifo_as_the_whole_input_is_refused_without_blocking(tmp_path) -> None:
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    t = time.time()
    with pytest.raises(DataError, match=r"data\.path=.*pipe\.jsonl is a FIFO, not a regular file.*Fix") as e:
        load_corpus(_cfg(source="jsonl", path=str(fifo)), progress=False)
    assert time.time() - t < 10 and "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"is a character device"):
        load_corpus(_cfg(source="text", path="/dev/null"), progress=False)


def test_special_files_inside_a_directory_or_glob_are_counted_and_skipped(tmp_path) -> None:
    d = tmp_path / "data"
    d.mkdir()
    _jsonl(d / "a.jsonl", [_doc(i) for i in range(5)])
    os.mkfifo(d / "b.jsonl")  # would block a reader forever
    (d / "loop.jsonl").symlink_to(d / "loop.jsonl")  # a symlink to itself: ELOOP
    (d / "gone.jsonl").symlink_to(d / "missing.jsonl")  # broken
    (d / "sub.jsonl").mkdir()  # a directory matched by the glob below
    _jsonl(d / "sub.jsonl" / "c.jsonl", [_doc(9)])
    c = load_corpus(_cfg(source="jsonl", path=str(d)), progress=False)
    assert c.num_documents == 6 and c.skipped == {"not_a_regular_file": 3}
    g = load_corpus(_cfg(source="jsonl", path=str(d / "*.jsonl")), progress=False)
    assert g.num_documents == 5 and g.skipped == {"not_a_regular_file": 4}
    with pytest.raises(DataError, match=r"no file matches this pattern that is a regular file"):
        load_corpus(_cfg(source="jsonl", path=str(d / "[bs]*.jsonl")), progress=False)


# --------------------------------------------------------------------------- records


def test_every_bad_record_costs_itself_only_and_is_counted(tmp_path) -> None:
    lines = [json.dumps(_doc(0, label="a")).encode()]
    lines.append(b"[" * 100_000 + b"]" * 100_000)  # deeper than the parser's stack
    lines.append(json.dumps(_doc(1, label={"nested": 1})).encode())  # wrong type
    lines.append(json.dumps(_doc(2, label=None)).encode())  # null label: kept, counted
    lines.append(json.dumps(_doc(3)).encode())  # no label: kept, counted
    lines.append(json.dumps(_doc(4, label="a")).replace('"a"', '"\\ud800"').encode())  # lone surrogate
    lines.append(json.dumps(_doc(5, label="b", key=7)).encode())  # a number is a fine id
    lines.append(json.dumps(_doc(6, label="b", key={"x": 1})).encode())  # bad id
    f = tmp_path / "d.jsonl"
    f.write_bytes(codecs.BOM_UTF8 + b"\n".join(lines) + b"\n")  # a byte-order mark is not a bad line
    c = load_corpus(_cfg(source="jsonl", path=str(f), label_field="label", id_field="key"), progress=False)
    assert c.skipped == {"nested_too_deep": 1, "bad_label": 1, "missing_label": 2, "non_utf8": 1, "bad_id": 1}
    assert c.dataset["label"] == ["a", None, None, "b"] and c.dataset["id"][3] == "7"
    # a file in another encoding is one count, not thousands of garbage lines
    (tmp_path / "wide.jsonl").write_bytes("\n".join(json.dumps(_doc(i)) for i in range(3)).encode("utf-16"))
    with pytest.raises(DataError, match=r"unsupported_encoding=1"):
        load_corpus(_cfg(source="jsonl", path=str(tmp_path / "wide.jsonl")), progress=False)


def test_a_runaway_line_is_skipped_unread(tmp_path, monkeypatch) -> None:
    import dipaco.data.readers as readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1000)
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps(_doc(0)) + "\n" + "x" * 50_000 + "\n" + json.dumps(_doc(1)) + "\n")
    c = load_corpus(_cfg(source="jsonl", path=str(f)), progress=False)
    assert c.num_documents == 2 and c.skipped == {"line_too_long": 1}
    assert c.dataset["id"] == ["d.jsonl#1", "d.jsonl#3"]  # line numbers still count the long line


def test_a_json_array_is_streamed_and_a_bad_element_ends_it(tmp_path, monkeypatch) -> None:
    import dipaco.data.readers as readers

    monkeypatch.setattr(readers, "_CHUNK", 64)  # elements span many reads
    rows = [_doc(i) for i in range(20)]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=1))
    c = load_corpus(_cfg(source="json", path=str(tmp_path / "a.json")), progress=False)
    assert c.num_documents == 20 and c.dataset["id"][-1] == "a.json#19"
    text = json.dumps(rows[:5])[:-1] + ', {"text": broken}, ' + json.dumps(rows[5])[0:] + "]"
    (tmp_path / "a.json").write_text(text)
    c = load_corpus(_cfg(source="json", path=str(tmp_path / "a.json")), progress=False)
    assert c.num_documents == 5 and c.skipped == {"malformed_json": 1}


# --------------------------------------------------------------------------- splits


def test_file_split_names() -> None:
    assert [file_split(p) for p in ("train.jsonl", "validation/x.jsonl", "data/test-00000-of-00002.parquet",
                                    "dev.json", "tests.jsonl", "devices.txt", "a/b.jsonl")] == \
        ["train", "validation", "test", "validation", None, None, None]


def test_an_unknown_split_mode_is_one_line(tmp_path) -> None:
    _jsonl(tmp_path / "d.jsonl", [_doc(0)])
    with pytest.raises(DataError, match=r"data\.splits='own' is unknown\. Fix: use one of auto, hash"):
        load_corpus(_cfg(source="jsonl", path=str(tmp_path / "d.jsonl"), splits="own"), progress=False)


def test_own_splits_of_local_files(tmp_path) -> None:
    _jsonl(tmp_path / "train.jsonl", [_doc(i) for i in range(60)])
    _jsonl(tmp_path / "validation.jsonl", [_doc(100 + i) for i in range(4)])
    c = load_corpus(_cfg(source="jsonl", path=str(tmp_path), val_fraction=0.1, test_fraction=0.1), progress=False)
    assert c.own_splits == ("validation",)
    assert c.split("validation")["id"] == [f"validation.jsonl#{i}" for i in range(1, 5)]
    train, test = c.split("train")["id"], c.split("test")["id"]
    assert test and all(i.startswith("train.jsonl") for i in train + test)  # test is drawn from train
    h = load_corpus(_cfg(source="jsonl", path=str(tmp_path), splits="hash"), progress=False)
    assert h.own_splits == () and any(i.startswith("validation.jsonl") for i in h.split("train")["id"])
    # a file named for a split, given alone, is the corpus
    alone = load_corpus(_cfg(source="jsonl", path=str(tmp_path / "validation.jsonl"), val_fraction=0.5),
                        progress=False)
    assert alone.own_splits == () and len(alone.split("train")) > 0


def test_save_to_disk_folders_and_a_dataset_with_its_own_validation_split(tmp_path) -> None:
    import datasets

    rows = {"content": [_doc(i)["text"] for i in range(30)], "topic": ["x"] * 30}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    c = load_corpus(_cfg(source="hub", path=str(tmp_path / "one"), text_field="content", label_field="topic"),
                    progress=False)
    assert c.num_documents == 30 and c.labels == ["x"] and c.dataset["id"][0] == "train#0"
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                               "validation": datasets.Dataset.from_dict({"content": [_doc(99)["text"]] * 3,
                                                                         "topic": ["v"] * 3})})
    dd.save_to_disk(str(tmp_path / "dict"))
    d = load_corpus(_cfg(source="hub", path=str(tmp_path / "dict"), text_field="content"), progress=False)
    assert d.own_splits == ("validation",) and d.split("validation")["id"] == ["validation#0", "validation#1",
                                                                               "validation#2"]
    assert len(d.split("train")) + len(d.split("test")) == 30
    with pytest.raises(DataError, match=r"has no split 'nope'.*train, validation"):
        load_corpus(_cfg(source="hub", path=str(tmp_path / "dict"), hub_split="nope"), progress=False)
    (tmp_path / "dict" / "train" / "state.json").write_text("{")
    with pytest.raises(DataError, match=r"save_to_disk folder cannot be loaded"):
        load_corpus(_cfg(source="hub", path=str(tmp_path / "dict"), text_field="content"), progress=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_dataset_by_name_with_its_own_splits(tmp_path, monkeypatch, streaming) -> None:
    """The hub code path, on a local data directory (load_dataset resolves it offline)."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    d = tmp_path / "corpus"
    d.mkdir()
    _jsonl(d / "train.jsonl", [_doc(i) for i in range(40)])
    _jsonl(d / "validation.jsonl", [_doc(50 + i) for i in range(3)])
    _jsonl(d / "test.jsonl", [_doc(60 + i) for i in range(2)])
    c = load_corpus(_cfg(source="hub", path=str(d), streaming=streaming), progress=False)
    assert c.own_splits == ("validation", "test")
    assert [len(c.split(s)) for s in ("train", "validation", "test")] == [40, 3, 2]


# --------------------------------------------------------------------------- store and sample


def test_the_store_is_on_disk_and_deleted_with_its_last_view(tmp_path) -> None:
    _jsonl(tmp_path / "d.jsonl", [_doc(i, label=str(i % 3)) for i in range(50)])
    c = load_corpus(_cfg(source="jsonl", path=str(tmp_path / "d.jsonl"), label_field="label"),
                    progress=False, work_dir=str(tmp_path / "work"))
    (store,) = (tmp_path / "work").iterdir()
    assert store.name.startswith(".tmp-corpus-") and (store / "text.bin").stat().st_size > 2000
    view = c.split("train")
    assert isinstance(view, Documents) and view["text"][0].startswith("document number")
    assert sorted(set(view["label"])) == ["0", "1", "2"] and view.label_codes().max() == 2
    del c
    assert store.is_dir()  # the view still reads it
    del view
    import gc

    gc.collect()
    assert not store.exists()
    # a store left by a process that is gone is swept by the next load
    stale = tmp_path / "work" / ".tmp-corpus-999999999-abc"
    stale.mkdir()
    new_store_dir(str(tmp_path / "work"))
    sweep_stale(str(tmp_path / "work"))
    assert not stale.exists()


def test_the_tokenizer_sample_is_spread_and_bounded(tmp_path) -> None:
    _jsonl(tmp_path / "d.jsonl", [{"text": f"{i:04d} " + "w" * 95} for i in range(100)])  # 100 bytes each
    docs = load_corpus(_cfg(source="jsonl", path=str(tmp_path / "d.jsonl"), val_fraction=0.0, test_fraction=0.0),
                       progress=False).dataset
    assert docs.spread(None, None) is docs and docs.spread(10_000, 100) is docs  # fits: all of it, in order
    half = docs.spread(5_000, None)
    assert len(half) == 50 and half["text"][0].startswith("0001") and half["text"][-1].startswith("0099")
    assert len(docs.spread(None, 10)) == 10 and docs.spread(None, 10)["text"][0].startswith("0009")
    assert int(docs.spread(1_050, None).text_bytes().sum()) <= 1_100  # the one crossing the cap is the last


# --------------------------------------------------------------------------- parallel tokenization


def test_tokenizing_on_threads_gives_the_ids_of_one_thread(tmp_path) -> None:
    from dipaco.data import Tokenizer, dataset_content_hash, tokenize_to_docs
    from dipaco.data.tokenize import encode_batches

    _jsonl(tmp_path / "d.jsonl", [{"text": f"line {i} " * (i % 17 + 8) + "é∑🙂"} for i in range(300)])
    docs = load_corpus(_cfg(source="jsonl", path=str(tmp_path / "d.jsonl")), progress=False).dataset
    tok = Tokenizer.train(docs["text"], 300)
    want = [tok.encode(t) for t in docs["text"]]
    for threads in (1, 3):
        flat = np.concatenate([f for f, _ in encode_batches(docs, tok, batch_size=7, threads=threads)])
        assert flat.tolist() == [i for ids in want for i in ids]
    cached = tokenize_to_docs(docs, tok, cache_dir=str(tmp_path / "cache"), batch_size=16, progress=False)
    assert [d.tolist() for d in cached] == want
    # the store's documents and an HF dataset of the same rows share a content hash (cache key)
    assert dataset_content_hash(docs) == dataset_content_hash(docs.to_hf())


_KILLED = """
import sys, time
from dataclasses import replace
from dipaco.config import DataConfig
from dipaco.data import Tokenizer, load_corpus, tokenize_to_docs
tok = Tokenizer.load(sys.argv[2])
encode = tok.encode_flat
def slow(texts):
    time.sleep(0.2)
    return encode(texts)
tok.encode_flat = slow
corpus = load_corpus(replace(DataConfig(), source="jsonl", path=sys.argv[1]), progress=False, work_dir=sys.argv[3])
tokenize_to_docs(corpus.dataset, tok, cache_dir=sys.argv[3], batch_size=4, progress=False)
"""


@pytest.mark.multiprocess
def test_a_kill_mid_tokenization_leaves_nothing_a_later_run_trusts(tmp_path) -> None:
    """SIGKILL while the text store and a token entry are being written: no tokens-* entry
    is published; the next run sweeps what the dead one left and completes."""
    import signal
    import subprocess
    import sys

    from dipaco.data import Tokenizer, tokenize_to_docs

    _jsonl(tmp_path / "d.jsonl", [_doc(i) for i in range(400)])
    tok = Tokenizer.train([_doc(i)["text"] for i in range(50)], 300)
    tok.save(str(tmp_path / "tok.json"))
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path / "d.jsonl"), str(tmp_path / "tok.json"),
                             str(cache)])
    deadline = time.time() + 120
    while time.time() < deadline and not any(p.name.startswith(".tokens-") for p in cache.glob(".*")):
        time.sleep(0.05)
    time.sleep(0.3)  # a few batches written
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    left = sorted(p.name for p in cache.iterdir())
    assert any(n.startswith(".tokens-") for n in left) and any(n.startswith(".tmp-corpus-") for n in left), left
    assert not [n for n in left if n.startswith("tokens-")]  # nothing published
    corpus = load_corpus(_cfg(source="jsonl", path=str(tmp_path / "d.jsonl")), progress=False, work_dir=str(cache))
    ids = tokenize_to_docs(corpus.dataset, tok, cache_dir=str(cache), progress=False)
    assert [d.tolist() for d in ids] == [tok.encode(t) for t in corpus.dataset["text"]]
    corpus.close()
    assert [p.name for p in cache.iterdir()] == [Path(ids.tokens.filename).parent.name]  # the dead run's temps are gone


def test_repeated_ids_are_numbered_across_the_digest_merges(tmp_path, monkeypatch) -> None:
    from dipaco.data.cleaning import DigestSet

    monkeypatch.setattr(DigestSet, "MERGE", 4)  # most ids are found in the merged array
    _jsonl(tmp_path / "d.jsonl", [_doc(i, key=f"k{i % 7}") for i in range(30)])
    c = load_corpus(_cfg(source="jsonl", path=str(tmp_path / "d.jsonl"), id_field="key", val_fraction=0.0,
                         test_fraction=0.0), progress=False)
    ids = c.dataset["id"]
    assert len(set(ids)) == 30 and ids[:8] == ["k0", "k1", "k2", "k3", "k4", "k5", "k6", "k0~2"]
    assert ids[-1] == "k1~5"


@pytest.mark.parametrize("source", ["hub", "tokens"])
def test_a_mistyped_local_path_is_not_blamed_on_the_network(tmp_path, source) -> None:
    from dipaco.data.pretokenized import load_token_corpus

    load = load_token_corpus if source == "tokens" else load_corpus
    with pytest.raises(DataError, match=r"data\.path=.*missing does not exist\. Fix") as e:
        load(_cfg(source=source, path=str(tmp_path / "missing")), progress=False, work_dir=str(tmp_path))
    assert "hub is reachable" not in str(e.value) and "\n" not in str(e.value)
