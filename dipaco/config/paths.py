"""A path means one thing: the path a command checks is the path it uses, from any directory.

Every setting that names a place on this machine (:data:`LOCAL_PATH_KEYS`) is pinned once,
when the config is made (:func:`pin_paths`, called by ``compose_config`` and the Hydra
CLIs): ``~`` expanded and a relative path made absolute against the working directory
of the command that started the run. So the run's ``config.yaml`` records where its data,
cache and tokenizer really are (a resume from another directory reads the same files),
and the guards of :mod:`dipaco.run.path_guard` check the very string that is written.

``hydra.run.dir`` is Hydra's, not the config's: :func:`pin_argument` rewrites it on the
command line before Hydra reads it (Hydra itself never expands ``~``, so a quoted
``'~/runs/a'`` made a folder named ``~`` in the working directory while the guard had
checked the home directory's).

Left as given: URLs (``s3://...``), a hub dataset name (``data=hub``: a name that does not
look like a path and is no folder here), interpolations (``${...}``).
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

__all__ = ["LOCAL_PATH_KEYS", "pin", "pin_argument", "pin_paths"]

#: config keys naming a file or folder on this machine
LOCAL_PATH_KEYS = ("data.path", "data.cache_dir", "data.tokenizer", "diloco.decoupled.store_url", "run_dir")


def pin(value: str, cwd: Optional[str] = None) -> str:
    """``value`` with ``~`` expanded, absolute against ``cwd`` (default: the working directory).

    ``..`` is kept as the kernel reads it (``a/../b`` through a symlinked ``a`` is not
    ``b``); otherwise the path is normalised (``./x/`` → ``x``)."""
    if not value or "://" in value or "${" in value:
        return value
    p = os.path.expanduser(value)
    if not os.path.isabs(p):
        p = os.path.join(cwd or os.getcwd(), p)
    return p if ".." in p.split(os.sep) else os.path.normpath(p)


def _is_hub_name(value: str) -> bool:
    return not value.startswith(("/", ".", "~")) and not os.path.exists(value)


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg: Any, key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        cfg = getattr(cfg, part)
    setattr(cfg, last, value)


def pin_paths(cfg: Any, cwd: Optional[str] = None) -> Any:
    """Pin every key of :data:`LOCAL_PATH_KEYS` of ``cfg`` (a :class:`dipaco.config.Config`), in place."""
    for key in LOCAL_PATH_KEYS:
        value = _get(cfg, key)
        if not isinstance(value, str) or not value:
            continue
        if key == "data.path" and cfg.data.source == "hub" and _is_hub_name(value):
            continue
        _set(cfg, key, pin(value, cwd))
    return cfg


def pin_argument(key: str, value: str) -> str:
    """The command-line override ``key=value`` with ``value`` pinned (:func:`pin`), quoted
    for Hydra's override grammar where it needs quotes."""
    pinned = pin(value)
    if re.fullmatch(r"[\w/.+@:-]+", pinned):  # nothing Hydra's grammar would read otherwise
        return f"{key}={pinned}"
    quoted = pinned.replace("\\", "\\\\").replace("'", "\\'")
    return f"{key}='{quoted}'"
