"""Experiment tracking and progress output: TensorBoard events, W&B, one line per round in logs.

One captured ``dipaco-train`` run (stdout/stderr are pipes, not a terminal, and
``trainer.progress=true`` asks for bars) serves both checks: its log has no tqdm updates,
and its TensorBoard events read back to the numbers in metrics.jsonl and summary.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dipaco.config.validate
from dipaco.runtime import progress
from dipaco.config import ConfigError, compose_config
from dipaco.run.run_dir import RunDir
from dipaco.runtime.tracking import MetricsWriter, round_scalars
from dipaco.config.validate import validate_config

ROUNDS = 2
SMOKE = ["experiment=smoke", "data.max_documents=200", f"trainer.rounds={ROUNDS}", "trainer.progress=true"]


def _series(metrics: list[dict], value) -> list[tuple[int, float]]:
    """(step, value(record)) per metrics.jsonl record, rounded like TensorBoard's float32:
    a round is plotted at its last inner step."""
    return [(m["step"], pytest.approx(value(m), rel=1e-6)) for m in metrics]


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def captured_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("tracked")
    code = "from dipaco.cli.train import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, *SMOKE, f"hydra.run.dir={tmp}/run"], cwd=tmp,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run", proc


@pytest.mark.slow
@pytest.mark.multiprocess
def test_log_without_a_terminal_has_one_line_per_round(captured_run) -> None:
    _, proc = captured_run
    out = proc.stdout + proc.stderr
    assert "\r" not in out, "tqdm updates written to a non-terminal"
    assert "it/s" not in out and "step/s" not in out
    rounds = [x for x in proc.stdout.splitlines() if x.startswith("[dipaco] round ")]
    assert [x.split()[2].rstrip(":") for x in rounds] == [f"{r}/{ROUNDS}" for r in range(1, ROUNDS + 1)]
    # the phases say where the run is, once each
    for phase in ("corpus:", "routing:", "dense baseline:"):
        assert sum(phase in x for x in proc.stdout.splitlines()) == 1, phase
    assert len(proc.stdout.splitlines()) < 30


@pytest.mark.slow
@pytest.mark.multiprocess
def test_train_log_in_the_hydra_run_dir_holds_the_messages(captured_run) -> None:
    """Hydra's job log is switched off (a refused run must write nothing); the run writes
    its own train.log where Hydra would have: every console line of the logger is in it."""
    run_dir, proc = captured_run
    text = (run_dir / "train.log").read_text()
    for line in proc.stdout.splitlines():
        if line.startswith("[dipaco] "):
            assert line[len("[dipaco] "):] in text, line
    assert "[DEBUG] - step " in text  # the per-step health lines, which the console leaves out


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tensorboard_events_hold_the_round_metrics_and_summary(captured_run) -> None:
    run_dir, _ = captured_run
    scalars = _scalars(run_dir / "tb")
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    H = compose_config(SMOKE).diloco.inner_steps
    assert [m["round"] for m in metrics] == list(range(1, ROUNDS + 1))
    assert [m["step"] for m in metrics] == [r * H for r in range(1, ROUNDS + 1)]
    for p in "0123":
        assert scalars[f"loss/path_{p}"] == _series(metrics, lambda m: m["paths"][p]["loss"])
        assert scalars[f"lr/path_{p}"] == _series(metrics, lambda m: m["paths"][p]["lr"])
    for mid in ("embed", "L0.0", "L0.1", "L1.0", "L1.1", "head"):
        assert scalars[f"pseudo_grad_norm/{mid}"] == _series(metrics, lambda m: m["modules"][mid]["pseudo_grad_norm"])
    # L0.0 is shared by paths 0 and 1: the local backend sees both contributions
    assert len(scalars["cosine/L0.0"]) == ROUNDS
    assert scalars["comm/bytes_sent"] == _series(metrics, lambda m: m["bytes_sent"])
    assert all(0 <= v <= 1 for _, v in scalars["time/sync_share"])
    assert scalars["lr/outer"] == [(r * H, pytest.approx(0.7)) for r in range(1, ROUNDS + 1)]
    # the learning rate follows the schedule: it decays over the rounds after the warm-up
    lrs = [v for _, v in scalars["lr/path_0"]]
    assert lrs[-1] < lrs[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert scalars["summary/routed_ppl"] == [(ROUNDS * H, pytest.approx(summary["routed_ppl"], rel=1e-6))]
    assert scalars["summary/ratio_vs_dense"][0][1] == pytest.approx(summary["ratio_vs_dense"], rel=1e-6)


def test_round_scalars_leave_out_missing_and_non_finite_values() -> None:
    record = {"round": 2, "paths": {"1": {"loss": 2.0, "lr": 1e-3}, "0": {"loss": float("nan"), "lr": 1e-3}},
              "modules": {"L0.0": {"pseudo_grad_norm": 0.5, "cosine": None, "bytes_sent": 10}},
              "bytes_sent": 10, "compute_s": 3.0, "wait_s": 0.0, "sync_s": 1.0, "outer_lr": 0.7}
    s = round_scalars(record)
    assert "loss/path_0" not in s and s["loss/path_1"] == 2.0 and s["loss/mean"] == 2.0
    assert "cosine/L0.0" not in s and s["pseudo_grad_norm/L0.0"] == 0.5
    assert s["time/sync_share"] == pytest.approx(0.25)
    assert s["lr/outer"] == 0.7


def _record(r: int, loss: float) -> dict:
    return {"round": r, "paths": {"0": {"loss": loss}}, "modules": {}, "bytes_sent": 0,
            "compute_s": 1.0, "wait_s": 0.0, "sync_s": 0.0}


def test_resumed_writer_replaces_the_rounds_it_reruns(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    cfg = compose_config(["experiment=smoke"], tmp_path)
    with MetricsWriter(run, cfg) as w:
        for r in (1, 2, 3):
            w.log_round(_record(r, float(r)))
    # resumed from the round-2 checkpoint: round 3 is trained again
    with MetricsWriter(run, cfg) as w:
        w.rewind(2)
        w.log_round(_record(3, 30.0))
    H = cfg.diloco.inner_steps
    assert _scalars(run.tensorboard)["loss/path_0"] == [(H, 1.0), (2 * H, 2.0), (3 * H, 30.0)]
    assert [m["round"] for m in run.records()] == [1, 2, 3] and run.records()[-1]["paths"]["0"]["loss"] == 30.0


def test_wandb_gets_the_same_scalars_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list] = {"init": [], "log": [], "summary": [], "finish": []}

    class FakeRun:
        summary = types.SimpleNamespace(update=lambda d: calls["summary"].append(dict(d)))

        def log(self, data: dict, step: int) -> None:
            calls["log"].append((step, dict(data)))

        def finish(self) -> None:
            calls["finish"].append(True)

    def init(**kwargs):
        calls["init"].append(kwargs)
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = compose_config(["experiment=smoke", "logging.tensorboard=false", "logging.wandb=true",
                          "logging.wandb_mode=offline", "logging.wandb_project=p"], tmp_path)
    with MetricsWriter(RunDir.at(tmp_path), cfg) as w:
        w.log_round(_record(1, 4.0))
        w.log_summary({"routed_ppl": 12.0, "dense_ppl": float("nan")}, step=1)
    (kw,) = calls["init"]
    assert kw["mode"] == "offline" and kw["project"] == "p" and kw["config"]["model"]["d_model"] == 32
    assert calls["log"] == [(cfg.diloco.inner_steps, round_scalars(_record(1, 4.0)))]
    assert calls["summary"] == [{"routed_ppl": 12.0}] and calls["finish"] == [True]
    assert not (tmp_path / "tb").exists()


def test_wandb_without_the_package_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dipaco.config.validate.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(["logging.wandb=true"]))
    assert err.value.key == "logging.wandb" and "pip install wandb" in str(err.value)
    assert "\n" not in str(err.value)


def test_progress_bars_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert progress.progress_bar(True, 10, "rounds", "step") is None
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert progress.progress_bar(False, 10, "rounds", "step") is None
    bar = progress.progress_bar(True, 10, "rounds", "step")
    assert bar is not None
    bar.close()
