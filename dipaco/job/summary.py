"""What a finished run reports: ``summary.json`` as a type, how it is built, and the table printed.

:class:`RunSummary` is the file's schema: every key a finished run writes, with its type
and meaning (``tests/test_summary.py`` holds a real run's file to it, key for key). It is
a ``TypedDict``, not a class with methods, because the summary's readers (sweeps,
``dipaco-report``, resume's "already finished" check, W&B) take it as the JSON mapping it
is on disk; the type gives them its keys. :func:`build_summary` makes one from what the
job measured; :func:`summary_table` is its headline numbers as the run prints them: a
number the run did not measure (no dense baseline: ``dense_ppl`` is nan and the ratio
``None``; no long evaluation; no re-routing) is left out, not printed as ``nan``/``None``.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from dipaco.config import Config, eval_window
from dipaco.config.schedule import describe_segments
from dipaco.plan.build import build_comm_plan, build_grid
from dipaco.run.results import RoundsResult
from dipaco.run.run_dir import RunDir, bytes_totals
from dipaco.runtime import elastic

if TYPE_CHECKING:
    from dipaco.job.prepare import Prepared


class RunSummary(TypedDict):
    """``summary.json`` of a finished run (perplexities on ``trainer.eval_split``).

    ``None`` where the run did not measure it; ``*_long`` keys are ``trainer.eval_long``'s
    (whole documents in windows of ``eval_seq_len``).
    """

    routed_ppl: float                       # each document on the path its prefix routes to
    dense_ppl: float                        # the same-size dense baseline (nan without one)
    ratio_vs_dense: Optional[float]         # routed / dense: below 1 is what routing buys
    rerouted_ppl: Optional[float]           # routed again every trainer.reroute_every tokens
    wrong_path_ppl: Optional[float]         # each document on a path it was not routed to
    per_path: Any                           # the routed evaluation per path (ppl, tokens, documents)
    eval_tokens: int
    eval_split: str
    routed_ppl_long: Optional[float]
    dense_ppl_long: Optional[float]
    ratio_vs_dense_long: Optional[float]
    rerouted_ppl_long: Optional[float]
    wrong_path_ppl_long: Optional[float]
    eval_tokens_long: Optional[int]
    eval_seq_len: Optional[int]
    routed_ppl_last_weights: Optional[float]  # path_early_stopping: the last checkpoint's weights
    best_rounds: Optional[Any]              # path_early_stopping: the round each path's weights are from
    alpha: str                              # diloco.alpha
    bytes_sent: int                         # every round's own record summed (metrics.jsonl)
    ddp_bytes_equivalent: int               # what data parallelism would have sent in as many rounds
    bytes_ratio_vs_ddp: Optional[float]
    tokens_per_s: float                     # training tokens over the rounds' wall time
    train_tokens: int
    compute_s: float                        # inner steps
    wait_s: float                           # waiting at the round barrier for the slowest group
    sync_s: float                           # the exchange and outer step themselves
    sync_share: float                       # sync_s of the rounds' time (compute + wait + sync)
    rounds_s: float
    wall_s: float                           # the whole job, preparation and evaluation included
    rounds: int
    lr_schedule: list[dict[str, Any]]       # what the learning rate did, segment by segment
    inner_steps: int
    warmup_steps: int
    num_paths: int
    grid: list[int]
    path_parameters: int
    total_parameters: int
    specialised_parameters: int             # of path 0: the parameters not every path shares
    routing: dict[str, Any]                 # shard sizes, imbalance, NMI and purity of the assignment
    reshards: list[dict[str, Any]]          # EM re-shard phases (routing_report.json has each in full)
    dense_baseline: Optional[dict[str, Any]]
    timings: dict[str, Any]                 # preparation's phases, seconds
    launcher: str
    device: Optional[str]                   # where the paths trained
    precision: str
    peak_memory_bytes: Optional[int]        # the largest per-rank peak (CUDA allocator, or RSS)
    codec: str
    resumed_from_round: Optional[int]       # totals count every round anyway
    totals_missing_rounds: int              # rounds before a resume whose totals were not found
    decoupled: Optional[dict[str, Any]]     # goodput, staleness, drops (diloco.mode=decoupled)
    membership_changes: list[dict[str, Any]]  # elastic launches: who left or joined, and when
    tag: Optional[str]
    seed: int


def build_summary(cfg: Config, run: RunDir, prep: "Prepared", result: RoundsResult, rounds_s: float,
                  baseline: dict[str, Any], routed: dict[str, Any], wall_s: float) -> RunSummary:
    """The summary of a finished run from what the job measured: the rounds' result, the
    dense baseline's and the routed evaluation's outputs, and the timings."""
    grid = build_grid(cfg)
    plan = build_comm_plan(cfg, result.world_size)
    rounds_done = result.rounds - result.start_round
    ddp_bytes = plan.ddp_bytes_per_round * rounds_done
    bytes_sent = result.bytes_sent
    if cfg.diloco.mode == "sync" and run.metrics.is_file():  # every total: the sum of each round's record
        bytes_sent, ddp_bytes = bytes_totals(run, result.rounds, plan.ddp_bytes_per_round)
    routed_ppl = routed["once"]["ppl"]
    dense_ppl = baseline.get("eval", {}).get("ppl", float("nan"))
    routed_long = routed.get("once_long", {}).get("ppl")
    dense_long = baseline.get("eval_long", {}).get("ppl")
    return RunSummary(
        routed_ppl=routed_ppl,
        dense_ppl=dense_ppl,
        ratio_vs_dense=routed_ppl / dense_ppl if dense_ppl and math.isfinite(dense_ppl) else None,
        rerouted_ppl=routed.get("rerouted", {}).get("ppl"),
        wrong_path_ppl=routed.get("wrong_path", {}).get("ppl"),
        per_path=routed["once"]["per_path"],
        eval_tokens=routed["once"]["num_tokens"],
        eval_split=cfg.trainer.eval_split,
        routed_ppl_long=routed_long,
        dense_ppl_long=dense_long,
        ratio_vs_dense_long=routed_long / dense_long if routed_long and dense_long else None,
        rerouted_ppl_long=routed.get("rerouted_long", {}).get("ppl"),
        wrong_path_ppl_long=routed.get("wrong_path_long", {}).get("ppl"),
        eval_tokens_long=routed.get("once_long", {}).get("num_tokens"),
        eval_seq_len=eval_window(cfg) if cfg.trainer.eval_long else None,
        routed_ppl_last_weights=routed.get("last_weights", {}).get("ppl"),
        best_rounds=routed.get("best_rounds"),
        alpha=cfg.diloco.alpha,
        bytes_sent=bytes_sent,
        ddp_bytes_equivalent=ddp_bytes,
        bytes_ratio_vs_ddp=bytes_sent / ddp_bytes if ddp_bytes else None,
        tokens_per_s=result.tokens / max(rounds_s, 1e-9),
        train_tokens=result.tokens,
        compute_s=result.compute_s,
        wait_s=result.wait_s,
        sync_s=result.sync_s,
        sync_share=result.sync_s / max(result.compute_s + result.wait_s + result.sync_s, 1e-9),
        rounds_s=rounds_s,
        wall_s=wall_s,
        rounds=result.rounds,
        lr_schedule=describe_segments(cfg),  # an extended run: trainer.extend_schedule
        inner_steps=cfg.diloco.inner_steps,
        warmup_steps=prep.warmup_steps,
        num_paths=grid.num_paths,
        grid=list(cfg.grid.levels),
        path_parameters=grid.path_param_count(0),
        total_parameters=grid.total_param_count(),
        specialised_parameters=grid.specialised_param_count(0),
        routing={k: prep.report.get(k) for k in ("shard_sizes", "imbalance", "nmi", "purity")},
        reshards=[{k: p.get(k) for k in ("round", "assign", "reassigned", "shard_sizes", "nmi")}
                  for p in prep.report.get("reshards", [])],
        dense_baseline=baseline.get("info"),
        timings=prep.timings,
        launcher=cfg.launcher.name,
        device=result.device,
        precision=cfg.trainer.precision,
        peak_memory_bytes=result.peak_memory_bytes,
        codec=cfg.diloco.codec,
        resumed_from_round=result.resumed_from_round,
        totals_missing_rounds=result.totals_missing_rounds,
        decoupled=result.decoupled,
        membership_changes=elastic.changes(run),
        tag=cfg.tag,
        seed=cfg.seed,
    )


def _measured(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and not math.isfinite(v))


def summary_rows(s: "RunSummary | dict[str, Any]") -> list[tuple[str, Any]]:
    """``(label, value)`` of every headline number the run measured."""
    rows = [("routed perplexity", s.get("routed_ppl")), ("dense same-size perplexity", s.get("dense_ppl")),
            ("ratio vs dense", s.get("ratio_vs_dense")),
            ("routed, re-routed perplexity", s.get("rerouted_ppl")),
            ("routed perplexity, long", s.get("routed_ppl_long")),
            ("ratio vs dense, long", s.get("ratio_vs_dense_long")),
            ("routed perplexity, last weights", s.get("routed_ppl_last_weights")),
            ("paths", s.get("num_paths")), ("rounds x H", f"{s.get('rounds')} x {s.get('inner_steps')}")]
    if _measured(s.get("bytes_sent")):
        rows.append(("bytes sent", f"{s['bytes_sent']:,}"))
    if _measured(s.get("ddp_bytes_equivalent")):
        rows.append(("DDP equivalent bytes", f"{int(s['ddp_bytes_equivalent']):,}"))
    rows += [("training tokens/s", s.get("tokens_per_s")), ("wall time (s)", s.get("wall_s"))]
    return [(k, v) for k, v in rows if _measured(v)]


def summary_table(s: "RunSummary | dict[str, Any]") -> str:
    """The rows of :func:`summary_rows`, aligned, as printed at the end of a run."""
    rows = summary_rows(s)
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in rows)


__all__ = ["RunSummary", "build_summary", "summary_rows", "summary_table"]
