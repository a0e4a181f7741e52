"""Every committed config choice composes and validates; packaging lists every package."""
from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dipaco.config import ConfigError, compose_config
from dipaco.config.names import DATA_SOURCES
from dipaco.job.prepare import _require_documents_per_path
from dipaco.config.validate import validate_config

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# every registered source but the built-in corpora reads data.path (dipaco/config/names.py)
NEEDS_PATH = {name for name, source in DATA_SOURCES.items() if source.kind != "builtin"}
# launcher=slurm has no default partition, and its 8 ranks per node need at least 8 paths
NEEDS_MORE = {("launcher", "slurm"): ["launcher.partition=gpu", "grid=4x4"]}


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    ("group", "choice"),
    [(g, c) for g in ("data", "model", "grid", "router", "diloco", "trainer", "launcher", "experiment")
     for c in _choices(g)],
)
def test_every_group_choice_composes_and_validates(group: str, choice: str) -> None:
    overrides = [f"{group}={choice}"]
    if group == "data" and OmegaConf.load(CONF / "data" / f"{choice}.yaml").get("source", choice) in NEEDS_PATH:
        overrides.append("data.path=docs.jsonl")
    overrides += NEEDS_MORE.get((group, choice), [])
    cfg = compose_config(overrides)
    validate_config(cfg)


@pytest.mark.parametrize("sweep", _choices("sweep"))
def test_sweeps_name_real_keys(sweep: str) -> None:
    """A typo in a committed sweep would only show after minutes of runs: catch it here."""
    raw = OmegaConf.load(CONF / "sweep" / f"{sweep}.yaml")
    params = raw.hydra.sweeper.params
    assert params, sweep
    base = OmegaConf.structured(compose_config([f"sweep={sweep}"]))
    for key, values in params.items():
        if (CONF / key).is_dir():  # a config group: every value must be a choice
            for v in str(values).split(","):
                assert v in _choices(key), (sweep, key, v)
        else:
            assert OmegaConf.select(base, key, throw_on_missing=False, default="<absent>") != "<absent>", key


def test_total_steps_sets_rounds_and_must_divide() -> None:
    cfg = compose_config(["trainer.total_steps=800", "diloco.inner_steps=200"])
    validate_config(cfg)
    assert cfg.trainer.rounds == 4
    with pytest.raises(ConfigError, match="trainer.total_steps"):
        validate_config(compose_config(["trainer.total_steps=810", "diloco.inner_steps=200"]))


@pytest.mark.parametrize(("grid", "paths"), [("dense", 1), ("2x2", 4), ("4x4", 16)])
def test_documents_per_path_scales_the_training_data_with_the_paths(grid: str, paths: int) -> None:
    cfg = compose_config([f"grid={grid}", "data.documents_per_path=250"])
    validate_config(cfg)
    validate_config(cfg)  # idempotent: a resolved config (a resumed run's) validates again
    assert cfg.data.max_train_documents == 250 * paths
    assert cfg.data.max_documents is None  # validation and test stay whole


def test_documents_per_path_and_max_train_documents_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="documents_per_path.*drop data.max_train_documents"):
        validate_config(compose_config(["data.documents_per_path=250", "data.max_train_documents=100"]))
    with pytest.raises(ConfigError, match="max_train_documents.*positive"):
        validate_config(compose_config(["data.max_train_documents=0"]))


def test_a_corpus_too_small_for_documents_per_path_is_one_line_naming_the_most_it_allows() -> None:
    cfg = compose_config(["grid=4x4", "data.documents_per_path=1000"])
    validate_config(cfg)
    _require_documents_per_path(cfg, 16_000)  # exactly enough
    with pytest.raises(ConfigError, match=r"16,000 training documents; the corpus's training split has 5,212"
                                          r".*documents_per_path<=325"):
        _require_documents_per_path(cfg, 5_212)


def test_setup_cfg_lists_every_package() -> None:
    """Packages are listed, not found (conf/ installs as dipaco.conf): none may be forgotten."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in parser["options"]["packages"].split() if p.strip()}
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("dipaco", "router", "modules")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found - listed == set(), f"add to setup.cfg [options] packages: {sorted(found - listed)}"
    assert "dipaco.conf" in listed


def test_cluster_tokens_shorter_than_the_routing_prefix_is_refused() -> None:
    validate_config(compose_config(["router.cluster_tokens=128"]))
    validate_config(compose_config(["router.cluster_tokens=null"]))
    with pytest.raises(ConfigError, match=r"router.cluster_tokens: 16 is out of range: must be >= 32 \(router.prefix_tokens\)"):
        validate_config(compose_config(["router.cluster_tokens=16"]))


def test_the_router_keys_are_the_router_package_s_settings() -> None:
    """router.<name> keys, their domains and the router's fingerprint come from router/
    (RouterSettings and every routing method's config): a method's new setting needs no
    line in dipaco."""
    from dataclasses import fields

    from dipaco.config import RouterConfig
    from dipaco.config.domains import DOMAINS
    from dipaco.run.fingerprint import _DEPENDS_ON
    from router.methods import METHODS, method_settings
    from router.settings import RouterSettings

    declared = {f.name for f in fields(RouterSettings)} | set(method_settings())
    assert declared <= {f.name for f in fields(RouterConfig)}
    assert {f"router.{n}" for n in declared} <= set(_DEPENDS_ON["router"])
    assert DOMAINS["router.method"].names() == METHODS
    assert DOMAINS["router.niter"].hi == 10_000 and DOMAINS["router.fine_clusters"].null


def test_merge_router_options_are_validated() -> None:
    validate_config(compose_config(["router=merge"]))
    validate_config(compose_config(["router=merge", "grid=4x4", "router.fine_clusters=16"]))
    with pytest.raises(ConfigError, match=r"router.fine_clusters: 8 is out of range: must be >= 16 \(the number of paths\)"):
        validate_config(compose_config(["router=merge", "grid=4x4", "router.fine_clusters=8"]))
    with pytest.raises(ConfigError, match="router.prompt_classifier: learns content-based shards"):
        validate_config(compose_config(["router=random", "router.prompt_classifier=true"]))
