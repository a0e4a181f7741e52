"""A token store's header names the tokenizer its ids were made with, and reading
refuses another (dipaco/data/pretokenized.py): ids made with one BPE fit another's
vocabulary, so nothing else would notice."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dipaco.config import DataConfig
from dipaco.data import DataError, Tokenizer, load_token_corpus
from dipaco.data.pretokenized import write_token_header

TEXTS = [f"def g_{i}(y):\n    return y - {i} * {i % 5}\n" * 2 for i in range(60)]


@pytest.fixture(scope="module")
def tokenizers() -> tuple[Tokenizer, Tokenizer]:
    """Two BPEs of the same size trained on different text: each one's ids fit the other."""
    return Tokenizer.train(TEXTS, 300), Tokenizer.train([t.upper() for t in TEXTS], 300)


def _store(d: Path, tok: Tokenizer, header_tokenizer: Tokenizer | None) -> Path:
    d.mkdir(parents=True)
    docs = [tok.encode(t) for t in TEXTS]
    np.concatenate([np.asarray(x, "<u2") for x in docs]).tofile(d / "tokens.bin")
    np.save(d / "offsets.npy", np.concatenate([[0], np.cumsum([len(x) for x in docs])]).astype(np.int64))
    if header_tokenizer is None:  # a store written before headers named their tokenizer
        (d / "tokens.json").write_text(json.dumps({"dtype": "uint16"}))
    else:
        write_token_header(d, "<u2", header_tokenizer)
    return d


def _load(path: Path, **kw):
    cfg = replace(DataConfig(), source="tokens", text_field="input_ids", path=str(path), **kw)
    return load_token_corpus(cfg, progress=False, work_dir=str(path.parent / "work"))


def test_ids_of_another_tokenizer_are_refused_in_one_line(tmp_path, tokenizers) -> None:
    mine, other = tokenizers
    d = _store(tmp_path / "tok", other, other)  # made with another BPE ...
    mine.save(str(d))  # ... beside this run's tokenizer
    with pytest.raises(DataError, match="were made with another tokenizer") as e:
        _load(d)
    assert "\n" not in str(e.value) and "Fix: pass the tokenizer they were made with" in str(e.value)
    other.save(str(tmp_path / "other.json"))
    with pytest.raises(DataError, match="another tokenizer"):  # data.tokenizer is checked the same way
        _load(_store(tmp_path / "tok2", other, mine), tokenizer=str(tmp_path / "other.json"))
    with _load(d, tokenizer=str(tmp_path / "other.json")) as corpus:  # the right one: read
        assert corpus.num_documents == len(TEXTS)


def test_a_store_without_the_tokenizer_in_its_header_is_refused_and_the_fix_works(tmp_path, tokenizers) -> None:
    mine, _ = tokenizers
    d = _store(tmp_path / "tok", mine, None)
    mine.save(str(d))
    with pytest.raises(DataError, match="does not name the tokenizer") as e:
        _load(d)
    line = str(e.value).split("add ", 1)[1].split(" to tokens.json")[0]
    header = json.loads((d / "tokens.json").read_text())
    (d / "tokens.json").write_text(json.dumps({**header, **json.loads("{" + line + "}")}))
    with _load(d) as corpus:
        assert [x.tolist() for x in corpus.split("train", whole=True).token_docs()][:1] == \
            [mine.encode(TEXTS[int(corpus.split("train", whole=True)["id"][0].lstrip("#"))])]
