"""Per-step health metrics (issue #35 item 1, docs/metrics.md): a tiny run's TensorBoard
events hold loss, grad norm, lr, tokens/s and memory every ``logging.every_steps`` inner
steps and the sample's validation loss per round; its messages are in ``train.log``;
W&B is initialised once per job. Plus the pieces: the turn's intervals, merging ranks,
MFU only where a peak is known, the spawned rank's records mirrored to W&B.
"""
from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dipaco.config.validate
from dipaco.config import compose_config
from dipaco.job.train import train
from dipaco.rounds.health import merge_step_records
from dipaco.rounds.turn_log import TurnLog
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.runtime.device import choose_device
from dipaco.runtime.hardware import flops_per_token, peak_flops
from dipaco.runtime.tracking import MetricsWriter, round_scalars, step_scalars

ROUNDS, EVERY = 2, 2
TINY = ["experiment=smoke", "data.max_documents=200", f"trainer.rounds={ROUNDS}", "trainer.progress=false",
        "trainer.dense_baseline=false", f"logging.every_steps={EVERY}", "logging.val_documents=4"]


class FakeWandb:
    """``wandb`` as the writer uses it: init / log / summary / finish, counted."""

    def __init__(self) -> None:
        self.inits: list[dict] = []
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        Path(kwargs["dir"], "wandb", f"offline-run-{kwargs['id']}-{len(self.inits)}").mkdir(parents=True)
        outer = self

        class Run:
            summary = types.SimpleNamespace(update=lambda d: None)

            def log(self, data: dict, step: int) -> None:
                outer.logged.append((step, dict(data)))

            def finish(self) -> None:
                outer.finished += 1

        return Run()


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FakeWandb]:
    """One local run with W&B on (a fake module: wandb is not a dependency)."""
    tmp = tmp_path_factory.mktemp("health")
    fake = FakeWandb()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init))
        real = dipaco.config.validate.importlib.util.find_spec
        mp.setattr(dipaco.config.validate.importlib.util, "find_spec",
                   lambda name: object() if name == "wandb" else real(name))
        cfg = compose_config([*TINY, "logging.wandb=true", "logging.wandb_mode=offline"], tmp / "run")
        train(cfg)
    return tmp / "run", fake


@pytest.mark.slow
def test_tensorboard_has_the_health_metrics_every_logging_interval(tiny_run) -> None:
    run_dir, _ = tiny_run
    H = compose_config(TINY).diloco.inner_steps
    steps = list(range(EVERY, ROUNDS * H + 1, EVERY))
    s = _scalars(run_dir / "tb")
    for tag in ("loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm", "lr",
                "throughput(tps)", "tflops", "time_metrics/end_to_end(s)", "memory/rss(GiB)",
                "memory/max_rss(GiB)", "skipped_steps", "loss_metrics/path_0", "grad_norm/path_3"):
        assert [step for step, _ in s[tag]] == steps, tag
    assert all(v > 0 for _, v in s["grad_norm"] + s["throughput(tps)"] + s["memory/max_rss(GiB)"])
    # MFU where the run's device has a known peak (an H100 or H200), left out, not made up, where
    # it has none (the CPU)
    cfg = compose_config(TINY)
    known = peak_flops(choose_device(cfg.trainer.device), cfg.trainer.precision) is not None
    assert any(t.startswith("mfu(%)") for t in s) == known
    # validation loss on the fixed sample once per round, at the round's last step
    assert [step for step, _ in s["validation_metrics/loss"]] == [r * H for r in range(1, ROUNDS + 1)]
    # the per-step loss is the record's, and the lr follows the schedule down
    records = RunDir.at(run_dir).records(steps=True)
    first = [r for r in records if r["step"] == EVERY]
    assert s["loss_metrics/global_avg_loss"][0][1] == pytest.approx(
        sum(r["loss"] * r["tokens"] for r in first) / sum(r["tokens"] for r in first), rel=1e-6)
    assert s["lr"][-1][1] < s["lr"][0][1]
    rounds = RunDir.at(run_dir).records()
    assert [m["step"] for m in rounds] == [r * H for r in range(1, ROUNDS + 1)]
    assert any(v.get("val_sample_loss") for v in rounds[0]["paths"].values())


def test_step_records_agree_with_the_round_totals(tiny_run) -> None:
    """The intervals of a round cover its steps: their token-weighted loss is the round's."""
    run = RunDir.at(tiny_run[0])
    for rnd in run.records():
        for p, v in rnd["paths"].items():
            recs = [r for r in run.records(steps=True) if r["round"] == rnd["round"] and r["path"] == int(p)]
            assert sum(r["steps"] for r in recs) == compose_config(TINY).diloco.inner_steps
            assert sum(r["tokens"] for r in recs) == v["tokens"]
            mean = sum(r["loss"] * r["steps"] for r in recs) / sum(r["steps"] for r in recs)
            assert mean == pytest.approx(v["loss"], rel=1e-9)


@pytest.mark.slow
def test_metrics_do_not_change_the_results(tiny_run, tmp_path: Path) -> None:
    """The same run with no per-step metrics and no validation sample trains bit for bit
    the same: losses of every round and path, and the routed perplexity."""
    off = tmp_path / "off"
    summary = train(compose_config([*TINY, "logging.every_steps=0", "logging.val_documents=0"], off))

    def losses(d: Path) -> list:
        return [{p: v["loss"] for p, v in r["paths"].items()} for r in RunDir.at(d).records()]

    assert losses(off) == losses(tiny_run[0])
    assert summary["routed_ppl"] == json.loads((tiny_run[0] / "summary.json").read_text())["routed_ppl"]
    assert not (off / "steps.jsonl").exists()


def test_train_log_holds_the_run_messages(tiny_run) -> None:
    text = (tiny_run[0] / "train.log").read_text()
    assert "[dipaco][INFO] - run directory:" in text and "corpus:" in text and "routing:" in text
    assert f"round {ROUNDS}/{ROUNDS}: mean path loss" in text
    assert f"[DEBUG] - step {EVERY}: loss" in text and "tokens/s" in text  # the health lines
    assert "routed perplexity" in text  # the summary table


def test_wandb_is_initialised_once_per_job(tiny_run) -> None:
    run_dir, fake = tiny_run
    assert len(fake.inits) == 1 and fake.finished == 1
    assert len(list((run_dir / "wandb").iterdir())) == 1
    steps = [step for step, _ in fake.logged]
    assert steps == sorted(steps)  # W&B drops a step lower than the last one
    assert any("loss_metrics/global_avg_loss" in d for _, d in fake.logged)


def test_real_wandb_offline_makes_one_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``wandb`` installed (not a dependency): one offline run holding the step metrics."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    train(compose_config([*TINY, "trainer.rounds=1", "logging.val_documents=0", "logging.wandb=true",
                          "logging.wandb_mode=offline"], run_dir))
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    tags = (b"loss_metrics/global_avg_loss", b"grad_norm", b"throughput(tps)", b"loss/mean")
    for _ in range(60):  # W&B's own process may still be writing its file after finish()
        data = next(folder.glob("run-*.wandb")).read_bytes()
        if all(tag in data for tag in tags):
            break
        time.sleep(0.5)
    assert [tag for tag in tags if tag not in data] == []


def test_a_refused_run_writes_no_train_log(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a run")
    with pytest.raises(RunDirError):
        train(compose_config(TINY, tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_turn_log_intervals_skip_a_non_finite_step_exactly() -> None:
    """Five steps logged every 2 from step 10: intervals end at steps 12, 14 and 15 (the
    turn's end); the NaN step is counted as skipped and left out of loss and norm."""
    log = TurnLog(torch.device("cpu"), 5, every=2, step0=10)
    for i in range(5):
        bad = i == 2
        loss = torch.tensor(float("nan") if bad else 1.0 + i)
        norm = torch.tensor(float("inf") if bad else 0.5)
        log.add(loss, norm, torch.tensor(bad), tokens=7, lr=0.1 * (i + 1), step=11 + i)
    stats = log.read()
    assert (stats.steps, stats.skipped, stats.tokens) == (4, 1, 28)
    assert stats.loss_sum == 1.0 + 2.0 + 4.0 + 5.0
    got = [(iv["step"], iv["steps"], iv["skipped_steps"], iv["loss"], iv["grad_norm"], iv["lr"], iv["tokens"])
           for iv in stats.intervals]
    assert got == [(12, 2, 0, 1.5, 0.5, pytest.approx(0.2), 14), (14, 2, 1, 4.0, 0.5, pytest.approx(0.4), 14),
                   (15, 1, 0, 5.0, 0.5, pytest.approx(0.5), 7)]


def test_no_intervals_when_per_step_metrics_are_off() -> None:
    log = TurnLog(torch.device("cpu"), 3, every=0, step0=0)
    for i in range(3):
        log.add(torch.tensor(2.0), torch.tensor(1.0), torch.tensor(False), tokens=3, lr=0.1, step=i + 1)
    stats = log.read()
    assert stats.intervals == [] and stats.steps == 3 and stats.loss == 2.0


def test_mfu_only_where_a_peak_is_known() -> None:
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32") is None
    assert peak_flops(cpu, "fp32", peak_tflops=100.0) == 100e12
    assert flops_per_token(1000, 2, 8, 16) == 6 * 1000 + 12 * 2 * 8 * 16
    rec = {"path": 0, "step": 2, "loss": 1.0, "tokens": 10, "tokens_per_s": 5.0, "mfu_pct": None, "memory": {}}
    assert "mfu(%)" not in step_scalars([rec])
    assert step_scalars([{**rec, "mfu_pct": 40.0}])["mfu(%)"] == 40.0


def test_ranks_of_a_worker_group_merge_into_one_record() -> None:
    a = {"kind": "step", "step": 4, "round": 1, "path": 2, "steps": 2, "skipped_steps": 0, "loss": 2.0,
         "loss_max": 2.5, "grad_norm": 1.0, "grad_norm_max": 1.2, "lr": 0.1, "tokens": 30, "seconds": 1.0,
         "memory": {"rss_bytes": 5}, "tokens_per_s": 30.0, "tflops": 1.0, "mfu_pct": None}
    b = {**a, "loss": 4.0, "loss_max": 4.5, "tokens": 10, "seconds": 2.0, "memory": {"rss_bytes": 9},
         "tokens_per_s": 5.0}
    (m,) = merge_step_records([[a], [b]])
    assert m["loss"] == pytest.approx((2.0 * 30 + 4.0 * 10) / 40) and m["loss_max"] == 4.5
    assert (m["tokens"], m["seconds"], m["memory"]["rss_bytes"]) == (40, 2.0, 9)
    assert m["tokens_per_s"] == 17.5 and m["mfu_pct"] is None


def test_the_job_mirrors_a_spawned_rank_records_to_wandb(tmp_path: Path, monkeypatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=fake.init))
    run = RunDir.at(tmp_path)
    cfg = compose_config(["experiment=smoke", "logging.tensorboard=false", "logging.wandb=true"], tmp_path)
    H = cfg.diloco.inner_steps
    step = {"kind": "step", "round": 1, "path": 0, "loss": 3.0, "tokens": 8, "memory": {}}
    rnd = {"round": 1, "step": H, "paths": {"0": {"loss": 3.0}}, "modules": {}, "bytes_sent": 0,
           "compute_s": 1.0, "wait_s": 0.0, "sync_s": 0.0}
    with MetricsWriter(run, cfg, shared=True) as job:
        assert MetricsWriter.shared(run) is job
        with MetricsWriter(run, cfg, wandb=False) as rank0:  # what a spawned rank 0 holds
            rank0.log_steps([{**step, "step": 2}, {**step, "step": H}])
            rank0.log_round(rnd)
        assert fake.logged == []
        job.mirror_to_wandb(after_round=0)
    assert MetricsWriter.shared(run) is None and len(fake.inits) == 1
    assert [s for s, _ in fake.logged] == [2, H, H]
    assert fake.logged[-1][1] == round_scalars(rnd)
    assert json.loads(run.steps.read_text().splitlines()[0])["kind"] == "step"


@pytest.mark.multiprocess
def test_spawned_ranks_merge_their_records_and_share_train_log(tmp_path: Path) -> None:
    """One worker group of two spawned ranks: one step record per path and interval (the
    two ranks' halves of the batch merged), and rank 0's lines in the job's train.log."""
    cfg = compose_config([*TINY, "trainer.rounds=1", "logging.val_documents=0", "launcher=spawn",
                          "launcher.nproc=2", "launcher.group_size=2"], tmp_path / "run")
    train(cfg)
    run = RunDir.at(tmp_path / "run")
    H = cfg.diloco.inner_steps
    recs = run.records(steps=True)
    assert sorted((r["step"], r["path"]) for r in recs) == [(s, p) for s in range(EVERY, H + 1, EVERY) for p in range(4)]
    # the two ranks' halves add up to the group's whole batch of every step
    assert all(r["tokens"] == r["steps"] * cfg.trainer.batch_size * cfg.trainer.seq_len for r in recs)
    text = run.log_file.read_text()
    assert "2 rank(s)" in text and f"[DEBUG] - step {EVERY}: loss" in text and "round 1/1" in text


def test_a_resume_drops_the_steps_it_trains_again(tmp_path: Path) -> None:
    run = RunDir.at(tmp_path)
    cfg = compose_config(["experiment=smoke"], tmp_path)
    H = cfg.diloco.inner_steps

    def steps(r: int, loss: float) -> list[dict]:
        return [{"kind": "step", "step": (r - 1) * H + s, "round": r, "path": 0, "loss": loss, "tokens": 1,
                 "memory": {}} for s in (H // 2, H)]

    with MetricsWriter(run, cfg) as w:
        w.log_steps(steps(1, 1.0) + steps(2, 2.0))
    with MetricsWriter(run, cfg) as w:  # resumed from the round-1 checkpoint
        w.rewind(1)
        w.log_steps(steps(2, 20.0))
    assert [(r["round"], r["loss"]) for r in run.records(steps=True)] == [(1, 1.0), (1, 1.0), (2, 20.0), (2, 20.0)]
    assert [v for _, v in _scalars(run.tensorboard)["loss_metrics/global_avg_loss"]] == [1.0, 1.0, 20.0, 20.0]


@pytest.mark.multiprocess
def test_decoupled_workers_report_their_steps(tmp_path: Path) -> None:
    """Decoupled mode: each worker's phase carries its intervals; the job writes them with
    the phase records, every path at every interval."""
    cfg = compose_config([*TINY, "logging.val_documents=0", "diloco.mode=decoupled", "launcher.nproc=2"],
                         tmp_path / "run")
    train(cfg)
    H = cfg.diloco.inner_steps
    recs = RunDir.at(tmp_path / "run").records(steps=True)
    assert sorted((r["step"], r["path"]) for r in recs) == \
        [(s, p) for s in range(EVERY, ROUNDS * H + 1, EVERY) for p in range(4)]
    s = _scalars(tmp_path / "run" / "tb")
    assert [step for step, _ in s["loss_metrics/global_avg_loss"]] == list(range(EVERY, ROUNDS * H + 1, EVERY))
