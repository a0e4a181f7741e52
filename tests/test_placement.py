"""Every rank of every launcher on its own GPU, with its share of the host's cores
(dipaco/runtime/placement.py), on fake device and core counts: no GPU needed.

For each launcher the test builds the environment each rank of one host really gets
(torch's agent variables, the elastic agents' block, SLURM's task variables turned into
torch's by :func:`dipaco.runtime.slurm.slurm_rendezvous`) and asks the one placement
function every launcher goes through where the rank goes.
"""
from __future__ import annotations

import pytest

from dipaco.config import compose_config
from dipaco.runtime.elastic_spawn import agent_config, agent_rank_env
from dipaco.runtime.placement import host_rank, place_rank, placement_of
from dipaco.runtime.slurm import slurm_rendezvous

CPUS = 64


def _torch_agent(ranks: int, node: int = 0, nodes: int = 1) -> list[dict[str, str]]:
    """What torch's agent (spawn, torchrun) exports to the ranks of one host."""
    return [{"RANK": str(node * ranks + i), "WORLD_SIZE": str(nodes * ranks), "LOCAL_RANK": str(i),
             "LOCAL_WORLD_SIZE": str(ranks)} for i in range(ranks)]


def _elastic(ranks: int, group_size: int) -> list[dict[str, str]]:
    """``launcher=spawn launcher.elastic=true``: one torch agent per worker group on the host."""
    cfg = compose_config(["launcher=spawn", "launcher.elastic=true", f"launcher.nproc={ranks}",
                          f"launcher.group_size={group_size}"])
    lc = agent_config(cfg.launcher, 29500)
    out = []
    for slot in range(lc["max_nodes"]):
        for i in range(lc["nproc_per_node"]):
            out.append({**agent_rank_env(slot, lc), "RANK": str(len(out)), "WORLD_SIZE": str(ranks),
                        "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(lc["nproc_per_node"])})
    return out


def _slurm(ranks: int, node: int = 1, nodes: int = 2, cpus_per_task: int = 0) -> list[dict[str, str]]:
    """One node of a SLURM job: each task's SLURM variables, then what the task exports."""
    out = []
    for i in range(ranks):
        env = {"SLURM_PROCID": str(node * ranks + i), "SLURM_NTASKS": str(nodes * ranks), "SLURM_LOCALID": str(i),
               "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NTASKS_PER_NODE": f"{ranks}(x{nodes})"}
        if cpus_per_task:
            env["SLURM_CPUS_PER_TASK"] = str(cpus_per_task)
        out.append({**env, **slurm_rendezvous(env, 29500)})
    return out


HOSTS = {  # launcher -> the env of every rank of one host
    "local": ("local", lambda n: [{}]),
    "spawn": ("spawn", lambda n: _torch_agent(n)),
    "spawn elastic, groups of 1": ("spawn", lambda n: _elastic(n, 1)),
    "spawn elastic, groups of 2": ("spawn", lambda n: _elastic(n, 2)),
    "torchrun, second node": ("torchrun", lambda n: _torch_agent(n, node=1, nodes=2)),
    "slurm, second node": ("slurm", lambda n: _slurm(n)),
}


@pytest.mark.parametrize("case", sorted(HOSTS))
@pytest.mark.parametrize("ranks,gpus", [(4, 4), (4, 8), (8, 4), (4, 0)])
def test_every_rank_of_every_launcher_gets_its_own_gpu_and_share_of_cores(case: str, ranks: int, gpus: int) -> None:
    """Placement: host rank i of n takes GPU i % gpus (each its own while there are enough) and
    cpus // n threads, whichever launcher started it."""
    launcher, envs = HOSTS[case]
    envs = envs(ranks)
    n = len(envs)
    where = [place_rank(launcher, env, device_count=gpus, cpu_count=CPUS) for env in envs]
    assert sorted(host_rank(launcher, env)[0] for env in envs) == list(range(n))
    assert {host_rank(launcher, env)[1] for env in envs} == {n}
    if gpus:
        assert [str(p.device) for p in sorted(where, key=lambda p: p.rank_device.local_rank)] == \
            [f"cuda:{i % gpus}" for i in range(n)]
        assert len({p.device for p in where}) == min(n, gpus)  # never two ranks on a GPU while one is free
    else:
        assert {str(p.device) for p in where} == {"cpu"}
    assert {p.threads for p in where} == {CPUS // n}
    assert {p.rank_device.local_world for p in where} == {n}


def test_threads_setting_and_slurm_cpus_per_task_win() -> None:
    """``trainer.threads`` when set; under SLURM the task's CPUs (``launcher.cpus_per_task``)."""
    assert {place_rank("slurm", e, device_count=8, cpu_count=CPUS).threads for e in _slurm(8, cpus_per_task=6)} == {6}
    assert {place_rank("slurm", e, threads=2, device_count=8, cpu_count=CPUS).threads
            for e in _slurm(8, cpus_per_task=6)} == {2}
    assert {place_rank("spawn", e, threads=3, cpu_count=CPUS).threads for e in _elastic(4, 1)} == {3}
    assert place_rank("local", {}, cpu_count=1).threads == 1  # never 0 threads


def test_placement_of_a_run_reads_its_settings() -> None:
    cfg = compose_config(["launcher=spawn", "launcher.nproc=4", "trainer.device=cpu", "trainer.threads=5"])
    p = placement_of(cfg, _elastic(4, 1)[3], device_count=4, cpu_count=CPUS)
    assert (str(p.device), p.threads, p.rank_device.local_rank, p.rank_device.backend) == ("cpu", 5, 3, "gloo")
    assert "4 rank(s) on this host" in p.describe()
