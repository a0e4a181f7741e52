"""``dipaco-plan [overrides]``: print the communication and memory plan of a config.

Per module: the paths that share it, the worker groups that hold it, its parameters and
the bytes it sends per round with the configured codec; and the bytes a data-parallel
(DDP) run of one path's model over the same ranks would send in the same H steps.
With ``diloco.streaming=true``, each fragment's launch and landing step and the peak
bytes a path has in flight (:mod:`dipaco.plan.stagger`). Then each rank's parameter, gradient, optimiser and activation memory
(:mod:`dipaco.plan.memory`).
Takes the same overrides as ``dipaco-train``, so a plan can be read before launching::

    dipaco-plan grid=4x4 diloco.codec=int8 diloco.inner_steps=100

``--simulate`` puts the run on a described cluster (``cluster=...`` and ``cluster.*``:
chips, failures, stragglers, links) and prints, per sync mode (sync, elastic,
streaming, decoupled, DDP of one path), the simulated wall time per round, exposed
communication, bytes, goodput, steps lost to failures and time to the run's tokens
(:mod:`dipaco.sim`, docs/planning.md); ``--json FILE`` and ``--plot FILE`` write them
(an earlier one of its own is replaced with ``--force``, a file dipaco did not write never)::

    dipaco-plan --simulate experiment=paper cluster=paper_1m --json sim.json --plot sim.png
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from dipaco.plan.build import build_comm_plan, build_grid, build_topology, format_streaming_plan
from dipaco.cli.errors import fail, report_user_errors
from dipaco.cli.help import plain
from dipaco.plan.comm_plan import CommPlan, format_plan
from dipaco.config import Config, ConfigError
from dipaco.plan.memory import RankMemory, outer_on_device, rank_memory
from dipaco.job.preflight import compose, preflight
from dipaco.run.owned import check_out_file


def planned_ranks(cfg: Config) -> int:
    """How many ranks ``cfg`` launches: ``launcher.nproc`` (× ``launcher.nodes`` under
    slurm); under torchrun torchrun decides, so only its own ``WORLD_SIZE`` says."""
    la = cfg.launcher
    if la.name == "slurm":
        return la.nodes * la.nproc
    if la.name == "torchrun":
        if os.environ.get("WORLD_SIZE", "").isdigit():
            return int(os.environ["WORLD_SIZE"])
        raise ConfigError("launcher", "under launcher=torchrun the ranks are torchrun's (--nnodes x "
                          "--nproc-per-node), which dipaco-plan cannot see",
                          "plan the same ranks with launcher=spawn launcher.nproc=N (N = nnodes x nproc-per-node; "
                          "add launcher.group_size=G as you will under torchrun)")
    return la.nproc


def plan_for(cfg: Config) -> CommPlan:
    """The communication plan of ``cfg`` (no data, no training: module sizes only)."""
    return build_comm_plan(cfg, planned_ranks(cfg))


def format_capacity(cfg: Config) -> str:
    """One line: a path's parameters, the share routing can specialise, the grid's total.

    Modules every path shares (the embed and head unless private) are trained alike by all
    paths; only the rest can specialise. When that share is small a routed path is nearly
    the dense model, whatever the router does (docs/results.md §17).
    """
    grid = build_grid(cfg, torch.device("cpu"))
    path, total = grid.path_param_count(0), grid.total_param_count()
    spec = grid.specialised_param_count(0)
    return (f"capacity: a path has {path:,} parameters, {spec:,} ({spec / path:.0%}) in modules "
            f"not every path shares; the grid has {total:,} ({total / path:.2f}x a path)")


def memory_for(cfg: Config) -> list[tuple[str, RankMemory]]:
    """Each kind of rank's memory (:mod:`dipaco.plan.memory`): ``(label, RankMemory)`` rows.

    Ranks of one worker group are alike; worker groups with the same modules and path
    count share a row. The local backend is one process holding every module and path.
    """
    grid = build_grid(cfg, torch.device("cpu"))
    distributed = cfg.launcher.name != "local"
    topo = build_topology(cfg, grid, planned_ranks(cfg), distributed)
    counts = {m: grid.param_count(m) for m in grid.module_ids}
    t = cfg.trainer
    groups = range(topo.num_groups) if distributed else [None]
    G = topo.group_size if distributed else 1
    shards = G if cfg.launcher.group_parallel == "fsdp" else 1  # validated: fsdp is never local
    sequences = t.batch_size // G // max(1, t.micro_batches)
    rows: dict[RankMemory, list[int]] = {}
    for g in groups:
        paths = list(range(len(topo.path_modules))) if g is None else topo.paths_of_group(g)
        held = {m for p in paths for m in topo.path_modules[p]}
        mem = rank_memory(cfg.model, len(cfg.grid.levels), sum(counts[m] for m in held),
                          [sum(counts[m] for m in topo.path_modules[p]) for p in paths],
                          sequences=sequences, seq_len=t.seq_len, low_precision=t.precision != "fp32",
                          checkpointing=t.activation_checkpointing, shards=shards,
                          gathered_params=max(counts[m] for m in held), outer_on_device=outer_on_device(cfg))
        rows.setdefault(mem, []).append(-1 if g is None else g)
    out = []
    for mem, gs in sorted(rows.items(), key=lambda kv: -kv[0].total):
        label = "the process" if gs == [-1] else (f"worker group {gs[0]}" if len(gs) == 1
                                                 else f"{len(gs)} worker groups")
        out.append((label, mem))
    return out


def format_memory(cfg: Config, rows: list[tuple[str, RankMemory]]) -> str:
    """The memory table of ``dipaco-plan`` (MiB per rank)."""
    t = cfg.trainer
    head = (f"memory per rank (model in docs/gpu.md): precision={t.precision} "
            f"activation_checkpointing={str(t.activation_checkpointing).lower()} "
            f"micro-batch {t.batch_size // max(1, cfg.launcher.group_size) // max(1, t.micro_batches)} x {t.seq_len}")
    where = "(device)" if rows and rows[0][1].outer_on_device else "(host)"
    cols = ("params", "grads", "AdamW", "activations", "device", f"outer {where}")
    lines = [head, f"{'rank of':<20}" + "".join(f"{c:>15}" for c in cols), "-" * (20 + 15 * len(cols))]
    mib = 2.0 ** 20
    for label, m in rows:
        vals = (m.parameters, m.gradients, m.optimizer, m.activations, m.device, m.outer)
        lines.append(f"{label:<20}" + "".join(f"{v / mib:>11.1f} MiB" for v in vals))
    return "\n".join(lines)


def _options(argv: list[str]) -> tuple[dict[str, Optional[str]], list[str]]:
    """``--simulate``, ``--json FILE``, ``--plot FILE`` out of ``argv``; the rest are overrides."""
    opts: dict[str, Optional[str]] = {"--simulate": None, "--json": None, "--plot": None, "--force": None}
    rest, i = [], 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if a in ("--simulate", "--force"):
            opts[a] = "1"
        elif name in ("--json", "--plot"):
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                    fail(f"{name} needs a file: {name} FILE")
                i, val = i + 1, argv[i + 1]
            if not val.strip():  # `--json=` (an empty shell variable): would write nothing, silently
                fail(f"{name} names no file: {name} FILE")
            opts[name] = val
        elif a.startswith("--"):
            fail(f"unknown option {a}: dipaco-plan takes --simulate, --json FILE, --plot FILE, --force and overrides")
        else:
            rest.append(a)
        i += 1
    if (opts["--json"] or opts["--plot"]) and not opts["--simulate"]:
        fail("--json and --plot write the simulation: add --simulate")
    if opts["--force"] and not (opts["--json"] or opts["--plot"]):
        fail("--force replaces an earlier --json or --plot file: drop --force, or add --json FILE")
    _check_outputs(opts)
    return opts, rest


def _check_outputs(opts: dict[str, Optional[str]]) -> None:
    """Refuse before simulating what ``--json`` / ``--plot`` could not write, or must not:
    a file of a run directory (contract 8), a folder, a link, a file dipaco did not write,
    an earlier one without ``--force`` (dipaco/run/owned.py: ``check_out_file``), a plot
    format matplotlib lacks."""
    if opts["--json"] and opts["--plot"] and os.path.abspath(os.path.expanduser(opts["--json"])) == \
            os.path.abspath(os.path.expanduser(opts["--plot"])):
        fail(f"--json and --plot name the same file ({opts['--json']}): choose another --plot, e.g. --plot sim.png")
    for flag in ("--json", "--plot"):
        if opts[flag] and os.path.isdir(opts[flag]):
            fail(f"{flag} {opts[flag]} is a folder: name a file in it ({flag} {os.path.join(opts[flag], 'sim')}."
                 f"{'json' if flag == '--json' else 'png'})")
        if opts[flag]:
            check_out_file(opts[flag], f"dipaco-plan {flag}", again=bool(opts["--force"]))
    if opts["--plot"]:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        suffix = os.path.splitext(opts["--plot"])[1].lstrip(".").lower()
        if suffix not in kinds:
            fail(f"--plot {opts['--plot']}: the file's suffix names its format; use one of "
                 f"{', '.join('.' + k for k in sorted(kinds))} (e.g. --plot sim.png)")


def _simulate(cfg: Config, opts: dict[str, Optional[str]]) -> None:
    """Print (and write) the simulation of ``cfg`` on ``cfg.cluster``."""
    from dipaco.sim.report import simulate

    report = simulate(cfg)
    print(report.format())
    if opts["--json"]:
        report.write_json(opts["--json"])
    if opts["--plot"]:
        report.plot(opts["--plot"])


@report_user_errors
def main(argv: Optional[list[str]] = None) -> None:
    """Print the plan for ``argv`` (Hydra-style overrides)."""
    @report_user_errors
    def run(overrides: list[str]) -> None:
        if any(a in ("-h", "--help") for a in overrides):
            print(plain(__doc__), end="")
            return
        opts, overrides = _options(overrides)
        cfg = compose(overrides)
        preflight(cfg, simulating=bool(opts["--simulate"]))
        if opts["--simulate"]:
            _simulate(cfg, opts)
            return
        print(format_plan(plan_for(cfg)))
        if cfg.diloco.streaming:
            print(format_streaming_plan(cfg, planned_ranks(cfg)))
        print(format_capacity(cfg))
        print()
        print(format_memory(cfg, memory_for(cfg)))

    run(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
