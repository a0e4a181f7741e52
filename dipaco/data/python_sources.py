"""The built-in offline corpus ``python_sources``: the running interpreter's standard library.

Why the stdlib: it is on every machine, needs no network, and has real domains (``json``,
``email``, ``asyncio`` ...) that a router can find. It is read from
``sysconfig.get_paths()["stdlib"]`` only, never from ``site-packages`` / ``dist-packages``,
so two machines with the same Python version see the same documents.

Documents. Each ``.py`` file (walked in sorted order) is cut into *chunks* at its
top-level statements (``def``, ``class``, imports, assignments ...; decorators and the
comment lines directly above a statement stay with it). A class larger than
``target_doc_chars`` is cut further at the statements of its body (its methods), so one
big class does not become one huge document. Consecutive chunks are grouped greedily
into documents of about ``target_doc_chars``; a chunk still longer than ``max_doc_chars``
is cut at line boundaries. A file that does not parse is cut at line boundaries only.

Labels. ``label`` is the top-level name a user would ``import``: the package for files
inside a package (``json/decoder.py`` → ``"json"``, ``email/mime/text.py`` → ``"email"``)
and the module's own name for a top-level single-file module (``argparse.py`` →
``"argparse"``). One label per importable top-level name keeps every label meaningful
(a bucket such as "misc" would lump unrelated modules together); it gives a few dozen
package labels with many documents each plus one label per single-file module.

Ids are ``"<path relative to the stdlib, with />#<index of the document in the file>"``,
e.g. ``"json/decoder.py#3"``: stable for a given Python version and ``target_doc_chars``.
"""
from __future__ import annotations

import ast
import os
import sysconfig
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple

# Never part of the corpus, whatever exclude_packages says: third-party code differs
# from machine to machine, and __pycache__ holds bytecode.
_ALWAYS_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class SourceDocument:
    """One document of the built-in corpus (before the common checks in corpus.py)."""

    id: str
    text: str
    label: str

    @property
    def group(self) -> str:
        """The source file (the id without ``#<index>``): documents of one file share a split."""
        return self.id.rsplit("#", 1)[0]


def stdlib_root() -> str:
    """The directory of the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def label_of(rel_path: str) -> str:
    """Top-level importable name of a file given by its path relative to the stdlib."""
    parts = rel_path.split("/")
    if len(parts) > 1:
        return parts[0]
    return parts[0][: -len(".py")]


def list_source_files(
    exclude_packages: Sequence[str] = (), root: Optional[str] = None,
    suffixes: Optional[Tuple[str, ...]] = (".py",),
) -> List[str]:
    """Paths (relative to ``root``, with ``/``) of the stdlib's ``.py`` files, sorted.

    Top-level packages or modules named in ``exclude_packages`` are left out, and so are
    top-level directories that are not importable names (``lib-dynload``,
    ``config-3.x-...``) and the third-party directories. ``suffixes=None`` lists every
    file of those directories (the multidomain corpus also reads the stdlib's data files).
    """
    root = root or stdlib_root()
    excluded = set(exclude_packages)
    out: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        keep = []
        for d in dirnames:
            if d in _ALWAYS_SKIPPED_DIRS:
                continue
            if not rel_dir and (d in excluded or not d.isidentifier()):
                continue
            keep.append(d)
        # os.walk visits in the order left in dirnames: sort so the walk is reproducible
        dirnames[:] = sorted(keep)
        for name in sorted(filenames):
            if suffixes is not None and not name.endswith(suffixes):
                continue
            if not rel_dir and name.rsplit(".", 1)[0] in excluded:
                continue
            out.append(f"{rel_dir}/{name}" if rel_dir else name)
    out.sort()
    return out


def _statement_starts(body: Sequence[ast.stmt], lines: Sequence[str], floor: int) -> List[int]:
    """0-based first line of each statement, pulled up over decorators and comments above it.

    ``floor`` is the lowest line a start may move to (the previous statement's end).
    """
    starts = []
    for node in body:
        first = node.lineno
        for dec in getattr(node, "decorator_list", ()):  # decorators belong to their def
            first = min(first, dec.lineno)
        start = first - 1
        # comment lines directly above a definition describe it: keep them together
        while start - 1 >= floor and lines[start - 1].lstrip().startswith("#"):
            start -= 1
        starts.append(start)
        floor = (node.end_lineno or node.lineno)
    return starts


def _cut_lines(text: str, max_chars: int) -> List[str]:
    """Cut ``text`` at line boundaries into pieces of at most ``max_chars``.

    A single line longer than ``max_chars`` is cut inside the line (rare: data tables).
    """
    pieces: List[str] = []
    cur = ""
    for line in text.splitlines(keepends=True):
        while len(line) > max_chars:
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(line[:max_chars])
            line = line[max_chars:]
        if len(cur) + len(line) > max_chars and cur:
            pieces.append(cur)
            cur = ""
        cur += line
    if cur:
        pieces.append(cur)
    return pieces


def _chunks_of_source(text: str, target_chars: int) -> List[str]:
    """Cut one file into chunks at top-level statements (big classes: at their methods)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # ValueError: NUL bytes
        return [text]
    if not tree.body:
        return [text]
    lines = text.splitlines(keepends=True)
    # (start_line, is_big_class, node) for each top-level statement
    starts = _statement_starts(tree.body, lines, 0)
    starts[0] = 0  # the module header (docstring, comments) goes with the first chunk
    bounds: List[int] = []
    for start, node in zip(starts, tree.body):
        bounds.append(start)
        end = node.end_lineno or node.lineno
        size = sum(len(x) for x in lines[start:end])
        if isinstance(node, ast.ClassDef) and size > target_chars and len(node.body) > 1:
            # cut inside the class at its body statements; the class line and docstring
            # stay with the first method
            inner = _statement_starts(node.body, lines, node.lineno)
            bounds.extend(s for s in inner[1:] if s > start)
    bounds.append(len(lines))
    bounds = sorted(set(bounds))
    return ["".join(lines[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def split_source(text: str, target_chars: int, max_chars: int) -> List[str]:
    """Cut one Python file into documents of about ``target_chars`` (each ≤ ``max_chars``).

    Chunks are grouped by :func:`pack_pieces` (a trailing ``if __name__ == "__main__":``
    block is not worth a document of its own).
    """
    if target_chars <= 0 or max_chars <= 0:
        raise ValueError("target_chars and max_chars must be positive")
    max_chars = max(max_chars, 1)
    pieces: List[str] = []
    for chunk in _chunks_of_source(text, target_chars):
        pieces.extend(_cut_lines(chunk, max_chars) if len(chunk) > max_chars else [chunk])
    return pack_pieces(pieces, target_chars, max_chars)


def pack_pieces(pieces: Sequence[str], target_chars: int, max_chars: int) -> List[str]:
    """Group consecutive ``pieces`` (each ≤ ``max_chars``) greedily into documents of about ``target_chars``.

    A document is closed when the next piece would push it past ``target_chars``; a last
    document shorter than a quarter of the target joins the previous one when the result
    stays ≤ ``max_chars``.
    """
    docs: List[str] = []
    cur = ""
    for piece in pieces:
        if cur and len(cur) + len(piece) > target_chars:
            docs.append(cur)
            cur = ""
        cur += piece
    if cur:
        if docs and len(cur) < target_chars // 4 and len(docs[-1]) + len(cur) <= max_chars:
            docs[-1] += cur
        else:
            docs.append(cur)
    return docs


def split_text(text: str, target_chars: int, max_chars: int) -> List[str]:
    """Cut any text file into documents of about ``target_chars`` at line boundaries.

    The non-Python counterpart of :func:`split_source`: the pieces are lines (a line longer
    than ``max_chars`` is cut inside, e.g. a one-line JSON file), packed by :func:`pack_pieces`.
    """
    if target_chars <= 0 or max_chars <= 0:
        raise ValueError("target_chars and max_chars must be positive")
    return pack_pieces(_cut_lines(text, min(target_chars, max_chars)), target_chars, max_chars)


def iter_python_sources(
    exclude_packages: Sequence[str] = (),
    target_doc_chars: int = 3000,
    max_doc_chars: int = 20000,
    root: Optional[str] = None,
    skipped: Optional[dict] = None,
    progress: bool = False,
) -> Iterator[SourceDocument]:
    """Yield the documents of the built-in corpus in a fixed order.

    Files that are not valid UTF-8 are not decoded with a guess: they are counted in
    ``skipped["non_utf8"]`` (none in CPython's stdlib outside ``test``).
    """
    from tqdm.auto import tqdm

    root = root or stdlib_root()
    files = list_source_files(exclude_packages, root)
    for rel in tqdm(files, desc="python_sources", unit="file", disable=not progress):
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            if skipped is not None:
                skipped["non_utf8"] = skipped.get("non_utf8", 0) + 1
            continue
        label = label_of(rel)
        for i, doc in enumerate(split_source(text, target_doc_chars, max_doc_chars)):
            yield SourceDocument(id=f"{rel}#{i}", text=doc, label=label)
