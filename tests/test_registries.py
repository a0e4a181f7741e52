"""The registries of named choices (docs/design.md, "Adding a codec", "Adding a data
source"): a throwaway entry, registered by one line and removed after, is accepted by the
config and used by the code, with nothing else to change."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import pytest

from dipaco.config import ConfigError, DataConfig, codec_kwargs, compose_config
from dipaco.config.names import CODECS, DATA_SOURCES, CodecEntry, SourceEntry
from dipaco.config.validate import validate_config
from dipaco.data import load_corpus
from dipaco.data.sources import FileContext, Record
from dipaco.plan.build import build_comm_plan
from dipaco.plan.codecs import Int8Codec, make_codec

SMOKE = ["experiment=smoke"]


class HalvedInt8Codec(Int8Codec):
    """A throwaway codec: int8 blocks of half the configured size."""

    name = "int8_half"

    def __init__(self, block_size: int = 256) -> None:
        super().__init__(max(1, block_size // 2))


def read_lines(path: str, rel: str, ctx: FileContext) -> Iterator[Record]:
    """A throwaway reader: every non-empty line of a file is a document."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                yield f"{rel}:{i}", {ctx.text_field: line.strip()}, False


@pytest.fixture()
def throwaway_codec(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(CODECS, "int8_half", CodecEntry(f"{__name__}:HalvedInt8Codec", {"block_size": "codec_block"}))
    return "int8_half"


def test_a_registered_codec_is_accepted_and_encodes(throwaway_codec: str) -> None:
    cfg = compose_config(SMOKE + [f"diloco.codec={throwaway_codec}", "diloco.codec_block=64"])
    validate_config(cfg)  # its name is in the domain, and codec_block applies to it
    assert codec_kwargs(cfg.diloco) == {"block_size": 64}
    codec = make_codec(cfg.diloco.codec, **codec_kwargs(cfg.diloco))
    assert isinstance(codec, HalvedInt8Codec) and codec.block_size == 32
    plan = build_comm_plan(cfg, 1)  # the planner counts its bytes
    assert plan.ddp_bytes_per_round > 0


def test_an_unregistered_codec_is_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="diloco.codec: unknown value 'int8_half'.*use one of .*int8") as e:
        validate_config(compose_config(SMOKE + ["diloco.codec=int8_half"]))
    assert "\n" not in str(e.value)


def test_a_codec_option_applies_only_to_the_codecs_that_read_it(throwaway_codec: str) -> None:
    with pytest.raises(ConfigError, match="diloco.codec_block=64 is read only by diloco.codec=int8, int4 or fp8"):
        validate_config(compose_config(SMOKE + ["diloco.codec=topk", "diloco.codec_block=64"]))


def test_a_registered_data_source_is_accepted_and_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(DATA_SOURCES, "lines", SourceEntry("files", f"{__name__}:read_lines", (".lines",)))
    (tmp_path / "a.lines").write_text("".join(f"document number {i} of a.lines\n" for i in range(40)))
    (tmp_path / "b.txt").write_text("not picked up: the source reads .lines files only\n")
    validate_config(compose_config(SMOKE + ["data.source=lines", f"data.path={tmp_path}", "data.min_doc_chars=1"]))
    cfg: Any = replace(DataConfig(), source="lines", path=str(tmp_path), min_doc_chars=1, val_fraction=0.1)
    with load_corpus(cfg, progress=False) as corpus:
        texts = sorted(corpus.dataset["text"])
    assert texts == sorted(f"document number {i} of a.lines" for i in range(40))


def test_every_registered_source_and_codec_points_at_code() -> None:
    """Each registry line names a reader / class that exists (imported here)."""
    from dipaco.config.names import load
    from dipaco.plan.codecs import Codec

    for name, entry in CODECS.items():
        cls = load(entry.where)
        assert issubclass(cls, Codec) and cls.name == name, name
        assert entry.lossy == cls.lossy, f"{name}: its registry line's lossy must be its class's"
    for name, src in DATA_SOURCES.items():
        assert (src.reader is not None) == (src.kind in ("builtin", "files")), name
        if src.reader:
            assert callable(load(src.reader)), name
