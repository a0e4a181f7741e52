"""compute_metrics on hand-written stores: which inner steps a run's events count as useful."""
from __future__ import annotations

import json
from pathlib import Path

from dipaco.decoupled.metrics import compute_metrics
from dipaco.decoupled.module_leases import module_folder
from dipaco.decoupled.store import FileStore, encode_state
from dipaco.decoupled.versions import publish

H = 8


def _store(tmp_path: Path, events: list[dict]) -> FileStore:
    """Module ``m`` with phase ``0:0``'s update applied; ``events`` as one worker's log."""
    store = FileStore(tmp_path / "store")
    store.put_new("inbox/m/u0.st", b"x")  # the pushed update the ledger accounts for
    state = {"version": 1, "applied": {"u0": 1}, "dropped": {}, "phases": {"0:0": "u0"}}
    assert publish(store, module_folder("m"), 0, encode_state(state, {"module_id": "m", "version": 1}))
    for t, e in enumerate(events):
        store.append_line("events/worker-0.jsonl", json.dumps({"t": float(t), "worker": "w0", **e}))
    return store


def test_a_phase_killed_after_its_push_counts_its_steps_from_the_push_line(tmp_path: Path) -> None:
    # killed between its push and its "end" line, its "progress" lines lost with it (an object
    # store buffers them): the "push" line says how many steps the applied update holds
    store = _store(tmp_path, [{"e": "begin", "path": 0, "phase": 0, "steps": H},
                              {"e": "push", "path": 0, "phase": 0, "steps": H}])
    m = compute_metrics(store, ["m"], num_workers=1)
    assert m["useful_inner_steps"] == H and m["wasted_steps_killed"] == 0 and m["killed_phases"] == 0


def test_a_phase_killed_before_its_push_is_wasted(tmp_path: Path) -> None:
    store = _store(tmp_path, [{"e": "begin", "path": 0, "phase": 0, "steps": H},
                              {"e": "end", "path": 0, "phase": 0, "steps": H, "seconds": 1.0, "tokens": 10,
                               "ids": {"m": "u0"}},
                              {"e": "begin", "path": 0, "phase": 1, "steps": H},
                              {"e": "progress", "path": 0, "phase": 1, "steps": 3}])
    m = compute_metrics(store, ["m"], num_workers=1)
    assert m["useful_inner_steps"] == H and m["wasted_steps_killed"] == 3 and m["killed_phases"] == 1
