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
from dipaco.config.applies import APPLIES, check_applies, not_applying
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


def test_every_schema_key_declares_where_it_applies() -> None:
    assert set(APPLIES) == set(flat_config(Config())) == set(DOMAINS)
    assert len(CONDITIONAL) >= 40  # the slurm, decoupled, streaming, elastic, data-source and codec keys


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
