"""Experiment tracking: ONE writer persists the run's records, wherever they should go.

    metrics.jsonl          always: one JSON line per round record (the record as it is)
    steps.jsonl            always: one JSON line per step record
    tb/                    ``logging.tensorboard=true``: TensorBoard event files
    W&B                    ``logging.wandb=true`` and ``wandb`` installed (one run per job)
    train.log              one DEBUG line per logged step (dipaco/runtime/progress.py)

Two kinds of record (docs/metrics.md says what each value means):

* a **round record**, built once per round (per phase in decoupled mode): ``round``,
  ``step``, ``paths`` (per path: ``loss``, ``lr``, ``tokens``, ``val_sample_loss``…),
  ``modules`` (per module: ``pseudo_grad_norm``, ``cosine``, ``bytes_sent``…),
  ``bytes_sent``, ``compute_s``, ``wait_s``, ``sync_s``, ``outer_lr``;
* a **step record**, ``"kind": "step"``: one path's logging interval (every
  ``logging.every_steps`` inner steps, :mod:`dipaco.rounds.health`). Its own file, so
  that metrics.jsonl stays one line per round for everything that reads it.

Every scalar is plotted against the path's inner step count (round ``r`` ends at step
``r·H``): :func:`step_scalars` names the per-step ones as torchtitan does
(``loss_metrics/global_avg_loss``, ``grad_norm``, ``lr``, ``throughput(tps)``, ``mfu(%)``,
``memory/…``), :func:`round_scalars` the per-round ones.

One writer per job process (:meth:`MetricsWriter.shared`): the job opens it, and the
rounds, decoupled mode and the summary write through it, so W&B is initialised once. A
rank spawned on this host (``launcher=spawn``) writes its own metrics.jsonl lines and
TensorBoard events but no W&B run; the job's process follows those files while the ranks
train and sends each new record to W&B through its writer
(:class:`dipaco.runtime.record_tail.RecordTail`). TensorBoard (through
``torch.utils.tensorboard``) and W&B are wrapped here and nowhere else.
"""
from __future__ import annotations

import contextlib
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator, Optional


from dipaco.config import Config
from dipaco.storage.atomic import atomic_write_text
from dipaco.storage.jsonl import append_json_lines
from dipaco.run.run_dir import RunDir
from dipaco.runtime.progress import log
from dipaco.runtime.run_identity import RUN_UID, run_uid, wandb_settings

__all__ = ["MetricsWriter", "RUN_UID", "SUMMARY_SCALARS", "round_scalars", "run_uid", "step_scalars",
           "wandb_settings", "writer_for"]

# summary.json keys plotted as ``summary/<key>`` at the last round
SUMMARY_SCALARS = ("routed_ppl", "dense_ppl", "ratio_vs_dense", "wrong_path_ppl", "rerouted_ppl",
                   "bytes_sent", "bytes_ratio_vs_ddp", "tokens_per_s", "sync_share", "rounds_s", "wall_s")
GIB = 2.0**30
# step record memory key → tag (CUDA allocator peaks, the host's resident set)
MEMORY_TAGS = {"max_active_bytes": "memory/max_active(GiB)", "max_reserved_bytes": "memory/max_reserved(GiB)",
               "rss_bytes": "memory/rss(GiB)", "max_rss_bytes": "memory/max_rss(GiB)"}
# (memory key, total key, tag): the same peaks as a share of the memory they live in
SHARE_TAGS = (("max_active_bytes", "device_total_bytes", "memory/max_active(%)"),
              ("max_reserved_bytes", "device_total_bytes", "memory/max_reserved(%)"),
              ("max_rss_bytes", "host_total_bytes", "memory/max_rss(%)"))


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The plotted scalars of one round record, by TensorBoard tag (non-finite left out)."""
    out: dict[str, float] = {}
    losses, val = [], []
    for p, s in sorted(record.get("paths", {}).items(), key=lambda kv: int(kv[0])):
        if _finite(s.get("loss")):
            out[f"loss/path_{p}"] = float(s["loss"])
            losses.append(float(s["loss"]))
        if _finite(s.get("lr")):
            out[f"lr/path_{p}"] = float(s["lr"])
        if _finite(s.get("val_sample_loss")):
            out[f"validation_metrics/path_{p}"] = float(s["val_sample_loss"])
            val.append((float(s["val_sample_loss"]), int(s.get("val_sample_tokens") or 1)))
    if losses:
        out["loss/mean"] = sum(losses) / len(losses)
    if val:  # the sample's mean loss over every scored token
        out["validation_metrics/loss"] = sum(v * n for v, n in val) / sum(n for _, n in val)
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


def step_scalars(records: list[dict[str, Any]]) -> dict[str, float]:
    """The plotted scalars of one step's records (one per path), by tag.

    Across paths: ``loss_metrics/global_avg_loss`` (token-weighted mean of the paths'
    interval losses), ``loss_metrics/global_max_loss`` (the largest step loss of any
    path), ``grad_norm``, ``throughput(tps)``, ``tflops``, ``mfu(%)``,
    ``time_metrics/end_to_end(s)`` (seconds per inner step; means over paths),
    ``time_metrics/data_loading(s)`` / ``(%)`` (the host's wait for each step's batch),
    the memory peaks as shares of the device's (host's) memory (``memory/max_reserved(%)``),
    ``lr``, ``skipped_steps`` (sum) and the memory peaks (largest). Per path:
    ``loss_metrics/path_<p>``, ``grad_norm/path_<p>``, ``throughput(tps)/path_<p>`` and
    ``mfu(%)/path_<p>``.
    """
    out: dict[str, float] = {}
    weighted, maxes, norms, tps, tflops, mfu, step_s, data_s, data_pct = [], [], [], [], [], [], [], [], []
    memory: dict[str, float] = {}
    for r in sorted(records, key=lambda x: int(x["path"])):
        p = r["path"]
        if _finite(r.get("loss")):
            out[f"loss_metrics/path_{p}"] = float(r["loss"])
            weighted.append((float(r["loss"]), max(1, int(r.get("tokens") or 0))))
        if _finite(r.get("loss_max")):
            maxes.append(float(r["loss_max"]))
        if _finite(r.get("grad_norm")):
            out[f"grad_norm/path_{p}"] = float(r["grad_norm"])
            norms.append(float(r["grad_norm"]))
        if _finite(r.get("tokens_per_s")):
            out[f"throughput(tps)/path_{p}"] = float(r["tokens_per_s"])
            tps.append(float(r["tokens_per_s"]))
        if _finite(r.get("tflops")):
            tflops.append(float(r["tflops"]))
        if _finite(r.get("seconds")) and r.get("steps"):
            step_s.append(float(r["seconds"]) / int(r["steps"]))
            if _finite(r.get("data_s")):  # torchtitan's data-loading time, per step and as a share
                data_s.append(float(r["data_s"]) / int(r["steps"]))
                if r["seconds"] > 0:
                    data_pct.append(100.0 * float(r["data_s"]) / float(r["seconds"]))
        if _finite(r.get("mfu_pct")):
            out[f"mfu(%)/path_{p}"] = float(r["mfu_pct"])
            mfu.append(float(r["mfu_pct"]))
        mem = r.get("memory") or {}
        for key, value in mem.items():
            if key in MEMORY_TAGS and _finite(value):
                memory[MEMORY_TAGS[key]] = max(memory.get(MEMORY_TAGS[key], 0.0), value / GIB)
        for key, total, tag in SHARE_TAGS:  # memory as a share of the device (host) it lives on
            if _finite(mem.get(key)) and _finite(mem.get(total)) and mem[total] > 0:
                memory[tag] = max(memory.get(tag, 0.0), 100.0 * mem[key] / mem[total])
    if weighted:
        out["loss_metrics/global_avg_loss"] = sum(v * n for v, n in weighted) / sum(n for _, n in weighted)
    for tag, values, fn in (("loss_metrics/global_max_loss", maxes, max), ("grad_norm", norms, _mean),
                            ("throughput(tps)", tps, _mean), ("tflops", tflops, _mean), ("mfu(%)", mfu, _mean),
                            ("time_metrics/end_to_end(s)", step_s, _mean),
                            ("time_metrics/data_loading(s)", data_s, _mean),
                            ("time_metrics/data_loading(%)", data_pct, _mean)):
        if values:
            out[tag] = float(fn(values))
    lrs = [float(r["lr"]) for r in records if _finite(r.get("lr"))]
    if lrs:
        out["lr"] = lrs[0]  # one schedule: every path has the same lr at a given step
    out["skipped_steps"] = float(sum(int(r.get("skipped_steps") or 0) for r in records))
    out.update(memory)
    return out


def _health_line(step: int, s: dict[str, float]) -> str:
    """One train.log line for a logged step (what a practitioner greps for)."""
    def num(tag: str, fmt: str) -> str:
        return format(s[tag], fmt) if tag in s else "-"

    mem = next((s[t] for t in ("memory/max_reserved(GiB)", "memory/rss(GiB)", "memory/max_rss(GiB)") if t in s), None)
    return (f"step {step}: loss {num('loss_metrics/global_avg_loss', '.4f')} (max "
            f"{num('loss_metrics/global_max_loss', '.4f')}), grad norm {num('grad_norm', '.4g')}, "
            f"lr {num('lr', '.3g')}, {num('throughput(tps)', ',.0f')} tokens/s, "
            f"{'' if 'mfu(%)' not in s else format(s['mfu(%)'], '.2f') + '% MFU, '}"
            f"memory {'-' if mem is None else f'{mem:.3f}'} GiB, skipped {int(s.get('skipped_steps', 0))}")


def nonfinite_line(record: dict[str, Any]) -> Optional[str]:
    """The line that says a round's loss became infinite (or NaN): its paths with skipped
    inner steps (a non-finite loss or gradient: the step is not applied) or a non-finite
    mean loss. ``None`` when every path's loss stayed finite."""
    bad = []
    for p, v in sorted((record.get("paths") or {}).items(), key=lambda kv: int(kv[0])):
        skipped, loss = int(v.get("skipped_steps") or 0), v.get("loss")
        if skipped or (loss is not None and not _finite(loss)):
            bad.append(f"path {p} ({skipped} step(s) skipped, loss {loss})")
    if not bad:
        return None
    return (f"round {record.get('round')}: the loss became non-finite (inf or NaN) on {', '.join(bad)}; "
            "those steps were not applied. If it goes on, lower trainer.lr or diloco.outer.lr, or keep "
            "trainer.grad_clip > 0")


class MetricsWriter:
    """Persists the records and the final summary of one run (the job's process, or a
    spawned rank 0 without W&B).

    Args:
        run: the run directory.
        cfg: the run's config (``logging.*`` decides the sinks; W&B gets the whole config;
            ``diloco.inner_steps`` places round ``r`` at step ``r·H``).
        wandb: send to W&B (default: ``logging.wandb``); a spawned rank says False.
        shared: register as this process's writer of ``run`` until closed
            (:meth:`shared`): the job's writer, which the rounds and the summary reuse.
    """

    _open: dict[Path, "MetricsWriter"] = {}

    def __init__(self, run: RunDir, cfg: Config, wandb: Optional[bool] = None, shared: bool = False) -> None:
        self.run, self.cfg = run, cfg
        self.inner_steps = int(cfg.diloco.inner_steps)
        self.tb = None
        self._purge_step: Optional[int] = None
        self.wandb_run = None
        self.shared_as = run.root if shared else None
        log_cfg = cfg.logging
        if log_cfg.wandb if wandb is None else wandb:
            import wandb as wandb_module  # optional dependency; validate_config refused the run if missing

            self.wandb_run = wandb_module.init(**wandb_settings(run, cfg))
        if shared:
            MetricsWriter._open[run.root] = self

    @classmethod
    def shared(cls, run: RunDir) -> Optional["MetricsWriter"]:
        """The writer this process's job opened for ``run`` (None: none is open)."""
        return cls._open.get(run.root)

    def rewind(self, rounds: int) -> None:
        """A resume from the checkpoint of round ``rounds``: the records of later rounds
        go (they are trained again) from metrics.jsonl and steps.jsonl, and TensorBoard
        drops its events past step ``rounds·H`` (a purge step: no duplicated steps)."""
        for path in (self.run.metrics, self.run.steps):
            if path.exists():
                lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
                kept = [x for x in lines if json.loads(x).get("round", 0) <= rounds]
                if len(kept) != len(lines):
                    atomic_write_text(path, "".join(x + "\n" for x in kept))
        if self.tb is not None:  # reopened with the purge step at the next write
            self.tb.close()
            self.tb = None
        self._purge_step = rounds * self.inner_steps + 1

    def _tensorboard(self) -> Any:
        if self.tb is None and self.cfg.logging.tensorboard:
            # The import costs ~0.5 s: only a writing process pays it, never every rank.
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run.tensorboard), purge_step=self._purge_step)
            self._purge_step = None
        return self.tb

    @staticmethod
    def _append(path: Path, records: list[dict[str, Any]]) -> None:
        append_json_lines(path, records)

    def log_steps(self, records: list[dict[str, Any]]) -> None:
        """Append step records (:mod:`dipaco.rounds.health`) and plot each step's scalars."""
        if not records:
            return
        self._append(self.run.steps, records)
        by_step: dict[int, list[dict]] = defaultdict(list)
        for r in records:
            by_step[int(r["step"])].append(r)
        for step in sorted(by_step):
            scalars = step_scalars(by_step[step])
            self._scalars(scalars, step)
            log.debug(_health_line(step, scalars))

    def log_curve(self, name: str, intervals: list[dict[str, Any]], offset: int = 0) -> None:
        """A dense model's per-step intervals (the warm-up's, the dense baseline's) on the
        paths' board: ``loss_metrics/<name>``, ``grad_norm/<name>``, ``throughput(tps)/<name>``
        at step ``interval step + offset`` (the warm-up ends at step 0, where the paths start).
        TensorBoard only: W&B takes one rising step per run, which the paths' steps use."""
        tb = self._tensorboard() if intervals else None
        if tb is None:
            return
        for iv in intervals:
            step = int(iv["step"]) + offset
            secs = iv.get("seconds") or 0.0
            for tag, value in ((f"loss_metrics/{name}", iv.get("loss")), (f"grad_norm/{name}", iv.get("grad_norm")),
                               (f"throughput(tps)/{name}", iv["tokens"] / secs if secs > 0 else None)):
                if _finite(value):
                    tb.add_scalar(tag, float(value), global_step=step)
        tb.flush()

    def round_step(self, record: dict[str, Any]) -> int:
        """The step a round record is plotted at: its ``step``, or ``round·H``."""
        return int(record.get("step") or int(record["round"]) * self.inner_steps)

    def log_round(self, record: dict[str, Any]) -> None:
        """Append ``record`` to metrics.jsonl and plot its scalars at its round's last step."""
        self._append(self.run.metrics, [record])
        self._scalars(round_scalars(record), self.round_step(record))
        line = nonfinite_line(record)
        if line:
            log.warning(line)

    def log_summary(self, summary: dict[str, Any], step: int) -> None:
        """The run's final numbers as ``summary/<key>`` scalars at ``step`` (the last round's)."""
        scalars = {k: float(summary[k]) for k in SUMMARY_SCALARS if _finite(summary.get(k))}
        tb = self._tensorboard()
        if tb is not None:
            for key, value in scalars.items():
                tb.add_scalar(f"summary/{key}", value, global_step=step)
            tb.flush()
        if self.wandb_run is not None:
            # W&B's run summary, not a logged step: the last step was logged already
            self.wandb_run.summary.update(scalars)

    def send_to_wandb(self, scalars: dict[str, float], step: int) -> None:
        """Log ``scalars`` at ``step`` to this writer's W&B run only (what a spawned rank 0
        wrote to the files already: :class:`dipaco.runtime.record_tail.RecordTail`)."""
        if self.wandb_run is not None and scalars:
            self.wandb_run.log(scalars, step=step)

    def mirror_to_wandb(self, after_round: int) -> None:
        """Send the records of rounds past ``after_round`` to W&B: what a spawned rank 0
        wrote (to metrics.jsonl, steps.jsonl and TensorBoard only), each round's steps
        before its round record, as the rounds logged them."""
        if self.wandb_run is None:
            return
        steps: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
        for rec in self.run.records(steps=True):
            steps[int(rec["round"])][int(rec["step"])].append(rec)
        for rec in self.run.records():
            if int(rec.get("round", 0)) <= after_round:
                continue
            for step, recs in sorted(steps.get(int(rec["round"]), {}).items()):
                self.wandb_run.log(step_scalars(recs), step=step)
            self.wandb_run.log(round_scalars(rec), step=self.round_step(rec))

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        tb = self._tensorboard()
        if tb is not None:
            for tag, value in scalars.items():
                tb.add_scalar(tag, value, global_step=step)
            tb.flush()
        if self.wandb_run is not None and scalars:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close every sink (idempotent); a shared writer is no longer shared."""
        if self.shared_as is not None and MetricsWriter._open.get(self.shared_as) is self:
            del MetricsWriter._open[self.shared_as]
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


@contextlib.contextmanager
def writer_for(run: RunDir, cfg: Config) -> Iterator[MetricsWriter]:
    """The job's writer of ``run`` when this process opened one (left open), else a
    writer of its own for the block (a direct call, a test)."""
    shared = MetricsWriter.shared(run)
    if shared is not None:
        yield shared
        return
    with MetricsWriter(run, cfg) as writer:
        yield writer
