"""The built-in offline multi-domain corpus ``multidomain``: five kinds of text from this install.

Why: routing can only specialise paths when the corpus has domains that differ in kind.
Every fresh install of dipaco already holds such text on disk: the interpreter's standard
library and the packages dipaco depends on. No network, no download.

Which files, and their domain, is :mod:`dipaco.data.domain_files` (the standard library, the
interpreter's C headers and the distributions dipaco requires, transitively).

The domains (``label``; labels only evaluate routing, they never route):

=================== =======================================================================
``python``          stdlib ``.py`` files, cut along top-level definitions
                    (:func:`~dipaco.data.python_sources.split_source`)
``c_cpp``           C/C++ headers and sources (``.h``, ``.hpp``, ``.c``, ``.cpp``, ``.cuh`` ...):
                    the Python headers, ``torch/include``, numpy's headers ...
``prose``           English prose: license texts, the long descriptions of the
                    distributions (``METADATA`` bodies: their READMEs), and ``.txt`` / ``.md``
                    files that read as prose (mostly letters and spaces, frequent "the")
``reference_docs``  reference documentation: the language reference shipped as
                    ``pydoc_data/topics.py`` (one group per topic), ``.rst`` files, and the
                    docstrings of the dependencies' modules, classes and functions
``structured_data`` JSON / CSV / YAML / TOML / INI files and the ``RECORD`` CSVs of the
                    distributions (the lines the installer wrote left out: :func:`record_text`)
=================== =======================================================================

How it is built. Files are classified by name into a domain; within a domain they are
read in the order of a hash of their path (so a cap samples across packages rather than
taking the alphabetically first) until the domain holds ``data.domain_max_chars``
characters; a file gives at most :data:`MAX_FILE_CHARS`. Files whose text is identical to
one already taken (the Apache license shipped by ten packages) are dropped, so no text is
in two splits, and so are generated code files (a generator's marker such as
``@generated`` or "DO NOT EDIT" in the first 1,000 characters of a ``python`` or
``c_cpp`` file; :func:`is_generated`). Each file is cut into documents of about
``data.target_doc_chars`` at line boundaries (Python at definitions). Documents are emitted sorted by domain and path.

Ids are ``"<domain>/<origin>/<path>#<i>"`` with origin ``stdlib``, ``include`` or the
distribution's normalised name; ``group`` (what splits are keyed by, see
:mod:`dipaco.data.splits`) is the source file, or the topic for the language reference.

Cache. The first build reads ~70 MB of files (about 50 s on 2 cores, with progress
bars); the documents are then written to ``$DIPACO_CACHE`` (default ``~/.cache/dipaco``)
as ``multidomain-<fingerprint>.jsonl``. The fingerprint covers :data:`BUILDER_VERSION`,
the build settings and every candidate file's (path, size, mtime), so a changed install
(an upgraded package) rebuilds and an unchanged one reads the cache in seconds.
"""
from __future__ import annotations

import ast
import functools
import json
import logging
import multiprocessing
import os
import re
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from tqdm.auto import tqdm

from dipaco.data.errors import DataError
from dipaco.data.domain_files import Candidate, discover, package_closure, requirement_closure  # noqa: F401
from dipaco.data.python_sources import pack_pieces, split_source, split_text
from dipaco.data.readers import count_skip, read_text_head
from dipaco.storage.atomic import atomic_write_lines
from dipaco.storage.hashing import sha256, sha256_digest
from dipaco.storage.strict_json import dumps_strict

log = logging.getLogger("dipaco")

__all__ = ["BUILDER_VERSION", "DOMAINS", "Candidate", "DomainDocument", "cache_dir", "discover",
           "is_generated", "load_multidomain", "record_text", "requirement_closure"]

# Bump when the classification or cutting changes: old caches are then rebuilt.
BUILDER_VERSION = 3  # 2: generated code files left out; 3: RECORD without the installer's lines
DOMAINS = ("python", "c_cpp", "prose", "reference_docs", "structured_data")
# One file gives at most this many characters (a 5 MB JSON table must not fill a domain).
MAX_FILE_CHARS = 400_000

# The lines of a RECORD that the installer writes rather than the wheel ships: console
# scripts ("../../../bin/x": their shebang, hence hash and size, names this interpreter's
# path), byte code compiled at install time (pip compiles, uv does not), and the
# installer's own dist-info files (INSTALLER, REQUESTED only for what was named on the
# command line, direct_url.json). With them, two installs of the same versions in two
# places built different corpora (25 RECORD documents differed).
_INSTALLER_RECORD = re.compile(r"^(?:\.\./|[^,]*__pycache__/|[^,/]*\.dist-info/(?:INSTALLER|REQUESTED|direct_url\.json),)")
# Machine-generated code (torchgen's thousands of ATen/ops headers, protobuf stubs, ...)
# is near-duplicate text: 31% of c_cpp's documents in builder version 1, and one
# cluster that the router split off before any domain. Left out by the markers generators
# write at the top of a file, in the code domains only: in reference_docs the language
# reference itself (pydoc_data/topics.py) is "Autogenerated by Sphinx", and
# structured_data (RECORD files) is machine-written by nature.
_GENERATED_DOMAINS = frozenset({"python", "c_cpp"})
_GENERATED_HEAD_CHARS = 1000
_GENERATED = re.compile(r"@generated|do not edit|auto-?generated|automatically generated|"
                        r"generated by (?:the )?(?:cython|swig|protoc|the protocol buffer compiler)",
                        re.IGNORECASE)


@dataclass(frozen=True)
class DomainDocument:
    """One document of the multidomain corpus (before the common checks in corpus.py)."""

    id: str
    text: str
    label: str
    group: str


# --------------------------------------------------------------------------- cutting


def _reads_as_prose(text: str) -> bool:
    """English prose, not a data table: mostly letters and spaces, with "the" every ~1000 chars."""
    head = text[:8000]
    if len(head) < 200:
        return False
    wordy = sum(c.isalpha() or c.isspace() for c in head) / len(head)
    return wordy >= 0.8 and len(re.findall(r"\bthe\b", head, re.IGNORECASE)) * 1000 >= len(head)


def is_generated(text: str) -> bool:
    """True when the file's head carries a code generator's marker (``@generated``,
    "DO NOT EDIT", "Auto-generated", "Generated by Cython" ...)."""
    return _GENERATED.search(text[:_GENERATED_HEAD_CHARS]) is not None


def _docstrings(text: str) -> List[str]:
    """``"<qualified name>\\n<docstring>\\n\\n"`` for the module and each class and function."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out: List[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc and len(doc) >= 40:  # a one-liner "Return x." is no documentation
                    out.append(f"{name}\n{doc}\n\n")
                visit(child, name + ".")

    module_doc = ast.get_docstring(tree, clean=True)
    if module_doc:
        out.append(f"{module_doc}\n\n")
    visit(tree, "")
    return out


def _topics(text: str) -> List[Tuple[str, str]]:
    """(topic, text) of the language reference in ``pydoc_data/topics.py``, read without importing it."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "topics" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return []
            return sorted((str(k), str(v)) for k, v in value.items() if isinstance(v, str))
    return []


def _cut(c: Candidate, text: str, target: int, max_chars: int) -> List[Tuple[str, str, str]]:
    """(id, group, text) of the documents of one file."""
    if c.kind == "topics":
        return [(f"{c.key}::{topic}#{i}", f"{c.key}::{topic}", doc)
                for topic, body in _topics(text)
                for i, doc in enumerate(split_text(f"{topic}\n\n{body}", target, max_chars))]
    if c.kind == "python":
        docs = split_source(text, target, max_chars)
    elif c.kind == "docstrings":
        pieces = [p for s in _docstrings(text) for p in split_text(s, max_chars, max_chars)]
        docs = pack_pieces(pieces, target, max_chars)
    elif c.kind == "metadata":  # e-mail headers, a blank line, the long description
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        docs = split_text(body, target, max_chars) if len(body.strip()) >= 200 else []
    elif c.kind == "record":
        docs = split_text(record_text(text), target, max_chars)
    elif c.kind == "prose" and not _reads_as_prose(text):
        docs = []
    else:
        docs = split_text(text, target, max_chars)
    return [(f"{c.key}#{i}", c.key, doc) for i, doc in enumerate(docs)]


def record_text(text: str) -> str:
    """A distribution's ``RECORD`` without the lines its installer wrote (see
    ``_INSTALLER_RECORD``): what the wheel ships, the same for every install of it."""
    return "".join(line for line in text.splitlines(keepends=True) if not _INSTALLER_RECORD.match(line))


def _order(key: str) -> bytes:
    return sha256_digest(key)


def _read(c: Candidate, target: int, max_chars: int) -> Tuple[str, Optional[bytes], List[Tuple[str, str, str]]]:
    """Read and cut one file (runs in a worker): ``(skip reason or "", digest, documents)``.
    Dedupe against earlier files is the parent's: it needs the files in order."""
    try:
        raw, _ = read_text_head(c.path, MAX_FILE_CHARS)
        text = raw.decode("utf-8")[:MAX_FILE_CHARS]
    except OSError:
        return "unreadable_file", None, []
    except UnicodeDecodeError:
        return "non_utf8", None, []
    if "\x00" in text or not text.strip():
        return "binary_or_empty", None, []
    digest = sha256_digest(text)
    if c.domain in _GENERATED_DOMAINS and is_generated(text):
        return "generated_file", digest, []
    return "", digest, _cut(c, text, target, max_chars)


# Below this many candidate files the build runs in this process (a pool costs ~1 s to start).
_PARALLEL_MIN_FILES = 500
# Files handed to the pool at a time, per worker.
_BATCH_PER_WORKER = 32


def _workers() -> int:
    """Processes for reading and cutting files: the CPUs this process may use, at most 8."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def _read_in_order(files: Sequence[Candidate], read: Callable, pool: Any, workers: int) -> Iterator[Tuple]:
    """``read(f)`` of each file, in order; with a pool, a batch of files at a time (the
    batch bounds the read-ahead when the consumer stops early)."""
    if pool is None:
        yield from map(read, files)
        return
    step = _BATCH_PER_WORKER * workers
    for start in range(0, len(files), step):
        yield from pool.map(read, files[start:start + step], chunksize=4)


def build(candidates: Sequence[Candidate], target_doc_chars: int, max_doc_chars: int,
          domain_max_chars: int, skipped: Optional[Dict[str, int]] = None,
          progress: bool = False, workers: Optional[int] = None) -> List[DomainDocument]:
    """Read and cut the candidates of each domain (hash order, up to the cap), sorted by domain and id.

    Files are read and cut by ``workers`` processes (default: one per CPU, at most 8;
    parsing the dependencies' docstrings is most of the build), in order: the parent takes
    their results in the files' hash order, dedupes and stops at the cap exactly as a
    sequential build would, so the corpus does not depend on ``workers``.
    """
    skipped = {} if skipped is None else skipped
    if workers is None:
        workers = _workers() if len(candidates) >= _PARALLEL_MIN_FILES else 1
    workers = max(1, int(workers))
    seen_text: set = set()
    docs: List[DomainDocument] = []
    read = functools.partial(_read, target=target_doc_chars, max_chars=max_doc_chars)
    # spawn, not fork: the caller may hold threads (torch, tokenizers) that fork would copy mid-lock
    pool = multiprocessing.get_context("spawn").Pool(workers) if workers > 1 else None
    try:
        for domain in DOMAINS:
            mine = sorted((c for c in candidates if c.domain == domain), key=lambda c: _order(c.key))
            total = 0
            bar = tqdm(total=domain_max_chars, desc=f"multidomain {domain}", unit="char", unit_scale=True,
                       mininterval=2.0, disable=not progress)
            for reason, digest, cut in _read_in_order(mine, read, pool, workers):
                if total >= domain_max_chars:
                    break  # stops the reading: at most one batch was read ahead
                if digest is not None and digest in seen_text:
                    count_skip(skipped, "duplicate_file")
                    continue
                if digest is not None:
                    seen_text.add(digest)
                if reason:
                    count_skip(skipped, reason)
                    continue
                for doc_id, group, doc in cut:
                    docs.append(DomainDocument(doc_id, doc, domain, group))
                    total += len(doc)
                    bar.update(len(doc))
            bar.close()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    docs.sort(key=lambda d: (DOMAINS.index(d.label), d.id))
    return docs


# --------------------------------------------------------------------------- cache


def cache_dir() -> str:
    """``$DIPACO_CACHE``, else ``~/.cache/dipaco``: where built corpora are kept between runs."""
    return os.environ.get("DIPACO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dipaco")


def fingerprint(candidates: Iterable[Candidate], settings: Dict[str, object]) -> str:
    """sha256 of the builder version, the settings and every candidate's (path, size, mtime)."""
    h = sha256(dumps_strict({"version": BUILDER_VERSION, **settings}, sort_keys=True))
    for c in sorted(candidates, key=lambda c: c.key):
        try:
            st = os.stat(c.path)
        except OSError:
            continue
        h.update(f"{c.key}\x00{c.path}\x00{st.st_size}\x00{st.st_mtime_ns}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _write_jsonl(path: str, docs: Sequence[DomainDocument]) -> None:
    # atomic: readers (another rank, a concurrent run) never see a half-written cache
    atomic_write_lines(path, (dumps_strict(asdict(d), ensure_ascii=False) + "\n" for d in docs))


def _read_jsonl(path: str) -> Iterator[DomainDocument]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield DomainDocument(**json.loads(line))


def load_multidomain(exclude_packages: Sequence[str] = (), target_doc_chars: int = 2400,
                     max_doc_chars: int = 20000, domain_max_chars: int = 24_000_000, progress: bool = False,
                     packages: Optional[Sequence[str]] = None) -> Tuple[List[DomainDocument], str]:
    """The documents of the multidomain corpus and the cache file they were read from (built on a miss).

    ``packages``: the distributions whose files (with their requirements) join the stdlib's
    (``data.packages``); None: what the installed dipaco requires. A named one that is not
    installed is left out with a warning: that corpus differs from an install that has it.
    """
    if packages is None:
        candidates = discover(exclude_packages)
    else:
        dists, missing = package_closure(list(packages))
        if missing:
            log.warning("data.packages: %s not installed: left out of the multidomain corpus, which "
                        "therefore differs from the corpus of an install that has them", ", ".join(missing))
        candidates = discover(exclude_packages, distributions=dists)
    settings = {"exclude": sorted(exclude_packages), "target": target_doc_chars, "max": max_doc_chars,
                "cap": domain_max_chars}
    path = os.path.join(cache_dir(), f"multidomain-{fingerprint(candidates, settings)[:20]}.jsonl")
    if os.path.isfile(path):
        try:
            return list(_read_jsonl(path)), path
        except (ValueError, TypeError, UnicodeDecodeError):  # a damaged cache file: build it again
            pass
    if progress:
        log.info("multidomain: first build from %d files of this install (cached afterwards at %s)",
                 len(candidates), path)
    # files left out here are not added to Corpus.skipped: a cache hit must give the same corpus record
    left_out: Dict[str, int] = {}
    docs = build(candidates, target_doc_chars, max_doc_chars, domain_max_chars, left_out, progress)
    try:
        _write_jsonl(path, docs)
    except OSError as e:
        raise DataError(f"cannot write the multidomain cache {path}: {e.strerror or e}. "
                        f"Fix: set DIPACO_CACHE to a writable directory") from None
    if progress:
        log.info("multidomain: %d documents; files left out: %s", len(docs), left_out)
    return docs, path
