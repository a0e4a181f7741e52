"""EM re-sharding phases in the job (dipaco/job/reshard.py): when they run, their report, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import dipaco.job.reshard as reshard_mod
from dipaco.config import ConfigError, compose_config
from dipaco.job.reshard import phases_done, reshard_rounds
from dipaco.job.train import train
from dipaco.config.validate import validate_config

TINY = ["model=tiny", "trainer=tiny"]


@pytest.mark.parametrize("overrides, want", [
    (["trainer.rounds=10"], []),
    (["trainer.rounds=10", "router.reshard_at_round=4"], [4]),
    (["trainer.rounds=10", "router.reshard_at_round=2", "router.reshard_every=3"], [2, 5, 8]),
    (["trainer.rounds=9", "router.reshard_at_round=1", "router.reshard_every=4"], [1, 5]),
    (["trainer.rounds=3", "router.reshard_at_round=1", "router.reshard_every=1"], [1, 2]),
])
def test_phases_run_after_the_right_rounds(overrides: list[str], want: list[int]) -> None:
    cfg = compose_config(TINY + overrides)
    validate_config(cfg)
    assert reshard_rounds(cfg) == want


def test_phases_done_reads_the_report_and_the_single_phase_of_older_runs() -> None:
    cfg = compose_config(TINY + ["trainer.rounds=10", "router.reshard_at_round=2", "router.reshard_every=3"])
    assert phases_done({}, cfg) == set()
    assert phases_done({"reshards": [{"round": 2}, {"round": 5}], "reshard": {"round": 5}}, cfg) == {2, 5}
    assert phases_done({"reshard": {"fitted": True}}, cfg) == {2}  # before the phase list existed


@pytest.mark.parametrize("overrides, key", [
    (["router.reshard_every=2"], "router.reshard_every"),  # no first phase
    (["router.reshard_at_round=1", "router.reshard_every=0"], "router.reshard_every"),
    (["router.reshard_at_round=1", "router.reshard_assign=argmin"], "router.reshard_assign"),
    (["router.reshard_at_round=1", "router.reshard_documents=0"], "router.reshard_documents"),
    (["router.reshard_at_round=3"], "router.reshard_at_round"),  # not before the last round
    (["router.reshard_at_round=1", "diloco.mode=decoupled"], "router.reshard_at_round"),
])
def test_reshard_config_errors_name_the_key_and_the_fix(overrides: list[str], key: str) -> None:
    cfg = compose_config(TINY + ["trainer.rounds=3", *overrides])
    with pytest.raises(ConfigError) as e:
        validate_config(cfg)
    assert e.value.key == key and "Fix:" in str(e.value)


@pytest.mark.slow
def test_em_phases_run_at_their_rounds_and_resume_across_a_phase(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Phases after rounds 1 and 2 of 3 (loss M step). The run dies after round 2's
    checkpoint, before its phase: resume re-shards from that checkpoint *before* training
    round 3 (no round is trained on the old shards), and finishes."""
    args = ["experiment=smoke", "data.max_documents=120", "trainer.rounds=3", "router.reshard_at_round=1",
            "router.reshard_every=1", "router.reshard_assign=loss", "router.reshard_documents=32",
            "trainer.dense_baseline=false"]
    real = reshard_mod.reshard

    def dies_at_round_2(cfg, run, prep, ckpt, round_idx):
        if round_idx == 2:
            raise RuntimeError("killed before the phase")
        return real(cfg, run, prep, ckpt, round_idx)

    monkeypatch.setattr(reshard_mod, "reshard", dies_at_round_2)
    with pytest.raises(RuntimeError, match="killed"):
        train(compose_config(args, tmp_path))
    report = json.loads((tmp_path / "routing_report.json").read_text())
    assert [p["round"] for p in report["reshards"]] == [1]
    monkeypatch.setattr(reshard_mod, "reshard", real)
    capsys.readouterr()
    summary = train(compose_config(args + ["resume=true"], tmp_path))
    log = capsys.readouterr().out
    assert log.index("re-shard after round 2") < log.index("round 3/3") and log.count("round 3/3") == 1
    assert "round 2/3" not in log  # round 2 was not trained again
    assert summary["rounds"] == 3 and [p["round"] for p in summary["reshards"]] == [1, 2]
    report = json.loads((tmp_path / "routing_report.json").read_text())
    phases = report["reshards"]
    assert [p["round"] for p in phases] == [1, 2] and report["reshard"] == phases[-1]
    for p in phases:
        assert p["assign"] == "loss" and p["documents"] > 0 and p["fitted"] is True
        assert 0.0 <= p["reassigned"] <= 1.0 and 0.0 <= p["agreement_with_previous"] <= 1.0
        assert sum(p["shard_sizes"]) == 2 * p["num_documents"]  # the smoke router's top_k=2
        assert p["nmi"] is not None and p["seconds"] > 0  # the corpus has domain labels
        assert p["scored_loss_new"] > 0 and p["scored_loss_previous"] > 0
    rounds = [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    manifest = json.loads((tmp_path / "shards" / "shards.json").read_text())
    assert manifest["documents_per_path"] == phases[-1]["shard_sizes"]  # the last phase's shards trained round 3
