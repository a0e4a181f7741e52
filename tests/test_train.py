"""End-to-end tests of ``train(cfg)`` and the ``dipaco-train`` CLI on tiny configs.

The smoke experiment (tiny model, 300 documents, 2 rounds of 4 inner steps) runs in a
few seconds, so these tests exercise the real pipeline: corpus → tokenizer → router →
shards → rounds with per-module DiLoCo → checkpoints → dense baseline → evaluation.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _dist import free_port

from dipaco.storage.tensor_io import load_state
from dipaco.job.prepare import validation_ids
from dipaco.run.run_dir import RunDir
from dipaco.config import ConfigError, compose_config
from dipaco.job.train import train
from dipaco.config.validate import validate_config

SMOKE = ["experiment=smoke", "data.max_documents=200"]
SUMMARY_KEYS = {"routed_ppl", "dense_ppl", "ratio_vs_dense", "bytes_sent", "ddp_bytes_equivalent",
                "tokens_per_s", "wall_s", "rounds"}


def module_weights(run_dir: Path, round_idx: int) -> dict[str, dict[str, torch.Tensor]]:
    ckpt = run_dir / "checkpoints" / f"round_{round_idx:06d}" / "modules"
    return {p.stem: load_state(p) for p in sorted(ckpt.glob("*.safetensors"))}


def assert_same_weights(a: dict, b: dict, *, exact: bool = False, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys() and a
    for mid in a:
        for k in a[mid]:
            if exact:
                assert torch.equal(a[mid][k], b[mid][k]), (mid, k)
            else:
                torch.testing.assert_close(a[mid][k], b[mid][k], atol=atol, rtol=1e-5, msg=f"{mid}/{k}")


@pytest.fixture(scope="module")
def local_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("local")
    summary = train(compose_config(SMOKE + ["launcher=local", "launcher.nproc=4"], run_dir))
    return run_dir, summary


@pytest.mark.slow
def test_local_run_writes_every_output(local_run: tuple[Path, dict]) -> None:
    run_dir, summary = local_run
    assert SUMMARY_KEYS <= summary.keys()
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["routed_ppl"] == pytest.approx(summary["routed_ppl"])
    # a tiny model after 8 steps is far from uniform over 512 tokens but not trained
    assert 1.0 < summary["routed_ppl"] < 512
    assert summary["wrong_path_ppl"] > 1.0
    assert summary["bytes_sent"] > 0
    # communication is H times rarer than DDP (H=4 here) and fp32 pseudo-gradients
    assert summary["bytes_sent"] < summary["ddp_bytes_equivalent"] / 2
    for name in ("config.yaml", "metrics.jsonl", "routing_report.json", "tokenizer.json"):
        assert (run_dir / name).is_file(), name
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    assert set(lines[0]["paths"]) == {"0", "1", "2", "3"}
    assert set(lines[0]["modules"]) == {"embed", "L0.0", "L0.1", "L1.0", "L1.1", "head"}
    report = json.loads((run_dir / "routing_report.json").read_text())
    # training shards: every document in router.top_k (default 2) of them
    assert sum(report["shard_sizes"]) == 2 * report["num_documents"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spawn_worker_groups_of_two_match_local(local_run: tuple[Path, dict], tmp_path: Path) -> None:
    """Contract 1 through the spawn launcher, G=2: two worker groups of two data-parallel
    ranks, each group training two paths in turn, end with the local backend's weights."""
    run_dir, summary = local_run
    spawned = train(compose_config(SMOKE + ["launcher=spawn", "launcher.nproc=4", "launcher.group_size=2"],
                                   tmp_path))
    # the worker group's averaged half-batch gradients differ from one full batch in the last bits
    assert_same_weights(module_weights(run_dir, 2), module_weights(tmp_path, 2), atol=2e-5)
    assert spawned["routed_ppl"] == pytest.approx(summary["routed_ppl"], rel=1e-4)


@pytest.mark.slow
def test_resume_equals_uninterrupted_run(local_run: tuple[Path, dict], tmp_path: Path) -> None:
    """Contract 5: stop after round 1, resume, and land on the same bits as one run."""
    run_dir, summary = local_run
    stopped = train(compose_config(SMOKE + ["launcher=local", "launcher.nproc=4",
                                            "trainer.stop_after_rounds=1"], tmp_path))
    assert stopped["stopped_at_round"] == 1
    assert not (tmp_path / "summary.json").exists()
    resumed = train(compose_config(SMOKE + ["launcher=local", "launcher.nproc=4", "resume=true"], tmp_path))
    assert_same_weights(module_weights(run_dir, 2), module_weights(tmp_path, 2), exact=True)
    assert resumed["routed_ppl"] == summary["routed_ppl"]


@pytest.mark.slow
def test_fresh_run_refuses_a_directory_with_checkpoints(local_run: tuple[Path, dict]) -> None:
    run_dir, _ = local_run
    with pytest.raises(ConfigError, match="resume"):
        train(compose_config(SMOKE, run_dir))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("diloco.inner_steps=0", "diloco.inner_steps"),
        ("diloco.inner_steps=-3", "diloco.inner_steps"),
        ("diloco.codec=zip", "diloco.codec"),
        ("grid.levels=[]", "grid.levels"),
        ("grid.levels=[2,0]", "grid.levels"),
        ("router.top_k=9", "router.top_k"),
        ("router.prefix_tokens=200", "router.prefix_tokens"),
        ("launcher.nproc=3", "launcher.nproc"),
        ("trainer.batch_size=3", "trainer.batch_size"),
        ("data.source=jsonl", "data.path"),
        ("model.n_heads=3", "model.n_heads"),
        ("trainer.eval_split=train", "trainer.eval_split"),
    ],
)
def test_impossible_configs_name_the_key(override: str, key: str) -> None:
    cfg = compose_config(["launcher=spawn", "launcher.group_size=2", override])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert err.value.key == key
    assert "\n" not in str(err.value) and "Fix:" in str(err.value)


def test_default_config_is_valid() -> None:
    validate_config(compose_config([]))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    code = "from dipaco.cli.train import main; main()"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.multiprocess
def test_cli_config_error_is_one_line(tmp_path: Path) -> None:
    proc = _cli("diloco.inner_steps=0", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "diloco.inner_steps" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_cli_unknown_group_option_fails_before_work(tmp_path: Path) -> None:
    proc = _cli("model=nope", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert proc.returncode != 0
    assert "model" in proc.stderr and "nope" in proc.stderr
    assert not (tmp_path / "run" / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cli_multirun_sweep_of_two_points(tmp_path: Path) -> None:
    # a path-valued override: each job is still one folder of the sweep, not a tree of the path's parts
    proc = _cli("-m", *SMOKE, "trainer.rounds=1", "diloco.inner_steps=2,3", "trainer.dense_baseline=false",
                f"data.cache_dir={tmp_path}/cache", f"hydra.sweep.dir={tmp_path}/sweep", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 2
    assert "%2F" in summaries[0].parent.name
    steps = sorted(json.loads(p.read_text())["inner_steps"] for p in summaries)
    assert steps == [2, 3]
    # dipaco-report turns the sweep into one table row per setting, plus a plot
    from dipaco.cli.report import main as report_main

    report_main([str(tmp_path / "sweep")])
    table = [x for x in (tmp_path / "sweep" / "report.md").read_text().splitlines() if x.startswith("|")]
    assert table[0].startswith("| diloco.inner_steps |") and len(table) == 4
    assert (tmp_path / "sweep" / "report.png").is_file()


@pytest.mark.slow
def test_warmup_lm_features_and_discriminative_reshard(tmp_path: Path) -> None:
    """The paper's full pipeline: dense warm-up → LM-feature routing → re-shard mid-run."""
    summary = train(compose_config(SMOKE + ["trainer.rounds=3", "trainer.warmup_fraction=0.25",
                                            "router.featurizer=lm", "router.reshard_at_round=1",
                                            "router.reshard_documents=64"], tmp_path))
    assert summary["warmup_steps"] == 4  # 25% of (4 warm-up + 3 rounds x 4 steps)
    assert (tmp_path / "warmup" / "modules.safetensors").is_file()
    report = json.loads((tmp_path / "routing_report.json").read_text())
    assert report["reshard"]["fitted"] is True
    assert sum(report["reshard"]["shard_sizes"]) == 2 * report["num_documents"]  # top_k=2: two shards each
    manifest = json.loads((tmp_path / "router" / "manifest.json").read_text())
    assert manifest["featurizer"]["kind"] == "callable" and manifest["discriminative"] is True
    assert (tmp_path / "router" / "discriminative.npz").is_file()
    # rounds 2-3 ran after the re-shard, on the new shards, and their traffic is counted
    rounds = [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3]
    assert summary["bytes_sent"] == sum(json.loads(x)["bytes_sent"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_ranks_match_local_backend(local_run: tuple[Path, dict], tmp_path: Path) -> None:
    """Under torchrun every process is a rank: rank 0 prepares, all train, rank 0 evaluates."""
    run_dir, summary = local_run
    # a free port, not torchrun's default 29500: tests run side by side (pytest -n) on one host
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "-m", "dipaco.cli.train", "launcher=torchrun", *SMOKE, f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_weights(module_weights(run_dir, 2), module_weights(tmp_path, 2))
    spawned = json.loads((tmp_path / "summary.json").read_text())
    assert spawned["routed_ppl"] == pytest.approx(summary["routed_ppl"], rel=1e-5)


def test_replicas_make_flat_diloco_topology() -> None:
    """grid.replicas=R: R training paths per grid path, same modules, disjoint data."""
    from dipaco.plan.build import build_grid, build_topology
    from router import expand_replicas

    cfg = compose_config(["grid=dense", "grid.replicas=4"])
    validate_config(cfg)
    grid = build_grid(cfg)
    topo = build_topology(cfg, grid, 1, distributed=False)
    assert topo.num_paths == 4 and topo.num_groups == 4
    assert len({tuple(m) for m in topo.path_modules}) == 1  # every replica holds every module
    assignments = expand_replicas([[0]] * 1000, 4, seed=0)
    counts = [sum(1 for a in assignments if a == [r]) for r in range(4)]
    assert sum(counts) == 1000 and min(counts) > 200


@pytest.mark.slow
def test_flat_diloco_baseline_trains(tmp_path: Path) -> None:
    summary = train(compose_config(SMOKE + ["grid=dense", "grid.replicas=4"], tmp_path))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(lines[-1]["paths"]) == {"0", "1", "2", "3"}
    assert lines[-1]["modules"]["L0.0"]["contributions"] == 4
    assert summary["bytes_sent"] > 0 and summary["num_paths"] == 1


@pytest.mark.slow
def test_eval_split_test_scores_the_held_out_documents(local_run: tuple[Path, dict], tmp_path: Path) -> None:
    """Settings are chosen on validation, results reported on test: the same run scores
    other documents (and dipaco-infer's document list follows the setting)."""
    _, val_summary = local_run
    summary = train(compose_config(SMOKE + ["trainer.eval_split=test"], tmp_path))
    assert val_summary["eval_split"] == "validation" and summary["eval_split"] == "test"
    cfg = compose_config(SMOKE + ["trainer.eval_split=test"], tmp_path)
    test_docs = validation_ids(cfg, RunDir.at(tmp_path))
    val_docs = validation_ids(compose_config(SMOKE, tmp_path), RunDir.at(tmp_path))
    assert len(test_docs) > 0 and summary["eval_tokens"] != val_summary["eval_tokens"]
    assert {tuple(d) for d in test_docs}.isdisjoint({tuple(d) for d in val_docs})


def test_default_top_k_is_two_and_one_path_grids_route_each_document_once() -> None:
    cfg = compose_config([])
    validate_config(cfg)
    assert cfg.router.top_k == 2  # overlapping shards: the default since sweep=routing
    for grid in (["grid=dense"], ["grid=dense", "grid.replicas=4"]):
        one = compose_config(grid)
        validate_config(one)  # not a config error: a single path takes every document
        assert one.router.top_k == 1


def test_lm_featurizer_reads_the_last_positions_of_a_long_context() -> None:
    """A re-route's context can outgrow the warm-up model: the LM features then read its
    last max_seq_len tokens, as if the context were cut there (no positional error)."""
    import numpy as np

    from dipaco.job.prepare import lm_featurizer
    from modules import ModelConfig, ModuleGrid

    grid = ModuleGrid(ModelConfig(vocab_size=64, d_model=16, n_heads=2, layers_per_level=1, max_seq_len=16), [1, 1])
    featurize = lm_featurizer(grid)
    long = np.random.default_rng(0).integers(0, 64, size=40)
    short = long[:10]
    out = featurize([long, short])
    assert out.shape == (2, 16) and np.isfinite(out).all()
    np.testing.assert_allclose(out[0], featurize([long[-16:]])[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[1], featurize([short])[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(out[0], featurize([long[:16]])[0])  # the last tokens, not the first
