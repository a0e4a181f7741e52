"""``launcher=slurm``: one SLURM job, ``launcher.nodes`` nodes, ``launcher.nproc`` ranks each.

Hydra's submitit launcher (``pip install -e ".[slurm]"``, selected by
``conf/launcher/slurm.yaml``) submits the job with sbatch; ``srun`` then starts
``nodes × nproc`` tasks and each runs the ``dipaco-train`` job body as one rank. This
module turns the SLURM environment of a task into the torch.distributed rendezvous
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR = the job's first host), after which the job
runs exactly as under torchrun (rank 0 prepares, all train, rank 0 evaluates).

It also renders the sbatch script submitit would write, without a cluster
(:func:`sbatch_script`): the tests check it, and a user can read it before queueing.
submitit is wrapped here and nowhere else.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

from dipaco.launch import LaunchError

# SLURM variables every srun task has, and what they become
_TASK_ENV = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``gpu[03-04,07],cpu1`` → ``gpu03``.

    ``scontrol show hostnames`` does this on a cluster; parsing here keeps the
    rendezvous free of a subprocess on every rank.
    """
    group = re.split(r",(?![^\[]*\])", nodelist.strip(), maxsplit=1)[0]
    m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", group)
    if m is None:
        return group
    prefix, ranges, suffix = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def slurm_rendezvous(env: Mapping[str, str], master_port: int) -> dict[str, str]:
    """The torch.distributed env of one srun task, from its SLURM variables.

    ``LOCAL_WORLD_SIZE`` comes from ``SLURM_NTASKS_PER_NODE`` (``8`` or ``8(x2)``);
    a ``MASTER_PORT`` already set (by the user's sbatch setup) wins over ``master_port``.
    """
    missing = [k for k in (*_TASK_ENV, "SLURM_JOB_NODELIST") if k not in env]
    if missing:
        raise LaunchError(f"launcher=slurm but {', '.join(missing)} not set: submit with "
                          "`dipaco-train launcher=slurm launcher.partition=NAME` (each rank is an srun task)")
    out = {torch_key: str(int(env[slurm_key])) for slurm_key, torch_key in _TASK_ENV.items()}
    per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1")
    out["LOCAL_WORLD_SIZE"] = re.match(r"\d+", per_node).group(0)  # type: ignore[union-attr]
    out["MASTER_ADDR"] = first_host(env["SLURM_JOB_NODELIST"])
    out["MASTER_PORT"] = env.get("MASTER_PORT", str(master_port))
    return out


def sbatch_script(launcher: Mapping[str, Any], command: str = "<submitit task>") -> str:
    """The sbatch script submitit writes for the resolved ``hydra.launcher`` node.

    Mirrors the submitit launcher's mapping (its keys → sbatch parameters) but calls
    submitit's script builder directly, since ``SlurmExecutor`` refuses to exist
    where ``srun`` is missing. Unknown keys raise ``ValueError`` as submitit would.
    """
    from submitit.slurm import slurm as submitit_slurm  # optional dependency: launcher=slurm only

    rename = submitit_slurm.SlurmExecutor._equivalence_dict()
    params: dict[str, Any] = {}
    for key, value in launcher.items():
        if key in ("_target_", "submitit_folder", "max_num_timeout") or value is None:
            continue
        params[rename.get(key, key)] = value
    if "mem" in params:
        params["mem"] = submitit_slurm._convert_mem(params["mem"])
    unknown = sorted(set(params) - set(submitit_slurm._get_default_parameters()))
    if unknown:
        raise ValueError(f"hydra.launcher keys sbatch does not know: {unknown}")
    folder = Path(str(launcher.get("submitit_folder", ".submitit/%j")))
    return submitit_slurm._make_sbatch_string(command=command, folder=folder, **params)
