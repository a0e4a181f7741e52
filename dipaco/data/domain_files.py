"""Which files of this install give the ``multidomain`` corpus, and in which domain.

Where the files come from (never a hard-coded path):

* the standard library, ``sysconfig.get_paths()["stdlib"]`` (the top-level packages in
  ``data.exclude_packages`` left out, as for ``python_sources``), and the interpreter's C
  headers, ``sysconfig.get_paths()["include"]``;
* the installed distributions named by ``data.packages`` and those they require,
  transitively (``importlib.metadata``: each distribution's ``requires`` and its ``files``
  list). The roots are named in the config, not read from dipaco's own requirements, so a
  dependency added to the code leaves the default corpus as it was. Requirements behind an
  environment marker (extras such as ``dev``, platform-only wheels such as CUDA runtimes)
  are left out, so the same package versions give the same corpus on every platform.

Files are classified by name alone; what is read from them, and how they are cut, is
:mod:`dipaco.data.multidomain`.
"""
from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from dipaco.data.errors import DataError
from dipaco.data.python_sources import list_source_files

__all__ = ["Candidate", "discover", "package_closure", "requirement_closure"]

_C_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh", ".inl")
_DATA_SUFFIXES = (".json", ".csv", ".yaml", ".yml", ".toml", ".ini", ".cfg")
_PROSE_SUFFIXES = (".txt", ".md")
_LICENSE_PREFIXES = ("license", "licence", "copying", "notice", "authors", "copyright")
_TEST_DIRS = frozenset({"test", "tests", "testing"})
_TOPICS = "pydoc_data/topics.py"

@dataclass(frozen=True)
class Candidate:
    """One file that may give documents: where it is and how to cut it."""

    domain: str
    origin: str  # "stdlib", "include" or the normalised distribution name
    rel: str  # path inside its origin, with "/"
    path: str  # absolute path on this machine
    kind: str  # "python", "text", "prose", "metadata", "record", "docstrings" or "topics"

    @property
    def key(self) -> str:
        """``<domain>/<origin>/<rel>``: the id prefix of its documents, stable across machines."""
        return f"{self.domain}/{self.origin}/{self.rel}"





def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_closure(root: str = "dipaco") -> List[metadata.Distribution]:
    """The installed distributions ``root`` requires, transitively, sorted by name (``root`` excluded)."""
    try:
        metadata.distribution(root)
    except metadata.PackageNotFoundError:
        raise DataError(f"data.source=multidomain reads the dependencies of the installed {root} "
                        f"package, which is not installed. Fix: pip install -e .") from None
    return [d for d in package_closure([root])[0] if _norm(d.metadata["Name"] or "") != _norm(root)]


def package_closure(roots: Sequence[str]) -> Tuple[List[metadata.Distribution], List[str]]:
    """The installed distributions named by ``roots`` and those they require, transitively,
    sorted by name; and the roots that are not installed (left out: the caller says so)."""
    missing = []
    for root in roots:
        try:
            metadata.distribution(root)
        except metadata.PackageNotFoundError:
            missing.append(root)
    return _closure([r for r in roots if r not in missing]), missing


def _closure(roots: Sequence[str]) -> List[metadata.Distribution]:
    seen: Dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _norm(name) in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency of a dependency, not installed here
        seen[_norm(name)] = dist
        for req in dist.requires or ():
            if ";" not in req:  # markers: extras and platform-only wheels stay out
                todo.append(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))  # type: ignore[union-attr]
    return [seen[k] for k in sorted(seen)]


def _is_license(base: str) -> bool:
    return base.lower().startswith(_LICENSE_PREFIXES)


def _classify_stdlib(rel: str) -> Optional[Tuple[str, str]]:
    """(domain, kind) of a stdlib file, or None when it gives no documents."""
    low = rel.lower()
    if rel == _TOPICS:
        return "reference_docs", "topics"
    if low.endswith(".py"):
        return "python", "python"
    return _classify_by_suffix(low)


def _classify_by_suffix(low: str) -> Optional[Tuple[str, str]]:
    if low.endswith(_C_SUFFIXES):
        return "c_cpp", "text"
    if low.endswith(_DATA_SUFFIXES):
        return "structured_data", "text"
    if low.endswith(".rst"):
        return "reference_docs", "text"
    if _is_license(low.rsplit("/", 1)[-1]):
        return "prose", "text"
    if low.endswith(_PROSE_SUFFIXES):
        return "prose", "prose"  # kept only when it reads as prose (see _reads_as_prose)
    return None


def _classify_dist(rel: str) -> Optional[Tuple[str, str]]:
    """(domain, kind) of a file listed by a distribution, or None."""
    parts = rel.split("/")
    base = parts[-1]
    if "__pycache__" in parts:
        return None
    if parts[0].endswith(".dist-info"):
        if base == "METADATA":
            return "prose", "metadata"
        if base == "RECORD":
            return "structured_data", "record"
        return ("prose", "text") if _is_license(base) else None
    if base.endswith(".py"):
        return None if _TEST_DIRS & set(parts[:-1]) else ("reference_docs", "docstrings")
    return _classify_by_suffix(rel.lower())


def discover(exclude_packages: Sequence[str] = (), stdlib: Optional[str] = None,
             include: Optional[str] = None,
             distributions: Optional[Sequence[metadata.Distribution]] = None) -> List[Candidate]:
    """Every candidate file of this install, classified; defaults: this interpreter and dipaco's dependencies."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    include = include or sysconfig.get_paths()["include"]
    dists = requirement_closure() if distributions is None else distributions
    out: List[Candidate] = []
    for rel in list_source_files(exclude_packages, stdlib, suffixes=None):
        where = _classify_stdlib(rel)
        if where:
            out.append(Candidate(where[0], "stdlib", rel, os.path.join(stdlib, *rel.split("/")), where[1]))
    if os.path.isdir(include):
        for rel in list_source_files((), include, suffixes=_C_SUFFIXES):
            out.append(Candidate("c_cpp", "include", rel, os.path.join(include, *rel.split("/")), "text"))
    for dist in dists:
        name = dist.metadata["Name"]
        if not name:
            continue  # a broken dist-info without METADATA: no stable name for ids
        origin = _norm(name)
        for f in dist.files or ():
            rel = f.as_posix()
            where = _classify_dist(rel)
            if where and not rel.startswith(".."):  # "../../bin/x": scripts outside site-packages
                out.append(Candidate(where[0], origin, rel, str(dist.locate_file(f)), where[1]))
    return out
