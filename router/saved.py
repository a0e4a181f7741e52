"""A saved Router on disk: ``manifest.json`` plus ``.npz`` arrays, no pickle.

Array files are written first and the manifest last, each atomically, with the sha256 of
every array file in the manifest: a directory with a manifest always has the arrays it
names, and a truncated or swapped file is refused on load with a message naming it.
:class:`router.Router` calls :func:`write_router` / :func:`read_router`; this file knows
the layout, the Router knows what the arrays mean.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .discriminative import DiscriminativeHead
from .features import featurizer_from_state
from .storage import atomic_write_json, atomic_write_npz, load_npz_checked

__all__ = ["ROUTER_FORMAT_VERSION", "check_grid", "read_router", "write_router"]

# 2: methods "tree" (per-level node centroids) and "grouped", keys "balance" and
# "soft_capacity_factor". 3: method "merge" (array cluster_paths), keys "fine_clusters" and
# "prompt_classifier". Directories of versions 1 and 2 still load.
ROUTER_FORMAT_VERSION = 3
_READABLE_VERSIONS = (1, 2, 3)
_MANIFEST = "manifest.json"
_FILES = {"kmeans": "kmeans.npz", "featurizer": "featurizer.npz", "discriminative": "discriminative.npz"}


def check_grid(grid: Sequence[int]) -> tuple[int, ...]:
    try:
        g = tuple(int(k) for k in grid)
    except TypeError:
        raise ValueError(f"grid must be a list of modules per level, e.g. [4, 4]; got {grid!r}") from None
    if not g or any(k < 1 for k in g):
        raise ValueError(f"grid must be a non-empty list of positive ints (modules per level), got {list(grid)}")
    return g


def write_router(d: Path, manifest: dict[str, Any], kmeans: dict[str, np.ndarray],
                 featurizer: dict[str, np.ndarray], head: dict[str, np.ndarray] | None) -> Path:
    """Write the arrays, drop a stale head file, then the manifest (with hashes) last."""
    d.mkdir(parents=True, exist_ok=True)
    files = {"kmeans": kmeans, "featurizer": featurizer}
    if head is not None:
        files["discriminative"] = head
    hashes = {}
    for key, arrays in files.items():
        hashes[_FILES[key]] = atomic_write_npz(d / _FILES[key], arrays)
    stale = d / _FILES["discriminative"]
    if head is None and stale.exists():
        stale.unlink()
    atomic_write_json(d / _MANIFEST, dict(manifest, files=hashes))
    return d


def _read_manifest(mpath: Path) -> dict[str, Any]:
    if not mpath.is_file():
        raise ValueError(f"missing {mpath}: not a saved router directory (Router.save writes it)")
    try:
        m = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{mpath} is not valid JSON ({e}); save the router again") from e
    if not isinstance(m, dict):
        raise ValueError(f"{mpath} is not a router manifest (expected a JSON object)")
    if m.get("version") not in _READABLE_VERSIONS:
        raise ValueError(
            f"{mpath}: router format version {m.get('version')!r} is not supported "
            f"(this code reads versions {list(_READABLE_VERSIONS)}); re-run routing (dipaco-route) to refit it"
        )
    required_keys = ("grid", "method", "prefix_tokens", "top_k", "capacity_factor", "seed", "featurizer")
    missing = [k for k in required_keys if k not in m]
    if missing:
        raise ValueError(f"{mpath} lacks keys {missing}; save the router again")
    return m


def read_router(d: Path, featurizer_fn: Callable[[list[np.ndarray]], Any] | None,
                expected_grid: Sequence[int] | None) -> dict[str, Any]:
    """The :class:`router.Router` constructor arguments saved in ``d``, every file checked.

    Raises ValueError naming the file for anything missing, corrupt or inconsistent
    (including a grid other than ``expected_grid`` when that is given).
    """
    mpath = d / _MANIFEST
    m = _read_manifest(mpath)
    grid = check_grid(m["grid"])
    if expected_grid is not None and tuple(int(k) for k in expected_grid) != grid:
        raise ValueError(
            f"{mpath}: router was fitted for grid {list(grid)} but grid {list(expected_grid)} "
            "was expected; re-run routing for this grid"
        )
    files = m.get("files", {})
    for required in (_FILES["kmeans"], _FILES["featurizer"]):
        if required not in files:
            raise ValueError(f"{mpath} lists no {required}; the directory is incomplete")
    loaded = {name: load_npz_checked(d / name, sha) for name, sha in files.items()}
    km = loaded[_FILES["kmeans"]]
    feat = featurizer_from_state(
        m["featurizer"]["kind"], m["featurizer"]["params"], loaded[_FILES["featurizer"]], featurizer_fn
    )
    head = None
    if m.get("discriminative"):
        h = loaded.get(_FILES["discriminative"])
        if h is None:
            raise ValueError(f"{mpath} says discriminative but lists no {_FILES['discriminative']}")
        head = DiscriminativeHead(h["coef"], h["intercept"], h["classes"], int(np.prod(grid)))
    n_cent = 1 if m["method"] in ("flat", "grouped", "merge", "random") else len(grid)
    try:
        centroids = [km[f"centroids_{l}"] for l in range(n_cent)]
    except KeyError as e:
        raise ValueError(f"{d / _FILES['kmeans']} lacks array {e}") from None
    return dict(
        grid=grid,
        method=m["method"],
        prefix_tokens=m["prefix_tokens"],
        cluster_tokens=m.get("cluster_tokens"),  # absent before it existed: prefix_tokens
        # absent before it existed: re-routes then read the cluster_tokens before the window
        reroute_context=(m["reroute_context"] if "reroute_context" in m
                         else (m.get("cluster_tokens") or m["prefix_tokens"])),
        top_k=m["top_k"],
        capacity_factor=m["capacity_factor"],
        seed=m["seed"],
        niter=m.get("niter", 20),
        balance=m.get("balance", "hard"),  # version 1 had only the hard cap
        soft_capacity_factor=m.get("soft_capacity_factor", 2.0),
        featurizer=feat,
        centroids=centroids,
        rotation=km.get("rotation"),
        fallback_order=km["fallback_order"],
        head=head,
        cluster_paths=km.get("cluster_paths"),
        fine_clusters=m.get("fine_clusters"),
        prompt_classifier=m.get("prompt_classifier", False),  # absent before version 3
    )
