"""The token splits a run was prepared with, recorded so that a resume needs no corpus.

Preparing a run reads the raw corpus, hashes every split and tokenizes it into the token
cache. A resume (or a requeued SLURM job) used to do all of that again, only to find the
cache entries it had written: seconds on a smoke run, growing with the corpus. So the
first preparation records, under ``tokens`` in ``fingerprints.json``, what each split's
cache entry is (its name, which is a hash of the split's content and the tokenizer, its
document and token counts and the sha256 of its offsets), plus the labels the routing
reports need (``labels-<key>.npz`` beside the entries). A later preparation of the same
run takes the splits from there when every recorded piece is on disk as recorded: the
corpus is not read and no document is tokenized (or routed: :mod:`dipaco.job.prepare`
reuses the shards the same way). The run's data is then what the run was made from,
even if ``data.path`` has changed or gone since: the saved config is the truth on resume.

A recorded piece that is missing or does not match (a cache entry deleted, the cache
moved with ``data.cache_dir``, an offsets file that is not the one recorded) is never a
pass: one log line names it and the corpus is read again, which recomputes the entry and
checks the data against the tokenizer's record (a resume whose data changed is refused
there). A run recorded before this record has none: its corpus is read, as before.
A ``tokens.bin`` rewritten in place, even to the same length, is refused where it is
read: every entry carries the sha256 its writer took of it (``tokens.sha256``, checked by
:func:`router.tokens.open_token_docs`, about 2 s a GB), and the record names that sha256 too.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from dipaco.config import Config
from dipaco.data import Tokenizer
from dipaco.run.checkpoint import sha256_file, write_json
from dipaco.run.fingerprint import Fingerprints, read_fingerprints
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.storage.atomic import write_atomically
from dipaco.storage.hashing import short_key
from router import TokenDocs
from router.tokens import CHECKSUM_FILE, OFFSETS_FILE, TokenFileError, open_token_docs

RECORD = "tokens"  # the key of fingerprints.json holding the record
_TOKENIZER_INPUTS = ("data", "given", "bpe_text")  # what the tokenizer's record names besides config keys


def entry_name(content: str, tokenizer_sha256: str) -> str:
    """The token cache's entry of a split whose content hash is ``content`` (the key of
    :func:`dipaco.data.tokenize.cache_path` and of the pre-tokenized copy)."""
    return "tokens-" + short_key(f"{content}:{tokenizer_sha256}")


def describe_split(cache_dir: str, content: str, tokenizer: Tokenizer, ids: TokenDocs) -> dict[str, Any]:
    """The record of one split's cache entry (``ids``: what was read or written there)."""
    name = entry_name(content, tokenizer.sha256)
    checksum = Path(cache_dir) / name / CHECKSUM_FILE
    return {"content": content, "entry": name, "documents": len(ids), "tokens": int(ids.num_tokens),
            "offsets_sha256": sha256_file(Path(cache_dir) / name / OFFSETS_FILE),
            "tokens_sha256": checksum.read_text(encoding="ascii").strip() if checksum.is_file() else None}


def labels_name(data_fp: str, label_field: Optional[str]) -> str:
    return "labels-" + short_key(f"{data_fp}:{label_field}") + ".npz"


def save_record(fps: Fingerprints, cache_dir: str, record: dict[str, Any], val_labels: list,
                train_labels: Optional[np.ndarray]) -> None:
    """Write the labels file (when the data has labels) and ``record`` into
    ``fingerprints.json``; nothing when the same record is there already. Called once
    preparation accepted everything, so a refused resume writes nothing."""
    record = dict(record, labels=None)
    if train_labels is not None:
        path = Path(cache_dir) / labels_name(record["data"], record["label_field"])
        known = np.array([lab is not None for lab in val_labels], dtype=bool)
        names = np.array(["" if lab is None else str(lab) for lab in val_labels], dtype=str)

        def fill(tmp: Path) -> None:
            with open(tmp, "wb") as tmp_file:  # a file object: np.savez would add .npz to a name
                np.savez(tmp_file, train=np.asarray(train_labels, np.int32), validation=names, validation_known=known)

        write_atomically(path, fill)
        record["labels"] = {"file": path.name, "sha256": sha256_file(path)}
    if fps.saved.get(RECORD) != record:
        fps.saved[RECORD] = record
        write_json(fps.path, fps.saved)


def reuse_splits(cfg: Config, run: RunDir, fps: Fingerprints, cache_dir: str,
                 log: Callable[[str], None]) -> Optional[dict[str, Any]]:
    """The token splits of ``run`` as recorded, without reading the corpus; ``None`` (with
    a line saying why, when there was a record) where the corpus must be read. Returns
    the pieces of :class:`dipaco.job.prepare_tokens.TokenSplits` as a dict."""
    t0 = time.perf_counter()
    rec, tok_rec = fps.saved.get(RECORD), fps.saved.get("tokenizer")
    if not isinstance(rec, dict) or not isinstance(tok_rec, dict) or not run.tokenizer.is_file():
        return None  # a fresh run, or one recorded before this record: the corpus is read
    if rec.get("data") != tok_rec.get("data") or rec.get("label_field") != cfg.data.label_field:
        return _recompute(log, "the recorded token splits are not those of the run's tokenizer record")
    inputs = {k: tok_rec[k] for k in _TOKENIZER_INPUTS if k in tok_rec}
    # the tokenizer's config keys (data.*, model.vocab_size) as recorded: a resume that
    # changed one is refused here, as it would be with the corpus read
    if not fps.reusable("tokenizer", fps.want("tokenizer", **inputs), True, "tokenizer.json"):
        return None
    tokenizer = Tokenizer.load(str(run.tokenizer))
    if tokenizer.sha256 != rec.get("tokenizer"):
        return _recompute(log, f"{run.tokenizer} is not the tokenizer the token splits were recorded with")
    ids: dict[str, TokenDocs] = {}
    for split, entry in rec.get("splits", {}).items():
        got = _open_entry(Path(cache_dir), entry)
        if isinstance(got, str):
            return _recompute(log, got)
        ids[split] = got
    if "train" not in ids or "validation" not in ids or cfg.trainer.eval_split not in ids:
        return _recompute(log, "the token record lacks a split this run evaluates")
    rows = evaluated_rows(len(ids["validation"]), cfg.trainer.eval_max_documents)
    labels = _labels(Path(cache_dir), rec.get("labels"), len(rows), len(ids["train"]))
    if isinstance(labels, str):
        return _recompute(log, labels)
    val_labels, train_labels = labels
    eval_ids = ids[cfg.trainer.eval_split]
    eval_ids = eval_ids.select(evaluated_rows(len(eval_ids), cfg.trainer.eval_max_documents))
    log(f"tokens: the token cache that {fps.path.name} records ({len(ids['train'])} train, "
        f"{len(ids['validation'])} validation documents in {cache_dir}); the corpus is not read again")
    return {"tokenizer": tokenizer, "train_ids": ids["train"], "val_ids": ids["validation"].select(rows),
            "val_labels": val_labels, "eval_ids": eval_ids, "train_labels": train_labels,
            "data_fp": rec["data"], "seconds": time.perf_counter() - t0}


def evaluated_rows(n: int, max_documents: Optional[int]) -> np.ndarray:
    """Rows of a split's ``n`` documents that the evaluation scores: all of them, or
    ``max_documents`` spread evenly over the split (row ``floor(i * n / max_documents)``).

    Spread, not the first rows: a split is in corpus order, i.e. sorted by domain (or by
    package for python_sources), so its first 400 documents of the multidomain corpus were
    python and C/C++ only. An even spread keeps every domain in proportion and is a
    function of ``n`` alone, so every run and ``dipaco-infer score`` pick the same rows.
    """
    if max_documents is None or n <= int(max_documents):
        return np.arange(n, dtype=np.int64)
    k = int(max_documents)
    return (np.arange(k, dtype=np.int64) * n) // k


def _recompute(log: Callable[[str], None], why: str) -> None:
    log(f"tokens: {why}: reading the corpus again to recompute the token splits")
    return None


def recorded_split(run: RunDir, cache_dir: str, split: str) -> Optional[TokenDocs]:
    """``split``'s token ids as the run recorded them (its own copy: the corpus is not
    read), or ``None`` where the record has no usable entry for it. Read only: nothing
    is removed or rewritten (a reader of a finished run writes nothing into it)."""
    try:
        rec = read_fingerprints(run).get(RECORD)
        tok = read_fingerprints(run).get("tokenizer")
        entry = rec["splits"][split] if isinstance(rec, dict) else None
    except (RunDirError, KeyError, TypeError):
        return None
    if entry is None or not isinstance(tok, dict) or rec.get("tokenizer") is None:
        return None
    got = _open_entry(Path(cache_dir), entry, remove=False)
    return None if isinstance(got, str) else got


def check_corpus(run: RunDir, data_fp: str, what: str) -> None:
    """Refuse (one line naming ``what``) a corpus read again whose train and validation
    texts are not those ``run`` recorded when it was made (rule 3: a run's inputs are what
    it ran on): a file edited, a package of the built-in corpus upgraded since."""
    recorded = (read_fingerprints(run).get("tokenizer") or {}).get("data")
    if recorded is None:
        raise RunDirError(f"{run.root / 'fingerprints.json'} records no fingerprint of the data, so {what} cannot "
                          "be checked as the corpus the run was trained on; score the documents with --file")
    if recorded != data_fp:
        raise RunDirError(f"{what} is not the corpus {run.root} was trained on (its train and validation texts "
                          "differ from those fingerprints.json records: edited, or its packages upgraded since); "
                          "restore it, or score the documents with --file")


def _open_entry(cache_dir: Path, entry: Any, remove: bool = True) -> TokenDocs | str:
    """The recorded entry, memory-mapped, or why it cannot be used (``remove``: a
    well-formed entry that is not the recorded one is deleted, so the cache rebuilds it)."""
    try:
        path = cache_dir / str(entry["entry"])
        want = (int(entry["documents"]), int(entry["tokens"]), str(entry["offsets_sha256"]))
    except (TypeError, KeyError, ValueError):
        return "the token record is damaged"
    if not path.is_dir():
        return f"the token cache entry {path} is missing"
    try:
        docs = open_token_docs(path)
    except TokenFileError as e:
        return f"the token cache entry {path} is damaged ({e})"
    recorded = entry.get("tokens_sha256") if isinstance(entry, dict) else None
    written = (path / CHECKSUM_FILE).read_text(encoding="ascii").strip() if recorded else None
    if (len(docs), int(docs.num_tokens), sha256_file(path / OFFSETS_FILE)) != want or written != recorded:
        # well-formed, so the cache would serve it again: removed, the corpus read rebuilds it
        del docs
        if remove:
            shutil.rmtree(path, ignore_errors=True)
        return f"the token cache entry {path} is not the one recorded (other documents or token counts; removed)"
    return docs


def _labels(cache_dir: Path, rec: Any, n_val: int, n_train: int) -> tuple[list, Optional[np.ndarray]] | str:
    if rec is None:
        return [None] * n_val, None
    path = cache_dir / str(rec.get("file"))
    if not path.is_file():
        return f"the labels file {path} is missing"
    if sha256_file(path) != rec.get("sha256"):
        return f"the labels file {path} is not the one recorded"
    with np.load(path, allow_pickle=False) as z:
        train, names, known = z["train"], z["validation"], z["validation_known"]
    if len(train) != n_train or len(names) != n_val:
        return f"the labels file {path} does not match the token splits"
    return [str(name) if k else None for name, k in zip(names.tolist(), known.tolist())], train
