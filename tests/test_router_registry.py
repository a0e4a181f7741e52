"""Routers saved by earlier code still load and route as they did, and fitting gives what
the earlier code gave.

``tests/golden/routers_v3/`` was written by the code of commit 8e27190 (router format
version 3; ``make.py`` there says how): one saved router per method and
what that code computed with it on a small corpus.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from router import METHODS, Router

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "routers_v3"


def _make():
    spec = importlib.util.spec_from_file_location("routers_v3_make", GOLDEN / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAKE = _make()
EXPECTED = np.load(GOLDEN / "expected.npz")


def _docs() -> list[np.ndarray]:
    t, off = EXPECTED["tokens"].astype(np.int64), EXPECTED["offsets"]
    return [t[a:b] for a, b in zip(off[:-1], off[1:])]


def _check(r: Router, method: str) -> None:
    """``r`` computes what the pre-registry code computed for ``method``."""
    docs = _docs()
    prompts = [d[:8] for d in docs] + [np.zeros(0, np.int64)]
    np.testing.assert_allclose(r.shard_costs(docs), EXPECTED[f"{method}.shard_costs"], rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.array(r.assign(docs), np.int8), EXPECTED[f"{method}.assign"])
    assert np.array_equal(r.route_batch(prompts).astype(np.int8), EXPECTED[f"{method}.route"])


def test_the_fixture_covers_every_method() -> None:
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(METHODS)
    assert list(MAKE.FITS) == list(METHODS)


def test_the_fixture_corpus_is_make_py_s() -> None:
    assert all(np.array_equal(a, b) for a, b in zip(_docs(), MAKE.corpus()))


@pytest.mark.parametrize("method", METHODS)
def test_a_router_saved_before_the_registry_loads_and_routes_as_it_did(method: str) -> None:
    r = Router.load(GOLDEN / method, expected_grid=MAKE.GRID)
    assert r.method == method and json.loads((GOLDEN / method / "manifest.json").read_text())["version"] == 3
    _check(r, method)


@pytest.mark.parametrize("method", METHODS)
def test_fitting_gives_what_the_code_before_the_registry_gave(method: str) -> None:
    _check(MAKE.fit(method, _docs()), method)
