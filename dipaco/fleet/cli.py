"""``dipaco-decoupled``: join a decoupled run from its store, from any host.

    dipaco-decoupled worker STORE [--count N] [--device auto|cuda|cpu] [--run-dir DIR] [--config FILE] [--wait S]
    dipaco-decoupled sync   STORE [--count N] [--config FILE] [--wait S]
    dipaco-decoupled status STORE [--json] [--no-events]
    dipaco-decoupled finish STORE RUN_DIR [--wait] [--timeout S]

The run is made by ``dipaco-train diloco.mode=decoupled`` (which also runs its own
workers and synchronisers); its config, plan and code version live in the store, so a
role needs nothing but the store's URL (and, for workers, the run directory's prepared
data, at the path the store records or ``--run-dir``). A role of another dipaco, with
another config (``--config``), for a finished run, or a store that cannot be reached or
is not a run's, is refused in one line (exit 2), before anything is written.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Sequence

from dipaco.cli.errors import entry_point
from dipaco.cli.infer_args import HUGE, Parser, positive
from dipaco.config.names import DEVICES
from dipaco.decoupled.owner import FINISHED_KEY, JoinRefused
from dipaco.runtime.device import cuda_count
from dipaco.storage.strict_json import dumps_strict
from dipaco.fleet.join import check_data, finish, join, serve_host
from dipaco.fleet.status import render, run_status

__all__ = ["main", "build_parser"]

_STORE = "the run's store: a directory (diloco.decoupled.store_url, default RUN_DIR/decoupled) or an fsspec URL"


def build_parser() -> Parser:
    p = Parser(prog="dipaco-decoupled", description="Join a decoupled DiLoCo run from its store (docs/decoupled.md, "
               "'Across hosts'): workers and synchronisers on this host, the run's status, its final checkpoint.")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=Parser)
    w = sub.add_parser("worker", help="N decoupled workers on this host, until every path has its budget")
    w.add_argument("store", help=_STORE)
    w.add_argument("--count", type=positive("--count", 1024), default=1, metavar="N", help="workers (default 1)")
    w.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: GPU (worker i of this host on GPU i %% GPUs) if there is one, else CPU")
    w.add_argument("--run-dir", default=None, metavar="DIR",
                   help="the run directory as mounted on this host (default: the path the store records)")
    w.add_argument("--config", default=None, metavar="FILE", help="refuse to join unless the run has this config")
    w.add_argument("--wait", type=positive("--wait", HUGE), default=None, metavar="S",
                   help="wait up to S seconds for the store to hold the run (started with its creator)")
    s = sub.add_parser("sync", help="synchronisers on this host: they share the modules with the run's others")
    s.add_argument("store", help=_STORE)
    s.add_argument("--count", type=positive("--count", 64), default=1, metavar="N", help="synchronisers (default 1)")
    s.add_argument("--config", default=None, metavar="FILE", help="refuse to join unless the run has this config")
    s.add_argument("--wait", type=positive("--wait", HUGE), default=None, metavar="S",
                   help="wait up to S seconds for the store to hold the run (started with its creator)")
    t = sub.add_parser("status", help="paths, leases, module versions, synchronisers, hosts, heartbeats")
    t.add_argument("store", help=_STORE)
    t.add_argument("--json", action="store_true", help="one JSON object")
    t.add_argument("--no-events", action="store_true", help="skip the event logs (wasted phases): a quicker read")
    f = sub.add_parser("finish", help="the final checkpoint into RUN_DIR once every path has its budget")
    f.add_argument("store", help=_STORE)
    f.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (its prepared data; dipaco-infer reads it)")
    f.add_argument("--wait", action="store_true", help="wait for the run to finish instead of refusing")
    f.add_argument("--timeout", type=positive("--timeout", HUGE), default=86400, metavar="S",
                   help="with --wait: give up after S seconds (default a day)")
    return p


def _worker(a: Any) -> int:
    if a.device == "cuda" and cuda_count() == 0:
        raise JoinRefused("--device cuda, but this host has no CUDA device visible; use --device auto or cpu")
    j = join(a.store, run_dir=a.run_dir, config=a.config, needs_data=True, wait_s=a.wait or 0)
    return 1 if serve_host(j, workers=a.count, device=a.device) else 0


def _sync(a: Any) -> int:
    j = join(a.store, config=a.config, wait_s=a.wait or 0)
    return 1 if serve_host(j, syncs=a.count) else 0


def _status(a: Any) -> int:
    j = join(a.store, to_train=False)
    st = run_status(j.store, j.record, events=not a.no_events)
    print(dumps_strict(st, indent=1, sort_keys=True, default=str) if a.json else render(st))
    return 0


def _finish(a: Any) -> int:
    j = join(a.store, run_dir=a.run_dir, to_train=False)
    done = j.store.get_json(FINISHED_KEY)
    if done is not None:
        raise JoinRefused(f"the run in {a.store} is already finished (checkpoint {done.get('checkpoint')})")
    check_data(j)
    finish(j, wait=a.wait, timeout_s=float(a.timeout))
    return 0


VERBS: dict[str, Callable[[Any], int]] = {"worker": _worker, "sync": _sync, "status": _status, "finish": _finish}


@entry_point
def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console-script entry point."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    raise SystemExit(VERBS[args.verb](args))


if __name__ == "__main__":
    main()
