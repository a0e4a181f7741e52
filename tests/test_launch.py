"""Launching beyond one host: ``launcher=slurm`` (composed and rendered, no SLURM here)
and multi-node ``torchrun`` for real (two agents on localhost, c10d rendezvous)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from dipaco.config import ConfigError, compose_config, register_configs
from dipaco.runtime.launch import LaunchError, free_port
from dipaco.runtime.slurm import first_host, sbatch_script, slurm_rendezvous
from dipaco.config.validate import validate_config

TWO_NODES = ["launcher=slurm", "launcher.partition=gpu", "launcher.nodes=2", "launcher.gpus_per_node=8",
             "launcher.nproc=8", "grid=4x4"]


def _compose_with_hydra(overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="dipaco.conf", version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=True)


def test_slurm_renders_a_two_node_eight_gpu_job() -> None:
    cfg = _compose_with_hydra(TWO_NODES)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.dipaco_slurm.launcher.DipacoSlurmLauncher"
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"  # `launcher=slurm` alone submits
    assert "validate_before_submit" in cfg.hydra.callbacks
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    script = sbatch_script(launcher).splitlines()
    for flag in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--time=60"):
        assert f"#SBATCH {flag}" in script, flag
    assert any(x.startswith("srun ") for x in script)
    # the job's own config is valid: 2 nodes x 8 ranks = 16 worker groups for 16 paths
    job = compose_config(TWO_NODES)
    validate_config(job)
    assert job.launcher.name == "slurm" and job.launcher.nodes * job.launcher.nproc == 16


@pytest.mark.multiprocess
def test_slurm_without_a_partition_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(["launcher=slurm", "grid=4x4"]))
    assert err.value.key == "launcher.partition"
    code = "from dipaco.cli.train import main; main()"
    proc = subprocess.run([sys.executable, "-c", code, "launcher=slurm", "grid=4x4",
                           f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "launcher.partition" in lines[0], proc.stderr
    assert not (tmp_path / "sweep").exists()  # nothing was submitted


def test_slurm_refuses_more_ranks_per_node_than_gpus() -> None:
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(TWO_NODES + ["launcher.gpus_per_node=4"]))
    assert err.value.key == "launcher.nproc"


@pytest.mark.parametrize(("nodelist", "host"), [
    ("node7", "node7"), ("gpu[03-04,07]", "gpu03"), ("gpu[12,3],cpu1", "gpu12"),
    ("a-[001-004]-ib", "a-001-ib"), ("x1,x2", "x1"),
])
def test_first_host_of_a_slurm_node_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


def test_slurm_task_env_becomes_the_torchrun_env() -> None:
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[03-04]", "SLURM_NTASKS_PER_NODE": "8(x2)"}
    assert slurm_rendezvous(env, 29500) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1",
                                            "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu03",
                                            "MASTER_PORT": "29500"}
    with pytest.raises(LaunchError, match="SLURM_PROCID"):
        slurm_rendezvous({"SLURM_NTASKS": "2"}, 29500)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_torchrun_agents_on_localhost_train_one_run(tmp_path: Path) -> None:
    """Multi-node torchrun: two agents (``--nnodes=2``, one rank each) meet through the c10d
    rendezvous and train one run in a shared directory, as two hosts would."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=0",
           "-m", "dipaco.cli.train", "launcher=torchrun", "data=python_sources", "model=tiny", "trainer=tiny",
           "data.max_documents=120", "router.prefix_tokens=16", "diloco.inner_steps=2",
           "trainer.rounds=1", "trainer.dense_baseline=false", f"hydra.run.dir={tmp_path}/run",
           # two "hosts" on one machine: each agent sees one local rank and would take nccl, but on a
           # GPU host both ranks land on GPU 0, which nccl refuses; real hosts have their own GPUs
           "launcher.backend=gloo"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for _ in range(2)]
    try:
        logs = [a.communicate(timeout=200)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(x[-2000:] for x in logs)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["bytes_sent"] > 0
    # two ranks, one per "node", each a worker group training two of the four paths
    state = json.loads(next((run / "checkpoints").glob("round_*/state.json")).read_text())
    assert (state["worker_groups"], state["group_size"]) == (2, 1)
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert (run / "tb").is_dir()
