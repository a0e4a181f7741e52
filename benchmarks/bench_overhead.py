"""Framework overhead: training tokens/s of the local backend for one path vs bare PyTorch.

    python -m benchmarks.bench_overhead --quick   # model=tiny, 5 interleaved repeats
    python -m benchmarks.bench_overhead --full    # model=small, more steps, 9 repeats

Both sides train the same ``modules.PathModel`` (same config, same seed, batch 16 × 128
tokens, same torch thread count, in one process):

* dipaco: exactly the trainer's loop body, local backend, for a ``[1, 1]`` grid (one path
  of a 2-level grid):
  the round driver over the synchronous schedule, ``RoundDriver.activate`` →
  ``PathLearner.train_steps(H)`` (AdamW with warm-up + cosine LR, gradient clipping,
  token counting, the per-step health metrics every ``logging.every_steps`` steps
  (``--every-steps``, default the config's), ``TokenStream`` batches) → ``contribute`` →
  ``sync_point(H)`` (the outer step of every module) → ``end_round``.
* direct: the same body calling the per-module syncs themselves, no driver: each
  ``CollectiveModuleSync.restore`` → ``train_steps(H)`` → ``contribute`` → ``launch`` →
  ``land`` → ``restore``. ``dipaco ÷ direct`` is what the driver costs.
* bare: a plain loop over the same batches held in memory: forward, cross entropy,
  backward, ``torch.optim.AdamW.step``. Nothing else.

One sample = H steps of one side; the sides alternate (A B, B A, ...) and the medians of
tokens/s are compared. Target: dipaco ÷ bare ≥ 0.95.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, Sequence

from benchmarks.common import (base_parser, interleaved, load_average, print_table, torch_threads, verdict,
                               write_result)

TARGET = 0.95
SIZES: dict[str, dict[str, Any]] = {
    # tiny in quick mode: per-step framework costs weigh MORE against a smaller model
    "quick": {"model": "tiny", "steps": 20, "repeats": 5},
    "full": {"model": "small", "steps": 30, "repeats": 9},
}


def make_sides(model_name: str, steps: int, seed: int = 0,
               every_steps: Optional[int] = None) -> tuple[dict[str, Callable[[], float]], dict[str, Any]]:
    """The two callables (each runs ``steps`` steps, returns tokens/s) and the setup facts."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from dipaco.config import compose_config
    from dipaco.data import TokenStream
    from dipaco.rounds.learner import PathLearner
    from dipaco.plan.schedule import RoundSchedule
    from dipaco.sync.diloco import DiLoCoSync
    from dipaco.sync.round_driver import RoundDriver
    from dipaco.plan.topology import Topology
    from modules import ModuleGrid, PathModel

    cfg = compose_config([f"model={model_name}", "grid.levels=[1,1]", f"diloco.inner_steps={steps}"])
    t = cfg.trainer
    rng = np.random.default_rng(seed)
    # content does not matter for speed: random token documents of typical length
    docs = [rng.integers(1, cfg.model.vocab_size, size=int(n)) for n in rng.integers(200, 2000, size=400)]

    # --- dipaco side: the trainer's per-round body for a one-path grid, local backend
    grid = ModuleGrid(cfg.model, [1, 1], seed=seed)
    model = PathModel(grid, 0)
    topo = Topology.from_grid(grid, 1, 1)
    sync = DiLoCoSync(topo, {m: grid.module(m) for m in grid.module_ids},
                      outer={"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False})
    driver = RoundDriver(sync, RoundSchedule.synchronous(grid.module_ids, steps), rounds=10**9)
    stream = TokenStream(docs, seq_len=t.seq_len, batch_size=t.batch_size, seed=seed, path_id=0, eos_id=0)
    every = cfg.logging.every_steps if every_steps is None else every_steps
    learner = PathLearner(0, model, stream, t, total_steps=10**9, log_every=every)

    def dipaco_round() -> float:
        t0 = time.perf_counter()
        driver.begin_round(0)
        driver.activate(0)
        stats = learner.train_steps(steps)
        driver.contribute(0, steps, stats.tokens, lambda p, tokens: float(tokens))
        driver.sync_point(steps)
        driver.end_round()
        learner.take_intervals()  # what the round's record takes
        return stats.tokens / (time.perf_counter() - t0)

    # --- direct side: the same body without the driver (its own grid, learner and data)
    grid_d = ModuleGrid(cfg.model, [1, 1], seed=seed)
    sync_d = DiLoCoSync(Topology.from_grid(grid_d, 1, 1), {m: grid_d.module(m) for m in grid_d.module_ids},
                        outer={"name": "sgd", "lr": 1.0, "momentum": 0.0, "nesterov": False})
    stream_d = TokenStream(docs, seq_len=t.seq_len, batch_size=t.batch_size, seed=seed, path_id=0, eos_id=0)
    learner_d = PathLearner(0, PathModel(grid_d, 0), stream_d, t, total_steps=10**9, log_every=every)

    def direct_round() -> float:
        t0 = time.perf_counter()
        for s in sync_d.syncs.values():
            s.restore()
        stats = learner_d.train_steps(steps)
        for s in sync_d.syncs.values():
            s.contribute(0, stats.tokens, 0)
            s.launch()
            s.land()
            s.restore()
        learner_d.take_intervals()
        return stats.tokens / (time.perf_counter() - t0)

    # --- bare side: same model shape and init, same batches, but held in memory
    bare_model = PathModel(ModuleGrid(cfg.model, [1, 1], seed=seed), 0)
    opt = torch.optim.AdamW(bare_model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                            weight_decay=t.weight_decay)
    batch_src = TokenStream(docs, seq_len=t.seq_len, batch_size=t.batch_size, seed=seed, path_id=1, eos_id=0)
    batches = [batch_src.next_batch() for _ in range(steps)]
    tokens_per_round = sum(int(y.numel()) for _, y in batches)

    def bare_round() -> float:
        t0 = time.perf_counter()
        bare_model.train()
        for x, y in batches:
            loss = F.cross_entropy(bare_model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return tokens_per_round / (time.perf_counter() - t0)

    facts = {"model": model_name, "path_parameters": sum(p.numel() for p in model.parameters()),
             "batch_size": t.batch_size, "seq_len": t.seq_len, "steps_per_sample": steps,
             "torch_threads": torch.get_num_threads(), "every_steps": every}
    return {"dipaco": dipaco_round, "direct": direct_round, "bare": bare_round}, facts


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = base_parser(__doc__ or "")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    ap.add_argument("--every-steps", type=int, default=None,
                    help="per-step metrics interval (default: logging.every_steps; 0: off)")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    load0 = load_average()
    size = SIZES[args.mode]
    sides, facts = make_sides(size["model"], size["steps"], every_steps=args.every_steps)
    res = interleaved(sides, repeats=size["repeats"])
    ratio = res["dipaco"]["median"] / res["bare"]["median"]
    rows = [{"side": n, "median_tokens_per_s": r["median"], "min": min(r["samples"]), "max": max(r["samples"])}
            for n, r in res.items()]
    rows.append({"side": "dipaco / bare", "median_tokens_per_s": ratio})
    driver_cost = res["dipaco"]["median"] / res["direct"]["median"]
    rows.append({"side": "dipaco / direct", "median_tokens_per_s": driver_cost})
    print_table(rows, ["side", "median_tokens_per_s", "min", "max"],
                title=f"framework overhead ({args.mode}): model={facts['model']}, {facts['path_parameters']:,} "
                      f"params, batch {facts['batch_size']}x{facts['seq_len']}, {facts['steps_per_sample']} steps "
                      f"per sample, {size['repeats']} interleaved repeats, {torch_threads()} threads, "
                      f"step metrics every {facts['every_steps']} steps")
    print(f"ratio dipaco / bare = {ratio:.3f} (target >= {TARGET}: {verdict(ratio, TARGET, at_most=False)}); "
          f"dipaco / direct (the round driver) = {driver_cost:.3f}")
    payload = {**facts, "repeats": size["repeats"], "sides": res, "ratio": ratio, "driver_ratio": driver_cost,
               "target": TARGET,
               "verdict": verdict(ratio, TARGET, at_most=False)}
    write_result("overhead", payload, mode=args.mode, load_before=load0, out=args.out, argv=argv)
    return payload


if __name__ == "__main__":
    main()
