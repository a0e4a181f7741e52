"""Log lines never print over a progress bar, and the per-step metrics torchtitan users look
for: data-loading time per step and memory as a share of the device (docs/metrics.md)."""
from __future__ import annotations

import json

import pytest
import torch
from tqdm import tqdm

import dipaco.runtime.progress as progress
from dipaco.rounds.turn_log import TurnLog
from dipaco.runtime.hardware import memory_snapshot
from dipaco.runtime.tracking import step_scalars


def test_a_log_line_goes_through_tqdm_write_while_a_bar_is_drawn(monkeypatch, capsys):
    written: list[str] = []
    monkeypatch.setattr(tqdm, "write", classmethod(lambda cls, s, file=None, **kw: written.append(s)))
    progress.log.info("before the bar")
    bar = tqdm(total=3, desc="round", disable=False, file=open("/dev/null", "w"))
    try:
        progress.log.info("round 1/3: mean path loss 4.0")
    finally:
        bar.close()
    progress.log.info("after the bar")
    assert written == ["[dipaco] round 1/3: mean path loss 4.0"]
    out = capsys.readouterr().out
    assert "[dipaco] before the bar" in out and "[dipaco] after the bar" in out


def test_intervals_carry_the_data_loading_time():
    turn = TurnLog(torch.device("cpu"), n=4, every=2, step0=0)
    z = torch.tensor(1.0)
    for k in range(1, 5):
        turn.add(z, z, torch.tensor(False), tokens=8, lr=0.1, step=k, data_s=0.25)
    stats = turn.read()
    assert [iv["data_s"] for iv in stats.intervals] == [0.5, 0.5]


def test_step_scalars_name_data_loading_and_memory_shares():
    gib = 2**30
    rec = {"path": 0, "step": 10, "steps": 2, "seconds": 4.0, "data_s": 1.0, "loss": 2.0, "tokens": 10,
           "memory": {"max_reserved_bytes": 20 * gib, "max_active_bytes": 10 * gib, "device_total_bytes": 80 * gib,
                      "max_rss_bytes": 4 * gib, "host_total_bytes": 128 * gib}}
    s = step_scalars([rec])
    assert s["time_metrics/data_loading(s)"] == pytest.approx(0.5)
    assert s["time_metrics/data_loading(%)"] == pytest.approx(25.0)
    assert s["memory/max_reserved(%)"] == pytest.approx(25.0) and s["memory/max_active(%)"] == pytest.approx(12.5)
    assert s["memory/max_rss(%)"] == pytest.approx(100 * 4 / 128)
    snap = memory_snapshot(torch.device("cpu"))
    assert snap["host_total_bytes"] > snap["max_rss_bytes"] > 0


@pytest.mark.slow
def test_warmup_and_dense_baseline_curves_share_the_paths_board(finished):
    """The warm-up's and the dense baseline's losses are on the paths' TensorBoard board: the
    baseline at the paths' inner steps, the warm-up just before step 0."""
    from test_health_metrics import _scalars

    run_dir = finished[0]
    s = _scalars(run_dir / "tb")
    paths = [step for step, _ in s["loss_metrics/global_avg_loss"]]
    dense = [step for step, _ in s["loss_metrics/dense_baseline"]]
    assert dense and max(dense) == max(paths)
    warm = json.loads((run_dir / "warmup" / "info.json").read_text())["steps"] if (run_dir / "warmup").is_dir() else 0
    if warm:
        steps = [step for step, _ in s["loss_metrics/warmup"]]
        assert steps[-1] == 0 and min(steps) > -warm
