"""``dipaco-train --help`` and ``dipaco-route --help``: one screen that says what the tool
does, its config groups and the overrides people reach for first.

Hydra's own ``--help`` prints the whole composed config (about 190 lines) and lists the
schema entries the project registers (``dipaco_*_schema``) as if they were choices. The
groups and choices here are read from the installed ``conf/`` folder, so they cannot
drift from it; Hydra's text stays one flag away (``--hydra-help``, ``--cfg job``).
"""
from __future__ import annotations

import re
import textwrap
from importlib.resources import files
from typing import Sequence

from omegaconf import OmegaConf

_HELP_FLAGS = ("-h", "--help")
_WIDTH = 79

_ABOUT = {
    "dipaco-train": (
        "usage: dipaco-train [GROUP=CHOICE ...] [KEY=VALUE ...] [-m]",
        "Train a DiPaCo model: route each document to a path (one module per level of a grid), "
        "train every path with per-module DiLoCo, score it against a same-size dense model, and "
        "write a run directory (config, router, shards, checkpoints, metrics, summary.json). "
        "With no arguments: the built-in multidomain corpus on a [2, 2] grid, about 7 minutes "
        "on 2 CPU cores (413 s in the README's run).",
        ("data", "model", "grid", "router", "diloco", "trainer", "launcher", "experiment", "sweep"),
        (("hydra.run.dir=DIR", "the run directory (outputs/DATE/TIME)"),
         ("resume=true", "continue that run from its checkpoint"),
         ("experiment=smoke", "a run of seconds on a tiny model"),
         ("grid.levels=[4,4] trainer.rounds=8", "modules per level; DiLoCo rounds"),
         ("diloco.inner_steps=100", "inner steps H per round"),
         ("launcher=spawn launcher.nproc=4", "4 ranks on this host (docs/launch.md)"),
         ("launcher=slurm launcher.dry_run=true", "print the SLURM job, submit nothing"),
         ("trainer.device=cuda", "train on the GPU (docs/gpu.md)"),
         ("-m sweep=paths", "one run per point (docs/results.md)")),
    ),
    "dipaco-route": (
        "usage: dipaco-route [GROUP=CHOICE ...] [KEY=VALUE ...]",
        "Fit the router on a corpus (after its tokenizer, and the dense warm-up where the config has "
        "one: trainer.warmup_fraction) and write its shards and routing_report.json into a new run "
        "directory; `dipaco-train hydra.run.dir=DIR` then trains from what it holds (its own config: a "
        "KEY=VALUE the tokenizer, warm-up, router or shards were made from is refused). It takes "
        "dipaco-train's config; these groups matter here.",
        ("data", "model", "grid", "router", "experiment"),
        (("hydra.run.dir=DIR", "a new directory (outputs/DATE/TIME)"),
         ("data=jsonl data.path=F.jsonl", "your own documents (docs/data.md)"),
         ("grid.levels=[4,4]", "modules per level"),
         ("router=tree router.prefix_tokens=64", "how to cluster, on how many tokens"),
         ("router.top_k=2", "each document in its 2 best shards")),
    ),
}


def wants_help(argv: Sequence[str]) -> bool:
    """``-h`` / ``--help`` on the command line (Hydra's ``--hydra-help`` is left alone)."""
    return any(a in _HELP_FLAGS for a in argv)


def config_defaults() -> dict[str, str]:
    """The default choice of each group, from ``conf/config.yaml``'s defaults list."""
    text = files("dipaco.conf").joinpath("config.yaml").read_text(encoding="utf-8")
    out = {}
    for item in OmegaConf.to_container(OmegaConf.create(text))["defaults"]:
        if isinstance(item, dict) and len(item) == 1:
            (group, choice), = item.items()
            if isinstance(choice, str):
                out[str(group)] = choice
    return out


def config_groups() -> dict[str, list[str]]:
    """Each group folder of the installed ``conf/`` and its choices, the default first."""
    defaults = config_defaults()
    groups = {}
    for folder in sorted((p for p in files("dipaco.conf").iterdir() if p.is_dir() and not p.name.startswith("_")),
                         key=lambda p: p.name):
        choices = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
        first = defaults.get(folder.name)
        groups[folder.name] = ([first] if first in choices else []) + [c for c in choices if c != first]
    return groups


def usage(tool: str) -> str:
    """The help text of ``tool`` (``dipaco-train`` or ``dipaco-route``)."""
    line, about, shown, overrides = _ABOUT[tool]
    groups, defaults = config_groups(), config_defaults()
    width = max(len(k) for k, _ in overrides)
    out = [line, "", textwrap.fill(about, _WIDTH), "", "config groups (GROUP=CHOICE; * marks the default):"]
    for g in shown:
        choices = " ".join(("*" + c) if c == defaults.get(g) else c for c in groups.get(g, []))
        out.append(textwrap.fill(choices, _WIDTH, initial_indent=f"  {g:<11}", subsequent_indent=" " * 13))
    out += ["", "common overrides (any key of the config can be set: KEY=VALUE):"]
    out += [f"  {k:<{width}}  {v}" for k, v in overrides]
    out += ["", textwrap.fill("--cfg job prints the composed config, --hydra-help Hydra's own options; "
                              "dipaco-plan takes the same overrides and prints the bytes and memory a run "
                              "needs. Docs: README.md, docs/launch.md.", _WIDTH, break_on_hyphens=False)]
    return "\n".join(out)


def plain(doc: str) -> str:
    """A module docstring as help text: reStructuredText roles (``:mod:`x```) and literals
    (````x````) as plain words, a literal-block ``::`` as one colon."""
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    text = re.sub(r"``([^`]+)``", r"\1", text)
    return re.sub(r"::(\s*\n)", r":\1", text).strip() + "\n"
