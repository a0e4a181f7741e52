"""The job's routed evaluation after training (rank 0 / the launching process).

On the validation documents, with the rule of :mod:`dipaco.rounds.evaluate`:

* ``once``: routed by the first ``router.prefix_tokens`` tokens, the first
  ``trainer.seq_len + 1`` tokens of each document (summary.json ``routed_ppl``);
* ``wrong_path``: every document scored by the next path over (control);
* ``rerouted``: re-routed every ``router.reroute_every`` tokens, when set;
* with ``trainer.eval_long`` the same three on the long protocol (whole documents in
  windows of ``trainer.eval_seq_len``), under keys ending in ``_long``;
* with ``trainer.path_early_stopping`` each path is loaded from its kept best weights
  (:mod:`dipaco.rounds.early_stopping`), and ``last_weights`` is ``once`` with the last
  checkpoint's weights, for comparison.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from dipaco.plan.build import build_grid
from dipaco.storage.tensor_io import load_state
from dipaco.config import Config, eval_window
from dipaco.rounds.early_stopping import load_best_path, read_best_record
from dipaco.rounds.evaluate import evaluate_routed
from dipaco.run.run_dir import RunDir
from modules import ModuleGrid, PathModel


def load_grid_from_checkpoint(cfg: Config, ckpt: Path) -> ModuleGrid:
    """The run's grid with every module's weights from checkpoint ``ckpt``."""
    grid = build_grid(cfg)
    for mid in grid.module_ids:
        grid.load_module_state_dict(mid, load_state(ckpt / "modules" / f"{mid}.safetensors"))
    return grid


def path_models(cfg: Config, run: RunDir, ckpt: Path, *, best: bool) -> Callable[[int], PathModel]:
    """``get_model(path)`` over checkpoint ``ckpt``; with ``best``, a path with kept best
    weights is loaded from them instead (on a grid of its own: paths share modules, their
    best rounds differ). One best-weights path is held at a time."""
    grid = load_grid_from_checkpoint(cfg, ckpt)
    models: dict[int, PathModel] = {}
    held: dict[int, PathModel] = {}

    def get_model(p: int) -> PathModel:
        if best and read_best_record(run, p) is not None:
            if p not in held:
                held.clear()
                own = build_grid(cfg)
                load_best_path(run, own, p)
                held[p] = PathModel(own, p)
            return held[p]
        if p not in models:
            models[p] = PathModel(grid, p)
        return models[p]

    return get_model


def evaluate_run(cfg: Config, run: RunDir, router: Any, val_ids: Any, ckpt: Path) -> dict[str, Any]:
    """Every routed evaluation of the run (see the module docstring); keys as listed there."""
    t, r = cfg.trainer, cfg.router
    get_model = path_models(cfg, run, ckpt, best=t.path_early_stopping)
    protocols: list[tuple[str, dict]] = [("", {"seq_len": t.seq_len})]
    if t.eval_long:
        protocols.append(("_long", {"seq_len": eval_window(cfg), "whole_documents": True}))
    out: dict[str, Any] = {}
    for suffix, protocol in protocols:
        common = dict(prefix_tokens=r.prefix_tokens, route_batch=router.route_batch,
                      reroute_windows=router.reroute_windows, batch_size=t.eval_batch_size,
                      progress=t.progress, **protocol)
        out["once" + suffix] = evaluate_routed(val_ids, get_model, **common)
        if router.num_paths > 1:
            # Control: every document scored by the next path over, not its own. If the
            # specialists are real this is clearly worse than routed.
            wrong = dict(common, route_batch=lambda d: (router.route_batch(d) + 1) % router.num_paths)
            out["wrong_path" + suffix] = evaluate_routed(val_ids, get_model, **wrong)
        if r.reroute_every:
            out["rerouted" + suffix] = evaluate_routed(val_ids, get_model, reroute_every=r.reroute_every, **common)
    if t.path_early_stopping:
        last = path_models(cfg, run, ckpt, best=False)
        out["last_weights"] = evaluate_routed(val_ids, last, **dict(common, seq_len=t.seq_len, whole_documents=False))
        records = {p: read_best_record(run, p) for p in range(router.num_paths)}
        out["best_rounds"] = {str(p): rec["round"] if rec else None for p, rec in records.items()}
    return out
