"""Every mode of one job on one cluster: :func:`simulate`, its table, JSON and plot."""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dipaco.config import Config
from dipaco.run.owned import write_owned_file
from dipaco.storage.strict_json import dumps_strict
from dipaco.sim.cost import check_cost
from dipaco.sim.job import SimJob, sim_job
from dipaco.sim.modes import MODES, make_mode
from dipaco.sim.tally import ModeResult

__all__ = ["MODES", "SimReport", "simulate", "simulate_job"]


@dataclass(frozen=True)
class SimReport:
    """The job's numbers and one :class:`ModeResult` per mode."""

    job: SimJob
    results: tuple[ModeResult, ...]

    def to_dict(self) -> dict[str, Any]:
        j, c = self.job, self.job.cluster
        return {"cluster": dict(c.__dict__), "job": {
            "paths": j.paths, "groups": j.groups, "chips": j.chips, "chips_per_group": j.chips_per_group,
            "inner_steps": j.inner_steps, "step_s": j.step_s, "rounds": j.rounds, "workers": j.workers,
            "path_params": j.path_params, "rank_bytes_per_round": j.rank_bytes()},
            "modes": {r.mode: r.to_dict() for r in self.results}}

    def format(self) -> str:
        j, c = self.job, self.job.cluster
        mtbf = "no failures" if c.mtbf_hours is None else f"chip MTBF {c.mtbf_hours:g} h"
        head = (f"simulated: {j.chips:,} chips in {j.groups:,} worker groups of {j.chips_per_group}, {j.paths} paths, "
                f"inner step {j.step_s:.4g} s, H={j.inner_steps}, link {c.link_gbps:g} Gbit/s ({c.link_scope}), "
                f"{mtbf}, straggler {c.straggler}, seed {c.seed}")
        cols = ("wall/round s", "exposed s", "exposed %", "bytes/round", "goodput", "steps lost", "failures",
                "to tokens h")
        lines = [head, f"{'mode':<11}" + "".join(f"{x:>17}" for x in cols), "-" * (11 + 17 * len(cols))]
        for r in self.results:
            tt = "-" if r.time_to_tokens_s is None else f"{r.time_to_tokens_s / 3600:.4g}"
            vals = (f"{r.wall_per_round_s:.4g}", f"{r.exposed_per_round_s:.4g}", f"{100 * r.exposed_share:.1f}",
                    f"{r.bytes_per_round:,.0f}", f"{r.goodput:.3f}", f"{r.steps_lost:,.0f}", f"{r.failures:,}", tt)
            lines.append(f"{r.mode:<11}" + "".join(f"{v:>17}" for v in vals))
        return "\n".join(lines)

    def write_json(self, path: str) -> None:
        """The :meth:`to_dict` numbers as strict JSON, by the rule of a command's output file
        (dipaco/run/owned.py: atomic, never through a link nor over a file dipaco did not write)."""
        write_owned_file(path, dumps_strict(self.to_dict(), indent=1, default=str) + "\n", "dipaco-plan --json")

    def plot(self, path: str) -> None:
        """Goodput and wall-time split (compute vs exposed communication) per mode."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        modes = [r.mode for r in self.results]
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
        a.bar(modes, [r.goodput for r in self.results], color="tab:green")
        a.set_ylim(0, 1)
        a.set_title("goodput")
        exposed = [r.exposed_per_round_s for r in self.results]
        rest = [r.wall_per_round_s - e for r, e in zip(self.results, exposed)]
        b.bar(modes, rest, label="compute and waits")
        b.bar(modes, exposed, bottom=rest, label="exposed communication")
        b.set_title("wall per round (s)")
        b.legend(fontsize=7)
        fig.tight_layout()
        fmt = Path(path).suffix.lstrip(".").lower() or "png"
        buf = io.BytesIO()
        fig.savefig(buf, dpi=90, format=fmt)
        plt.close(fig)
        write_owned_file(path, buf.getvalue(), "dipaco-plan --plot")


def simulate_job(job: SimJob, modes: Sequence[str] = tuple(MODES)) -> SimReport:
    """Simulate ``modes`` of ``job`` (horizon: ``cluster.horizon_hours``)."""
    out = [mode.simulate(mode.horizon_s()) for mode in (make_mode(m, job) for m in modes)]
    return SimReport(job, tuple(out))


def simulate(cfg: Config, modes: Sequence[str] = tuple(MODES)) -> SimReport:
    """``dipaco-plan --simulate``: every mode of validated ``cfg`` on ``cfg.cluster``."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}: choose from {list(MODES)}")
    job = sim_job(cfg)
    check_cost(job, modes)  # refuse in one line what would run for hours
    return simulate_job(job, modes)
