"""Training on a directory that holds prepared artefacts but no training yet.

``dipaco-route ... hydra.run.dir=D`` writes a config, a tokenizer, a router, shards (and
the dense warm-up where the config asks for one); ``dipaco-train hydra.run.dir=D`` then
continues from what D holds. No command overwrites what a run directory holds, so this
is a continuation, not a fresh run: the saved ``config.yaml`` is the config, and the
command line may change only keys that none of the recorded artefacts was made from
(the training schedule, DiLoCo, the launcher; not the data, tokenizer, router, grid or
seed). A change of such a key is refused in one line, before anything is written; the
artefacts themselves are then checked against ``fingerprints.json`` like a resume's.

The same holds for a directory whose first training launch stopped before its first
checkpoint: what it prepared is kept, not rebuilt.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from dipaco.config import Config
from dipaco.run.fingerprint import artefact_depends, held_artefacts, preflight_resume, read_fingerprints
from dipaco.run.resume import allowed_on_resume, check_fresh, resume_config
from dipaco.run.run_dir import RunDir


def holds_prepared_run(run: RunDir) -> bool:
    """Whether ``run`` holds a config and prepared artefacts (tokenizer, router, shards,
    warm-up) but no checkpoint: a routed directory for training to continue from.
    :class:`RunDirError` where it holds artefacts but no ``fingerprints.json``."""
    held = held_artefacts(run)
    if not held:
        return False
    read_fingerprints(run)  # artefacts without the record of what made them: refused, never a pass
    return run.config.is_file() and "checkpoints/" not in held


def routed_config(given: Config, run: RunDir, overrides: Optional[list[str]],
                  log: Callable[[str], None] = lambda _msg: None) -> tuple[Config, dict[str, list[Any]]]:
    """The config to train ``run`` with (its own, with the command line's allowed
    changes) and those changes; :class:`~dipaco.config.ConfigError` for a key that one of
    the recorded artefacts was made from. Reads only: a refusal leaves ``run`` as it was."""
    # what the directory's artefacts were made from (a missing record is refused there);
    # the checkpoints' record is the config the preparing command would have trained
    # with: nothing was trained yet, so it binds nothing
    recorded = [a for a in read_fingerprints(run) if a != "checkpoints"]

    def may_change(key: str) -> bool:
        return allowed_on_resume(key) or not any(artefact_depends(key, a) for a in recorded)

    if not given.resume:
        check_fresh(run)  # nothing in it that dipaco did not write
    cfg, changes = resume_config(given, run, overrides, may_change=may_change, trained=False, log=log)
    preflight_resume(run, cfg)
    log(f"{run.root} holds a routed run (no checkpoint yet): training continues from its config.yaml and "
        "artefacts" + (f", changing {', '.join(changes)}" if changes else ""))
    return cfg, changes


__all__ = ["holds_prepared_run", "routed_config"]
