"""A fake SLURM on one host for tests: ``sbatch``, ``srun``, ``scontrol`` and ``sacct``
executables (Python scripts) that submitit and dipaco call as they would call SLURM's.

* ``sbatch SCRIPT`` prints ``Submitted batch job N`` and runs SCRIPT in the background
  (one node, ``localhost``) with the job's SLURM variables, its output appended to the
  ``#SBATCH --output/--error`` files. When the script ends and ``scontrol requeue N``
  was called, it runs the script again with ``SLURM_RESTART_COUNT`` one higher, as
  SLURM restarts a requeued job.
* ``srun [--output O --error E] CMD`` starts ``SLURM_NTASKS`` copies of CMD with
  ``SLURM_PROCID`` / ``SLURM_LOCALID`` set, each task's output in O / E with ``%j``
  and ``%t`` replaced; with ``FAKE_SLURM_BREAK_TASK=T`` task T gets no ``SLURM_PROCID``
  (a task that cannot start). When a task fails the others are killed
  (``--kill-on-bad-exit``).
* ``scontrol requeue N`` records the request; ``sacct`` reports each job's state.

Everything is recorded under ``$FAKE_SLURM_DIR``: ``requeues.log`` (one line per
``scontrol requeue``), ``state_N`` and ``attempts_N``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

_COMMON = '''
import os, re, signal, subprocess, sys, time
from pathlib import Path
STATE = Path(os.environ["FAKE_SLURM_DIR"])
STATE.mkdir(parents=True, exist_ok=True)
'''

SBATCH = _COMMON + '''
def run_job(script, job):
    text = Path(script).read_text()
    opts = dict(re.findall(r"^#SBATCH --([\\w-]+)(?:=(.*))?$", text, re.M))
    nodes, per_node = int(opts.get("nodes", 1)), int(opts.get("ntasks-per-node", 1))
    assert nodes == 1, "the fake SLURM has one node"
    env = dict(os.environ, SLURM_JOB_ID=job, SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1",
               SLURM_NNODES="1", SLURM_NTASKS=str(per_node), SLURM_NTASKS_PER_NODE=str(per_node),
               SLURM_NODEID="0", SLURM_SUBMIT_DIR=os.getcwd())
    if opts.get("cpus-per-task"):
        env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
    restarts = 0
    while True:
        if restarts:
            env["SLURM_RESTART_COUNT"] = str(restarts)
        (STATE / f"state_{job}").write_text("RUNNING")
        with open(STATE / f"attempts_{job}", "a") as f:
            f.write(f"{restarts}\\n")
        out = opts["output"].replace("%j", job)
        err = opts.get("error", opts["output"]).replace("%j", job)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "a") as o, open(err, "a") as e:
            rc = subprocess.call(["bash", script], env=env, stdout=o, stderr=e)
        marker = STATE / f"requeue_{job}"
        if marker.exists():
            marker.unlink()
            restarts += 1
            (STATE / f"state_{job}").write_text("REQUEUED")
            continue
        (STATE / f"state_{job}").write_text("COMPLETED" if rc == 0 else "FAILED")
        return

if sys.argv[1] == "--run":
    run_job(sys.argv[2], sys.argv[3])
    sys.exit(0)
counter = STATE / "next_job"
job = str(int(counter.read_text()) if counter.exists() else 1)
counter.write_text(str(int(job) + 1))
(STATE / f"state_{job}").write_text("PENDING")
subprocess.Popen([sys.executable, __file__, "--run", sys.argv[-1], job], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(f"Submitted batch job {job}")
'''

SRUN = _COMMON + '''
args, out, err = sys.argv[1:], None, None
while args and args[0].startswith("--"):
    flag = args.pop(0)
    if flag in ("--output", "--error"):
        value = args.pop(0)
        out, err = (value, err) if flag == "--output" else (out, value)
job, n = os.environ["SLURM_JOB_ID"], int(os.environ["SLURM_NTASKS"])
broken = os.environ.get("FAKE_SLURM_BREAK_TASK")
procs = []
for t in range(n):
    env = dict(os.environ, SLURM_PROCID=str(t), SLURM_LOCALID=str(t), SLURM_STEP_ID="0")
    if broken is not None and int(broken) == t:
        del env["SLURM_PROCID"]
    o = open(out.replace("%j", job).replace("%t", str(t)), "a") if out else None
    e = open(err.replace("%j", job).replace("%t", str(t)), "a") if err else None
    procs.append(subprocess.Popen(args, env=env, stdout=o, stderr=e))
codes = {}
while len(codes) < n:
    for t, p in enumerate(procs):
        if t not in codes and p.poll() is not None:
            codes[t] = p.returncode
            if p.returncode != 0:  # --kill-on-bad-exit
                for q in procs:
                    if q.poll() is None:
                        q.kill()
    time.sleep(0.05)
sys.exit(max(abs(c) for c in codes.values()))
'''

SCONTROL = _COMMON + '''
if sys.argv[1:2] != ["requeue"]:
    sys.exit(f"fake scontrol: only `scontrol requeue JOB` is faked, got {sys.argv[1:]}")
job = sys.argv[2]
with open(STATE / "requeues.log", "a") as f:
    f.write(f"requeue {job} SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', '0')}\\n")
(STATE / f"requeue_{job}").write_text("")
'''

SACCT = _COMMON + '''
jobs = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "-j"]
print("JobID|State|NodeList")
for job in jobs:
    state = STATE / f"state_{job}"
    print(f"{job}|{state.read_text() if state.exists() else 'PENDING'}|localhost")
'''


def install(bin_dir: Path, state_dir: Path) -> dict[str, str]:
    """Write the fake executables into ``bin_dir``; the environment that puts them first on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL), ("sacct", SACCT)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n" + body)
        path.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_SLURM_DIR": str(state_dir)}
