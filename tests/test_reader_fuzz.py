"""Generated-file fuzz test of the readers: every bad record costs itself only.

Each case writes a JSON-lines file of good documents and bad lines of random kinds
(seeded), in random order, sometimes behind a byte-order mark or with CRLF line ends, then
loads it as training does (``load_corpus``) and as ``dipaco-infer --file`` does
(``read_jsonl``). Both must keep exactly the good documents, in order, and count every
bad line once: no traceback, no hang, nothing lost or invented.
"""
from __future__ import annotations

import codecs
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from dipaco.cli.infer import read_jsonl
from dipaco.config import DataConfig
from dipaco.data import load_corpus


def _good(i: int, rng: random.Random) -> tuple[bytes, str]:
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "délta", "日本", "x"]) for _ in range(20))
    text = f"document {i}: {words}"
    return json.dumps({"text": text, "n": i}, ensure_ascii=rng.random() < 0.5).encode(), text


# each makes one line that no reader may keep; none is blank (a blank line is no record)
BAD_KINDS = {
    "random bytes": lambda rng: bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 60))).replace(b"\n", b"?").replace(b"\r", b"?").strip() or b"\xff",
    "truncated JSON": lambda rng: b'{"text": "cut off here',
    "a JSON array": lambda rng: b'["text", "not an object"]',
    "a bare string": lambda rng: b'"text"',
    "deep nesting": lambda rng: b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "lone surrogate": lambda rng: b'{"text": "bad \\udc80 text that is long enough to be kept"}',
    "invalid UTF-8": lambda rng: b'{"text": "caf\xe9 latin-1 text that is long enough"}',
    "text is a number": lambda rng: b'{"text": 12345}',
    "text is a list": lambda rng: b'{"text": ["a", "b"]}',
    "text is null": lambda rng: b'{"text": null}',
    "no text field": lambda rng: b'{"body": "the wrong field, long enough to be a document"}',
    "empty text": lambda rng: b'{"text": "   "}',
    "NUL in text": lambda rng: b'{"text": "binary \\u0000 inside a long enough text"}',
}


def _case(seed: int, tmp_path: Path) -> tuple[Path, list[str], int, set[str]]:
    rng = random.Random(seed)
    lines, good, bad, kinds = [], [], 0, set()
    for i in range(rng.randrange(5, 40)):
        if rng.random() < 0.5:
            raw, text = _good(i, rng)
            lines.append(raw)
            good.append(text)
        else:
            kind = rng.choice(sorted(BAD_KINDS))
            lines.append(BAD_KINDS[kind](rng))
            bad += 1
            kinds.add(kind)
    end = b"\r\n" if rng.random() < 0.3 else b"\n"
    body = end.join(lines) + (end if rng.random() < 0.8 else b"")
    if rng.random() < 0.3:
        body = codecs.BOM_UTF8 + body
    f = tmp_path / f"fuzz{seed}.jsonl"
    f.write_bytes(body)
    return f, good, bad, kinds


@pytest.mark.parametrize("seed", range(12))
def test_generated_files_keep_every_good_document_and_count_every_bad_line(seed: int, tmp_path: Path, capsys) -> None:
    f, good, bad, _ = _case(seed, tmp_path)
    if good:
        cfg = replace(DataConfig(), source="jsonl", path=str(f), min_doc_chars=1, val_fraction=0.01,
                      test_fraction=0.0, splits="hash")
        c = load_corpus(cfg, progress=False)
        assert sorted(c.dataset["text"]) == sorted(good)
        assert sum(c.skipped.values()) == bad, c.skipped
        texts, skipped = read_jsonl(str(f), "text")
        assert texts == good and skipped == bad
    else:  # nothing usable: one line each, no traceback
        with pytest.raises(SystemExit):
            read_jsonl(str(f), "text")
        assert len(capsys.readouterr().err.strip().splitlines()[-1]) < 300


def test_the_fuzz_cases_cover_every_bad_kind(tmp_path: Path) -> None:
    """The seeds above draw every kind of bad line at least once (else a kind is untested)."""
    seen: set[str] = set()
    for seed in range(12):
        seen |= _case(seed, tmp_path)[3]
    assert seen == set(BAD_KINDS)
