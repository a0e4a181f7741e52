"""The layout of a run directory, in one place, and loading a finished run back.

Every file a run writes is named here; the job (``train(cfg)``), ``dipaco-route`` and
``dipaco-infer`` all go through :class:`RunDir`, so the layout cannot drift.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from omegaconf import OmegaConf

from dipaco.run.checkpoint import CheckpointManager
from dipaco.run.results import RoundsResult
from dipaco.config import to_config


# Every name dipaco writes at the top of a run directory (the properties below, and the
# files other modules add: locks, resumes, Hydra's record, decoupled mode, the early
# stopping shards, an old Hydra log). A fresh run refuses a directory holding anything else.
RUN_LAYOUT = frozenset({
    "config.yaml", "tokenizer.json", "router", "shards", "routing_report.json", "warmup", "val_shards",
    "checkpoints", "metrics.jsonl", "tb", "baseline", "summary.json", "plots", "cache", "fingerprints.json",
    "resumes.jsonl", ".dipaco.lock", ".hydra", "decoupled", "decoupled_metrics.json", "train.log", "route.log",
    "report.md", "report.json", "report.png", "steps.jsonl", "wandb", "membership.jsonl",
    "provenance.jsonl", ".dipaco-owned.json", "run_uid",
})


class RunDirError(ValueError):
    """A run directory that is missing, incomplete or corrupt (message names the file)."""


class RunStopped(RuntimeError):
    """The run stopped for a reason outside its config (a signal, a full disk); the
    message names the last complete checkpoint and the resume command. Exit code 1."""


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

    @property
    def val_shards(self) -> Path:
        """Validation documents by routed path (trainer.path_early_stopping)."""
        return self.root / "val_shards"

    # written by the ranks
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def best_paths(self) -> Path:
        """Each path's weights with its best validation loss (dipaco/rounds/early_stopping.py)."""
        return self.checkpoints / "best_paths"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def membership(self) -> Path:
        """One line per start of the ranks of an elastic launch (dipaco/runtime/elastic.py)."""
        return self.root / "membership.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def steps(self) -> Path:
        """Per-step health records, one per path and logging interval (docs/metrics.md)."""
        return self.root / "steps.jsonl"

    def records(self, steps: bool = False) -> list[dict[str, Any]]:
        """The records of ``metrics.jsonl`` (one per round, or per phase in decoupled
        mode) or, with ``steps``, of ``steps.jsonl``; empty when the file is missing."""
        path = self.steps if steps else self.metrics
        if not path.is_file():
            return []
        return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]

    @property
    def log_file(self) -> Path:
        """The run's messages (the ``dipaco`` logger), where Hydra names its job log."""
        return self.root / "train.log"

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


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    # safetensors reports its Rust io::Error as text
    text = str(e)
    return type(e).__name__ == "SafetensorError" and ("No space left" in text or "StorageFull" in text)


@contextlib.contextmanager
def disk_full_guard(run: "RunDir") -> Iterator[None]:
    """A full disk (ENOSPC, also inside safetensors) becomes one line naming what was
    being written, the last complete checkpoint and the resume command."""
    try:
        yield
    except Exception as e:
        if not _is_disk_full(e):
            raise
        what = getattr(e, "filename", None) or "a file in the run directory"
        try:
            last = str(run.latest_checkpoint())
        except (RunDirError, OSError):
            last = "none yet"
        raise RunStopped(f"disk full while writing {what}; last complete checkpoint: {last}; free space, "
                         f"then continue with: dipaco-train hydra.run.dir={run.root} resume=true") from None


def prior_totals(run: "RunDir", result: RoundsResult, rounds_s: float,
                 timed_from: Optional[int] = None) -> tuple[RoundsResult, float]:
    """``result`` of a resumed launch plus the rounds before it, from ``metrics.jsonl``.

    On resume the ranks cut ``metrics.jsonl`` to the checkpoint's round before re-running
    later rounds, so its lines up to ``start_round`` are exactly the rounds this launch
    did not train. Returns the whole run's result (``start_round`` 0, counted from the
    first round) and rounds time (summed over launches). Rounds missing from the file
    are counted in ``totals_missing_rounds``. ``timed_from``: ``rounds_s`` already holds
    the time of the rounds after it (an elastic launch that restarted its ranks from a
    later round), so only rounds up to it add their time.
    """
    start = int(result.start_round)
    before = [x for x in run.records() if 0 < int(x.get("round", 0)) <= start]
    out = dataclasses.replace(
        result, start_round=0, resumed_from_round=start,
        # metrics.jsonl deleted or edited by hand: say so, do not guess
        totals_missing_rounds=start - len(before),
        bytes_sent=result.bytes_sent + sum(x.get("bytes_sent", 0) for x in before),
        compute_s=result.compute_s + sum(x.get("compute_s", 0) for x in before),
        wait_s=result.wait_s + sum(x.get("wait_s", 0) for x in before),
        sync_s=result.sync_s + sum(x.get("sync_s", 0) for x in before),
        tokens=result.tokens + sum(
            x["tokens"] if "tokens" in x else sum(p["tokens"] for p in x["paths"].values()) for x in before))
    timed = [x for x in before if timed_from is None or int(x["round"]) <= timed_from]
    return out, rounds_s + sum(x.get("compute_s", 0) + x.get("wait_s", 0) + x.get("sync_s", 0) for x in timed)


def bytes_totals(run: "RunDir", rounds: int, ddp_per_round: int) -> tuple[int, int]:
    """``(bytes sent, DDP-equivalent bytes)`` of rounds 1..``rounds``, each the sum of every
    round's own record in ``metrics.jsonl``: a run resumed under another launcher, or whose
    worker groups changed (elastic), counts each round on the topology that trained it.
    A record written before rounds recorded their DDP bytes counts ``ddp_per_round``."""
    sent = ddp = 0
    for x in run.records():
        if 0 < int(x.get("round", 0)) <= rounds:
            sent += int(x.get("bytes_sent", 0))
            ddp += int(x.get("ddp_bytes_equivalent", ddp_per_round))
    return sent, ddp
