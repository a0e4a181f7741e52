"""``dipaco-decoupled status STORE``: a decoupled run's state, read from its store only.

:func:`run_status` gathers it as one JSON-able dict (``--json`` prints it); :func:`render`
writes it for a person: the run, every path (progress, who holds its lease and since
when), every module (version, last step and its trigger, who synchronises it), the
synchronisers and hosts with their heartbeats, the workers, and what was wasted or dropped.
Nothing is written to the store.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Optional

from dipaco.decoupled.lease import Lease
from dipaco.decoupled.metrics import worker_events
from dipaco.decoupled.module_leases import module_lease, read_module
from dipaco.decoupled.owner import FINISHED_KEY, PLAN_KEY
from dipaco.decoupled.service import path_steps_done, progress_key
from dipaco.decoupled.store import Store

__all__ = ["run_status", "render"]


def _lease(store: Store, name: str, now: float) -> Optional[dict]:
    """Who holds the lease ``name`` (None: nobody: free, released or expired)."""
    info = Lease.info(store, name)
    if not info or info.get("released") or float(info["expires_at"]) < now:
        return None
    return {"owner": info["owner"], "epoch": info["epoch"], "since_s": now - float(info.get("since") or now),
            "expires_in_s": float(info["expires_at"]) - now}


def _records(store: Store, folder: str) -> dict[str, dict]:
    out = {}
    for name in store.list(folder):
        rec = store.get_json(f"{folder}/{name}")
        if isinstance(rec, dict):
            out[name[:-5] if name.endswith(".json") else name] = rec
    return out


def run_status(store: Store, record: dict, events: bool = True) -> dict[str, Any]:
    """The run's state (see the module doc); ``events``: also read the workers' event logs
    (aborted and killed phases: a read of every log, the one costly part)."""
    now = time.time()
    plan = store.get_json(PLAN_KEY) or {}
    R, H = int(plan.get("rounds", 0)), int(plan.get("inner_steps", 0))
    paths = []
    for p in range(int(plan.get("num_paths", 0))):
        prog = store.get_json(progress_key(p))
        paths.append({"path": p, "steps_done": path_steps_done(prog, H), "budget": R * H,
                      "phases_done": int((prog or {}).get("phases_done", 0)), "lease": _lease(store, f"path_{p}", now)})
    modules = []
    dropped: Counter = Counter()
    for m in plan.get("module_ids", []):
        got = read_module(store, m, meta_only=True)
        meta = got[2] if got else {}
        dropped.update(meta.get("dropped") or {})
        last = meta.get("last_step") or None
        modules.append({"module": m, "version": meta.get("version"), "revision": got[0] if got else None,
                        "applied": meta.get("applied"), "dropped": meta.get("dropped") or {},
                        "last_step": None if last is None else {**last, "ago_s": now - float(last["t"])},
                        "lease": _lease(store, module_lease(m), now)})
    syncs = {n: {**r, "heartbeat_ago_s": now - float(r.get("t", 0))} for n, r in _records(store, "syncs").items()}
    hosts = {n: {**r, "heartbeat_ago_s": now - float(r.get("t", 0))} for n, r in _records(store, "hosts").items()}
    host_of = {int(w["slot"]): h for h, r in hosts.items() for w in r.get("workers", [])}
    workers = [{"slot": int(n.split("_")[-1]), "host": host_of.get(int(n.split("_")[-1])),
                "s_per_step": r.get("s_per_step"), "heartbeat_ago_s": now - float(r.get("t", 0))}
               for n, r in _records(store, "speed").items() if n.split("_")[-1].isdigit()]
    out: dict[str, Any] = {
        "run_dir": record.get("run_dir"), "code": record.get("code"), "created": record.get("created"),
        "finished": store.get_json(FINISHED_KEY), "rounds": R, "inner_steps": H, "paths": paths, "modules": modules,
        "synchronisers": syncs, "hosts": hosts, "workers": sorted(workers, key=lambda w: w["slot"]),
        "dropped": dict(dropped)}
    if events:
        out["wasted"] = _wasted(store)
    return out


def _wasted(store: Store) -> dict[str, int]:
    """Phases begun and never ended: aborted (lease lost, commit refused, store error)
    with their steps, and still open (running now, or killed)."""
    open_: dict[tuple, int] = {}
    aborted = aborted_steps = 0
    for e in worker_events(store):
        key = (e.get("worker"), e.get("path"), e.get("phase"))
        if e["e"] == "begin":
            open_[key] = 0
        elif e["e"] in ("progress", "push") and key in open_:
            open_[key] = int(e["steps"])
        elif e["e"] == "end":
            open_.pop(key, None)
        elif e["e"] == "abort":
            aborted += 1
            aborted_steps += int(e.get("steps", open_.pop(key, 0)) or 0)
            open_.pop(key, None)
    return {"aborted_phases": aborted, "aborted_steps": aborted_steps, "open_phases": len(open_),
            "open_steps": sum(open_.values())}


def _ago(s: Optional[float]) -> str:
    return "never" if s is None else f"{s:.1f}s ago"


def _holder(lease: Optional[dict]) -> str:
    if lease is None:
        return "free"
    return f"{lease['owner']} (epoch {lease['epoch']}, since {lease['since_s']:.1f}s, expires in {lease['expires_in_s']:.1f}s)"


def render(st: dict[str, Any]) -> str:
    """The status for a person, one line per path, module, synchroniser, host and worker."""
    done = sum(p["steps_done"] >= p["budget"] for p in st["paths"])
    fin = st["finished"]
    lines = [f"run {st['run_dir']} (dipaco {st['code']}): "
             + (f"finished, checkpoint {fin.get('checkpoint')}" if fin else f"{done}/{len(st['paths'])} paths done"),
             f"paths ({st['rounds']} x {st['inner_steps']} inner steps each):"]
    for p in st["paths"]:
        lines.append(f"  path {p['path']}: {p['steps_done']}/{p['budget']} steps, {p['phases_done']} phases; "
                     f"lease {_holder(p['lease'])}")
    lines.append("modules:")
    for m in st["modules"]:
        last = m["last_step"]
        step = "no step yet" if last is None else f"last step: {last['trigger']} {_ago(last['ago_s'])}"
        drops = ", ".join(f"{k} {v}" for k, v in sorted(m["dropped"].items())) or "none"
        lines.append(f"  {m['module']}: version {m['version']} ({step}); applied {m['applied']}, dropped {drops}; "
                     f"synchroniser {_holder(m['lease'])}")
    lines.append("synchronisers:")
    for n, r in sorted(st["synchronisers"].items()):
        state = "ended" if r.get("ended") else f"heartbeat {_ago(r['heartbeat_ago_s'])}"
        lines.append(f"  {n} on {r.get('host')} (pid {r.get('pid')}): modules {', '.join(r.get('modules', [])) or '-'}; "
                     f"{state}")
    lines.append("hosts:")
    for n, r in sorted(st["hosts"].items()):
        slots = [w["slot"] for w in r.get("workers", [])]
        alive = sum(bool(w.get("alive")) for w in r.get("workers", []))
        state = "ended" if r.get("ended") else f"heartbeat {_ago(r['heartbeat_ago_s'])}"
        lines.append(f"  {n} ({r.get('role')}): workers {slots or '-'} ({alive} alive), "
                     f"synchronisers {len(r.get('syncs', []))}; {state}")
    lines.append("workers:")
    for w in st["workers"]:
        sps = "?" if w["s_per_step"] is None else f"{w['s_per_step']:.3f}"
        lines.append(f"  slot {w['slot']} on {w['host'] or '?'}: {sps} s/step; heartbeat {_ago(w['heartbeat_ago_s'])}")
    dropped = ", ".join(f"{k} {v}" for k, v in sorted(st["dropped"].items())) or "none"
    wasted = st.get("wasted")
    if wasted is not None:
        lines.append(f"wasted: {wasted['aborted_phases']} aborted phase(s) ({wasted['aborted_steps']} steps); "
                     f"{wasted['open_phases']} phase(s) begun and not ended (running, or killed)")
    lines.append(f"dropped updates: {dropped}")
    return "\n".join(lines)
