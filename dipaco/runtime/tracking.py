"""Experiment tracking: one writer persists each round's record, wherever it should go.

    metrics.jsonl          always: one JSON line per round (the record as it is)
    tb/                    ``logging.tensorboard=true``: TensorBoard event files
    W&B                    ``logging.wandb=true`` and ``wandb`` installed

A round record is the dict the rounds loop builds once per round: ``round``, ``paths``
(per path: ``loss``, ``lr``, ``tokens``…), ``modules`` (per module: ``pseudo_grad_norm``,
``cosine``, ``bytes_sent``…), ``bytes_sent``, ``compute_s``, ``wait_s``, ``sync_s`` and
``outer_lr``. :func:`round_scalars` flattens it into the named scalars TensorBoard and
W&B plot. Only the process that owns the run's outputs (rank 0, or the local process)
creates a :class:`MetricsWriter`.

TensorBoard (through ``torch.utils.tensorboard``) and W&B are wrapped here and nowhere
else.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any, Optional

from omegaconf import OmegaConf

from dipaco.config import Config
from dipaco.run.run_dir import RunDir

# summary.json keys plotted as ``summary/<key>`` at the last round
SUMMARY_SCALARS = ("routed_ppl", "dense_ppl", "ratio_vs_dense", "wrong_path_ppl", "rerouted_ppl",
                   "bytes_sent", "bytes_ratio_vs_ddp", "tokens_per_s", "sync_share", "rounds_s", "wall_s")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plotted scalars of one round record, by TensorBoard tag (non-finite left out)."""
    out: dict[str, float] = {}
    losses = []
    for p, s in sorted(record.get("paths", {}).items(), key=lambda kv: int(kv[0])):
        if _finite(s.get("loss")):
            out[f"loss/path_{p}"] = float(s["loss"])
            losses.append(float(s["loss"]))
        if _finite(s.get("lr")):
            out[f"lr/path_{p}"] = float(s["lr"])
    if losses:
        out["loss/mean"] = sum(losses) / len(losses)
    for mid, s in record.get("modules", {}).items():
        if _finite(s.get("pseudo_grad_norm")):
            out[f"pseudo_grad_norm/{mid}"] = float(s["pseudo_grad_norm"])
        if _finite(s.get("cosine")):
            out[f"cosine/{mid}"] = float(s["cosine"])
        if _finite(s.get("bytes_sent")):
            out[f"bytes_sent/{mid}"] = float(s["bytes_sent"])
    if _finite(record.get("outer_lr")):
        out["lr/outer"] = float(record["outer_lr"])
    if _finite(record.get("bytes_sent")):
        out["comm/bytes_sent"] = float(record["bytes_sent"])
    times = {k: float(record[k]) for k in ("compute_s", "wait_s", "sync_s") if _finite(record.get(k))}
    out.update({f"time/{k}": v for k, v in times.items()})
    if len(times) == 3:
        # the same share summary.json reports: exchange + outer step over the round's time
        out["time/sync_share"] = times["sync_s"] / max(sum(times.values()), 1e-9)
    return out


class MetricsWriter:
    """Persists round records and the final summary of one run (rank 0 / local only).

    Args:
        run: the run directory.
        cfg: the run's config (``logging.*`` decides the sinks; W&B gets the whole config).
        purge_from_round: on resume, the first round that is re-run: TensorBoard drops
            the events it had written from that round on (metrics.jsonl is truncated by
            the caller), so a resumed run's curves have no duplicated rounds.
    """

    def __init__(self, run: RunDir, cfg: Config, purge_from_round: Optional[int] = None) -> None:
        self.run = run
        self.tb = None
        self.wandb_run = None
        log = cfg.logging
        if log.tensorboard:
            # The import costs ~0.5 s: only the writing process pays it, never every rank.
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run.tensorboard), purge_step=purge_from_round)
        if log.wandb:
            import wandb  # optional dependency; validate_config refused the run if missing

            self.wandb_run = wandb.init(
                project=log.wandb_project, entity=log.wandb_entity, mode=log.wandb_mode,
                dir=str(run.root), config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
                # one W&B run per run directory: the rounds and the summary (written by
                # another process under torchrun, or after a resume) land in the same run
                id=hashlib.sha1(str(run.root).encode()).hexdigest()[:16], resume="allow",
            )

    def log_round(self, record: dict[str, Any]) -> None:
        """Append ``record`` to metrics.jsonl and plot its scalars at step ``record['round']``."""
        with open(self.run.metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self._scalars(round_scalars(record), int(record["round"]))

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        """The run's final numbers as ``summary/<key>`` scalars at ``step`` (the last round)."""
        scalars = {k: float(summary[k]) for k in SUMMARY_SCALARS if _finite(summary.get(k))}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(f"summary/{key}", value, global_step=step)
            self.tb.flush()
        if self.wandb_run is not None:
            # W&B's run summary, not a logged step: a step equal to the last round's
            # (from another process) would be dropped as non-increasing
            self.wandb_run.summary.update(scalars)

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, global_step=step)
            self.tb.flush()
        if self.wandb_run is not None and scalars:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close every sink (idempotent)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
