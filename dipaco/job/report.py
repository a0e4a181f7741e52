"""Turn one or more multirun directories into a table (markdown) and a plot.

Each run of a ``dipaco-train -m`` sweep leaves ``summary.json`` and Hydra's
``.hydra/`` (overrides, and the config-group choices) in its own folder. The columns
are the keys overridden anywhere, each read as the run's *effective* value (its
override, else its config-group choice, else its resolved config), so runs of
different sweeps line up (a default [2,2] run shows ``grid=2x2`` beside a sweep's
``grid=4x4``). Runs that differ only in ``seed`` are one *setting*: the table shows the
mean and the spread over seeds, so a claim rests on more than one seed (seed noise is
~15% at this scale in an earlier prototype's runs). Keys that do not change what is trained (``IGNORED``)
are left out of the grouping.
"""
from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from dipaco.config import ConfigError
from dipaco.job.plots import bar_chart
from dipaco.run.owned import OwnedWrite, check_owned
from dipaco.run.provenance import one_line as provenance_line, read as read_provenance

# What dipaco-report writes into its first DIR (and so may replace there).
REPORT_FILES = ("report.md", "report.json", "report.png")

METRICS = (
    ("routed_ppl", "routed ppl"),
    ("dense_ppl", "dense ppl"),
    ("ratio_vs_dense", "ratio vs dense"),
    ("rerouted_ppl", "re-routed ppl"),
    ("wrong_path_ppl", "wrong-path ppl"),
    ("bytes_ratio_vs_ddp", "bytes / DDP"),
    ("tokens_per_s", "tokens/s"),
    ("wall_s", "wall s"),
)


# Overrides that change how a run is executed or reported, not what it trains.
IGNORED = frozenset({"sweep", "trainer.threads", "trainer.progress", "trainer.plots", "hydra.sweep.dir",
                     "logging.tensorboard", "logging.wandb", "logging.wandb_project",
                     "logging.wandb_entity", "logging.wandb_mode", "logging.every_steps",
                     "logging.run_name", "logging.wandb_group", "logging.tags",
                     "logging.val_documents", "logging.peak_tflops"})


@dataclass
class RunRow:
    """One run of a sweep."""

    path: Path
    overrides: dict[str, str]
    summary: dict[str, Any]
    choices: Optional[dict[str, Any]] = None  # Hydra's config-group choices (grid: 2x2, ...)
    config: Any = None  # the run's resolved config.yaml

    def value(self, key: str) -> str:
        """The run's effective value of ``key``: what ran (its ``config.yaml``) for a
        setting, else (a config group: ``grid``) its override or group choice. Hydra's
        ``.hydra/`` record can lag behind what ran, so it never overrides ``config.yaml``."""
        if self.config is not None:
            got = OmegaConf.select(self.config, key, default=None)
            if got is not None and not OmegaConf.is_dict(got):
                return str(got)
        if key in self.overrides:
            return self.overrides[key]
        if self.choices and key in self.choices:
            return str(self.choices[key])
        return ""


def find_runs(*roots: Path) -> list[RunRow]:
    """Every finished run (a folder holding ``summary.json``) below any of ``roots``."""
    rows = []
    for root in roots:
        for summary_path in sorted(Path(root).rglob("summary.json")):
            run = summary_path.parent
            try:
                summary = json.loads(summary_path.read_text(encoding="utf-8"))
            except ValueError:
                continue  # an unfinished or corrupt run is not a row
            overrides: dict[str, str] = {}
            ov_file = run / ".hydra" / "overrides.yaml"
            if ov_file.exists():
                for item in OmegaConf.load(ov_file) or []:
                    key, _, value = str(item).partition("=")
                    overrides[key.lstrip("+~")] = value
            choices = None
            hydra_file = run / ".hydra" / "hydra.yaml"
            if hydra_file.exists():
                sel = OmegaConf.select(OmegaConf.load(hydra_file), "hydra.runtime.choices", default=None)
                choices = None if sel is None else OmegaConf.to_container(sel)
            config = OmegaConf.load(run / "config.yaml") if (run / "config.yaml").exists() else None
            rows.append(RunRow(run, overrides, summary, choices, config))
    return rows


def _setting(row: RunRow, varying: list[str]) -> tuple[tuple[str, str], ...]:
    return tuple((k, row.value(k)) for k in varying if k != "seed")


def _fmt(values: list[float]) -> str:
    vals = [v for v in values if v is not None and isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return "–"
    mean = statistics.fmean(vals)
    digits = ".4g" if abs(mean) < 1e5 else ".3g"
    if len(vals) == 1:
        return format(mean, digits)
    return f"{format(mean, digits)} ± {format(statistics.pstdev(vals), '.2g')}"


def _natural(value: str) -> tuple:
    """Sort key: numbers before words, numbers by value."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def build_table(rows: list[RunRow], ignore: frozenset[str] = IGNORED
                ) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """(header, table rows, per-setting records) with runs grouped over seeds."""
    keys = sorted({k for r in rows for k in r.overrides} - set(ignore))
    varying = [k for k in keys if len({r.value(k) for r in rows}) > 1]
    groups: dict[tuple, list[RunRow]] = defaultdict(list)
    for r in rows:
        groups[_setting(r, varying)].append(r)
    header = [k for k in varying if k != "seed"] + ["seeds"] + [label for _, label in METRICS]
    table, records = [], []
    # fewer paths first (a sweep over grids reads left to right), then by the settings'
    # values, numbers as numbers (H = 10, 50, 200)
    def order(kv: tuple) -> tuple:
        setting, members = kv
        paths = statistics.fmean([float(m.summary.get("num_paths") or 0) for m in members])
        return (paths, tuple(_natural(v) for _, v in setting))

    ordered = sorted(groups.items(), key=order)
    for setting, members in ordered:
        cells = [v for _, v in setting] + [str(len(members))]
        rec: dict[str, Any] = {"setting": dict(setting), "seeds": len(members)}
        for key, _label in METRICS:
            vals = [m.summary.get(key) for m in members]
            cells.append(_fmt(vals))
            finite = [v for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
            rec[key] = statistics.fmean(finite) if finite else None
        table.append(cells)
        records.append(rec)
    return header, table, records


def markdown(header: list[str], table: list[list[str]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    return "\n".join(lines)


DEFAULT_METRIC = "ratio_vs_dense"


def plot_metric(records: list[dict[str, Any]], asked: Optional[str]) -> str:
    """The metric to plot: ``asked`` (``--metric``) when some run has a value of it, else a
    :class:`ConfigError` naming those the runs have (a name plotted as another would be a
    wrong chart under the right title); by default ``ratio_vs_dense``, or ``routed_ppl``
    for runs without the dense baseline."""
    def held(key: str) -> bool:
        return any(r.get(key) is not None for r in records)

    if asked is None:
        return DEFAULT_METRIC if held(DEFAULT_METRIC) else "routed_ppl"
    if not held(asked):
        names = sorted({k for r in records for k, v in r.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        raise ConfigError("--metric", f"no run has a value of {asked!r}", f"choose one of {', '.join(names)}")
    return asked


def plot(records: list[dict[str, Any]], out: Path, metric: str = DEFAULT_METRIC) -> Optional[Path]:
    """Bar chart of one metric per setting (mean over seeds)."""
    pts = [(", ".join(f"{k}={v}" for k, v in r["setting"].items()) or "run", r[metric])
           for r in records if r.get(metric) is not None]
    if not pts:
        return None
    return bar_chart(out, [label for label, _ in pts], [v for _, v in pts], metric,
                     hline=1.0 if metric == "ratio_vs_dense" else None)


def provenance_section(rows: list[RunRow], root: Path) -> str:
    """What made each run (its ``provenance.jsonl``: first launch, and the last when it
    was resumed), so a table mixing versions or machines says so."""
    lines = ["Provenance (what made each run; provenance.jsonl):", ""]
    for row in sorted(rows, key=lambda r: str(r.path)):
        try:
            name = row.path.relative_to(root).as_posix() or "."
        except ValueError:
            name = str(row.path)
        recs = read_provenance(row.path)
        if not recs:
            lines.append(f"- {name}: not recorded")
            continue
        lines.append(f"- {name}: {provenance_line(recs[0])}")
        if len(recs) > 1:
            lines.append(f"  - last of {len(recs)} launches: {provenance_line(recs[-1])}")
    return "\n".join(lines)


def write_report(root: Path, metric: Optional[str] = None, more: tuple[Path, ...] = (),
                 ignore: frozenset[str] = IGNORED) -> str:
    """Write ``report.md``, ``report.json`` (+ ``report.png``) in ``root`` from the runs under
    ``root`` and under the directories ``more``; return the markdown. The files replace
    only an earlier report's (dipaco/run/owned.py): a ``report.md`` of the user's is refused."""
    rows = find_runs(root, *more)
    if not rows:
        raise FileNotFoundError(f"no finished run (summary.json) under {root}")
    header, table, records = build_table(rows, ignore)
    metric = plot_metric(records, metric)  # before anything is written
    text = markdown(header, table) + "\n\n" + provenance_section(rows, root)
    check_owned(root, REPORT_FILES, "dipaco-report DIR", replace=True)  # before the plot's work
    with OwnedWrite(root, "dipaco-report DIR", replace=True) as staging:
        (staging / "report.md").write_text(text + "\n", encoding="utf-8")
        (staging / "report.json").write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
        plot(records, staging / "report.png", metric)
    return text
