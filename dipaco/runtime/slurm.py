"""``launcher=slurm``: one SLURM job, ``launcher.nodes`` nodes, ``launcher.nproc`` ranks each.

Hydra's submitit launcher (``pip install -e ".[slurm]"``, selected by
``conf/launcher/slurm.yaml``) submits the job with sbatch; ``srun`` then starts
``nodes × nproc`` tasks and each runs the ``dipaco-train`` job body as one rank. This
module turns the SLURM environment of a task into the torch.distributed rendezvous
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR = the job's first host), after which the job
runs exactly as under torchrun (rank 0 prepares, all train, rank 0 evaluates).

It also renders the sbatch script submitit would write, without a cluster
(:func:`sbatch_script`), and with each task's environment (:func:`dry_run_text`, printed
by ``launcher.dry_run=true``). submitit is wrapped here and in :mod:`dipaco.cli.slurm_launcher`
(the login node's side: submission and failures) and nowhere else.
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from dipaco.runtime.launch import LaunchError
from dipaco.runtime.placement import place_rank

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


def submitit_command(folder: str) -> str:
    """The command each srun task runs: submitit's runner, which unpickles the Hydra job."""
    return f"{sys.executable} -u -m submitit.core._submit {shlex.quote(folder)}"


def dry_run_text(launcher: Mapping[str, Any], *, nodes: int, nproc: int, threads: Optional[int],
                 master_port: int, max_requeues: int, overrides: Sequence[str], device: str = "auto",
                 cpus_per_task: Optional[int] = None, gpus_per_node: Optional[int] = None) -> str:
    """What ``dipaco-train launcher=slurm launcher.dry_run=true`` prints: the sbatch script
    submitit would submit and the torch.distributed environment, device and threads each
    task derives (by :func:`dipaco.runtime.placement.place_rank`, as the task will)."""
    folder = str(Path(str(launcher.get("submitit_folder", ".submitit/%j"))).absolute())
    script = sbatch_script({**launcher, "submitit_folder": folder}, command=submitit_command(folder))
    world = nodes * nproc
    shown = list(range(world)) if world <= 16 else [*range(nproc), world - 1]
    rows = ["# task  node  RANK  LOCAL_RANK  WORLD_SIZE  LOCAL_WORLD_SIZE  MASTER_ADDR        MASTER_PORT  "
            "device   threads"]
    for t in shown:
        if shown[-1] == t and len(shown) < world:
            rows.append(f"# ... ({world} tasks in all)")
        task = {"SLURM_PROCID": str(t), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(t % nproc),
                "SLURM_JOB_NODELIST": "(first node)", "SLURM_NTASKS_PER_NODE": str(nproc)}
        if cpus_per_task:
            task["SLURM_CPUS_PER_TASK"] = str(cpus_per_task)
        env = slurm_rendezvous(task, master_port)
        where = place_rank("slurm", task, device=device, threads=threads, device_count=int(gpus_per_node or 0),
                           cpu_count=int(cpus_per_task or 1) * nproc)
        rows.append(f"# {t:>4}  {t // nproc:>4}  {env['RANK']:>4}  {env['LOCAL_RANK']:>10}  {env['WORLD_SIZE']:>10}  "
                    f"{env['LOCAL_WORLD_SIZE']:>16}  {env['MASTER_ADDR']:<17}  {env['MASTER_PORT']:>11}  "
                    f"{str(where.device):<7}  {where.threads:>7}")
    signal_s = launcher.get("signal_delay_s", 120)
    given = [o.split("=", 1)[1].strip("'\"") for o in overrides if o.startswith("run_dir=")]
    where = (f"# the run directory (hydra.run.dir): {given[-1]}" if given else
             "# the run directory: a folder of the sweep directory above (set hydra.run.dir=DIR to choose it)")
    return "\n".join([
        "# dry run (launcher.dry_run=true): nothing is submitted. The sbatch script submitit would submit:",
        script.rstrip(),
        "",
        where,
        f"# each of the {world} srun tasks runs the dipaco-train job (pickled by submitit) with these overrides:",
        "#   " + (" ".join(shlex.quote(o) for o in overrides) or "(none)"),
        "# and turns its SLURM variables into torch.distributed's (dipaco/runtime/slurm.py):",
        *rows,
        f"# SIGUSR2 {signal_s} s before the time limit: the round in flight finishes, its checkpoint is written and",
        f"# the job requeues itself (at most launcher.max_requeues={max_requeues} times); a requeued job runs with "
        "resume=true.",
    ])


def submission_warnings(nproc: int, gpus_per_node: Optional[int], timeout_min: int,
                        launcher: Mapping[str, Any]) -> list[str]:
    """Settings sbatch accepts but that waste the job: idle GPUs, a SIGUSR2 lead time
    (``hydra.launcher.signal_delay_s``) not shorter than the time limit."""
    out = []
    if gpus_per_node and nproc < gpus_per_node:
        out.append(f"warning: launcher.nproc={nproc} ranks per node but launcher.gpus_per_node={gpus_per_node}: "
                   f"{gpus_per_node - nproc} GPU(s) of each node are held and idle (set launcher.gpus_per_node="
                   f"{nproc}, or launcher.nproc={gpus_per_node})")
    lead = int(launcher.get("signal_delay_s", 120) or 0)
    if lead >= 60 * int(timeout_min):
        out.append(f"warning: SIGUSR2 comes hydra.launcher.signal_delay_s={lead} s before the time limit, but the "
                   f"limit is launcher.timeout_min={timeout_min} ({60 * int(timeout_min)} s): the job is told to "
                   "stop and requeue as soon as it starts (raise launcher.timeout_min or lower the delay)")
    return out


def submitted_text(job_id: str, stderr_log: str, stdout_log: str, tasks: int, nodes: int) -> str:
    """What the login node says once sbatch accepted the job: its id, its logs, how to follow it."""
    return (f"submitted SLURM job {job_id} ({tasks} task(s) on {nodes} node(s)); rank 0's log: {stdout_log} and "
            f"{stderr_log} (task t: _t_ in the name); follow it with `tail -f {stderr_log}` or "
            f"`squeue -j {job_id}`; this process waits for the job and reports how it ended")
