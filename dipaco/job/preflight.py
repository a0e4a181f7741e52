"""``preflight``: the config's own checks, then the ones that ask an implementation.

:func:`dipaco.config.validate.validate_config` reads the config only (it imports no torch
and no other dipaco package). What only the code that runs can answer is asked here,
before any work: the outer optimisers this torch has and one step of the chosen one, the
devices and precisions this machine supports, FSDP2's presence and the shapes it must
split, and the size of a given tokenizer. Every entry point (dipaco-train, dipaco-route,
dipaco-plan, the job itself) calls :func:`preflight` where it called ``validate_config``;
each refusal is one :class:`~dipaco.config.ConfigError` line, as before.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence

import torch

from dipaco.config import Config, ConfigError, compose_config, require
from dipaco.data.tokenizer import Tokenizer, tokenizer_beside
from dipaco.config.applies import check_not_simulated, check_simulated
from dipaco.config.domains import value_of
from dipaco.config.validate import validate_config
from dipaco.runtime.device import config_problems as device_problems
from dipaco.sync.fsdp import FSDP_MISSING, fsdp_available
from dipaco.sync.outer import accepted_options, make_outer_optimizer, optimizer_names, outer_options
from modules import ModuleGrid

__all__ = ["compose", "preflight", "resolve_tokenizer_vocab", "tokenizer_size"]

_DEFAULTS = Config()


def preflight(cfg: Config, simulating: bool = False) -> None:
    """Raise :class:`ConfigError` for the first problem of ``cfg``: the config's checks
    (``validate_config``, which also fills derived settings), then the implementation's.
    ``simulating``: the command reads ``cluster.*`` (``dipaco-plan --simulate``); every
    other command refuses those keys set away from their defaults."""
    if not simulating:
        check_not_simulated(cfg)  # first: a cluster key's only fix here is to drop it
    validate_config(cfg)
    if simulating:
        check_simulated(cfg)
    check_implementation(cfg)


def compose(overrides: Optional[List[str]] = None, run_dir: Optional[str] = None) -> Config:
    """:func:`~dipaco.config.compose_config`, then ``model.vocab_size`` from the tokenizer
    (:func:`resolve_tokenizer_vocab`), as ``dipaco-train`` composes a command line."""
    return resolve_tokenizer_vocab(compose_config(overrides, run_dir), list(overrides or []))


def resolve_tokenizer_vocab(cfg: Config, overrides: Sequence[str]) -> Config:
    """With ``data.tokenizer`` set (or, for ``data=tokens``, a ``tokenizer.json`` beside the
    token files), ``model.vocab_size`` becomes that tokenizer's size unless
    ``overrides`` (the command line) set it; ``preflight`` refuses a size too small for it."""
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    path = cfg.data.tokenizer or (tokenizer_beside(cfg.data) if cfg.data.source == "tokens" else None)
    if path and "model.vocab_size" not in given:
        cfg.model.vocab_size = tokenizer_size(path)
    return cfg


def tokenizer_size(path: str) -> int:
    """The vocabulary of the tokenizer at ``path`` (``data.tokenizer``), or one ConfigError
    naming it (a FIFO or device is never opened)."""
    fix = "pass a tokenizer.json (or a transformers tokenizer directory)"
    p = os.path.expanduser(path)
    require(os.path.isfile(p) or os.path.isdir(p), "data.tokenizer", f"{path} is not a file or directory", fix)
    try:
        return Tokenizer.load(p).vocab_size
    except Exception as e:  # noqa: BLE001 - whatever the file holds, the path is the user's to fix
        raise ConfigError("data.tokenizer", f"cannot read a tokenizer from {path}: {' '.join(str(e).split())[:160]}",
                          fix) from None



def check_implementation(cfg: Config) -> None:
    """The checks that ask torch, the machine or a file (see the module docstring)."""
    for key, problem, fix in device_problems(cfg.trainer, cfg.launcher):
        raise ConfigError(key, problem, fix)
    _check_fsdp(cfg)
    d, m = cfg.data, cfg.model
    if d.tokenizer:
        size = tokenizer_size(d.tokenizer)
        require(m.vocab_size >= size, "model.vocab_size",
                f"{m.vocab_size} cannot hold the {size} token ids of data.tokenizer={d.tokenizer}",
                f"set model.vocab_size={size} (or leave it out: the CLIs set it from data.tokenizer)")
    _check_outer(cfg)  # last: it steps a real optimiser once; the reads above fail first


def _check_outer(cfg: Config) -> None:
    """``diloco.outer.name`` is an optimiser of this torch (names are case-insensitive), and
    one step of it on a one-element tensor works: an optimiser that needs a closure (LBFGS)
    or sparse gradients (SparseAdam) would otherwise fail only after the first round."""
    name, names = cfg.diloco.outer.name, optimizer_names()
    if str(name).lower() not in names:
        raise ConfigError("diloco.outer.name", f"unknown value {name!r}", f"use one of {', '.join(names)}")
    opts = outer_options(cfg.diloco)
    taken = accepted_options(opts["name"])
    for opt in ("momentum", "nesterov"):  # a setting the chosen optimiser does not take does nothing
        key, value = f"diloco.outer.{opt}", opts[opt]
        default = value_of(_DEFAULTS, key)
        if opt not in taken and value != default:
            said = str(value).lower() if isinstance(value, bool) else value
            raise ConfigError(key, f"{key}={said} is read only by outer optimisers that take {opt} (sgd"
                              f"{', rmsprop' if opt == 'momentum' else ''}); diloco.outer.name={name} does not, so "
                              "this run would ignore it", f"drop {key} (its default is {str(default).lower()}), or "
                              "use diloco.outer.name=sgd")
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.ones(1)
    try:
        make_outer_optimizer([p], **opts).step()
    except Exception as e:  # noqa: BLE001 - any failure of the optimiser is the config's
        first = " ".join(str(e).split())[:200]
        raise ConfigError("diloco.outer.name", f"torch.optim cannot take an outer step with "
                          f"diloco.outer={name!r}: {first}",
                          "use diloco.outer.name=sgd (or adam, adamw, nadam, rmsprop)") from None
    if not torch.isfinite(p).all():
        raise ConfigError("diloco.outer", f"one outer step of {name} on a unit "
                          "pseudo-gradient gives a non-finite weight", "lower diloco.outer.lr")


def _check_fsdp(cfg: Config) -> None:
    """``launcher.group_parallel=fsdp``: this torch has FSDP2, and every parameter's first
    dimension splits over the worker group (the config's own refusals ran before)."""
    la, key = cfg.launcher, "launcher.group_parallel"
    if la.group_parallel != "fsdp":
        return
    require(fsdp_available(), key, FSDP_MISSING, "or use launcher.group_parallel=replicate")
    grid = ModuleGrid(cfg.model, list(cfg.grid.levels))  # lazy: shapes only, on meta
    for mid in dict.fromkeys(grid.kind_of(m) if m in ("embed", "head") else "L0.0" for m in grid.module_ids):
        bad = [f"{n}{tuple(s)}" for n, s in grid.param_shapes(mid).items() if not s or s[0] % la.group_size]
        require(not bad, "launcher.group_size", f"fsdp needs every parameter's first dimension to divide by "
                f"{la.group_size}; {mid} has {', '.join(bad)}", "pick a group size that divides model.d_model, "
                "model.vocab_size and the MLP width")
