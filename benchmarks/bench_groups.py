"""One worker group of G=2 ranks training one path: ``replicate`` vs ``fsdp`` (FSDP2).

    python -m benchmarks.bench_groups --quick   # CPU: model=small and base; CUDA (≥ 2 GPUs): medium
    python -m benchmarks.bench_groups --full    # CPU: model=base, more steps; CUDA: paper
    python -m benchmarks.bench_groups --tiny    # seconds: wiring check

Each side starts 2 fresh rank processes (gloo on the CPU; nccl with one GPU per rank, so
CUDA needs 2 GPUs: FSDP2 over gloo on a GPU is refused by ``dipaco/sync/fsdp.py``). Both
ranks form one worker group training the one path of a ``[1, 1]`` grid, exactly as
``dipaco/rounds/loop.py`` drives it, through the round driver over the synchronous schedule:
``activate`` → ``PathLearner.train_steps(H)`` (gradients all-reduced by hand under
``replicate``, reduce-scattered by FSDP2 under ``fsdp``) → ``contribute`` → ``sync_point(H)``
(the outer step; sharded under ``fsdp``) → ``end_round``. One round warms up, then R rounds
are timed.

Reported per side: the group's tokens/s, each rank's peak memory (the largest of the two;
CPU: peak RSS minus the RSS before the model was built) and :mod:`dipaco.plan.memory`'s plan
for that rank (``shards=2`` under fsdp), whose ratio the issue wants within 1.5×.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from benchmarks.bench_gpu import rss_now, warm_runtime
from benchmarks.common import base_parser, load_average, print_table, write_result
from dipaco.storage.strict_json import dumps_strict
from benchmarks.common import write_output

G = 2
# per mode and device type: model presets (conf/model/), global batch, T, H, timed rounds
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "tiny": {"cpu": {"models": ["tiny"], "batch": 4, "seq": 32, "H": 2, "rounds": 1},
             "cuda": {"models": ["tiny"], "batch": 4, "seq": 32, "H": 2, "rounds": 1}},
    "quick": {"cpu": {"models": ["small", "base"], "batch": 16, "seq": 128, "H": 5, "rounds": 2},
              "cuda": {"models": ["medium"], "batch": 16, "seq": 1024, "H": 10, "rounds": 3}},
    "full": {"cpu": {"models": ["base"], "batch": 16, "seq": 128, "H": 10, "rounds": 3},
             "cuda": {"models": ["paper"], "batch": 16, "seq": 1024, "H": 30, "rounds": 3}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, model_name: str, side: str, mode: str, out: str) -> None:
    """One rank of the worker group (a module-level function: spawned children import it)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from dipaco.config import compose_config
    from dipaco.data import TokenStream
    from dipaco.runtime.device import peak_memory_bytes, reset_peak_memory
    from dipaco.rounds.learner import PathLearner
    from dipaco.plan.memory import rank_memory
    from dipaco.sync.data_parallel import allreduce_gradients
    from dipaco.plan.schedule import RoundSchedule
    from dipaco.sync.diloco import DiLoCoSync
    from dipaco.sync.round_driver import RoundDriver
    from dipaco.sync.fsdp import apply_fsdp, worker_mesh
    from dipaco.sync.groups import ProcessGroups
    from dipaco.plan.topology import Topology
    from modules import ModuleGrid, PathModel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= G
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # the host's cores split between the two ranks, as dipaco's spawn launcher does
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // G))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=G)
    size = SIZES[mode][device.type]
    B, T, H, R = size["batch"], size["seq"], size["H"], size["rounds"]
    precision = "bf16" if cuda else "fp32"
    cfg = compose_config([f"model={model_name}", f"trainer.batch_size={B}", f"trainer.seq_len={T}",
                          f"trainer.precision={precision}", "trainer.compile=false", "trainer.warmup_steps=0"])
    m = cfg.model
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, m.vocab_size, size=int(n)) for n in rng.integers(T, 4 * T, size=200)]
    warm_runtime(device)
    rss0 = rss_now()
    reset_peak_memory(device)
    grid = ModuleGrid(m, [1, 1], seed=0, device=device)
    topo = Topology.from_grid(grid, G, G)
    pg = ProcessGroups(topo, rank)
    wpg = pg.worker_group(topo.group_of_rank(rank))
    modules = {mid: grid.module(mid) for mid in grid.module_ids}
    fsdp = side == "fsdp"
    if fsdp:
        apply_fsdp(modules, worker_mesh(wpg, device))
    driver = RoundDriver(DiLoCoSync(topo, modules, rank=rank, process_groups=pg, sharded=fsdp),
                         RoundSchedule.synchronous(grid.module_ids, H))
    grad_sync = None if fsdp else (lambda ps: allreduce_gradients(ps, wpg, G))
    stream = TokenStream(docs, seq_len=T, batch_size=B, seed=0, path_id=0, eos_id=0, rank=rank, world=G)
    learner = PathLearner(0, PathModel(grid, 0), stream, cfg.trainer, 10**9, grad_sync=grad_sync)

    def one_round() -> None:
        driver.begin_round(0)
        driver.activate(0)
        stats = learner.train_steps(H)
        driver.contribute(0, H, stats.tokens, lambda p, tokens: float(tokens))
        driver.sync_point(H)
        driver.end_round()

    one_round()  # warm-up: allocator, gloo/nccl buffers, FSDP2's lazy init
    dist.barrier()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(R):
        one_round()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - t0
    peak = peak_memory_bytes(device) - (0 if cuda else rss0)
    counts = {mid: grid.param_count(mid) for mid in grid.module_ids}
    path_params = sum(counts.values())
    plan = rank_memory(m, 2, path_params, [path_params], sequences=B // G, seq_len=T,
                       low_precision=precision != "fp32", shards=G if fsdp else 1,
                       gathered_params=max(counts.values()))
    planned = plan.device if cuda else plan.total  # CPU: the outer state lives in the same RSS
    row = {"model": model_name, "side": side, "rank": rank, "tokens_per_s": R * H * B * T / seconds,
           "peak_memory_bytes": peak, "planned_memory_bytes": planned, "path_parameters": path_params,
           "device_name": torch.cuda.get_device_name(device) if cuda else "cpu (gloo)", "precision": precision}
    rows: list[Any] = [None] * G
    dist.all_gather_object(rows, row)
    if rank == 0:
        worst = max(rows, key=lambda r: r["peak_memory_bytes"])
        write_output(out, dumps_strict({**row, "peak_memory_bytes": worst["peak_memory_bytes"],
                                         "measured_over_planned": worst["peak_memory_bytes"] / planned}))
    dist.destroy_process_group()


def measure(model_name: str, side: str, mode: str) -> dict[str, Any]:
    """Spawn the group's 2 ranks for one side; rank 0's row (peak: the larger rank's)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        mp.spawn(_rank, args=(_free_port(), model_name, side, mode, out), nprocs=G, join=True)
        return json.loads(Path(out).read_text())


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--tiny", dest="mode", action="store_const", const="tiny", help="seconds: wiring check only")
    args = ap.parse_args(argv)
    import torch

    load0 = load_average()
    argv = list(sys.argv[1:] if argv is None else argv)
    if torch.cuda.is_available() and torch.cuda.device_count() < G:
        why = (f"bench_groups needs {G} GPUs for nccl worker groups (FSDP2 over gloo on a GPU is refused); "
               f"this host has {torch.cuda.device_count()}: run it on a node with 2 or more GPUs")
        print(why, file=sys.stderr)
        payload: dict[str, Any] = {"device": torch.cuda.get_device_name(), "skipped": why, "rows": []}
        write_result("groups", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
        return payload
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [measure(model, side, args.mode) for model in SIZES[args.mode][kind]["models"]
            for side in ("replicate", "fsdp")]
    for model in {r["model"] for r in rows}:
        rep, sh = (next(r for r in rows if r["model"] == model and r["side"] == s) for s in ("replicate", "fsdp"))
        sh["vs_replicate"] = sh["tokens_per_s"] / rep["tokens_per_s"]
        sh["memory_vs_replicate"] = sh["peak_memory_bytes"] / rep["peak_memory_bytes"]
    table = [{**r, "peak_MiB": r["peak_memory_bytes"] / 2**20, "planned_MiB": r["planned_memory_bytes"] / 2**20}
             for r in rows]
    print_table(table, ["model", "side", "path_parameters", "tokens_per_s", "vs_replicate", "peak_MiB",
                        "planned_MiB", "measured_over_planned", "memory_vs_replicate"],
                title=f"bench_groups ({args.mode}): one worker group of {G} ranks on {rows[0]['device_name']}, "
                      f"precision={rows[0]['precision']}")
    payload = {"device": rows[0]["device_name"], "group_size": G, "rows": rows}
    write_result("groups", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
