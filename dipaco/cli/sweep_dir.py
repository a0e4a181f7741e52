"""A sweep folder (``dipaco-train -m``, ``hydra.sweep.dir=D``) by the ownership rule.

Hydra's sweeper writes ``D/multirun.yaml`` before its first job starts. Before it does,
:class:`OwnSweepDir` (a Hydra callback every dipaco config registers) checks D like every
folder dipaco writes into (dipaco/run/owned.py): not inside a run directory, no link in
the way, no ``multirun.yaml`` of the user's; and a ``multirun.yaml`` of an earlier, other
sweep (other overrides) is never rewritten: that sweep is refused in one line, so D still
describes the runs it holds. The same sweep again (a rerun after a stop) is allowed.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from dipaco.cli.errors import fail, user_errors
from dipaco.run.owned import OwnershipError, check_owned, record_written, sweep_stale_staging
from dipaco.run.path_guard import check_target
from dipaco.storage.hashing import short_key

SWEEP_RECORD = "multirun.yaml"
# a job folder's name stays one path component, and under the file systems' 255 bytes
_NAME_BYTES = 200
RESOLVER = "dipaco_job_dirname"


def job_dirname(overrides: str) -> str:
    """A sweep job's folder name from its overrides (Hydra's ``override_dirname``): one path
    component whatever the values hold. ``%`` and ``/`` are escaped (``%25``, ``%2F``), so a
    path-valued override (``data.path=/x/y``) does not nest the job in folders named after
    the path's parts; a name over 200 bytes keeps its first bytes and a hash of the whole."""
    name = str(overrides).replace("%", "%25").replace("/", "%2F")
    raw = name.encode("utf-8")
    if len(raw) <= _NAME_BYTES:
        return name
    digest = short_key(raw, 12)
    return raw[: _NAME_BYTES - 13].decode("utf-8", "ignore") + "-" + digest


# Hydra resolves the job folder (conf/config.yaml: hydra.sweep.subdir) in whichever process
# runs the job; this module is imported there first, as the sweep callback's home
if not OmegaConf.has_resolver(RESOLVER):
    OmegaConf.register_new_resolver(RESOLVER, job_dirname)


def _earlier_overrides(path: Path) -> Optional[list[str]]:
    try:
        got = OmegaConf.select(OmegaConf.load(path), "hydra.overrides.task", default=None)
        return None if got is None else [str(x) for x in got]
    except Exception:  # unreadable YAML of any kind: not a sweep record dipaco can vouch for
        return None


def check_sweep_dir(sweep_dir: str | Path, overrides: list[str]) -> Path:
    """Whether a sweep of ``overrides`` may write ``sweep_dir`` (else :class:`OwnershipError`,
    one line); writes nothing (a refused or dry-run sweep leaves no folder)."""
    d = check_target(sweep_dir, "hydra.sweep.dir", fix="choose a hydra.sweep.dir outside every run directory")
    check_owned(d, [SWEEP_RECORD], "hydra.sweep.dir", replace=True)  # a link, the user's file: refused
    earlier = d / SWEEP_RECORD
    if earlier.exists():  # dipaco's, as it wrote it (check_owned): the same sweep only
        before = _earlier_overrides(earlier)
        if before is None or sorted(before) != sorted(overrides):
            raise OwnershipError(f"hydra.sweep.dir {sweep_dir} holds another sweep ({SWEEP_RECORD}: "
                                 f"{' '.join(before or ['unreadable'])}); a sweep never rewrites another's record: "
                                 "choose a new hydra.sweep.dir")
    return d


def record_sweep(sweep_dir: str | Path) -> None:
    """Record the ``multirun.yaml`` Hydra has just written as dipaco's (from each job)."""
    d = Path(sweep_dir).expanduser().resolve()
    f = d / SWEEP_RECORD
    sweep_stale_staging(d)  # what an interrupted write of dipaco's left there
    if f.is_file() and not f.is_symlink():
        record_written(d, [SWEEP_RECORD], "hydra.sweep.dir")


class OwnSweepDir(Callback):
    """Hydra callback: :func:`check_sweep_dir` before the sweeper writes; each job records
    the ``multirun.yaml`` it finds (written by then) as dipaco's."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_sweep_dir(config.hydra.sweep.dir, [str(o) for o in config.hydra.overrides.task])
        except user_errors() as e:
            fail(str(e))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if "MULTIRUN" not in str(OmegaConf.select(config, "hydra.mode", default="")):
            return  # a single run has no sweep folder
        try:
            record_sweep(config.hydra.sweep.dir)
        except user_errors():
            pass  # changed under us since the check: left as it is, unrecorded (so never replaced)


__all__ = ["OwnSweepDir", "check_sweep_dir", "job_dirname", "record_sweep"]
