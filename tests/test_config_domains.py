"""Every config value by rule (issue: hostile input): each key of the schema has a domain
in dipaco/config/domains.py, and a fixed-seed walk of the whole schema checks that an
out-of-domain value is one ConfigError naming that key (before any file is written,
through the real CLI too), and that an in-domain edge value validates or is refused in
one line, never anything else. A sample of edge values runs end to end on the tiny
smoke config (slow)."""
from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from dipaco.cli import train as train_cli
from dipaco.config import Config, ConfigError, compose_config
from dipaco.config.domains import DOMAINS, Domain, _bound
from dipaco.run.resume import flat_config
from dipaco.job.train import train
from dipaco.config.validate import validate_config

SMOKE = ["experiment=smoke"]
SEED = 20261125


@pytest.fixture(scope="module")
def base() -> Config:
    cfg = compose_config(SMOKE)
    validate_config(cfg)
    return cfg


def set_value(cfg: Any, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    setattr(node, leaf, value)


def test_every_schema_key_has_a_domain_and_every_domain_a_key() -> None:
    keys = set(flat_config(Config()))
    assert keys - set(DOMAINS) == set(), "add these keys' domains to dipaco/config/domains.py"
    assert set(DOMAINS) - keys == set(), "dipaco/config/domains.py names keys the schema lacks"


def test_domain_kinds_match_the_schema_types() -> None:
    """A number has a range and a string of fixed names has its names: free text is
    declared as such, so no numeric or enumerated key goes unchecked."""
    for key, v in flat_config(Config()).items():
        dom = DOMAINS[key]
        if isinstance(v, bool):
            assert dom.kind == "flag", key
        elif isinstance(v, int):
            assert dom.kind == "int" and dom.lo is not None and dom.hi is not None, key
        elif isinstance(v, float):
            assert dom.kind == "real" and dom.lo is not None and dom.hi is not None, key
        elif isinstance(v, list):
            assert dom.kind in ("ints", "texts"), key
        elif dom.kind == "choice":
            assert v in dom.names(), (key, v)


def _numbers(dom: Domain, cfg: Config) -> tuple[float | None, float | None]:
    return _bound(dom.lo, cfg)[0], _bound(dom.hi, cfg)[0]


def outside(key: str, dom: Domain, cfg: Config, rng: random.Random) -> Iterator[Any]:
    """Values outside ``dom`` given ``cfg`` (the other keys as they are)."""
    if dom.kind in ("int", "real"):
        lo, hi = _numbers(dom, cfg)
        step = 1 if dom.kind == "int" else max(1e-9, abs(hi or 1) * 1e-6)
        if lo is not None:
            yield lo if dom.lo_open else (lo - step if dom.kind == "real" else int(lo) - 1)
            yield int(lo) - rng.randint(2, 10**6) if dom.kind == "int" else lo - rng.uniform(1, 1e6)
        if hi is not None:
            yield int(hi) + 1 if dom.kind == "int" else hi + step
            yield int(hi) + rng.randint(2, 10**12) if dom.kind == "int" else hi * rng.uniform(2, 1e6) + 1
        if dom.kind == "real":
            yield from (math.nan, math.inf, -math.inf)
        if not dom.null:
            yield None
    elif dom.kind == "choice":
        yield rng.choice(["", "none_such", "SYNC ", "auto2", "../x"])
        if not dom.null:
            yield None
    elif dom.kind == "ints":
        lo, hi = _numbers(dom, cfg)
        if hi is not None:
            yield [int(hi) + 1]
        if dom.items[0] > 0:
            yield []
        if dom.max_product:
            yield [int(math.isqrt(dom.max_product)) + 1] * 2
    elif dom.kind in ("text", "path") and not dom.null:
        yield from ("", "   ", "a\x00b")


def inside(dom: Domain, cfg: Config, rng: random.Random) -> Iterator[Any]:
    """Edge values inside ``dom``: its ends, a random point, null when allowed."""
    if dom.kind in ("int", "real"):
        lo, hi = _numbers(dom, cfg)
        if lo is not None and hi is not None and hi >= lo:
            if dom.kind == "int":
                yield from {int(lo), int(hi), rng.randint(int(lo), int(hi))}
            else:
                yield from (hi, lo + (hi - lo) * rng.random()) if dom.lo_open else (lo, hi)
    elif dom.kind == "choice":
        yield from dom.names()
    elif dom.kind == "flag":
        yield from (True, False)
    if dom.null:
        yield None


def test_out_of_domain_values_name_their_key_everywhere_in_the_schema(base: Config) -> None:
    rng = random.Random(SEED)
    cases = 0
    for key, dom in DOMAINS.items():
        for value in outside(key, dom, base, rng):
            cfg = copy.deepcopy(base)
            set_value(cfg, key, value)
            with pytest.raises(ConfigError) as err:
                validate_config(cfg)
            assert err.value.key == key, (key, value, str(err.value))
            assert "\n" not in str(err.value) and "Fix:" in str(err.value)
            cases += 1
    assert cases > 300


def test_in_domain_edge_values_validate_or_are_one_line(base: Config) -> None:
    """Every edge of every domain: accepted, or refused naming a key (a relation with
    another key), never another exception."""
    rng = random.Random(SEED)
    for key, dom in DOMAINS.items():
        if key in ("logging.wandb", "trainer.device", "launcher.backend"):
            continue  # environment-dependent (an installed package, a GPU): checked in their own tests
        for value in inside(dom, base, rng):
            cfg = copy.deepcopy(base)
            set_value(cfg, key, value)
            try:
                validate_config(cfg)
            except ConfigError as e:
                assert "\n" not in str(e) and e.key, (key, value)


@pytest.mark.parametrize("override", [
    "trainer.lr=-1", "diloco.inner_steps=0", "grid.levels=[1000,1000]", "trainer.lr=abc",
    "data.max_doc_chars=1000000000", "diloco.outer.name=lbfgs", "seed=-3", "trainer.lr=nan",
])
def test_cli_refuses_out_of_domain_values_in_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch,
                                                                         override) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setattr(sys, "argv", ["dipaco-train", *SMOKE, override, f"hydra.run.dir={run_dir}"])
    with pytest.raises(SystemExit) as ended:
        train_cli.main()
    assert ended.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    key = override.split("=")[0]
    assert len(lines) == 1 and key in lines[0] and "Traceback" not in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # not even the run directory


def edge_runs() -> list[list[str]]:
    """One run of six in-domain edge values, drawn with a fixed seed from a list of edges
    that change what is computed (so the run means something)."""
    edges = ["trainer.min_lr_ratio=1.0", "trainer.grad_clip=0", "router.top_k=4", "diloco.outer.momentum=0.999",
             "diloco.outer.nesterov=false", "trainer.warmup_steps=0", "trainer.weight_decay=0",
             "router.capacity_factor=1.0", "trainer.beta1=0", "data.min_doc_chars=0", "router.niter=1",
             "router.feature_dim=1", "diloco.outer.lr=10", "trainer.eval_max_documents=1",
             "diloco.codec=int8", "diloco.codec_block=1", "trainer.micro_batches=4", "router.prefix_tokens=63"]
    return [random.Random(SEED).sample(edges, 6)]


@pytest.mark.slow
@pytest.mark.parametrize("edges", edge_runs(), ids=lambda e: ",".join(x.split("=")[0] for x in e))
def test_in_domain_edge_values_run_to_the_end_or_refuse_in_one_line(tmp_path, edges) -> None:
    overrides = SMOKE + ["data.max_documents=120", "trainer.dense_baseline=false"] + edges
    try:
        summary = train(compose_config(overrides, tmp_path / "run"))
    except ConfigError as e:
        assert "\n" not in str(e)
        assert not (tmp_path / "run").exists()
        return
    assert summary["rounds"] == 2 and math.isfinite(summary["routed_ppl"]), summary
    assert Path(tmp_path / "run" / "summary.json").is_file()


def test_the_fix_never_suggests_a_value_that_is_out_of_range_itself() -> None:
    """With diloco.inner_steps=1 the default τ (1) is out of range: the fix names 0."""
    from dipaco.config import Config
    from dipaco.config.domains import check_domains

    cfg = Config()
    cfg.diloco.inner_steps, cfg.diloco.streaming = 1, True
    with pytest.raises(ConfigError, match=r"Fix: e\.g\. diloco\.streaming_delay=0 \(the default, 1, is out of range"):
        check_domains(cfg)
