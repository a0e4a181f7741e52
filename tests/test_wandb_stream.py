"""W&B with a fake ``wandb`` module (no network): the run id is the run's own and moves with
it, runs carry a name, group and tags, and a spawned rank 0's records reach W&B while it
trains (dipaco/runtime/tracking.py, dipaco/runtime/record_tail.py)."""
from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

from dipaco.config import compose_config
from dipaco.run.run_dir import RunDir
from dipaco.runtime.record_tail import RecordTail
from dipaco.runtime.tracking import MetricsWriter, round_scalars

from test_health_metrics import FakeWandb

BASE = ["experiment=smoke", "logging.tensorboard=false", "logging.wandb=true"]


def _fake(monkeypatch) -> FakeWandb:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init))
    return fake


def test_the_wandb_id_moves_with_the_run_and_runs_have_name_group_tags(tmp_path: Path, monkeypatch) -> None:
    fake = _fake(monkeypatch)
    sweep = tmp_path / "sweep"
    (sweep / "0_seed=0").mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    run = RunDir.at(sweep / "0_seed=0")
    cfg = compose_config([*BASE, "logging.tags=[ablation,h100]"], run.root)
    MetricsWriter(run, cfg).close()
    first = fake.inits[-1]
    assert (first["name"], first["group"], first["tags"]) == ("0_seed=0", "sweep", ["ablation", "h100"])
    moved = RunDir.at(tmp_path / "elsewhere" / "renamed")
    moved.root.parent.mkdir()
    shutil.move(str(run.root), str(moved.root))
    cfg = compose_config([*BASE, "logging.run_name=mine", "logging.wandb_group=g"], moved.root)
    MetricsWriter(moved, cfg).close()
    again = fake.inits[-1]
    assert again["id"] == first["id"] and again["resume"] == "allow"  # the same W&B run after the move
    assert (again["name"], again["group"], again["tags"]) == ("mine", "g", None)
    other = RunDir.at(tmp_path / "other")
    other.root.mkdir()
    MetricsWriter(other, compose_config(BASE, other.root)).close()
    assert fake.inits[-1]["id"] != first["id"]


def test_a_spawned_rank_records_reach_wandb_while_it_trains(tmp_path: Path, monkeypatch) -> None:
    fake = _fake(monkeypatch)
    run = RunDir.at(tmp_path)
    cfg = compose_config(BASE, tmp_path)
    H = cfg.diloco.inner_steps
    step = {"kind": "step", "path": 0, "loss": 3.0, "tokens": 8, "memory": {}}

    def rnd(r: int) -> dict:
        return {"round": r, "step": r * H, "paths": {"0": {"loss": 3.0 - r}}, "modules": {}, "bytes_sent": 0,
                "compute_s": 1.0, "wait_s": 0.0, "sync_s": 0.0}

    with MetricsWriter(run, cfg, shared=True) as job:
        with MetricsWriter(run, cfg, wandb=False) as rank0:  # what a spawned rank 0 holds
            rank0.log_round(rnd(0))  # a resumed run's earlier record: sent by the earlier launch
            tail = RecordTail(job, every_s=3600)  # polled by hand below
            rank0.log_steps([{**step, "round": 1, "step": 2}, {**step, "round": 1, "step": H}])
            rank0.log_round(rnd(1))
            rank0.log_steps([{**step, "round": 2, "step": H + 2}])
            assert tail.poll() == 3  # while training: round 1's steps and record; step H+2 may be incomplete
            assert [s for s, _ in fake.logged] == [2, H, H] and fake.logged[-1][1] == round_scalars(rnd(1))
            with open(run.steps, "a", encoding="utf-8") as f:
                f.write('{"kind": "step", "round": 2, "st')  # a line rank 0 is still writing
            assert tail.poll() == 0
        assert tail.poll(final=True) == 1  # the ranks are done: the rest
    assert [s for s, _ in fake.logged] == [2, H, H, H + 2]


def test_the_tail_thread_streams_and_drains(tmp_path: Path, monkeypatch) -> None:
    fake = _fake(monkeypatch)
    run = RunDir.at(tmp_path)
    cfg = compose_config(BASE, tmp_path)
    rec = {"round": 1, "step": 5, "paths": {"0": {"loss": 1.0}}, "modules": {}}
    with MetricsWriter(run, cfg, shared=True) as job:
        with RecordTail(job, every_s=0.01):
            with MetricsWriter(run, cfg, wandb=False) as rank0:
                rank0.log_round(rec)
        assert [s for s, _ in fake.logged] == [5]
