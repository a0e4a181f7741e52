"""The routing methods as a registry: routers saved before it still load and route as
they did, fitting gives what the code before it gave, and every method is reachable
through its one registry line and its YAML.

``tests/golden/routers_v3/`` was written by the code before the registry (commit 8e27190,
router format version 3; ``make.py`` there says how): one saved router per method and
what that code computed with it on a small corpus.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import yaml

from router import METHODS, Router
from router.methods import method_class, method_config, method_settings
from router.settings import RouterSettings

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "routers_v3"


def _make():
    spec = importlib.util.spec_from_file_location("routers_v3_make", GOLDEN / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MAKE = _make()
EXPECTED = np.load(GOLDEN / "expected.npz")
# the methods the fixture was written for (those before the registry); a method added
# since has no golden output and needs no test change
GOLDEN_METHODS = list(MAKE.FITS)


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


def test_the_fixture_covers_every_method_it_was_written_for() -> None:
    assert sorted(p.name for p in GOLDEN.iterdir() if p.is_dir()) == sorted(GOLDEN_METHODS)
    assert set(GOLDEN_METHODS) <= set(METHODS)


def test_the_fixture_corpus_is_make_py_s() -> None:
    assert all(np.array_equal(a, b) for a, b in zip(_docs(), MAKE.corpus()))


@pytest.mark.parametrize("method", GOLDEN_METHODS)
def test_a_router_saved_before_the_registry_loads_and_routes_as_it_did(method: str) -> None:
    r = Router.load(GOLDEN / method, expected_grid=MAKE.GRID)
    assert r.method == method and json.loads((GOLDEN / method / "manifest.json").read_text())["version"] == 3
    _check(r, method)


@pytest.mark.parametrize("method", GOLDEN_METHODS)
def test_fitting_gives_what_the_code_before_the_registry_gave(method: str) -> None:
    _check(MAKE.fit(method, _docs()), method)


@pytest.mark.parametrize("method", GOLDEN_METHODS)
def test_an_old_router_saved_again_is_version_4_and_routes_the_same(tmp_path: Path, method: str) -> None:
    shutil.copytree(GOLDEN / method, tmp_path / "r")
    Router.load(tmp_path / "r").save(tmp_path / "r")  # in place, as a re-shard does
    m = json.loads((tmp_path / "r" / "manifest.json").read_text())
    assert m["version"] == 4 and not (tmp_path / "r" / "kmeans.npz").exists()
    assert set(m["method_settings"]) == {f.name for f in fields(method_class(method))}
    _check(Router.load(tmp_path / "r"), method)


def test_every_method_has_a_yaml_in_conf_router() -> None:
    """Adding a router is one module, one YAML and one registry line: the YAML must exist."""
    named = {yaml.safe_load(p.read_text()).get("method", "product") for p in (REPO / "conf" / "router").glob("*.yaml")}
    assert set(METHODS) <= named, sorted(set(METHODS) - named)


def test_a_setting_the_method_lacks_is_refused() -> None:
    with pytest.raises(TypeError, match="method 'tree' has no setting 'fine_clusters'"):
        method_config("tree", fine_clusters=8)
    with pytest.raises(ValueError, match="method must be one of"):
        Router.fit(_docs(), [2, 2], method="nope")
    with pytest.raises(TypeError, match="no setting"):
        Router.fit(_docs(), [2, 2], method="flat", fine_clusters=8)


def test_method_settings_are_one_list_apart_from_the_router_s() -> None:
    router = {f.name for f in fields(RouterSettings)}
    assert {"niter", "fine_clusters"} <= set(method_settings()) and not router & set(method_settings())


@pytest.mark.parametrize("method", [m for m in METHODS if not method_class(m).learns_content])
def test_a_control_without_content_refuses_a_prompt_classifier(method: str) -> None:
    with pytest.raises(ValueError, match=f"prompt_classifier=False with method='{method}'"):
        Router.fit(_docs(), [2, 2], method=method, prompt_classifier=True)
