"""The hashes dipaco writes down or derives names from, in one place.

sha256 names every artefact (checkpoint manifests, exports, run fingerprints, cache
keys, the tokenizer); the split of a document and its sample order hash its id. Each
function fixes an encoding, so that a value written by one writer is reproduced by a
reader elsewhere: changing one changes file contents and cache keys (a test pins them).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Union
from dipaco.storage.strict_json import dumps_strict

_CHUNK = 1 << 20


def sha256_file(path: Union[str, os.PathLike], chunk: int = _CHUNK) -> str:
    """Hex sha256 of a file's bytes, read in chunks (a manifest's ``sha256``)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _bytes(data: Union[str, bytes]) -> bytes:
    # surrogatepass: file names and ids read from disk may hold lone surrogates
    return data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data


def sha256_hex(data: Union[str, bytes]) -> str:
    """Hex sha256 of ``data`` (a str is hashed as UTF-8)."""
    return hashlib.sha256(_bytes(data)).hexdigest()


def sha256_digest(data: Union[str, bytes]) -> bytes:
    """Raw sha256 of ``data`` (a str is hashed as UTF-8): an order or a unit interval."""
    return hashlib.sha256(_bytes(data)).digest()


def sha256_json(obj: Any) -> str:
    """Hex sha256 of ``obj`` as JSON with sorted keys: a record's fingerprint."""
    return sha256_hex(dumps_strict(obj, sort_keys=True))


def short_key(data: Union[str, bytes], length: int = 24) -> str:
    """The first ``length`` hex digits of sha256: a cache entry's name."""
    return sha256_hex(data)[:length]


def stable_u64(text: str) -> int:
    """A 64-bit integer of ``text`` that is the same in every process (``hash()`` is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def sha256(data: Union[str, bytes] = b"") -> "hashlib._Hash":
    """An incremental sha256 started with ``data`` (fed piece by piece: a fingerprint over
    many files or rows)."""
    return hashlib.sha256(_bytes(data))


__all__ = ["sha256", "sha256_digest", "sha256_file", "sha256_hex", "sha256_json", "short_key", "stable_u64"]
