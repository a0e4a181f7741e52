"""Tests of dipaco.data: the built-in corpus, splits, loading bad input, tokenizer, cache, batches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from dipaco.config import DataConfig
from dipaco.data import (
    CACHE_STATS,
    IGNORE_INDEX,
    Corpus,
    DataError,
    Tokenizer,
    TokenStream,
    iter_eval_batches,
    list_source_files,
    load_corpus,
    split_of,
    split_source,
    stdlib_root,
    tokenize_dataset,
    tokenize_to_docs,
    tokens_in_batch,
)
from dipaco.data.splits import id_unit_interval

DEFAULT_EXCLUDES = ["test", "tests", "idlelib", "lib2to3", "turtledemo"]
# The default target_doc_chars=3000 gives ~4,300 documents on Python 3.11; 2400 gives
# ~5,200 (see the report in the commit log / README of the data package).
TARGET_FOR_5K = 2400


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def stdlib_corpus() -> Corpus:
    """The built-in corpus, scanned once for the module (~4 s)."""
    return load_corpus(DataConfig(source="python_sources", target_doc_chars=TARGET_FOR_5K), progress=False)


@pytest.fixture(scope="module")
def small_tokenizer(stdlib_corpus: Corpus) -> Tokenizer:
    texts = stdlib_corpus.dataset.select(range(0, stdlib_corpus.num_documents, 10))["text"]
    return Tokenizer.train(texts, 512)


def _cfg(**kw) -> DataConfig:
    return replace(DataConfig(), **kw)


# --------------------------------------------------------------------------- python_sources


def test_python_sources_size_labels_and_no_third_party(stdlib_corpus: Corpus) -> None:
    ds = stdlib_corpus.dataset
    # a corpus, not a handful of files; the count depends on the interpreter's stdlib
    # (5,000+ documents from CPython 3.11 here, 3,994 from the CUDA image's 3.12)
    assert stdlib_corpus.num_documents == len(ds) >= 2000
    labels = stdlib_corpus.labels
    assert len(labels) >= 20
    for pkg in ("json", "email", "asyncio", "argparse", "xml", "unittest"):
        assert pkg in labels
    assert set(ds.column_names) == {"id", "text", "label", "group", "split"}
    ids = ds["id"]
    assert len(set(ids)) == len(ids)
    tops = {i.split("/")[0].split("#")[0] for i in ids}
    for excluded in DEFAULT_EXCLUDES + ["site-packages", "dist-packages"]:
        assert excluded not in tops and f"{excluded}.py" not in tops
    assert not any("site-packages" in i or "dist-packages" in i for i in ids)
    # json/decoder.py → label json; a single-file module → its own name
    row = ds[ids.index("json/decoder.py#0")]
    assert row["label"] == "json" and "JSONDecoder" in ds["text"][ids.index("json/decoder.py#0") + 1] + row["text"]
    assert ds[ids.index("argparse.py#0")]["label"] == "argparse"
    assert max(len(t) for t in ds["text"]) <= DataConfig().max_doc_chars


def test_python_sources_listing_is_stdlib_only() -> None:
    files = list_source_files(DEFAULT_EXCLUDES)
    assert files == sorted(files) and files
    root = stdlib_root()
    assert "site-packages" not in root
    assert all(os.path.isfile(os.path.join(root, f)) for f in files[:50])
    assert not any(f.startswith(("test/", "idlelib/", "lib2to3/")) for f in files)
    # exclusions are honoured: leaving out json removes json/*
    assert not any(f.startswith("json/") for f in list_source_files(["json"]))
    assert any(f.startswith("json/") for f in files)


@pytest.mark.multiprocess
def test_python_sources_identical_across_runs(stdlib_corpus: Corpus) -> None:
    """A fresh interpreter (other str-hash salt) builds exactly the documents of this one."""
    import hashlib

    def digest(docs) -> str:
        h = hashlib.sha256()
        for doc_id, text, label in docs:
            for part in (doc_id, text, label):
                h.update(part.encode()); h.update(b"\x00")
        return h.hexdigest()

    code = (
        "import hashlib\n"
        "from dipaco.data.python_sources import iter_python_sources\n"
        "h = hashlib.sha256()\n"
        f"for d in iter_python_sources({DEFAULT_EXCLUDES!r}, {TARGET_FOR_5K}, 20000):\n"
        "    if len(d.text.strip()) < 64: continue\n"
        "    for part in (d.id, d.text, d.label):\n"
        "        h.update(part.encode()); h.update(b'\\x00')\n"
        "print(h.hexdigest())\n"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    ds = stdlib_corpus.dataset
    assert out.stdout.strip() == digest(zip(ds["id"], ds["text"], ds["label"]))


def test_split_source_cuts_along_definitions() -> None:
    funcs = [f"def f{i}(x):\n    '''doc {i}'''\n" + "    x += 1\n" * 30 + "    return x\n\n\n" for i in range(20)]
    src = '"""module doc"""\nimport os\n\n\n' + "".join(funcs)
    docs = split_source(src, target_chars=1200, max_chars=5000)
    assert "".join(docs) == src  # nothing lost, nothing added
    assert len(docs) > 3
    for d in docs[1:]:
        assert d.startswith("def f")  # every cut is at a top-level definition
    # a huge single definition is cut at line boundaries into pieces <= max_chars
    huge = "X = [\n" + "    1,\n" * 3000 + "]\n"
    pieces = split_source(huge, target_chars=1000, max_chars=2000)
    assert "".join(pieces) == huge and all(len(p) <= 2000 for p in pieces)
    assert all(p.endswith("\n") for p in pieces)
    # a file that does not parse is still cut, never crashed on
    bad = "def broken(:\n" + "    pass\n" * 500
    assert "".join(split_source(bad, 1000, 1500)) == bad


# --------------------------------------------------------------------------- splits


def test_split_is_stable_when_documents_are_added() -> None:
    ids = [f"doc-{i}" for i in range(2000)]
    before = {i: split_of(i, 0.1, 0.1) for i in ids}
    more = [f"new-{i}" for i in range(5000)] + ids[::-1]
    after = {i: split_of(i, 0.1, 0.1) for i in more}
    assert all(after[i] == before[i] for i in ids)
    counts = {s: list(before.values()).count(s) for s in ("train", "validation", "test")}
    assert 120 < counts["validation"] < 280 and 120 < counts["test"] < 280
    assert split_of("x", 0.0, 0.0) == "train"
    with pytest.raises(ValueError):
        split_of("x", 0.6, 0.6)
    # the value is fixed forever (sha256, not Python's salted hash): pinned numbers
    assert id_unit_interval("json/decoder.py#3") == pytest.approx(0.14242086095740913, abs=1e-15)
    assert [split_of(i, 0.3, 0.3) for i in ("json/decoder.py#3", "a", "doc-7")] == ["test", "validation", "test"]


def test_corpus_splits_partition_the_documents(stdlib_corpus: Corpus) -> None:
    sizes = {s: len(stdlib_corpus.split(s)) for s in ("train", "validation", "test")}
    assert sum(sizes.values()) == stdlib_corpus.num_documents
    assert sizes["validation"] > 100 and sizes["test"] > 100
    assert set(stdlib_corpus.split("test")["split"]) == {"test"}
    with pytest.raises(ValueError):
        stdlib_corpus.split("dev")


def test_python_sources_split_by_file(stdlib_corpus: Corpus) -> None:
    """Chunks of one stdlib file never land in two splits (the group is the file)."""
    ds = stdlib_corpus.dataset
    split_of_file: dict = {}
    for doc_id, group, split in zip(ds["id"], ds["group"], ds["split"]):
        assert doc_id.rsplit("#", 1)[0] == group
        assert split_of_file.setdefault(group, split) == split


def test_max_documents_caps_deterministically(stdlib_corpus: Corpus) -> None:
    a = load_corpus(_cfg(source="python_sources", target_doc_chars=TARGET_FOR_5K, max_documents=300), progress=False)
    assert a.num_documents == 300 and a.skipped["capped_by_max_documents"] == stdlib_corpus.num_documents - 300
    # the kept documents are the 300 with the smallest id hash, in corpus order: a
    # function of the ids alone, so every run keeps the same ones
    ids = stdlib_corpus.dataset["id"]
    expected = sorted(sorted(range(len(ids)), key=lambda i: id_unit_interval(ids[i], "max_documents"))[:300])
    assert a.dataset["id"] == [ids[i] for i in expected]
    assert len(a.labels) >= 20  # a hash sample, not the alphabetically first files


def test_max_train_documents_samples_training_only(stdlib_corpus: Corpus) -> None:
    """data.max_train_documents (what documents_per_path sets) samples the training split
    alone: validation and test are those of the whole corpus, the whole training split is
    still there for the tokenizer, and a larger sample contains a smaller one (so more
    paths add data to what fewer paths saw)."""
    cfg = _cfg(source="python_sources", target_doc_chars=TARGET_FOR_5K)
    small = load_corpus(replace(cfg, max_train_documents=300), progress=False)
    large = load_corpus(replace(cfg, max_train_documents=1200), progress=False)
    whole_train = stdlib_corpus.split("train")["id"]
    for c, n in ((small, 300), (large, 1200)):
        assert c.num_documents == stdlib_corpus.num_documents and "capped_by_max_documents" not in c.skipped
        assert c.split("validation")["id"] == stdlib_corpus.split("validation")["id"]
        assert c.split("test")["id"] == stdlib_corpus.split("test")["id"]
        assert c.split("train", whole=True)["id"] == whole_train
        ids = c.split("train")["id"]
        kept = set(ids)
        assert len(ids) == n and kept <= set(whole_train)
        assert ids == [i for i in whole_train if i in kept]  # corpus order kept
        assert c.summary()["train_sample"] == n
    assert set(small.split("train")["id"]) < set(large.split("train")["id"])
    everything = load_corpus(replace(cfg, max_train_documents=10**9), progress=False)
    assert everything.split("train")["id"] == whole_train  # a cap above the split takes all of it


# --------------------------------------------------------------------------- bad input


def test_jsonl_with_bad_lines_loads_the_good_ones(tmp_path) -> None:
    long_text = "y" * 500
    good = [{"text": f"document number {i} " * 10, "label": f"L{i % 2}"} for i in range(5)]
    lines = [json.dumps(g).encode() for g in good[:2]]
    lines += [b"", b"   "]  # blank lines
    lines += [b'{"text": "unterminated']  # malformed json
    lines += [b'{"text": "caf\xe9 latin-1 bytes here, long enough to count ......................"}']
    lines += [json.dumps({"text": ""}).encode()]  # empty document
    lines += [json.dumps({"text": "short"}).encode()]  # too short
    lines += [json.dumps({"text": "nul\x00byte" * 20}).encode()]  # binary
    lines += [json.dumps({"body": "no text field here " * 10}).encode()]
    lines += [json.dumps({"text": 12345}).encode()]
    lines += [json.dumps({"text": long_text}).encode()]  # truncated, kept
    lines += [json.dumps(g).encode() for g in good[2:]]
    f = tmp_path / "docs.jsonl"
    f.write_bytes(b"\n".join(lines) + b"\n")
    c = load_corpus(_cfg(source="jsonl", path=str(f), label_field="label", max_doc_chars=200), progress=False)
    assert c.num_documents == 6
    assert c.skipped == {
        "binary": 1, "blank_line": 2, "empty": 1, "malformed_json": 1, "missing_text_field": 1,
        "non_utf8": 1, "not_a_string": 1, "too_short": 1, "truncated": 1,
        "missing_label": 1,  # kept: the truncated record has no label
    }
    texts = c.dataset["text"]
    assert [t for t in texts if t.startswith("document")] == [g["text"] for g in good]
    assert "y" * 200 in texts and long_text not in texts
    assert set(c.dataset["label"]) == {"L0", "L1", None}
    assert c.dataset["id"][0] == "docs.jsonl#1"  # ids are file#line: stable


def test_text_directory_with_binary_file(tmp_path) -> None:
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("Alpha document. " * 10, encoding="utf-8")
    (d / "sub" / "b.md").write_text("Beta document, ünïcödé 🙂 " * 10, encoding="utf-8")
    (d / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (d / "latin1.txt").write_bytes("Gamma caf\xe9 ".encode("latin-1") * 20)
    (d / "empty.txt").write_bytes(b"")
    (d / ".hidden").write_text("never read " * 20)
    c = load_corpus(_cfg(source="text", path=str(d)), progress=False)
    assert sorted(c.dataset["id"]) == ["a.txt", "sub/b.md"]
    assert c.skipped == {"binary": 1, "non_utf8": 1, "empty": 1}
    assert any("🙂" in t for t in c.dataset["text"])
    # a glob picks files the same way
    g = load_corpus(_cfg(source="text", path=str(d / "*.txt")), progress=False)
    assert g.dataset["id"] == ["a.txt"]


def test_json_and_parquet_sources(tmp_path) -> None:
    rows = [{"content": f"row {i} " * 20, "topic": "t"} for i in range(4)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    c = load_corpus(_cfg(source="json", path=str(tmp_path / "a.json"), text_field="content",
                         label_field="topic"), progress=False)
    assert c.num_documents == 4 and c.labels == ["t"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"content": [r["content"] for r in rows] + [None], "n": [1, 2, 3, 4, 5]}),
                   tmp_path / "a.parquet")
    p = load_corpus(_cfg(source="parquet", path=str(tmp_path), text_field="content"), progress=False)
    assert p.num_documents == 4 and p.skipped == {"empty": 1}


def test_missing_file_names_the_path(tmp_path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=r"data\.path=.*nope\.jsonl.*Fix") as e:
        load_corpus(_cfg(source="jsonl", path=missing), progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"data\.path"):
        load_corpus(_cfg(source="jsonl", path=None), progress=False)
    with pytest.raises(DataError, match=r"no file matches"):
        load_corpus(_cfg(source="text", path=str(tmp_path / "*.nothing")), progress=False)


def test_missing_text_field_names_the_key(tmp_path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("\n".join(json.dumps({"content": "hello " * 30}) for _ in range(3)))
    with pytest.raises(DataError, match=r"data\.text_field='text'.*content.*Fix") as e:
        load_corpus(_cfg(source="jsonl", path=str(f)), progress=False)
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"data\.label_field='lbl'"):
        load_corpus(_cfg(source="jsonl", path=str(f), text_field="content", label_field="lbl"), progress=False)


def test_all_bad_input_is_a_clear_error(tmp_path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"\n\nnot json\n")
    with pytest.raises(DataError, match=r"no usable document.*malformed_json=1"):
        load_corpus(_cfg(source="jsonl", path=str(f)), progress=False)


def test_hub_offline_is_a_clear_error_not_a_hang() -> None:
    assert os.environ.get("HF_DATASETS_OFFLINE") == "1"  # set by conftest
    t = time.time()
    with pytest.raises(DataError, match=r"data\.path=someone/no-such-dataset.*hub"):
        load_corpus(_cfg(source="hub", path="someone/no-such-dataset"), progress=False)
    assert time.time() - t < 60


def test_hub_streaming_reads_only_the_first_max_documents(monkeypatch) -> None:
    """data.streaming=true asks datasets for a stream and stops after max_documents."""
    import datasets

    calls, served = [], []

    def fake_load_dataset(path, name, split, streaming=False):
        calls.append(streaming)

        def stream():  # an endless stream: reading past the cap would hang the test
            i = 0
            while True:
                served.append(i)
                yield {"text": f"document number {i} " * 8}
                i += 1
        return stream()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    corpus = load_corpus(_cfg(source="hub", path="org/corpus", streaming=True, max_documents=30), progress=False)
    assert calls == [True] and corpus.num_documents == 30 and len(served) == 30


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tmp_path, small_tokenizer: Tokenizer, stdlib_corpus: Corpus) -> None:
    tok = small_tokenizer
    assert tok.vocab_size == 512 and tok.eos_id == 0
    samples = ["def f(x):\n    return x + 1\n", "  leading spaces\t\ttabs\r\n",
               "héllo wörld — 日本語 🙂 ∑", stdlib_corpus.dataset["text"][5]]
    for s in samples:
        assert tok.decode(tok.encode(s)) == s
    path = tok.save(str(tmp_path / "tok"))  # a directory
    assert path.endswith("tokenizer.json")
    loaded = Tokenizer.load(str(tmp_path / "tok"))
    assert loaded.sha256 == tok.sha256
    for s in samples:
        assert loaded.encode(s) == tok.encode(s)
    assert loaded.encode_batch(samples) == [tok.encode(s) for s in samples]
    assert loaded.decode([tok.eos_id]) == "<|endoftext|>"


def test_tokenizer_training_is_deterministic(small_tokenizer: Tokenizer, stdlib_corpus: Corpus) -> None:
    texts = stdlib_corpus.dataset.select(range(0, stdlib_corpus.num_documents, 10))["text"]
    again = Tokenizer.train(texts, 512)
    assert again.sha256 == small_tokenizer.sha256
    other = Tokenizer.train(texts[: len(texts) // 2], 512)
    assert other.sha256 != small_tokenizer.sha256
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(texts, 100)


def test_tokenizer_load_errors(tmp_path) -> None:
    with pytest.raises(DataError, match=r"not found"):
        Tokenizer.load(str(tmp_path / "missing.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match=r"corrupt") as e:
        Tokenizer.load(str(bad))
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- tokenize cache


def test_tokenize_cache_hit(tmp_path, small_tokenizer: Tokenizer, stdlib_corpus: Corpus) -> None:
    ds = stdlib_corpus.dataset.select(range(200))
    cache = str(tmp_path / "cache")
    hits, misses = CACHE_STATS["hits"], CACHE_STATS["misses"]
    a = tokenize_dataset(ds, small_tokenizer, cache_dir=cache, progress=False)
    assert (CACHE_STATS["hits"], CACHE_STATS["misses"]) == (hits, misses + 1)
    entries = [e for e in os.listdir(cache) if e.startswith("tokenized-")]
    assert len(entries) == 1 and not [e for e in os.listdir(cache) if e.startswith(".tmp")]
    assert a["input_ids"][3] == small_tokenizer.encode(ds["text"][3])
    assert a["num_tokens"][3] == len(a["input_ids"][3])
    assert str(a.features["input_ids"].feature) == "Value('int32')"
    # same documents from a freshly built dataset object (new in-memory fingerprint): a hit
    same = stdlib_corpus.dataset.select(range(200)).to_hf()
    b = tokenize_dataset(same, small_tokenizer, cache_dir=cache, progress=False)
    assert (CACHE_STATS["hits"], CACHE_STATS["misses"]) == (hits + 1, misses + 1)
    assert b["input_ids"] == a["input_ids"]
    # other documents or another tokenizer: a miss and a new entry
    tokenize_dataset(stdlib_corpus.dataset.select(range(1, 201)), small_tokenizer, cache_dir=cache, progress=False)
    assert CACHE_STATS["misses"] == misses + 2
    assert len([e for e in os.listdir(cache) if e.startswith("tokenized-")]) == 2
    # no cache dir: tokenized in memory, nothing written
    c = tokenize_dataset(ds, small_tokenizer, progress=False)
    assert c["num_tokens"] == a["num_tokens"]


def test_tokenize_handles_empty_texts(small_tokenizer: Tokenizer) -> None:
    import datasets

    ds = datasets.Dataset.from_dict({"id": ["a", "b"], "text": ["", ""]})
    out = tokenize_dataset(ds, small_tokenizer, progress=False)
    assert out["num_tokens"] == [0, 0]


# --------------------------------------------------------------------------- batches


def _docs(n_docs: int = 30, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, size=int(rng.integers(5, 80))).tolist() for _ in range(n_docs)]


def test_batches_shape_shift_and_determinism() -> None:
    docs = _docs()
    s = TokenStream(docs, seq_len=16, batch_size=4, seed=7, path_id=2, eos_id=0)
    x, y = s.next_batch()
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    assert s.num_tokens == sum(len(d) + 1 for d in docs)
    assert tokens_in_batch(y) == 4 * 16
    again = TokenStream(docs, 16, 4, 7, 2, 0)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(again.next_batch(), (x, y) if _ == 0 else s.next_batch()))
    # consecutive batches differ (batch k depends on k) ...
    assert not torch.equal(s.batch_at(0)[0], s.batch_at(1)[0])
    # ... and a different path or seed draws different windows
    other = TokenStream(docs, 16, 4, 7, 3, 0).next_batch()[0]
    assert not torch.equal(other, x)


def test_batches_resume_from_state_dict() -> None:
    docs = _docs()
    s = TokenStream(docs, 16, 4, seed=1, path_id=0, eos_id=0)
    for _ in range(5):
        s.next_batch()
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    assert state == {"step": 5}
    expected = [s.next_batch() for _ in range(3)]
    r = TokenStream(docs, 16, 4, seed=1, path_id=0, eos_id=0)
    assert not torch.equal(r.batch_at(0)[0], expected[0][0])  # the position matters
    r.load_state_dict(state)
    for ex in expected:
        got = r.next_batch()
        assert torch.equal(got[0], ex[0]) and torch.equal(got[1], ex[1])


def test_batches_worker_group_slices_match_one_process() -> None:
    docs = _docs()
    whole = TokenStream(docs, 16, 8, seed=3, path_id=1, eos_id=0)
    halves = [TokenStream(docs, 16, 8, seed=3, path_id=1, eos_id=0, rank=r, world=2) for r in range(2)]
    for _ in range(3):
        x, y = whole.next_batch()
        parts = [h.next_batch() for h in halves]
        assert parts[0][0].shape == (4, 16)
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match="batch_size"):
        TokenStream(docs, 16, 8, 0, 0, 0, rank=0, world=3)


def test_short_and_empty_shards() -> None:
    s = TokenStream([[5, 6, 7]], seq_len=8, batch_size=2, seed=0, path_id=0, eos_id=0)
    x, y = s.next_batch()
    assert x[0].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert y[0].tolist() == [6, 7, 0] + [IGNORE_INDEX] * 5
    assert tokens_in_batch(y) == 2 * 3
    with pytest.raises(DataError, match="empty"):
        TokenStream([], 8, 2, 0, 0, 0)


def test_from_dataset_matches_token_lists(small_tokenizer: Tokenizer, stdlib_corpus: Corpus) -> None:
    ds = tokenize_dataset(stdlib_corpus.dataset.select(range(50)), small_tokenizer, progress=False)
    sub = ds.select([3, 1, 4, 1, 5])  # indices mapping, repeats: read through it
    a = TokenStream.from_dataset(sub, 32, 4, 0, 0, small_tokenizer.eos_id)
    b = TokenStream(list(sub["input_ids"]), 32, 4, 0, 0, small_tokenizer.eos_id)
    assert np.array_equal(a.stream, b.stream)
    assert torch.equal(a.next_batch()[0], b.next_batch()[0])


def test_eval_batches_cover_every_target_once() -> None:
    docs = _docs(7)
    total = sum(len(d) + 1 for d in docs) - 1
    batches = list(iter_eval_batches(docs, seq_len=16, batch_size=3, eos_id=0))
    assert sum(tokens_in_batch(y) for _, y in batches) == total
    assert all(x.shape[1] == 16 for x, _ in batches)
    assert list(iter_eval_batches([], 16, 3, 0)) == []


# --------------------------------------------------------------------------- memory-mapped tokens


def test_tokenize_to_docs_is_cached_memmap_equal_to_tokenize_dataset(
        tmp_path, small_tokenizer: Tokenizer, stdlib_corpus: Corpus) -> None:
    ds = stdlib_corpus.dataset.select(range(60))
    want = tokenize_dataset(ds, small_tokenizer, progress=False)["input_ids"]
    hits = CACHE_STATS["hits"]
    a = tokenize_to_docs(ds, small_tokenizer, cache_dir=str(tmp_path), progress=False, batch_size=16)
    assert isinstance(a.tokens, np.memmap) and [d.tolist() for d in a] == want
    b = tokenize_to_docs(ds, small_tokenizer, cache_dir=str(tmp_path), progress=False)
    assert CACHE_STATS["hits"] == hits + 1 and np.array_equal(a.starts, b.starts)
    # a damaged cache entry is rebuilt, not trusted
    (entry,) = [p for p in tmp_path.iterdir() if p.name.startswith("tokens-")]
    (entry / "tokens.bin").write_bytes(b"\0" * 4)
    c = tokenize_to_docs(ds, small_tokenizer, cache_dir=str(tmp_path), progress=False)
    assert [d.tolist() for d in c] == want
    assert [d.tolist() for d in tokenize_to_docs(ds, small_tokenizer, progress=False)] == want


def test_memmapped_shards_route_train_and_score_like_in_memory_data(tmp_path) -> None:
    """Acceptance (issue 19, item 1): routing, training and perplexity from memory-mapped
    shards give exactly the numbers the same documents give from in-memory lists."""
    from dipaco.rounds.evaluate import evaluate_single
    from dipaco.rounds.learner import lm_loss
    from modules import ModelConfig, ModuleGrid, PathModel
    from router import Router, assign_in_batches, load_shard, write_shards, write_token_docs
    from router.synthetic import topic_corpus

    docs, _ = topic_corpus(4, docs_per_topic=20, seed=0)
    docs = [d % 60 for d in docs]  # token ids inside the tiny vocabulary
    train, val = docs[:64], docs[64:]
    td = write_token_docs(tmp_path / "corpus", train)
    fit = dict(method="flat", seed=0, prefix_tokens=8)
    mem_router = Router.fit(train, [2, 2], **fit)
    map_router = Router.fit(td.prefixes(8), [2, 2], **fit)
    mem_assign = mem_router.assign(train)
    assert assign_in_batches(map_router, td, batch_size=10) == mem_assign
    write_shards(td, mem_assign, 4, tmp_path / "shards")

    def train_path(shard) -> tuple[list[float], float]:
        model = PathModel(ModuleGrid(ModelConfig(vocab_size=64, d_model=16, n_heads=2, layers_per_level=1,
                                                 max_seq_len=32), [1], seed=0), 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        stream = TokenStream(shard, seq_len=16, batch_size=4, seed=0, path_id=1, eos_id=63)
        losses = []
        for _ in range(4):
            x, y = stream.next_batch()
            loss = lm_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, evaluate_single(val if isinstance(shard, list) else write_token_docs(
            tmp_path / "val", val), model, seq_len=16, prefix_tokens=8)["ppl"]

    in_memory = train_path([train[i] for i, paths in enumerate(mem_assign) if 1 in paths])
    mapped = train_path(load_shard(tmp_path / "shards", 1))
    assert in_memory == mapped and np.isfinite(in_memory[1])


def test_stream_from_a_damaged_shard_is_a_data_error(tmp_path) -> None:
    from router import write_shards

    write_shards([[1, 2, 3], [4, 5, 6, 7]], [[0], [1]], 2, tmp_path / "s")
    assert TokenStream.from_shard(tmp_path / "s", 1, 2, 2, 0, 9).num_tokens == 5  # [4, 5, 6, 7, eos]
    (tmp_path / "s" / "tokens" / "offsets.npy").unlink()
    with pytest.raises(DataError, match=r"missing .*offsets\.npy.*Fix: route again"):
        TokenStream.from_shard(tmp_path / "s", 1, 2, 2, 0, 9)


def test_stream_reads_memmapped_documents_by_offset_like_the_in_memory_stream(tmp_path) -> None:
    from router import write_token_docs

    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50, size=int(n)) for n in rng.integers(0, 30, size=40)] + [np.zeros(0, np.int64)]
    td = write_token_docs(tmp_path / "t", docs)
    rows = [3, 1, 1, 7, 0, 39, 20, 40]  # repeats and an empty document, as top-k shards have
    for in_memory, mapped in [(docs, td), ([docs[i] for i in rows], td.select(rows)),
                              ([docs[5]], td.select([5]))]:  # the last: shorter than a window
        a = TokenStream(list(in_memory), 16, 8, seed=0, path_id=2, eos_id=99, rank=1, world=2)
        b = TokenStream(mapped, 16, 8, seed=0, path_id=2, eos_id=99, rank=1, world=2)
        assert a.num_tokens == b.num_tokens
        for k in range(10):
            assert all(torch.equal(u, v) for u, v in zip(a.batch_at(k), b.batch_at(k)))
