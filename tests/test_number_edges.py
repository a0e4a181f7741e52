"""Rule 4 (docs/reliability.md): numbers at their edges, everywhere a number enters.

Every numeric entry point is enumerated from the code, never listed here: the config
schema's domains (``dipaco/config/domains.py``: every key, cluster descriptions included,
as Hydra parses a command line), every typed flag of every console script's parser
(``build_parser``), every numeric field of the server's request schema
(``dipaco/serve/schemas.py``) and every generation setting an lm-eval task may give
(``dipaco/inference/lm_generate.py: GEN_DOMAINS``). Each takes the same edges (0, -0.0,
the smallest subnormal, the largest finite, +-inf, NaN, a number that overflows, huge
integers, strings): it is used as given, or refused in one line naming the key. A value
accepted is then run through what reads it (the model's forward pass, the inner
optimiser and its schedule, the simulator, the sampler), which must stay finite.
"""
from __future__ import annotations

import argparse
import configparser
import copy
import functools
import importlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dipaco.config import Config, ConfigError, compose_config
from dipaco.config.domains import DOMAINS, TINY, value_of
from dipaco.config.errors import composition_error

REPO = Path(__file__).resolve().parents[1]
SMOKE = ["experiment=smoke"]
EDGES = ("0", "-0.0", "5e-324", "1.7976931348623157e308", "inf", "-inf", "nan", "1e400", str(2**64),
         str(-2**64), "abc", "0x1F", "true")
JSON_EDGES = ("0", "-0.0", "5e-324", "1.7976931348623157e308", "1e400", "NaN", "Infinity", "-Infinity",
              str(2**64), str(-2**64), '"abc"', "true", "1.5")
PY_EDGES: tuple[Any, ...] = (0, -0.0, 5e-324, 1.7976931348623157e308, math.inf, -math.inf, math.nan, 2**64,
                             -2**64, "abc", True, 1.5)


def numeric_keys() -> list[str]:
    return [k for k, d in DOMAINS.items() if d.kind in ("int", "real", "ints")]


@pytest.fixture(scope="module")
def base() -> Config:
    return compose_config(SMOKE)


@pytest.fixture(scope="module")
def typed(base: Config) -> Any:
    """The base config as OmegaConf's typed nodes, which type a value as a command line's is."""
    return OmegaConf.structured(base)


@functools.lru_cache(maxsize=None)
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parsed(key: str, text: str) -> Any:
    """``text`` as Hydra's override parser reads ``key=text``."""
    return _parser().parse_overrides([f"{key}={text}"])[0].value()


def with_override(base: Config, typed: Any, key: str, text: str) -> Config:
    """``base`` with ``key=text`` as Hydra parses it and the schema's node types it (the
    command line's path, without composing the groups again): ConfigError naming the key
    for a value of the wrong type, as compose_config says it."""
    old = OmegaConf.select(typed, key)
    try:
        OmegaConf.update(typed, key, parsed(key, text), merge=False)
        value = OmegaConf.to_object(typed[key]) if OmegaConf.is_config(typed[key]) else OmegaConf.select(typed, key)
    except OmegaConfBaseException as e:
        raise composition_error(e) from None
    finally:
        OmegaConf.update(typed, key, old, merge=False)
    cfg = copy.deepcopy(base)
    *parents, leaf = key.split(".")
    node = cfg
    for p in parents:
        node = getattr(node, p)
    setattr(node, leaf, value)
    return cfg


def finite(x: Any, what: str) -> None:
    """Every number in ``x`` (nested lists, dicts, tensors) is finite."""
    if isinstance(x, torch.Tensor):
        assert bool(torch.isfinite(x).all()), what
    elif isinstance(x, dict):
        for k, v in x.items():
            finite(v, f"{what}.{k}")
    elif isinstance(x, (list, tuple)):
        for v in x:
            finite(v, what)
    elif isinstance(x, float):
        assert math.isfinite(x), what


# ------------------------------------------------------------------ what reads an accepted value


def forward(cfg: Config) -> None:
    """A path of the config's model (smoke-sized) on random tokens: finite logits and loss."""
    from modules import ModuleGrid
    from modules.path_model import PathModel

    grid = ModuleGrid(cfg.model, list(cfg.grid.levels), seed=0)
    model = PathModel(grid, 0)
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    finite(logits, "logits")
    finite(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx.flatten()), "loss")


def inner_steps(cfg: Config) -> None:
    """The learning rate of every step of the schedule and two clipped AdamW steps."""
    from dipaco.config.schedule import lr_at, total_inner_steps, warmup_steps
    from dipaco.rounds.learner import make_inner_optimizer

    segments = total_inner_steps(cfg)
    end = max(e for _, e in segments)
    lrs = [lr_at(s, segments, cfg.trainer) for s in sorted({0, 1, warmup_steps(cfg), end // 2, end - 1, end})]
    finite(lrs, "lr")
    assert all(lr >= 0 for lr in lrs)
    model = torch.nn.Linear(4, 4)
    opt = make_inner_optimizer(model, cfg.trainer)
    for lr in lrs[:2]:
        for g in opt.param_groups:
            g["lr"] = lr
        model(torch.ones(1, 4)).sum().backward()
        if cfg.trainer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.grad_clip)
        opt.step()
        opt.zero_grad()
    finite([p.detach() for p in model.parameters()], "weights")


def simulate(cfg: Config) -> None:
    """The simulation (refused when it would not finish): every number of its report is
    finite, or null with the reason beside it (strict JSON)."""
    from dipaco.sim.report import simulate as run
    from dipaco.storage.strict_json import dumps_strict

    try:
        report = run(cfg)
    except ConfigError:
        return  # refused naming the key that makes it large (dipaco/sim/cost.py)
    json.loads(dumps_strict(report.to_dict()), parse_constant=lambda c: pytest.fail(f"{c} in the report"))
    for r in report.results:
        assert r.wall_per_round_s is None or math.isfinite(r.wall_per_round_s)


# the readers of a config section's real-valued keys (integers are shapes and counts)
READERS: dict[str, Callable[[Config], None]] = {"model.": forward, "trainer.": inner_steps, "cluster.": simulate}


def reader_of(key: str) -> Optional[Callable[[Config], None]]:
    return next((f for prefix, f in READERS.items() if key.startswith(prefix)), None)


def test_every_section_with_real_valued_keys_has_its_reader_or_says_why_not() -> None:
    """A real-valued key reaches float arithmetic: its section's reader is run above, or
    the key is bounded away from 0 and inf by its domain (NO_READER says how)."""
    missing = [k for k, d in DOMAINS.items() if d.kind == "real" and reader_of(k) is None and k not in NO_READER]
    assert not missing, f"run these keys' values through what reads them (READERS), or say why not: {missing}"


# real-valued keys read by plain arithmetic whose result stays finite for any value of the domain
NO_READER = {
    "data.val_fraction": "a share of the documents, rounded to a count",
    "data.test_fraction": "a share of the documents, rounded to a count",
    "router.capacity_factor": "a multiplier of a shard size in [1, 1e6], rounded to a count",
    "router.soft_capacity_factor": "a multiplier of a shard size in [1, 1e6], rounded to a count",
    "diloco.outer.lr": "stepped once at preflight, whose weight must stay finite (dipaco/job/preflight.py)",
    "diloco.outer.momentum": "stepped once at preflight, whose weight must stay finite",
    "diloco.codec_topk_fraction": "a share of a tensor's entries, rounded up to a count",
    "diloco.streaming_mix": "a convex weight in [0, 0.999]",
    "launcher.timeout_s": "seconds for a timer, at least 10",
    "launcher.rejoin_after_s": "seconds for a timer, at least 0",
    "logging.peak_tflops": "a divisor of the FLOPs achieved, at least float32's smallest normal",
}
NO_READER.update({k: "seconds, shares or factors of the decoupled scheduler, bounded on both sides"
                  for k in DOMAINS if k.startswith("diloco.decoupled.") and DOMAINS[k].kind == "real"})
NO_READER.update({k: "a routing method's setting, bounded by its declared domain"
                  for k in DOMAINS if k.startswith("router.") and DOMAINS[k].kind == "real" and k not in NO_READER})


def domain_edges(key: str) -> list[str]:
    """The key's own extremes: its constant bounds (the first value above an open one)."""
    dom = DOMAINS[key]
    out = []
    for bound, is_lo in ((dom.lo, True), (dom.hi, False)):
        if isinstance(bound, (int, float)) and not isinstance(bound, bool):
            v = bound
            if is_lo and dom.lo_open:
                v = max(TINY, math.nextafter(float(bound), math.inf)) if bound == 0 else math.nextafter(bound, math.inf)
            out.append(repr(int(v) if dom.kind != "real" else float(v)))
    return out


@pytest.mark.slow  # 160 keys x 15 edges, each validated and run through its reader: ~15 s of CPU
@pytest.mark.parametrize("key", numeric_keys())
def test_every_config_number_at_its_edges_is_used_as_given_or_refused_naming_its_key(base, typed, key) -> None:
    from dipaco.job.preflight import preflight

    for text in EDGES + tuple(domain_edges(key)):
        text = f"[{text}]" if DOMAINS[key].kind == "ints" else text
        try:
            cfg = with_override(base, typed, key, text)
            preflight(cfg, simulating=key.startswith("cluster."))
        except ConfigError as e:
            # the key itself (an entry of a list: key[i]), or a relation whose line names it
            assert (e.key == key or e.key.startswith(key + "[") or key in str(e)) and "\n" not in str(e), (text, str(e))
            continue
        given, got = parsed(key, text), value_of(cfg, key)
        assert got == given, (key, text, given, got)
        reader = reader_of(key)
        if reader is not None and DOMAINS[key].kind == "real":
            reader(cfg)


# ------------------------------------------------------------------ flags of every console script


def console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [ln.strip() for ln in cfg["options.entry_points"]["console_scripts"].splitlines() if ln.strip()]
    return {name.strip(): target.strip().split(":")[0] for name, target in (ln.split("=", 1) for ln in lines)}


# scripts whose numbers are config keys (Hydra overrides: walked above) and that take no typed flag
CONFIG_SCRIPTS = {"dipaco-train", "dipaco-route", "dipaco-plan"}


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for script, module in sorted(console_scripts().items()):
        mod = importlib.import_module(module)
        if not hasattr(mod, "build_parser"):
            assert script in CONFIG_SCRIPTS, f"{script}: give {module} a build_parser() so its flags are walked"
            continue
        todo = [(script, mod.build_parser())]
        while todo:
            name, p = todo.pop()
            yield name, p
            for a in p._actions:
                if isinstance(a, argparse._SubParsersAction):
                    todo += [(f"{name} {verb}", sub) for verb, sub in a.choices.items()]


def numeric_flags() -> list[tuple[str, argparse.Action]]:
    out = []
    for name, p in parsers():
        for a in p._actions:
            if a.type is None or not callable(a.type) or a.type in (str, Path):
                continue
            try:
                probe = a.type("1")
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                continue
            if isinstance(probe, (int, float)) and not isinstance(probe, bool):
                out.append((f"{name} {a.option_strings[0] if a.option_strings else a.dest}", a))
    return out


def test_the_console_scripts_have_numeric_flags_to_walk() -> None:
    names = [n for n, _ in numeric_flags()]
    assert len(names) >= 20 and any(n.startswith("dipaco-serve ") for n in names), names


@pytest.mark.parametrize("flag, action", numeric_flags(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_numeric_flag_at_its_edges_is_used_as_given_or_refused(flag: str, action: argparse.Action) -> None:
    """argparse turns the type's ArgumentTypeError / ValueError into one line naming the
    flag (exit 2); an accepted value is the number given, and what reads it stays finite."""
    for text in EDGES:
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, ValueError):
            continue
        assert isinstance(value, (int, float)) and math.isfinite(value), (flag, text, value)
        assert text != "true" and value == float(text), (flag, text, value)
        if action.dest in ("temperature", "top_p", "top_k"):
            sample(**{action.dest: value})


def sample(temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None) -> None:
    """The sampler draws a real token with these settings (never from NaN)."""
    from dipaco.inference.sampling import check_sampling, sample_token

    check_sampling(temperature, top_k, top_p)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 10
    logits[3] = -math.inf
    tok = int(sample_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(0)))
    assert 0 <= tok < 50 and tok != 3


# ------------------------------------------------------------------ the server's request fields


def request_fields() -> list[str]:
    """The numeric fields of the completions request (int or float in their annotation)."""
    schemas = pytest.importorskip("dipaco.serve.schemas")
    out = []
    for name, field in schemas.CompletionRequest.model_fields.items():
        ann = str(field.annotation)
        if "int" in ann.lower() or "float" in ann.lower():
            out.append(name)
    return out


@pytest.mark.parametrize("field", request_fields())
def test_every_numeric_request_field_at_its_edges_is_used_or_refused_naming_it(field: str) -> None:
    from dipaco.serve.errors import APIError
    from dipaco.serve.schemas import check_sampling, parse_completion

    for edge in JSON_EDGES:
        body = '{"model": "m", "prompt": "hi", "%s": %s}' % (field, edge)
        try:
            req = parse_completion(body.encode(), "application/json")
            check_sampling(req)
        except APIError as e:
            said = json.dumps(e.body() if callable(getattr(e, "body", None)) else str(e))
            assert field in said and "\\n" not in str(e), (field, edge, said)
            continue
        value = getattr(req, field)
        assert value is None or (isinstance(value, (int, float)) and math.isfinite(value)), (field, edge, value)
        if field in ("temperature", "top_p", "top_k") and value is not None:
            sample(**{field: value})
        if field == "seed" and value is not None:
            torch.Generator().manual_seed(value)


# ------------------------------------------------------------------ an lm-eval task's generation settings


@pytest.mark.parametrize("key", ["max_gen_toks", "temperature", "top_k", "top_p", "seed", "do_sample"])
def test_every_generation_setting_of_a_task_at_its_edges_is_used_or_refused_naming_it(key: str) -> None:
    from dipaco.inference.lm_generate import GEN_DOMAINS, gen_settings

    assert set(GEN_DOMAINS) == {"max_gen_toks", "temperature", "top_k", "top_p", "seed", "do_sample"}
    for edge in PY_EDGES:
        kwargs = {"until": ["\n"], "do_sample": True, key: edge}
        try:
            s = gen_settings(kwargs, "<eot>")
        except ValueError as e:
            assert key in str(e) and "\n" not in str(e), (key, edge, str(e))
            continue
        got = getattr(s, key, None) if key != "do_sample" else edge
        assert got is None or got == edge, (key, edge, got)
        sample(s.temperature, s.top_k, s.top_p)
