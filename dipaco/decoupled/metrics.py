"""Metrics of a decoupled run, computed from the store (ledgers + event logs).

* **goodput** (time): Σ seconds of inner phases whose update was applied ÷ (worker
  slots × wall time of the training phase). Idle waiting, killed or aborted phases,
  dropped updates and restart downtime all count against it. Sync mode's rounds loop's
  number is the same formula over its rounds (a fast path idles while the slow one
  finishes), so the two compare directly.
* **step goodput**: useful inner steps ÷ inner steps executed (any worker, any outcome).
* **staleness histogram**: over applied updates, versions of the module between the
  version an update started from and the version it was applied to.
* **version rate**: outer steps per second, per module.
* **dropped**: per reason, per module.
* **ledger check**: every pushed update (a file in a module's inbox or archive) is
  applied or dropped with a reason, never both, and no id appears in two outer steps.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict
from typing import Any, Iterable

from dipaco.decoupled.store import Store, iter_jsonl
from dipaco.decoupled.module_leases import read_module
from dipaco.decoupled.service import archive, inbox

__all__ = ["ledger_report", "compute_metrics", "load_events", "worker_events"]


def load_events(store: Store, prefix: str) -> list[dict]:
    """All events of the logs ``events/<prefix>*.jsonl``, time-ordered."""
    out: list[dict] = []
    for name in store.list("events"):
        if name.startswith(prefix) and name.endswith(".jsonl"):
            out.extend(iter_jsonl(store, f"events/{name}"))
    return sorted(out, key=lambda e: e.get("t", 0.0))


def worker_events(store: Store) -> list[dict]:
    """Every decoupled worker's events, time-ordered, each naming its ``worker``.

    Stores written before the rename keep loading: their logs are
    ``events/learner-*.jsonl`` and their events name a ``learner``."""
    out = load_events(store, "worker-") + load_events(store, "learner-")
    for e in out:
        if "worker" not in e and "learner" in e:
            e["worker"] = e["learner"]
    return sorted(out, key=lambda e: e.get("t", 0.0))


def pushed_ids(store: Store, module_id: str) -> set[str]:
    """Ids of every update file pushed for a module (inbox + archive)."""
    names: Iterable[str] = list(store.list(inbox(module_id))) + list(store.list(archive(module_id)))
    return {n[:-3] for n in names if n.endswith(".st")}


def ledger_report(store: Store, module_ids: Iterable[str]) -> dict[str, Any]:
    """Per module: pushed / applied / dropped counts and the invariant violations."""
    sync_events = load_events(store, "sync-")
    step_count: Counter = Counter()
    for e in sync_events:
        if e.get("e") == "step":
            step_count.update(e["update_ids"])
    out: dict[str, Any] = {"modules": {}, "ok": True}
    for m in module_ids:
        got = read_module(store, m)
        state = got[1] if got else {"applied": {}, "dropped": {}, "version": 0}
        applied, dropped = dict(state["applied"]), dict(state["dropped"])
        pushed = pushed_ids(store, m)
        lost = sorted(pushed - set(applied) - set(dropped))
        both = sorted(set(applied) & set(dropped))
        phantom = sorted((set(applied) | set(dropped)) - pushed)
        twice = sorted(uid for uid in applied if step_count[uid] > 1)
        rec = {"version": int(state["version"]), "pushed": len(pushed), "applied": len(applied),
               "dropped": len(dropped), "dropped_by_reason": dict(Counter(dropped.values())),
               "lost": lost, "applied_and_dropped": both, "unknown": phantom, "applied_twice": twice}
        out["modules"][m] = rec
        if lost or both or phantom or twice:
            out["ok"] = False
    return out


def compute_metrics(store: Store, module_ids: list[str], num_workers: int) -> dict[str, Any]:
    """Everything in the module doc, as one JSON-able dict."""
    lev = worker_events(store)
    sev = load_events(store, "sync-")
    ledger = ledger_report(store, module_ids)
    # (module, "path:phase") slots whose update went into a version. Counted by slot, not
    # by id: a phase killed mid-push and redone lands partly from each attempt (the
    # redo's duplicates are dropped), and its steps still counted once.
    slot_applied: set[tuple[str, str]] = set()
    for m in module_ids:
        got = read_module(store, m)
        if got:
            state = got[1]
            slot_applied.update((m, slot) for slot, uid in state.get("phases", {}).items()
                                if uid in state["applied"])

    ends = [e for e in lev if e["e"] == "end"]
    # the training window: first phase begun → last phase ended (interpreter start-up
    # and the idle tail of workers restarted after the work ran out are left out;
    # restarts *during* training count against goodput)
    begins = [e["t"] for e in lev if e["e"] == "begin"]
    t_start = min(begins) if begins else 0.0
    t_end = max((e["t"] for e in ends), default=t_start)
    wall = max(t_end - t_start, 1e-9)

    useful_s = useful_steps = executed = 0.0
    tokens = bytes_pushed = 0
    counted: set[str] = set()
    for e in ends:
        slot = f"{e['path']}:{e['phase']}"
        mods = list(e["ids"])
        frac = 0.0 if slot in counted else sum((m, slot) in slot_applied for m in mods) / max(1, len(mods))
        counted.add(slot)
        useful_s += frac * float(e["seconds"])
        useful_steps += frac * int(e["steps"])
        executed += int(e["steps"])
        tokens += int(e["tokens"])
        bytes_pushed += int(e.get("bytes", 0))
    # phases that never ended: aborted (lease lost) or killed; count their last known steps
    open_phases: dict[tuple, int] = {}
    for e in lev:
        key = (e["worker"], e.get("path"), e.get("phase"))
        if e["e"] == "begin":
            open_phases[key] = 0
        elif e["e"] in ("progress", "push") and key in open_phases:
            open_phases[key] = int(e["steps"])
        elif e["e"] in ("end", "abort"):
            if e["e"] == "abort" and key in open_phases:
                open_phases[key] = int(e.get("steps", open_phases[key]))
                executed += open_phases.pop(key)
            else:
                open_phases.pop(key, None)
    # killed after its push but before its "end" line: the phase's updates were applied,
    # so its steps were useful (and no redo ran: its path state was already saved)
    applied_slots = {slot for _, slot in slot_applied}
    for key, steps in list(open_phases.items()):
        slot = f"{key[1]}:{key[2]}"
        if slot in applied_slots and slot not in counted:
            counted.add(slot)
            useful_steps += steps
            executed += steps
            del open_phases[key]
    wasted_killed = sum(open_phases.values())
    executed += wasted_killed

    stal: Counter = Counter()
    versions: dict[str, int] = defaultdict(int)
    for e in sev:
        if e["e"] == "step":
            stal.update(int(s) for s in e["staleness"])
            versions[e["module_id"]] = max(versions[e["module_id"]], int(e["version"]))
    dropped: dict[str, int] = Counter()
    for rec in ledger["modules"].values():
        dropped.update(rec["dropped_by_reason"])
    kills = [e for e in load_events(store, "supervisor") if e.get("e") == "kill"]
    return {
        "goodput": useful_s / (num_workers * wall),
        "step_goodput": useful_steps / max(1.0, executed),
        "useful_inner_steps": useful_steps,
        "executed_inner_steps": executed,
        "wall_s": wall,
        "workers": num_workers,
        "phases_pushed": len(ends),
        "tokens": tokens,
        "bytes_pushed": bytes_pushed,
        "staleness_histogram": {str(k): v for k, v in sorted(stal.items())},
        "module_versions": {m: ledger["modules"][m]["version"] for m in module_ids},
        "version_rate_per_s": {m: ledger["modules"][m]["version"] / wall for m in module_ids},
        "dropped": dict(dropped),
        "aborted_phases": sum(1 for e in lev if e["e"] == "abort"),
        "killed_phases": len(open_phases),
        "wasted_steps_killed": wasted_killed,
        "lease_takeovers": sum(1 for e in lev if e["e"] == "takeover"),
        "killed_workers": len(kills),
        "ledger_ok": ledger["ok"],
        "ledger": ledger["modules"],
    }


def dumps(metrics: dict) -> str:
    return json.dumps(metrics, indent=2, sort_keys=True)
