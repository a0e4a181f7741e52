"""One ``state.json`` layout for both modes, and a checkpoint written in the older layout
(no ``mode``, no worker grouping) still resumes."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import golden_run
from dipaco.config import compose_config
from dipaco.plan.build import build_grid, build_topology
from dipaco.rounds.checkpointing import checkpoint_state, load_checkpoint, save_checkpoint
from dipaco.run.checkpoint import CheckpointManager
from dipaco.sync.diloco import DiLoCoSync


def _held(tmp: Path):
    cfg = compose_config(golden_run.BASE, tmp)
    grid = build_grid(cfg)
    topo = build_topology(cfg, grid, 1, distributed=False)
    return grid, topo, DiLoCoSync(topo, {m: grid.module(m) for m in grid.module_ids})


def test_both_modes_write_one_state_json_layout(tmp_path: Path) -> None:
    grid, _, _ = _held(tmp_path)
    sync = checkpoint_state(3, grid, mode="sync", worker_groups=2, group_size=1)
    decoupled = checkpoint_state(3, grid, mode="decoupled", worker_groups=grid.num_paths, group_size=1,
                                 versions={m: 3 for m in grid.module_ids})
    assert set(decoupled) - set(sync) == {"versions"}
    assert sync["mode"] == "sync" and decoupled["mode"] == "decoupled"
    assert sync["levels"] == list(grid.levels) and sync["round"] == 3


def test_a_checkpoint_in_the_old_state_json_layout_resumes(tmp_path: Path) -> None:
    grid, topo, sync = _held(tmp_path)
    ids = list(grid.module_ids)
    ckpts = CheckpointManager(tmp_path / "checkpoints")
    path = save_checkpoint(ckpts, 2, grid, sync, {}, topo, None, False, ids)
    state = json.loads((path / "state.json").read_text())
    assert state["mode"] == "sync"
    # the layout before the mode and the worker grouping were recorded
    (path / "state.json").write_text(json.dumps({k: state[k] for k in ("round", "num_paths", "module_ids", "levels")}))
    saved = {m: [p.detach().clone() for p in grid.module(m).parameters()] for m in ids}

    grid2, topo2, _ = _held(tmp_path)
    with torch.no_grad():
        for m in ids:
            for p in grid2.module(m).parameters():
                p.add_(1.0)  # other weights than the checkpoint's
    sync2 = DiLoCoSync(topo2, {m: grid2.module(m) for m in ids})
    assert load_checkpoint(path, grid2, sync2, {}, ids, topo2) == 2
    for m in ids:
        for a, b in zip(grid2.module(m).parameters(), saved[m]):
            assert torch.equal(a.detach(), b), m
