"""The layout of a run directory, in one place, and loading a finished run back.

Every file a run writes is named here; the job (``train(cfg)``), ``dipaco-route`` and
``dipaco-infer`` all go through :class:`RunDir`, so the layout cannot drift.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from dipaco.checkpoint import CheckpointManager
from dipaco.config import to_config


class RunDirError(ValueError):
    """A run directory that is missing, incomplete or corrupt (message names the file)."""


@dataclass(frozen=True)
class RunDir:
    """Named paths inside one run directory."""

    root: Path

    @classmethod
    def at(cls, path: str | Path) -> "RunDir":
        return cls(Path(path).expanduser().resolve())

    # written by the preparation phase (launching process)
    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer.json"

    @property
    def router(self) -> Path:
        return self.root / "router"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def routing_report(self) -> Path:
        return self.root / "routing_report.json"

    @property
    def warmup(self) -> Path:
        return self.root / "warmup"

    # written by the ranks
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    # written after training (launching process)
    @property
    def baseline(self) -> Path:
        return self.root / "baseline"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def require(self, path: Path, what: str) -> Path:
        """Return ``path`` or raise :class:`RunDirError` naming it."""
        if not self.root.is_dir():
            raise RunDirError(f"run directory {self.root} does not exist")
        if not path.exists():
            raise RunDirError(f"{what} missing: {path} (is {self.root} a finished dipaco-train run?)")
        return path

    def load_config(self) -> Any:
        """The resolved config the run was made with (typed :class:`dipaco.config.Config`)."""
        self.require(self.config, "resolved config")
        try:
            return to_config(OmegaConf.load(self.config))
        except Exception as e:  # a hand-edited or truncated YAML
            raise RunDirError(f"unreadable config {self.config}: {e}") from None

    def read_json(self, path: Path) -> Any:
        self.require(path, path.name)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise RunDirError(f"corrupt JSON file {path}: {e}") from None

    def latest_checkpoint(self, log: Optional[callable] = None) -> Path:
        """Newest checkpoint whose manifest checks out, or :class:`RunDirError`."""
        mgr = CheckpointManager(self.require(self.checkpoints, "checkpoints folder"))
        ckpt = mgr.latest_valid(log=log)
        if ckpt is None:
            raise RunDirError(f"no valid checkpoint under {self.checkpoints}")
        return ckpt
