"""The record of a run is what ran: ``config.yaml`` and the settings it was written with.

Every command that writes a run's ``config.yaml`` (``dipaco-route``, a new run, a resume
that changes a key) goes through :func:`write_run_config`, which also records every key's
value, as written, under ``config`` in ``fingerprints.json``. A resume compares the
``config.yaml`` it reads with that record (:func:`hand_edits`): a key changed by hand
since is either a change a resume may make, then honoured and recorded like one given on
the command line (logged, ``resumes.jsonl``), or refused in one line naming the key, the
value the run ran with and the edited one. No edit is used without a word.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from omegaconf import OmegaConf

from dipaco.config import Config
from dipaco.storage.atomic import atomic_write_text, write_json
from dipaco.run.run_dir import RunDir, RunDirError
from dipaco.storage.strict_json import dumps_strict

FINGERPRINTS = "fingerprints.json"  # the same file as dipaco.run.fingerprint's
CONFIG_RECORD = "config"
# Not settings of the run (the flag and the folder it is read from).
_NOT_SETTINGS = ("resume", "run_dir")


def flat_config(cfg: Config) -> dict[str, Any]:
    """``{"trainer.rounds": 16, "grid.levels": [2, 2], ...}`` for every leaf of ``cfg``."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            out[prefix] = node

    walk(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True, enum_to_str=True), "")
    return out


def _flat(cfg: Config) -> dict[str, Any]:
    """:func:`flat_config` with each value as JSON would hold it (lists, not tuples)."""
    return json.loads(dumps_strict(flat_config(cfg), default=str))


def write_run_config(run: RunDir, cfg: Config) -> None:
    """Write ``config.yaml`` (atomically) and record what it says in ``fingerprints.json``."""
    path = run.root / FINGERPRINTS
    try:
        saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except ValueError as e:
        raise RunDirError(f"corrupt {path}: {e}; start a new run directory") from None
    atomic_write_text(run.config, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    saved[CONFIG_RECORD] = {k: v for k, v in _flat(cfg).items() if k not in _NOT_SETTINGS}
    write_json(path, saved)


def hand_edits(run: RunDir, saved: Config, log: Callable[[str], None] = lambda _m: None) -> dict[str, list[Any]]:
    """``{key: [value it ran with, value config.yaml now says]}`` for every key edited by
    hand since the run wrote ``config.yaml`` (``saved``: what it says now).

    A run written by a dipaco from before this record has none: its ``config.yaml`` is
    then taken as what ran (logged), and the keys its artefacts were made from are still
    checked against their own records (:func:`dipaco.run.fingerprint.preflight_resume`);
    a missing ``fingerprints.json`` is refused there."""
    path = run.root / FINGERPRINTS
    try:
        record = json.loads(path.read_text(encoding="utf-8")).get(CONFIG_RECORD)
    except (OSError, ValueError, AttributeError):
        return {}  # missing or corrupt: refused, naming it, where the artefacts are checked
    if not isinstance(record, dict):
        log(f"{path} records no config (a run from an older dipaco): {run.config} is taken as what ran")
        return {}
    now = {k: v for k, v in _flat(saved).items() if k not in _NOT_SETTINGS}
    # a key the record lacks was not a setting of the dipaco that ran (a newer schema adds it
    # at its default): nobody edited it, so only the recorded keys can have been edited
    return {k: [v, now.get(k)] for k, v in sorted(record.items()) if v != now.get(k)}


__all__ = ["CONFIG_RECORD", "hand_edits", "write_run_config"]
