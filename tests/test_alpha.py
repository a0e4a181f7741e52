"""diloco.alpha: a path's pseudo-gradient weighed by tokens (uniform in sync mode) or by
its shard size, on the sync object and in a tiny run."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from _sync_rounds import sync_round, synchronous
from dipaco.config import compose_config
from dipaco.inference import InferenceRun
from dipaco.job.prepare import validation_ids
from dipaco.sync.alpha import PathAlpha
from dipaco.sync.diloco import DiLoCoSync
from dipaco.plan.topology import Topology
from dipaco.job.train import train
from router import write_shards

IDS = ["embed", "L0.0", "L0.1", "head"]
PATHS = [["embed", "L0.0", "head"], ["embed", "L0.1", "head"], ["embed", "L0.1", "head"]]
AVG = dict(name="sgd", lr=1.0, momentum=0.0, nesterov=False)


def _round(alpha: PathAlpha, values: list[float], tokens: int = 100) -> dict[str, float]:
    """One averaging round where path p moved every module it holds to ``values[p]``."""
    mods = {m: nn.Linear(2, 1, bias=False) for m in IDS}
    for m in mods.values():
        nn.init.zeros_(m.weight)
    driver = synchronous(DiLoCoSync(Topology(IDS, PATHS, world_size=1), mods, outer=AVG))

    def turn(p: int) -> float:
        with torch.no_grad():
            for m in PATHS[p]:
                mods[m].weight.fill_(values[p])
        return alpha(p, tokens)

    sync_round(driver, 0, turn)
    return {m: float(mods[m].weight.detach().mean()) for m in IDS}


def test_shard_size_weighs_pseudo_gradients_by_shard_size() -> None:
    values, shards = [1.0, 4.0, -2.0], [600, 100, 300]
    uniform = _round(PathAlpha.uniform(3), values)
    sized = _round(PathAlpha.from_shard_tokens(shards), values)
    assert uniform["embed"] == pytest.approx(sum(values) / 3)
    assert sized["embed"] == pytest.approx(np.dot(values, shards) / sum(shards))
    # L0.1 is shared by paths 1 and 2 only: their shards' 1:3 ratio
    assert sized["L0.1"] == pytest.approx((100 * 4.0 + 300 * -2.0) / 400)
    assert uniform["L0.1"] == pytest.approx(1.0)
    assert sized["L0.0"] == pytest.approx(1.0)  # one path: its own Δ whatever α is


def test_from_config_reads_the_shards_manifest(tmp_path: Path) -> None:
    docs = [np.arange(n, dtype=np.int64) for n in (10, 20, 30, 40)]
    write_shards(docs, [[0], [1], [1], [0, 1]], 2, tmp_path)  # 50 and 90 tokens
    assert PathAlpha.from_config("tokens", tmp_path).scale == (1.0, 1.0)
    a = PathAlpha.from_config("shard_size", tmp_path)
    assert a.scale == pytest.approx((50 / 70, 90 / 70))
    assert a(1, 10) == pytest.approx(90 / 7)
    with pytest.raises(ValueError, match="diloco.alpha"):
        PathAlpha.from_config("docs", tmp_path)


@pytest.mark.slow
def test_a_tiny_run_with_every_option(tmp_path: Path) -> None:
    """alpha=shard_size, path early stopping and the long protocol in one smoke run."""
    cfg = compose_config(["experiment=smoke", "data.max_documents=200", "diloco.alpha=shard_size",
                          "trainer.path_early_stopping=true", "trainer.eval_long=true", "trainer.rounds=3",
                          "trainer.eval_every=2", "router.reroute_every=32"], tmp_path)
    summary = train(cfg)
    tokens = json.loads((tmp_path / "shards" / "shards.json").read_text())["tokens_per_path"]
    scale = np.array(tokens) / np.mean(tokens)
    rounds = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = rounds[0]["paths"]["0"]["tokens"]
    # L0.0 is on paths 0 and 1 of the 2x2 grid: α = tokens × shard tokens / mean
    assert rounds[0]["modules"]["L0.0"]["alpha_sum"] == pytest.approx(trained * (scale[0] + scale[1]), rel=1e-6)
    assert [("val_loss" in r["paths"]["0"]) for r in rounds] == [False, True, True]  # rounds 2 and 3
    # a path with validation documents keeps round 2 or 3; one without has nothing to compare (None)
    val_sizes = json.loads((tmp_path / "routing_report.json").read_text())["validation"]["shard_sizes"]
    for p, best in summary["best_rounds"].items():
        assert best in ({2, 3} if val_sizes[int(p)] else {None}), (p, best, val_sizes)
    assert (tmp_path / "checkpoints" / "best_paths" / "path_0.safetensors").is_file()
    assert summary["eval_tokens_long"] > summary["eval_tokens"]
    # dipaco-infer reads the kept best weights and reproduces both protocols
    run = InferenceRun.open(tmp_path)
    docs = validation_ids(run.cfg, run.run)
    assert run.best_paths
    assert run.score(docs)["ppl"] == pytest.approx(summary["routed_ppl"], rel=1e-9)
    assert run.score(docs, whole_documents=True)["ppl"] == pytest.approx(summary["routed_ppl_long"], rel=1e-9)
    for key in ("routed_ppl_long", "dense_ppl_long", "rerouted_ppl_long", "wrong_path_ppl_long",
                "routed_ppl_last_weights"):
        assert 1.0 < summary[key] < cfg.model.vocab_size, key
