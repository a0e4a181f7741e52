"""Outputs never become inputs: which folders dipaco wrote, by one rule.

A run directory, an export, a report or a sweep folder that sits inside a data folder
(``data=text data.path=~/corpus`` with ``hydra.run.dir=~/corpus/run1``) holds configs,
metrics, tokenizers and manifests, not training text. Every reader of local files
(:mod:`dipaco.data.files`, the pre-tokenized shards, the saved datasets) asks
:func:`is_dipaco_output` of each folder it would descend into and skips the folder
whole, counted under ``dipaco_output`` in the skipped documents; a ``data.path`` that
itself names such a folder is refused in one line.

A folder is dipaco's when it carries one of the marks dipaco writes into it first:
``config.yaml`` beside ``fingerprints.json`` or the run lock (a run directory, also while
it is written), ``.dipaco-export`` (an export), ``report.md`` beside ``report.json`` (a
``dipaco-report`` folder) or ``multirun.yaml`` (a Hydra sweep folder of runs).
"""
from __future__ import annotations

import os
from pathlib import Path

from dipaco.run.path_guard import is_run_directory

SKIPPED_OUTPUT = "dipaco_output"  # the reason a skipped folder is counted under
# (file, [file beside it]) pairs: the folder is dipaco's when the first exists with any of the others
_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".dipaco-export", ()),                              # dipaco-infer export (one path, or --all)
    ("multirun.yaml", ()),                               # a Hydra sweep folder (dipaco-train -m)
    ("report.md", ("report.json",)),                     # dipaco-report
    ("config.yaml", ("fingerprints.json", ".dipaco.lock", ".hydra")),  # a run directory being written
)


def is_dipaco_output(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is one dipaco wrote (see the module docstring)."""
    d = Path(folder)
    try:
        if is_run_directory(d):
            return True
        for mark, beside in _MARKS:
            if (d / mark).is_file() and (not beside or any((d / b).exists() for b in beside)):
                return True
    except OSError:  # unreadable: the reader reports it as it would any folder
        return False
    return False


def output_between(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether a folder from ``root`` (included) down to ``path``'s folder is dipaco's."""
    root_p, d = Path(root).resolve(), Path(path).resolve().parent
    while True:
        if is_dipaco_output(d):
            return True
        if d == root_p or d == d.parent or root_p not in d.parents:
            return False
        d = d.parent


__all__ = ["SKIPPED_OUTPUT", "is_dipaco_output", "output_between"]
