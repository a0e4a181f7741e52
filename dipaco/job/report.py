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

The table accounts for every run it finds (docs/reliability.md, rule 7): a row holds the
runs its label says (runs whose ``config.yaml`` differ in a key no override names get that
key as a column, rather than share a row), every run found is in a row or listed under
"Not in the table" with the reason (unfinished, an unreadable ``summary.json``, found twice
through overlapping folders), and a mean that leaves out a run's value (missing, or not a
finite number) says how many it holds and names the run and the reason.
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
from dipaco.storage.strict_json import dumps_strict

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


# Keys of config.yaml that say where or how a run executed, never what it trained: not a
# reason for two runs to be two rows (their prefixes cover whole sections)
EXECUTION = ("run_dir", "resume", "tag", "seed", "data.cache_dir", "launcher.", "logging.", "cluster.",
             "trainer.progress", "trainer.plots", "trainer.threads", "trainer.checkpoint_every", "trainer.keep_last",
             "trainer.eval_batch_size", "trainer.stop_after_rounds", "trainer.deterministic", "diloco.outer_device")

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

    def flat(self) -> dict[str, str]:
        """Every setting of the run's ``config.yaml`` as text, by dotted key."""
        if self.config is None:
            return {}
        out: dict[str, str] = {}

        def walk(node: Any, prefix: str) -> None:
            for k in node:
                v = node[k]
                if OmegaConf.is_dict(v):
                    walk(v, f"{prefix}{k}.")
                else:
                    out[f"{prefix}{k}"] = str(OmegaConf.to_container(v) if OmegaConf.is_config(v) else v)
        walk(self.config, "")
        return out

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


def find_runs(*roots: Path) -> tuple[list[RunRow], list[tuple[Path, str]]]:
    """Every finished run (a folder holding ``summary.json``) below any of ``roots``, and
    every run found that is not one, with the reason: unfinished (a ``config.yaml`` but no
    ``summary.json``), unreadable records, or a folder reached twice (overlapping roots)."""
    rows: list[RunRow] = []
    skipped: list[tuple[Path, str]] = []
    seen: set[Path] = set()
    for root in roots:
        found = {p.parent for p in Path(root).rglob("summary.json")}
        found |= {p.parent for p in Path(root).rglob("config.yaml") if p.parent.name != ".hydra"}
        for run in sorted(found):
            real = run.resolve()
            if real in seen:
                skipped.append((run, "found twice (the folders given overlap): counted once"))
                continue
            seen.add(real)
            row, why = _read_run(run)
            if row is None:
                skipped.append((run, why))
            else:
                rows.append(row)
    return rows, skipped


def _read_run(run: Path) -> tuple[Optional[RunRow], str]:
    """The row of ``run``, or ``None`` and why it is not one."""
    if not (run / "summary.json").is_file():
        return None, "unfinished: no summary.json"
    try:
        summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return None, f"summary.json is unreadable ({' '.join(str(e).split())[:80]})"
    if not isinstance(summary, dict):
        return None, f"summary.json holds a {type(summary).__name__}, not a run's summary"
    try:
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
    except Exception as e:  # noqa: BLE001 - whatever a hand-edited record holds, this run is named, not a crash
        return None, f"its .hydra/ or config.yaml is unreadable ({type(e).__name__}: {' '.join(str(e).split())[:80]})"
    return RunRow(run, overrides, summary, choices, config), ""


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


def _executes(key: str) -> bool:
    return any(key == e or (e.endswith(".") and key.startswith(e)) for e in EXECUTION)


def build_table(rows: list[RunRow], ignore: frozenset[str] = IGNORED
                ) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """(header, table rows, per-setting records) with runs grouped over seeds.

    The columns are the overridden keys whose values differ, plus any key of the runs'
    ``config.yaml`` that differs inside one such group (so a row never mixes runs its
    label does not tell apart); a record's ``runs`` are its members and ``left_out`` the
    values a mean did not take (missing or not finite), by run and metric."""
    keys = sorted({k for r in rows for k in r.overrides} - set(ignore))
    varying = [k for k in keys if len({r.value(k) for r in rows}) > 1]
    flats = {id(r): r.flat() for r in rows}
    groups: dict[tuple, list[RunRow]] = defaultdict(list)
    for r in rows:
        groups[_setting(r, varying)].append(r)
    hidden = sorted({k for members in groups.values() for k in set().union(*(flats[id(m)] for m in members))
                     if k not in ignore and not _executes(k) and k not in varying
                     and len({flats[id(m)].get(k) for m in members}) > 1})
    if hidden:  # runs the overrides do not tell apart, that trained otherwise
        varying += hidden
        groups = defaultdict(list)
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
        rec: dict[str, Any] = {"setting": dict(setting), "seeds": len(members),
                               "runs": [str(m.path) for m in members], "left_out": []}
        for key, _label in METRICS:
            vals = [m.summary.get(key) for m in members]
            finite = [v for v in vals if _finite(v)]
            cell = _fmt(vals)
            if finite and len(finite) < len(vals):
                cell += f" ({len(finite)} of {len(vals)})"
            if any(v is not None for v in vals):  # a metric no member has is not "left out"
                rec["left_out"] += [{"run": str(m.path), "metric": key, "why": _why_not(v)}
                                    for m, v in zip(members, vals) if not _finite(v)]
            cells.append(cell)
            rec[key] = statistics.fmean(finite) if finite else None
        table.append(cells)
        records.append(rec)
    return header, table, records


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _why_not(v: Any) -> str:
    if v is None:
        return "no value in its summary.json"
    return f"{v!r} is not a finite number" if isinstance(v, (int, float)) else f"{v!r} is not a number"


def accounting(rows: list[RunRow], skipped: list[tuple[Path, str]], records: list[dict[str, Any]], root: Path) -> str:
    """Where every run found went: how many are in the table, the ones that are not and
    why, and the values a mean left out (rule 7: an aggregate accounts for every input)."""
    def name(p: Any) -> str:
        try:
            return Path(p).relative_to(root).as_posix() or "."
        except ValueError:
            return str(p)

    twice = sum(why.startswith("found twice") for _, why in skipped)
    lines = [f"Runs found: {len(rows) + len(skipped) - twice}" + (f" ({twice} reached twice, counted once)" if twice
                                                                  else "") + f"; in the table: {len(rows)}."]
    if skipped:
        lines += ["", "Not in the table:", ""] + [f"- {name(p)}: {why}" for p, why in skipped]
    left = [x for r in records for x in r["left_out"]]
    if left:
        lines += ["", "Values left out of a mean:", ""] + [f"- {name(x['run'])}: {x['metric']} ({x['why']})"
                                                        for x in left]
    return "\n".join(lines)


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
        names = [k for k, _ in METRICS if held(k)]
        raise ConfigError("--metric", f"no run has a value of {asked!r}",
                          f"choose one of {', '.join(names)}" if names else
                          "none of the runs has a finite value of any metric (see the report's left-out values)")
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
    rows, skipped = find_runs(root, *more)
    if not rows:
        why = "; ".join(f"{p}: {w}" for p, w in skipped[:3])
        raise FileNotFoundError(f"no finished run (summary.json) under {root}" + (f" ({why})" if why else ""))
    header, table, records = build_table(rows, ignore)
    metric = plot_metric(records, metric)  # before anything is written
    text = (markdown(header, table) + "\n\n" + accounting(rows, skipped, records, root) + "\n\n"
            + provenance_section(rows, root))
    check_owned(root, REPORT_FILES, "dipaco-report DIR", replace=True)  # before the plot's work
    doc = {"settings": records, "not_in_table": [{"run": str(p), "why": w} for p, w in skipped]}
    with OwnedWrite(root, "dipaco-report DIR", replace=True) as staging:
        (staging / "report.md").write_text(text + "\n", encoding="utf-8")
        (staging / "report.json").write_text(dumps_strict(doc, indent=2) + "\n", encoding="utf-8")
        plot(records, staging / "report.png", metric)
    return text
