"""Pre-tokenized input (``data=tokens``, issue 31 item 5): token shards or records of ids,
no tokenizer pass, the tokenizer beside the data used for inference."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dipaco.config import DataConfig
from dipaco.data import DataError, Tokenizer, load_token_corpus
from dipaco.data.pretokenized import write_token_header

TEXTS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}\n" * 3 for i in range(120)]


def _cfg(**kw) -> DataConfig:
    return replace(DataConfig(), **{"source": "tokens", "text_field": "input_ids", **kw})


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(TEXTS, 300)


def write_shard(directory: Path, docs: list, dtype: str = "<u2", tokenizer: Tokenizer | None = None) -> Path:
    """A token directory as docs/data.md describes it (its header names ``tokenizer``)."""
    directory.mkdir(parents=True, exist_ok=True)
    lengths = [len(d) for d in docs]
    np.concatenate([np.asarray(d, dtype) for d in docs]).tofile(directory / "tokens.bin")
    np.save(directory / "offsets.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    if tokenizer is not None:
        write_token_header(directory, dtype, tokenizer)
    else:
        (directory / "tokens.json").write_text(json.dumps({"dtype": np.dtype(dtype).name}))
    return directory


def test_a_token_directory_is_read_in_place_and_copied_per_split(tmp_path, tokenizer) -> None:
    docs = [tokenizer.encode(t) for t in TEXTS]
    write_shard(tmp_path / "tok", docs, "<u2", tokenizer)
    tokenizer.save(str(tmp_path / "tok"))
    c = load_token_corpus(_cfg(path=str(tmp_path / "tok")), progress=False)
    assert c.num_documents == 120 and c.skipped == {} and c.own_splits == ()
    assert c.tokens.tokens.dtype == np.dtype("<u2")  # memory-mapped as written, no copy
    train = c.split_tokens("train", str(tmp_path / "cache"), tokenizer)
    want = [docs[int(i.split("#")[1])] for i in c.split("train")["id"]]
    assert [d.tolist() for d in train] == want and train.tokens.dtype == np.dtype("<i4")
    again = c.split_tokens("train", str(tmp_path / "cache"), tokenizer)  # cached
    assert again.tokens.filename == train.tokens.filename
    small = Tokenizer.train(TEXTS[:5], 258)
    with pytest.raises(DataError, match=r"token id \d+ is outside the 2\d\d ids of the tokenizer"):
        c.split_tokens("validation", str(tmp_path / "cache"), small)
    c.close()


def test_uint32_shards_with_their_own_splits(tmp_path, tokenizer) -> None:
    docs = [tokenizer.encode(t) for t in TEXTS]
    write_shard(tmp_path / "d" / "train-0", docs[:50], "<u4")
    write_shard(tmp_path / "d" / "train-1", docs[50:100], "<u4")
    write_shard(tmp_path / "d" / "validation", docs[100:], "<u4")
    c = load_token_corpus(_cfg(path=str(tmp_path / "d"), test_fraction=0.1), progress=False)
    assert c.own_splits == ("validation",) and len(c.split("validation")) == 20
    assert len(c.split("train")) + len(c.split("test")) == 100 and len(c.split("test")) > 0
    assert c.split("validation")["id"][0] == "validation#0"
    assert [d.tolist() for d in c.split("validation").token_docs()] == docs[100:]


def test_a_broken_token_directory_is_one_line(tmp_path) -> None:
    d = write_shard(tmp_path / "t", [[1, 2, 3], [4, 5]])
    (d / "tokens.bin").write_bytes(b"\0" * 7)
    with pytest.raises(DataError, match=r"tokens\.bin holds 7 bytes for the 5 token ids.*Fix") as e:
        load_token_corpus(_cfg(path=str(d)), progress=False)
    assert "\n" not in str(e.value)
    np.save(d / "offsets.npy", np.array([0, 3, 2]))
    with pytest.raises(DataError, match=r"offsets\.npy is not a non-decreasing"):
        load_token_corpus(_cfg(path=str(d)), progress=False)


def test_records_of_token_ids_with_bad_ones_counted(tmp_path, tokenizer) -> None:
    rows = [{"input_ids": tokenizer.encode(t), "topic": str(i % 2)} for i, t in enumerate(TEXTS[:40])]
    rows += [{"input_ids": "not ids"}, {"input_ids": [1, -2]}, {"input_ids": [1, True]}, {"input_ids": []},
             {"input_ids": [[1, 2]]}, {"text": "no ids"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = load_token_corpus(_cfg(path=str(tmp_path / "d.jsonl"), label_field="topic"), progress=False)
    assert c.num_documents == 40 and c.labels == ["0", "1"]
    # the records without ids have no label either: they are left out before it counts
    assert c.skipped == {"bad_token_ids": 4, "empty": 1, "missing_text_field": 1}
    with pytest.raises(DataError, match=r"data\.text_field='ids' is not a key"):
        load_token_corpus(_cfg(path=str(tmp_path / "d.jsonl"), text_field="ids"), progress=False)


@pytest.mark.slow
def test_a_pre_tokenized_corpus_trains_and_infers(tmp_path: Path, capsys) -> None:
    """dipaco-train data=tokens on token shards with a tokenizer beside them, then
    dipaco-infer route / score / generate on the run."""
    from dipaco.cli.infer import main as infer_main
    from dipaco.config import compose_config
    from dipaco.data import load_corpus
    from dipaco.job.preflight import compose
    from dipaco.job.train import train

    text_cfg = compose_config(["experiment=smoke", "data.max_documents=200"]).data
    with load_corpus(text_cfg, progress=False) as corpus:
        texts = corpus.dataset["text"]
    tok = Tokenizer.train(texts, 512)
    write_shard(tmp_path / "tokens", [tok.encode(t) for t in texts], tokenizer=tok)
    tok.save(str(tmp_path / "tokens"))
    run_dir = tmp_path / "run"
    cfg = compose(["experiment=smoke", "data=tokens", f"data.path={tmp_path / 'tokens'}",
                   "trainer.dense_baseline=false", "trainer.plots=false"], run_dir)
    assert cfg.model.vocab_size == tok.vocab_size  # from the tokenizer beside the shards
    summary = train(cfg)
    assert np.isfinite(summary["routed_ppl"]) and summary["routed_ppl"] > 1.0
    assert (run_dir / "tokenizer.json").read_bytes() == (tmp_path / "tokens" / "tokenizer.json").read_bytes()

    def cli(*argv: str) -> dict:
        capsys.readouterr()
        infer_main([str(a) for a in argv])
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert 0 <= cli("route", run_dir, "--text", texts[0])["path_id"] < 4
    scored = cli("score", run_dir, "--validation")
    assert np.isclose(scored["ppl"], summary["routed_ppl"], rtol=1e-9)
    out = cli("generate", run_dir, "--prompt", "def ", "--max-new-tokens", "8", "--ignore-eos", "--json")
    assert out["new_tokens"] == 8 and tok.decode(out["prompt_ids"]) == "def "
