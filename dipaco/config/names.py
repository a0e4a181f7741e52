"""The registries of named choices whose implementations live higher up: codecs, data
sources, devices, precisions and collective backends.

Each name is declared once, here, as plain data (no torch, no reader library): the config
checks a value against these tables, and the implementation finds its code through them
(``"module:attribute"``, imported only when the choice is used), as the routing methods'
``router.methods.REGISTRY`` does. Adding a codec or a data source is its module and one
line below (docs/design.md, "Adding a codec", "Adding a data source"); nothing else names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Mapping, Optional, Tuple

__all__ = ["BACKENDS", "CODECS", "DATA_SOURCES", "DEVICES", "PRECISIONS", "CodecEntry", "SourceEntry", "load",
           "codec_options", "local_sources", "source_suffixes"]

DEVICES = ("auto", "cuda", "cpu")  # trainer.device (dipaco/runtime/device.py places ranks)
BACKENDS = ("auto", "gloo", "nccl")  # launcher.backend
PRECISIONS = ("fp32", "bf16", "fp16")  # trainer.precision (dipaco/runtime/device.py maps each to a dtype)


def load(where: str) -> Any:
    """The attribute a registry line names (``"dipaco.plan.codecs:Int8Codec"``), imported now."""
    module, attr = where.split(":")
    return getattr(import_module(module), attr)


@dataclass(frozen=True)
class CodecEntry:
    """One codec: its class and the ``diloco.*`` key each constructor keyword reads."""

    where: str  # "module:Class" of a dipaco.plan.codecs.Codec subclass
    options: Mapping[str, str] = field(default_factory=dict)  # keyword -> diloco key
    # the class's ``lossy`` (said here so the config reads it without importing torch):
    # error feedback and the lossy exchange act with a lossy codec only
    lossy: bool = True


_BLOCK = {"block_size": "codec_block"}
# diloco.codec -> its class and options (dipaco/plan/codecs.py holds the classes)
CODECS: dict[str, CodecEntry] = {
    "none": CodecEntry("dipaco.plan.codecs:NoneCodec", lossy=False),
    "fp16": CodecEntry("dipaco.plan.codecs:FP16Codec"),
    "bf16": CodecEntry("dipaco.plan.codecs:BF16Codec"),
    "int8": CodecEntry("dipaco.plan.codecs:Int8Codec", _BLOCK),
    "int4": CodecEntry("dipaco.plan.codecs:Int4Codec", _BLOCK),
    "fp8": CodecEntry("dipaco.plan.codecs:FP8Codec", _BLOCK),
    "topk": CodecEntry("dipaco.plan.codecs:TopKCodec", {"fraction": "codec_topk_fraction"}),
}


def codec_options(diloco: Any) -> dict[str, Any]:
    """The keyword arguments of ``diloco.codec``'s class, read from ``diloco`` (a
    :class:`~dipaco.config.DiLoCoConfig`) as its registry line says."""
    entry = CODECS.get(str(diloco.codec).lower())
    return {} if entry is None else {kw: getattr(diloco, key) for kw, key in entry.options.items()}


@dataclass(frozen=True)
class SourceEntry:
    """One data source (``data.source``): where its documents come from and who reads them.

    ``kind``: ``builtin`` (documents from this install, no ``data.path``), ``files``
    (``data.path`` names local files, a glob or a directory; ``reader`` reads one file),
    ``hub`` (a Hugging Face dataset name or a ``save_to_disk`` folder) or ``tokens``
    (token files written by dipaco-prepare-tokens, read by the training job itself).
    """

    kind: str
    reader: Optional[str] = None  # "module:function" (dipaco/data/sources.py says the signatures)
    suffixes: Optional[Tuple[str, ...]] = None  # files: names picked up in a directory (None: every file)
    whole_file: bool = False  # files: one document per file, so there are no fields to pick


_JSON = (".jsonl", ".ndjson", ".json")
DATA_SOURCES: dict[str, SourceEntry] = {
    "python_sources": SourceEntry("builtin", "dipaco.data.sources:read_python_sources"),
    "multidomain": SourceEntry("builtin", "dipaco.data.sources:read_multidomain"),
    "jsonl": SourceEntry("files", "dipaco.data.sources:read_json_lines", _JSON),
    "json": SourceEntry("files", "dipaco.data.sources:read_json", (".json", ".jsonl", ".ndjson")),
    "parquet": SourceEntry("files", "dipaco.data.sources:read_parquet", (".parquet",)),
    "text": SourceEntry("files", "dipaco.data.sources:read_text", None, whole_file=True),
    "hub": SourceEntry("hub"),
    "tokens": SourceEntry("tokens"),
}


def local_sources() -> Tuple[str, ...]:
    """The sources that read local files named by ``data.path``."""
    return tuple(n for n, s in DATA_SOURCES.items() if s.kind == "files")


def source_suffixes(source: str) -> Optional[Tuple[str, ...]]:
    """The file name endings a ``files`` source picks up in a directory (None: every file)."""
    entry = DATA_SOURCES.get(source)
    return None if entry is None else entry.suffixes
