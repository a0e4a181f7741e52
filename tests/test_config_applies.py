"""A setting is used or refused, never ignored (dipaco/config/applies.py): every key of the
schema declares where it applies; a key set away from its default where it does not apply
is refused in one line naming it, and the fix the line proposes makes it apply. In-domain
values the host cannot honour are capped with a line (trainer.threads); a loss that
becomes infinite says so."""
from __future__ import annotations

import copy
import logging
import re
from typing import Any

import pytest

from _compose import compose
from dipaco.config import Config, ConfigError, compose_config
from dipaco.config.applies import APPLIES, EVERYWHERE, check_applies, not_applying, undeclared
from dipaco.config.domains import DOMAINS, Domain, value_of
from dipaco.config.validate import validate_config
from dipaco.run.resume import flat_config
from dipaco.runtime.hardware import cap_threads
from dipaco.runtime.tracking import nonfinite_line
from router.methods import METHODS

SMOKE = ["experiment=smoke"]
DEFAULTS = Config()
CONDITIONAL = sorted(k for k, w in APPLIES.items() if w is not None)
# a config where the key does not apply, for keys the smoke config reads
AWAY: dict[str, list[str]] = {
    "data.exclude_packages": ["data=jsonl", "data.path=/nonexistent/x.jsonl"],
    "data.target_doc_chars": ["data=jsonl", "data.path=/nonexistent/x.jsonl"],
    "data.tokenizer_sample_bytes": ["data.tokenizer=/nonexistent/tokenizer.json", "model.vocab_size=512"],
    "data.tokenizer_sample_documents": ["data.tokenizer=/nonexistent/tokenizer.json", "model.vocab_size=512"],
    "trainer.compile_backend": ["trainer.compile=false"],
    "launcher.nproc": ["launcher=torchrun"],  # launcher=local reads it: the simulated worker groups
    "cluster.chip_tflops": ["cluster.step_s=1"], "cluster.mfu": ["cluster.step_s=1"],
}
# what a fix of the form "use data=hub" needs besides (data=hub requires a path)
NEEDS = {"data=hub": ["data.path=someone/some_dataset"], "data=jsonl": ["data.path=/nonexistent/x.jsonl"]}


def composed(overrides: list[str]) -> Config:
    """compose_config, fast (tests/_compose.py): the groups once per combination."""
    return compose(overrides)


def set_value(cfg: Any, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    setattr(node, leaf, value)


def other_value(key: str, dom: Domain) -> Any:
    """An in-domain value other than the schema default."""
    default = value_of(DEFAULTS, key)
    if dom.kind == "flag":
        return not default
    if dom.kind == "choice":
        return next(n for n in dom.names() if n != default)
    if dom.kind in ("text", "path"):
        return "someone/some_name"
    if dom.kind == "ints":
        return [1]
    if dom.kind == "texts":
        return ["x"]
    if default is None or default == 0:
        return 2 if dom.kind == "int" else 0.5
    return default + 1 if dom.kind == "int" else default / 2


def test_every_schema_key_declares_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Declared, not filled in: a key in neither EVERYWHERE nor a Where row fails here."""
    assert undeclared() == [], "declare where these keys apply in dipaco/config/applies.py"
    assert set(APPLIES) == set(flat_config(Config())) == set(DOMAINS)
    assert len(CONDITIONAL) >= 60  # the slurm, decoupled, streaming, elastic, data-source, codec and cluster keys
    import dipaco.config.applies as applies

    monkeypatch.setattr(applies, "EVERYWHERE", tuple(k for k in EVERYWHERE if k != "trainer.lr"))
    monkeypatch.setattr(applies, "APPLIES", {k: w for k, w in APPLIES.items() if k != "trainer.lr"})
    assert applies.undeclared() == ["trainer.lr"]


@pytest.mark.parametrize("key", CONDITIONAL)
def test_a_key_set_where_it_does_not_apply_is_refused_and_its_fix_makes_it_apply(key: str) -> None:
    where = APPLIES[key]
    value = other_value(key, DOMAINS[key])
    away = AWAY.get(key, [])
    if key.startswith("router.") and where.when(composed(SMOKE)):  # a routing method's setting: another method
        away = next([f"router.method={m}"] for m in METHODS if not where.when(composed(SMOKE + [f"router.method={m}"])))
    cfg = composed(SMOKE + away)
    assert not where.when(cfg), f"{key}: the smoke config (with {away}) should not read it"
    assert not not_applying(cfg), "the base config sets no key where it does not apply"
    set_value(cfg, key, value)
    with pytest.raises(ConfigError) as err:
        check_applies(cfg)
    msg = str(err.value)
    assert err.value.key == key and "\n" not in msg and "Fix:" in msg, msg
    # the fix: the overrides it names make the key apply (and "drop" gives the default back)
    fix = [w for w in re.findall(r"([\w.]+=[\w./-]+)", msg.split("Fix:", 1)[1]) if not w.startswith(key + "=")]
    assert fix, msg
    fixed = composed(SMOKE + away + fix[:1] + NEEDS.get(fix[0], []))
    set_value(fixed, key, value)
    assert key not in [k for k, _, _ in not_applying(fixed)], (key, fix[0])
    dropped = copy.deepcopy(cfg)
    set_value(dropped, key, value_of(DEFAULTS, key))
    assert key not in [k for k, _, _ in not_applying(dropped)]


@pytest.mark.parametrize("overrides, key", [
    (["launcher=spawn", "launcher.nproc=2", "launcher.nodes=2"], "launcher.nodes"),
    (["launcher.nodes=2"], "launcher.nodes"),
    (["data=jsonl", "data.path=/nonexistent/x.jsonl", "data.streaming=true"], "data.streaming"),
    (["launcher.partition=gpu"], "launcher.partition"),
    (["diloco.codec_block=64"], "diloco.codec_block"),
    (["logging.wandb_project=x"], "logging.wandb_project"),
    (["diloco.decoupled.quorum=0.9"], "diloco.decoupled.quorum"),
    (["trainer.rounds=3", "trainer.total_steps=40", "diloco.inner_steps=4"], "trainer.rounds"),
    # issue 56: switched off by another setting
    (["cluster.slow_factor=3"], "cluster.slow_factor"), (["cluster.slow_groups=2"], "cluster.slow_groups"),
    (["cluster.straggler_sigma=0.5"], "cluster.straggler_sigma"), (["cluster.wan_gbps=10"], "cluster.wan_gbps"),
    (["cluster.regions=4"], "cluster.regions"), (["cluster.step_s=1", "cluster.mfu=0.5"], "cluster.mfu"),
    (["cluster.restart_s=60"], "cluster.restart_s"), (["cluster.seed=7"], "cluster.seed"),
    (["diloco.error_feedback=true"], "diloco.error_feedback"),
    (["diloco.lossy_exchange=all_gather"], "diloco.lossy_exchange"),
    (["logging.run_name=x"], "logging.run_name"), (["router.method=random", "router.feature_dim=8"],
                                                   "router.feature_dim"),
])
def test_the_reported_ignored_settings_are_refused_by_validate(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(SMOKE + overrides))
    assert err.value.key == key, str(err.value)


def test_hub_config_on_a_local_folder_is_refused(tmp_path) -> None:
    cfg = compose_config(["data=hub", f"data.path={tmp_path}", "data.hub_config=en"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == "data.hub_config"
    validate_config(compose_config(["data=hub", "data.path=someone/dataset", "data.hub_config=en"]))


def test_total_steps_alone_or_with_its_own_rounds_is_accepted() -> None:
    for extra in ([], ["trainer.rounds=10"]):
        cfg = compose_config(["trainer.total_steps=500", "diloco.inner_steps=50", *extra])
        validate_config(cfg)
        assert cfg.trainer.rounds == 10
    # the fix of the refusal: drop trainer.total_steps
    validate_config(compose_config(SMOKE + ["trainer.rounds=3", "diloco.inner_steps=4"]))


def test_threads_beyond_the_host_are_capped_with_a_line() -> None:
    said: list[str] = []
    assert cap_threads(4096, 1, said.append, cores=2) == 2 and "trainer.threads=4096" in said[0]
    assert cap_threads(4, 2, said.append, cores=2) == 1 and len(said) == 2
    assert cap_threads(2, 1, said.append, cores=2) == 2 and len(said) == 2  # within the host: obeyed, silent


def test_a_loss_that_becomes_infinite_says_so(caplog: pytest.LogCaptureFixture) -> None:
    ok = {"round": 1, "paths": {"0": {"loss": 3.2, "skipped_steps": 0}}}
    assert nonfinite_line(ok) is None
    bad = {"round": 2, "paths": {"0": {"loss": 3.1, "skipped_steps": 0},
                                 "1": {"loss": float("nan"), "skipped_steps": 4}}}
    line = nonfinite_line(bad)
    assert line and "path 1" in line and "path 0" not in line and "non-finite" in line and "trainer.lr" in line


@pytest.mark.parametrize("overrides, key, says", [
    (["cluster.chips=64", "cluster.chips_per_group=3"], "cluster.chips", "1 chip(s) would sit idle"),
    (["grid.levels=[3]", "router.top_k=1"], "cluster.chips", "so 63 chips would be simulated"),
    (["cluster.slow_groups=9", "cluster.slow_factor=2"], "cluster.slow_groups", "more than the 4 worker groups"),
    (["cluster.regions=9", "cluster.wan_gbps=10"], "cluster.regions", "more than the 4 worker groups"),
    (["cluster.straggler=lognormal", "cluster.straggler_sigma=0"], "cluster.straggler_sigma", "would do nothing"),
])
def test_a_cluster_the_simulator_would_reshape_is_refused_naming_the_key(overrides: list[str], key: str,
                                                                         says: str) -> None:
    """`cluster.chips=64` simulated as 63, slow groups or regions capped at the group
    count, a straggler of spread 0: refused in one line by dipaco-plan --simulate's
    preflight, and the fix the line proposes is accepted."""
    from dipaco.job.preflight import preflight

    cfg = compose_config(SMOKE + overrides)
    with pytest.raises(ConfigError) as err:
        preflight(cfg, simulating=True)
    assert err.value.key == key and says in str(err.value), str(err.value)
    fix = re.search(r"Fix: use ([\w.]+=[\w.]+)", str(err.value))
    assert fix, str(err.value)
    preflight(compose_config(SMOKE + overrides + [fix.group(1)]), simulating=True)


def test_outer_momentum_is_refused_for_an_optimiser_that_does_not_take_it() -> None:
    from dipaco.job.preflight import preflight

    for given, key in ((["diloco.outer.momentum=0.5"], "diloco.outer.momentum"),
                       (["diloco.outer.nesterov=false"], "diloco.outer.nesterov")):
        with pytest.raises(ConfigError) as err:
            preflight(compose_config(SMOKE + ["diloco.outer.name=adam"] + given))
        assert err.value.key == key and "would ignore it" in str(err.value)
    preflight(compose_config(SMOKE + ["diloco.outer.name=adam"]))  # defaults are not "set"
    preflight(compose_config(SMOKE + ["diloco.outer.name=rmsprop", "diloco.outer.momentum=0.5",
                                      "diloco.outer.nesterov=true"]))
