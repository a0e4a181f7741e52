"""A saved Router on disk: ``manifest.json`` plus ``.npz`` arrays, no pickle.

Array files are written first and the manifest last, each atomically, with the sha256 of
every array file in the manifest: a directory with a manifest always has the arrays it
names, and a truncated or swapped file is refused on load with a message naming it.
:class:`router.Router` calls :func:`write_router` / :func:`read_router`; this file knows
the layout, the routing method knows what its arrays mean.

Version 4 (the routing-method registry)::

    manifest.json    version, grid, num_paths, method, seed, settings (router.settings.
                     RouterSettings), method_settings (the method's config), featurizer,
                     discriminative, files (sha256 of each array file)
    method.npz       the method's fitted arrays, named by the method (RoutingMethod.arrays)
    router.npz       fallback_order: the paths an empty prefix goes to, best first
    featurizer.npz   the featurizer's state (none for an LM featurizer)
    discriminative.npz   the classifier head, when there is one

Versions 1-3 (before the registry; run directories made then hold them) still load: their
settings are flat keys of the manifest, and ``kmeans.npz`` holds the method's arrays
under the same names (``centroids_<level>``, ``rotation``, ``cluster_paths``) with
``fallback_order`` beside them.
"""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .discriminative import DiscriminativeHead
from .features import featurizer_from_state
from .methods import method_class, method_config
from .settings import RouterSettings
from .storage import atomic_write_json, atomic_write_npz, load_npz_checked

__all__ = ["ROUTER_FORMAT_VERSION", "check_grid", "read_router", "write_router"]

# 2: methods "tree" (per-level node centroids) and "grouped", keys "balance" and
# "soft_capacity_factor". 3: method "merge" (array cluster_paths), keys "fine_clusters" and
# "prompt_classifier". 4: settings and method_settings as groups, method.npz + router.npz.
ROUTER_FORMAT_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
_MANIFEST = "manifest.json"
METHOD, ROUTER, FEATURIZER, HEAD = "method.npz", "router.npz", "featurizer.npz", "discriminative.npz"
_LEGACY_ARRAYS = "kmeans.npz"  # versions 1-3: the method's arrays and fallback_order


def check_grid(grid: Sequence[int]) -> tuple[int, ...]:
    try:
        g = tuple(int(k) for k in grid)
    except TypeError:
        raise ValueError(f"grid must be a list of modules per level, e.g. [4, 4]; got {grid!r}") from None
    if not g or any(k < 1 for k in g):
        raise ValueError(f"grid must be a non-empty list of positive ints (modules per level), got {list(grid)}")
    return g


def write_router(d: Path, manifest: dict[str, Any], arrays: dict[str, dict[str, np.ndarray] | None]) -> Path:
    """Write each array file of ``arrays`` (file name → arrays; None: no such file, a stale
    one is removed), drop files of an older layout, then the manifest (with hashes) last."""
    d.mkdir(parents=True, exist_ok=True)
    hashes = {name: atomic_write_npz(d / name, a) for name, a in arrays.items() if a is not None}
    for stale in {HEAD, _LEGACY_ARRAYS} - set(hashes):
        if (d / stale).exists():
            (d / stale).unlink()
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
    required = ("grid", "method", "seed", "featurizer") + (
        ("settings", "method_settings") if m["version"] >= 4 else ("prefix_tokens", "top_k", "capacity_factor"))
    missing = [k for k in required if k not in m]
    if missing:
        raise ValueError(f"{mpath} lacks keys {missing}; save the router again")
    return m


def _legacy_settings(m: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router's and the method's settings of a version 1-3 manifest (flat keys; a key
    written before it existed is absent and takes the behaviour of its time)."""
    settings = {f.name: m[f.name] for f in fields(RouterSettings) if m.get(f.name) is not None}
    settings.setdefault("cluster_tokens", m["prefix_tokens"])  # absent: clustered on the routing prefix
    if "reroute_context" not in m:  # absent: re-routes read the cluster_tokens before the window
        settings["reroute_context"] = settings["cluster_tokens"]
    own = {f.name for f in fields(method_class(m["method"]))}  # niter and fine_clusters were written for all
    return settings, {k: v for k, v in m.items() if k in own}


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
    legacy = m["version"] < 4
    method_file, router_file = (_LEGACY_ARRAYS, _LEGACY_ARRAYS) if legacy else (METHOD, ROUTER)
    files = m.get("files", {})
    for required in {method_file, router_file, FEATURIZER}:
        if required not in files:
            raise ValueError(f"{mpath} lists no {required}; the directory is incomplete")
    loaded = {name: load_npz_checked(d / name, sha) for name, sha in files.items()}
    try:
        settings, method_settings = _legacy_settings(m) if legacy else (m["settings"], m["method_settings"])
        config = method_config(m["method"], **method_settings)
        settings = RouterSettings(**settings)
    except (TypeError, ValueError) as e:  # an unknown method or setting: written by other code
        raise ValueError(f"{mpath}: {e}; re-run routing (dipaco-route) to refit it") from None
    feat = featurizer_from_state(
        m["featurizer"]["kind"], m["featurizer"]["params"], loaded[FEATURIZER], featurizer_fn
    )
    head = None
    if m.get("discriminative"):
        h = loaded.get(HEAD)
        if h is None:
            raise ValueError(f"{mpath} says discriminative but lists no {HEAD}")
        head = DiscriminativeHead(h["coef"], h["intercept"], h["classes"], int(np.prod(grid)))
    routing = config.build(grid, seed=int(m["seed"]), dim=feat.dim)
    try:
        routing.load_arrays(loaded[method_file])
    except KeyError as e:
        raise ValueError(f"{d / method_file} lacks array {e}") from None
    except ValueError as e:
        raise ValueError(f"{d / method_file}: {e}") from None
    if "fallback_order" not in loaded[router_file]:
        raise ValueError(f"{d / router_file} lacks array 'fallback_order'")
    return dict(grid=grid, routing=routing, settings=settings, seed=m["seed"], featurizer=feat,
                fallback_order=loaded[router_file]["fallback_order"], head=head)
