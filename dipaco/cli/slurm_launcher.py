"""The login node's side of ``launcher=slurm``: a job that fails is one line naming the
failing task and its log.

``conf/launcher/slurm.yaml`` selects ``hydra_plugins.dipaco_slurm.launcher`` (Hydra's
submitit launcher, ``hydra-submitit-launcher`` from the ``slurm`` extra, whose
``launch`` goes through :func:`report_failures`). Submission, the job body and its
requeue are the submitit launcher's; only what the user reads when it goes wrong
changes. submitit raises ``UncompletedJobError`` (a task left no result: it exited with
dipaco's one-line error, was killed, or its node died) or ``FailedJobError`` (it
raised), each carrying pages of log; here that becomes ``dipaco: error: SLURM job J
failed in task T (rank T): <the task's last error line>; its log: <path>``, exit code 1.
Which task: the one whose log ends with an error line and was written first (a rank
that fails makes the others fail later, at a collective); else the task submitit names.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from submitit.core.utils import FailedJobError, FailedSubmissionError, JobPaths, UncompletedJobError

from dipaco.cli.errors import fail
from dipaco.runtime.progress import say
from dipaco.runtime.slurm import submitted_text

# the last line of a task's log that says what went wrong: dipaco's one line, or the
# final line of a Python traceback
_ERROR_LINE = re.compile(r"^(dipaco: error: .*|[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*)$")
_JOB_TASK = (re.compile(r"Job (?P<job>\S+) \(task: (?P<task>\d+)\)"), re.compile(r"\(task=(?P<task>\d+)\)"))


def report_failures(launch: Callable[[], Any], folder: str) -> Any:
    """``launch()`` (the submitit launcher's), with a refused submission or a failed job
    turned into one line; ``folder`` is the launcher's ``submitit_folder``."""
    try:
        with announce_submissions():
            return launch()
    except (subprocess.CalledProcessError, FailedSubmissionError) as e:
        fail(f"sbatch refused the job: {_last_line(str(getattr(e, 'output', '') or e))} "
             "(change the launcher.* or hydra.launcher.* key it names)", code=2)
    except (UncompletedJobError, FailedJobError) as e:
        fail(describe_failure(str(e), folder), code=1)


@contextlib.contextmanager
def announce_submissions() -> Iterator[None]:
    """While the submitit launcher runs: each job sbatch accepted is announced on the login
    node (:func:`dipaco.runtime.slurm.submitted_text`) before the launcher waits for it.

    Hydra's submitit launcher submits and then blocks on the results in one method; the
    hook is submitit's ``map_array``, wrapped for the duration (this module is the one
    place dipaco touches submitit's login-node side)."""
    import submitit

    own = submitit.AutoExecutor.__dict__.get("map_array")  # None: inherited
    original = submitit.AutoExecutor.map_array

    def map_array(self: Any, *args: Any, **kwargs: Any) -> Any:
        jobs = original(self, *args, **kwargs)
        params = getattr(getattr(self, "_executor", None), "parameters", {}) or {}
        nodes = int(params.get("nodes", 1) or 1)
        tasks = nodes * int(params.get("ntasks_per_node", 1) or 1)
        for job in jobs:
            say(submitted_text(str(job.job_id), str(job.paths.stderr), str(job.paths.stdout), tasks, nodes))
        return jobs

    submitit.AutoExecutor.map_array = map_array  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del submitit.AutoExecutor.map_array
        else:
            submitit.AutoExecutor.map_array = own  # type: ignore[method-assign]


def describe_failure(message: str, folder: str) -> str:
    """One line for a job submitit reports as failed with ``message``; ``folder`` is the
    launcher's ``submitit_folder`` (``%j`` and all), where every task's log lives."""
    job, task = None, None
    for pattern in _JOB_TASK:
        m = pattern.search(message)
        if m:
            job, task = m.groupdict().get("job"), int(m.group("task"))
            break
    if job is None:  # FailedJobError does not name the job; its log path does
        m = re.search(r"(\S+)_(\d+)_log\.err", message)
        job = Path(m.group(1)).name if m else None
    if job is None:
        return f"SLURM job failed: {_last_line(message)}; the logs are under {Path(folder).parent}"
    paths = JobPaths(folder, job_id=job)
    first = _first_failing_task(paths.folder, job)
    if first is not None:
        task = first
    task = 0 if task is None else task
    log = JobPaths(folder, job_id=job, task_id=task).stderr
    line = _error_line(log) or "no error line in its log (killed, or its node failed?)"
    return f"SLURM job {job} failed in task {task} (rank {task}): {line}; its log: {log}"


def _first_failing_task(folder: Path, job: str) -> Optional[int]:
    """The task whose log ends with an error line and was written first, or ``None``."""
    found = []
    for log in folder.glob(f"{job}_*_log.err"):
        m = re.fullmatch(rf"{re.escape(job)}_(\d+)_log\.err", log.name)
        if m and _error_line(log):
            found.append((log.stat().st_mtime, int(m.group(1))))
    return min(found)[1] if found else None


def _error_line(log: Path) -> Optional[str]:
    """The last line of ``log`` that reports an error, or ``None``."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if _ERROR_LINE.match(line.strip()):
            return line.strip()
    return None


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "(no message)"
