"""Elastic launches: a start of the ranks after a membership change resumes, and says so.

Under torch elastic (``torchrun --nnodes=MIN:MAX --max-restarts=N --rdzv-backend=c10d``,
or ``launcher=spawn launcher.elastic=true``, :mod:`dipaco.runtime.elastic_spawn`) the
agents own the membership: when an agent (a machine) is lost, a rank fails, or a new
agent joins the rendezvous, every agent stops its ranks and starts them again with a
new ``RANK`` and ``WORLD_SIZE``. dipaco adds two things on top, and no membership
protocol of its own:

* **Every start after the first resumes** (:func:`join`). A start is a restart when one
  of its agents also ran the previous start recorded in ``membership.jsonl`` (an agent
  is a process: host, PID and start time; a new launch has new agents), so it continues
  the same launch. It then resumes from the newest valid round checkpoint with the
  topology of the new world size: checkpoints hold whole modules and one file per path
  (docs/design.md contract 5), so any grouping loads them and the paths of a lost group
  are dealt to the others (contract 3). A restart cannot tell ``TORCHELASTIC_RESTART_COUNT``
  apart from a first start: membership changes do not count as restarts there.
* **Every start is recorded** (:func:`started`): one ``membership.jsonl`` line per start
  (world size, worker groups, agents, the round it resumed from) and, after a change,
  one log line saying which agent left or joined, when, and what it cost: the seconds
  from the checkpoint it resumed from to the moment the ranks were ready again, that is
  the round in flight (unless the ranks stopped at a round boundary: a join, with rounds
  shorter than torch's 30 s stop grace), failure detection, the rendezvous and the
  restart of the ranks. The summary lists the changes (:func:`changes`).

HAZARD: :func:`join` is a collective over the new world; every rank calls it right after
``init_process_group`` and before any other collective, or the ranks deadlock.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist

from dipaco.run.run_dir import RunDir
from dipaco.runtime.faults import NODE_ENV, START_ENV, agent_pid
from dipaco.storage.jsonl import append_json_lines

__all__ = ["Membership", "join", "started", "current_change", "changes", "launch_first_round", "LAUNCH_ENV"]

LAUNCH_ENV = "DIPACO_ELASTIC_LAUNCH"  # the launch this rank belongs to (for code the rank runs; the
# run lock is held by the launching process, which outlives every restart of the ranks)


def _proc_start(pid: int) -> str:
    """A process's start time in clock ticks since boot (``/proc``), or ``""`` elsewhere:
    with the PID it names one process, even after the PID is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: starttime


def agent_id() -> str:
    """This rank's agent (the process that started it): ``host:pid:start``."""
    pid = agent_pid()
    return f"{socket.gethostname()}:{pid}:{_proc_start(pid)}"


def node_name() -> str:
    """A readable name of this rank's agent: ``launcher.elastic``'s slot name, or host/PID."""
    return os.environ.get(NODE_ENV) or f"{socket.gethostname()}/agent-{agent_pid()}"


@dataclass
class Membership:
    """One start of the ranks of an elastic launch, the same on every rank."""

    launch: str  # shared by every start of one launch
    start: int  # 0 the first start of the launch, then 1, 2, ...
    world_size: int
    nodes: list[str]  # each rank's agent name (index: rank)
    agent_ids: list[str]  # each rank's agent id
    previous: Optional[dict] = None  # the previous start's membership.jsonl line
    process_start: float = field(default_factory=time.time)  # rank 0's process start (wall clock)

    @property
    def restart(self) -> bool:
        """Not the launch's first start: resume from the newest valid checkpoint."""
        return self.start > 0


_CURRENT: Optional[Membership] = None
_CHANGE: Optional[dict] = None  # this start's change, for the first round's metrics line


def _last_line(path: Path) -> Optional[dict]:
    try:
        lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None  # none yet, or torn: a new launch


def _process_start_time() -> float:
    """When this process started, on the wall clock (now, where ``/proc`` is missing)."""
    ticks = _proc_start(os.getpid())
    try:
        boot = next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines()
                    if x.startswith("btime "))
        return boot + int(ticks) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


def join(run: RunDir, rank: int, world_size: int) -> Membership:
    """Which start of which launch this is (a collective over the world; see the module doc).

    Sets ``DIPACO_START`` (:mod:`dipaco.runtime.faults`), ``DIPACO_ELASTIC_LAUNCH`` (which
    launch) and ``DIPACO_NODE`` in this process.
    """
    global _CURRENT, _CHANGE
    me = {"agent": agent_id(), "node": node_name()}
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, me)
    decision: list[Any] = [None]
    if rank == 0:
        prev = _last_line(run.membership)
        ids = {e["agent"] for e in everyone}
        if prev is not None and ids & set(prev.get("agent_ids", [])):
            decision[0] = {"launch": prev["launch"], "start": int(prev["start"]) + 1, "previous": prev}
        else:  # no agent of an earlier start: a launch of its own (a resume is the user's call)
            decision[0] = {"launch": uuid.uuid4().hex[:12], "start": 0, "previous": None}
    dist.broadcast_object_list(decision, src=0)
    d = decision[0]
    os.environ[START_ENV] = str(d["start"])
    os.environ[LAUNCH_ENV] = d["launch"]
    os.environ.setdefault(NODE_ENV, me["node"])
    _CURRENT = Membership(d["launch"], d["start"], world_size, [e["node"] for e in everyone],
                          [e["agent"] for e in everyone], d["previous"], _process_start_time())
    _CHANGE = None
    return _CURRENT


def _groups_of_nodes(nodes: list[str], group_size: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r, n in enumerate(nodes):
        g = r // group_size
        if g not in out.setdefault(n, []):
            out[n].append(g)
    return out


def _checkpoint_time(run: RunDir, round_idx: int) -> Optional[float]:
    manifest = run.checkpoints / f"round_{round_idx:06d}" / "manifest.json"
    try:
        return manifest.stat().st_mtime  # written last, when the checkpoint was committed
    except OSError:
        return None


def started(run: RunDir, rank: Optional[int], group_size: int, start_round: int,
            log: Callable[[str], None]) -> Optional[dict]:
    """The ranks are ready to train round ``start_round + 1``: rank 0 records this start
    and, after a membership change, logs the one-line message. Returns the change (or
    ``None``). A no-op outside an elastic launch."""
    global _CHANGE
    m = _CURRENT
    if m is None or rank != 0:
        return None
    now = time.time()
    groups = _groups_of_nodes(m.nodes, group_size)
    line: dict[str, Any] = {"launch": m.launch, "start": m.start, "time": now, "world_size": m.world_size,
                            "worker_groups": m.world_size // group_size, "group_size": group_size,
                            "groups_of_node": groups, "agent_ids": sorted(set(m.agent_ids)),
                            "resumed_from_round": start_round, "change": None}
    prev = m.previous
    if prev is not None:
        before, after = set(prev.get("groups_of_node", {})), set(groups)
        since = _checkpoint_time(run, start_round) if start_round else None
        since = since if since is not None else float(prev["time"])
        lost = max(0.0, now - since)
        restart = max(0.0, min(lost, now - m.process_start))
        left, joined = sorted(before - after), sorted(after - before)
        change = {"round": start_round + 1, "start": m.start, "time": now,
                  "left": {n: prev["groups_of_node"][n] for n in left}, "joined": joined,
                  "world_size": [prev["world_size"], m.world_size],
                  "worker_groups": [prev["worker_groups"], line["worker_groups"]],
                  "resumed_from_round": start_round, "lost_s": round(lost, 3), "restart_s": round(restart, 3)}
        line["change"] = _CHANGE = change
        log(describe(change))
    run.membership.parent.mkdir(parents=True, exist_ok=True)
    append_json_lines(run.membership, [line])  # one writer: rank 0 of this start
    return _CHANGE


def describe(change: dict) -> str:
    """The one line of a membership change: who left or joined, when, what it cost."""
    left = "; ".join(f"worker group {', '.join(map(str, g))} ({n}) left" for n, g in change["left"].items())
    joined = "; ".join(f"{n} joined" for n in change["joined"])
    who = "; ".join(x for x in (left, joined) if x) or "the ranks restarted after a failure"
    (wb, wa), (gb, ga) = change["world_size"], change["worker_groups"]
    k = change["resumed_from_round"]
    since = f"round {k}'s checkpoint" if k else "the start"
    return (f"elastic: {who} during round {change['round']}; {gb} -> {ga} worker groups ({wb} -> {wa} ranks); "
            f"resumed from {since}; lost {change['lost_s']:.1f} s since {since} (the round in flight if it "
            f"was cut, detection and rendezvous; {change['restart_s']:.1f} s of it restarting the ranks)")


def current_change() -> Optional[dict]:
    """The membership change this start began with (rank 0), or ``None``."""
    return _CHANGE


def changes(run: RunDir) -> list[dict]:
    """Every membership change of the run, oldest first, for ``summary.json``."""
    return [x["change"] for x in _lines(run) if x.get("change")]


def _lines(run: RunDir) -> list[dict]:
    try:
        text = run.membership.read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for x in text.splitlines():
        try:
            out.append(json.loads(x))
        except ValueError:
            continue  # a torn last line of a killed rank 0
    return out


def launch_first_round(run: RunDir) -> Optional[int]:
    """The round the newest launch's first start resumed from (``None``: no elastic launch)."""
    firsts = [x for x in _lines(run) if x.get("start") == 0]
    return int(firsts[-1]["resumed_from_round"]) if firsts else None
