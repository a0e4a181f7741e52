"""A run's own identity, which moves with its directory: the ``run_uid`` file and the W&B
run it names (id, name, group, tags).

Kept apart from :mod:`dipaco.runtime.tracking` (which wraps TensorBoard and W&B themselves):
these are plain functions of the run directory and the config, importing neither library.
"""
from __future__ import annotations

import uuid
from typing import Any

from omegaconf import OmegaConf

from dipaco.config import Config
from dipaco.storage.atomic import atomic_write_text
from dipaco.run.run_dir import RunDir

__all__ = ["RUN_UID", "run_uid", "wandb_settings"]


RUN_UID = "run_uid"


def run_uid(run: RunDir) -> str:
    """The run's own id (``RUN/run_uid``, made once): it moves with the run directory, so
    the W&B run id made from it does too (a resume after a move continues the same W&B run)."""
    path = run.root / RUN_UID
    try:
        uid = path.read_text(encoding="ascii").strip()
        if len(uid) == 16 and all(c in "0123456789abcdef" for c in uid):
            return uid
    except (OSError, UnicodeDecodeError):
        pass
    uid = uuid.uuid4().hex[:16]
    atomic_write_text(path, uid + "\n")
    return uid


def wandb_settings(run: RunDir, cfg: Config) -> dict[str, Any]:
    """``wandb.init``'s arguments for ``run``: id from :func:`run_uid`, name (default: the run
    directory's name), group (default: the sweep folder's name for a sweep's run), tags."""
    log_cfg = cfg.logging
    in_sweep = (run.root.parent / "multirun.yaml").is_file()
    return dict(project=log_cfg.wandb_project, entity=log_cfg.wandb_entity, mode=log_cfg.wandb_mode,
                dir=str(run.root), config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
                id=run_uid(run), resume="allow",  # one W&B run per run: a resumed run continues it
                name=log_cfg.run_name or run.root.name,
                group=log_cfg.wandb_group or (run.root.parent.name if in_sweep else None),
                tags=list(log_cfg.tags) or None)
