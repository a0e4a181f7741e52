"""A short decoupled run on an S3 store (the local moto server of tests/_s3.py): goodput,
and how often the roles lost their own leases.

    python -m benchmarks.bench_decoupled_s3                    # 2 runs of this checkout
    python -m benchmarks.bench_decoupled_s3 --code /tmp/old    # ... of another checkout's dipaco/

Each run is ``dipaco-train diloco.mode=decoupled diloco.decoupled.store_url=s3://...``
(experiment=smoke, 4 paths x ``--rounds`` phases of ``--inner-steps``, 4 worker slots,
one synchroniser) in a process of its own, against a fresh bucket of a moto server in
this process (one request at a time, as tests/_s3.py explains: a slow store, which is the
point). The first run prepares the tokenizer and router; the later ones reuse them.

Reported per run: wall time, goodput and outer steps (``decoupled_metrics.json``), the
checkpoint's routed perplexity (``summary.json``), the synchronisers' longest interval
between two renewals of a lease, their and the workers' lease losses and takeovers
(``lease``/``abort`` events in the bucket's event logs), dropped updates by reason, the
ledger check, and requests to the server by method.
``--code DIR`` runs the training process with ``PYTHONPATH=DIR`` (DIR holding a
``dipaco/`` package: ``git archive <commit> dipaco | tar -x -C DIR``), to measure a
change before and after on the same host. The numbers in docs/decoupled.md ("Leases on a
slow store") come from it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from benchmarks.common import base_parser, load_average, print_table, work_dir, write_result
from dipaco.storage.strict_json import dumps_strict

NAME = "decoupled_s3"
TESTS = Path(__file__).resolve().parent.parent / "tests"


def _local_s3() -> Any:
    """The local S3 server (tests/_s3.py), its environment set in this process."""
    sys.path.insert(0, str(TESTS))
    import _s3  # noqa: E402 (the tests' wrapper of moto: one S3 server, one place)

    srv = _s3.server()
    os.environ.update(_s3.environment(srv.endpoint))
    return srv


def _lease_counts(url: str) -> dict[str, int]:
    """Lease losses and takeovers, from the run's event logs in the bucket."""
    from dipaco.decoupled.fsspec_store import open_store
    from dipaco.decoupled.metrics import load_events, worker_events

    store = open_store(url)
    sync = [e for e in load_events(store, "sync-") if e.get("e") == "lease"]
    workers = worker_events(store)
    # the longest interval between two renewals of a lease, as the synchronisers published
    # it (renewal_s in syncs/<name>.json; absent before the renewal rule)
    worst = [(store.get_json(f"syncs/{n}") or {}).get("renewal_s") for n in store.list("syncs") if n.endswith(".json")]
    return {"sync_renewal_s": max(filter(None, worst), default=None),
            "sync_lost": sum(e["what"] == "lost" for e in sync),
            "sync_fenced": sum(e["what"] == "fenced" for e in sync),
            "sync_takeover": sum(e["what"] == "takeover" for e in sync),
            "worker_abort": sum(e.get("e") == "abort" for e in workers),
            "worker_takeover": sum(e.get("e") == "takeover" for e in workers)}


def _run(srv: Any, args: Any, run_dir: Path, prepared: Optional[Path]) -> dict[str, Any]:
    import s3fs

    bucket = f"bench-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(bucket)
    url = f"s3://{bucket}/run"
    if prepared is not None:
        from benchmarks.common import reuse_preparation

        reuse_preparation(prepared, run_dir)
    train = ["experiment=smoke", "data.max_documents=200", f"trainer.rounds={args.rounds}",
             f"diloco.inner_steps={args.inner_steps}", "trainer.dense_baseline=false", "trainer.progress=false",
             "diloco.mode=decoupled", "launcher.nproc=4", f"diloco.decoupled.lease_s={args.lease_s}",
             f"diloco.decoupled.heartbeat_s={args.heartbeat_s}", "diloco.decoupled.timeout_s=600",
             f"diloco.decoupled.store_url={url}", f"hydra.run.dir={run_dir}", f"data.cache_dir={run_dir.parent}/cache"]
    env = dict(os.environ)
    if args.code:
        env["PYTHONPATH"] = os.pathsep.join([args.code, *filter(None, [env.get("PYTHONPATH")])])
    before = len(srv.app.requests)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", "from dipaco.cli.train import main; main()", *train],
                          cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    metrics = json.loads((run_dir / "decoupled_metrics.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    requests = Counter(method for method, path, _ in list(srv.app.requests)[before:]
                       if path == f"/{bucket}" or path.startswith(f"/{bucket}/"))
    return {"wall_s": round(wall, 1), "goodput": round(float(metrics["goodput"]), 3),
            "routed_ppl": round(float(summary["routed_ppl"]), 1),
            "ledger_ok": bool(metrics["ledger_ok"]), "step_goodput": round(float(metrics["step_goodput"]), 3),
            "outer_steps": sum(metrics["module_versions"].values()), "dropped": metrics.get("dropped", {}),
            **_lease_counts(url), "requests": dict(requests), "requests_total": sum(requests.values())}


def main(argv: Optional[list[str]] = None) -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--runs", type=int, default=2, help="runs (default 2)")
    ap.add_argument("--rounds", type=int, default=4, help="phases per path (default 4)")
    ap.add_argument("--inner-steps", type=int, default=8, help="H (default 8)")
    ap.add_argument("--lease-s", type=float, default=1.5, help="diloco.decoupled.lease_s (default 1.5)")
    ap.add_argument("--heartbeat-s", type=float, default=0.3, help="diloco.decoupled.heartbeat_s (default 0.3)")
    ap.add_argument("--code", default=None, help="a directory with another checkout's dipaco/ (PYTHONPATH)")
    args = ap.parse_args(argv)
    load_before = load_average()
    srv = _local_s3()
    srv.app.requests = type(srv.app.requests)()  # count every request (the deque keeps 10k by default)
    root = work_dir(NAME, args.work_dir)
    rows, prepared = [], None
    for i in range(args.runs):
        run_dir = root / f"run{i}"
        row = {"run": i, **_run(srv, args, run_dir, prepared)}
        prepared = prepared or run_dir
        rows.append(row)
        print(dumps_strict(row), flush=True)
    print_table(rows, ["run", "wall_s", "goodput", "routed_ppl", "outer_steps", "sync_renewal_s", "sync_lost",
                       "sync_fenced", "worker_abort", "worker_takeover", "requests_total", "ledger_ok"],
                title=f"decoupled on local S3 ({args.code or 'this checkout'})")
    write_result(NAME, {"code": args.code or "this checkout", "lease_s": args.lease_s,
                        "heartbeat_s": args.heartbeat_s, "rounds": args.rounds, "inner_steps": args.inner_steps,
                        "runs": rows}, mode=args.mode, load_before=load_before, out=args.out, argv=argv)


if __name__ == "__main__":
    main()
