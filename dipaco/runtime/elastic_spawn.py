"""``launcher=spawn launcher.elastic=true``: one torch elastic agent per worker group on this host.

What torchrun does across machines (``--nnodes=MIN:MAX``, a c10d rendezvous, an agent per
machine that restarts its ranks on a membership change), on one host: each worker group
gets an agent process of its own (``nproc_per_node = launcher.group_size``), so a lost
group is really one agent fewer and the run goes on with fewer ranks. This process only
hosts the rendezvous store, starts the agents, restarts a lost one and collects rank 0's
result; the membership is torch's rendezvous (:mod:`dipaco.runtime.elastic` has what
dipaco adds: every restart resumes and is recorded).

* **A lost agent** (killed with its ranks: ``DIPACO_FAULT=node_kill:...``, or ``kill -9``
  of an agent): the other ranks fail at their next collective, their agents restart
  them (``launcher.max_restarts`` each) and the c10d rendezvous forms without the lost
  one once its keep-alive expires (``KEEP_ALIVE_S`` × ``KEEP_ALIVE_TRIES``); the ranks
  resume from the newest round checkpoint with fewer worker groups. At most
  ``launcher.nproc - launcher.min_nproc`` ranks may be lost at once.
* **A failed rank** (its agent lives, ``DIPACO_FAULT=kill:...``): its agent restarts its
  ranks and the others follow, as under torchrun: the same groups go on from the
  checkpoint. An agent out of restarts closes the rendezvous and the run fails.
* **A rejoin**: a lost group's agent is started again ``launcher.rejoin_after_s`` after
  it was lost (null: never), but not before the others committed a round without it,
  so a group that keeps dying cannot stall the run; at most ``launcher.max_restarts``
  times per group. The running agents see it waiting and stop their ranks with SIGTERM,
  which finish the round in flight and checkpoint (:class:`dipaco.runtime.launch.StopSignals`)
  if torch's 30 s stop grace allows, then all ranks restart with one group more.

HAZARDS. The rendezvous store lives in this process, never in an agent: an agent that
hosted it would take the rendezvous with it when lost. An agent that ends on its own
(success, or out of restarts) closes the rendezvous for everyone (torch's rule), so the
ranks of an agent stopped for a restart must never exit 0
(:data:`RESTART_EXIT`): an agent that has not yet seen the change would take that for
the end of the run. torch's agents must not share their rendezvous TCPStore with the ranks
(:data:`NO_SHARED_STORE_ENV`): the ranks of a restart would read the previous ranks' keys.
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dipaco.config import Config
from dipaco.run.run_dir import RunDir
from dipaco.runtime import process_start
from dipaco.runtime.faults import AGENT_PID_ENV, NODE_ENV
from dipaco.runtime.placement import agent_env
from dipaco.runtime.progress import log, say

__all__ = ["ElasticOutcome", "agent_config", "agent_rank_env", "run_agents", "RESTART_EXIT"]

# torch's agents share one TCPStore server across rendezvous rounds by default; its keys
# outlive a restart, so the ranks of the next round read the dead round's gloo addresses
# ("connectFullMesh failed ... Connection refused"). Off: a fresh store per round.
NO_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
RESTART_EXIT = 75  # a rank stopped for a restart of its agent: never 0 (module doc)
KEEP_ALIVE_S, KEEP_ALIVE_TRIES = 1, 5  # a lost agent leaves the rendezvous after ~5 s of silence
LAST_CALL_S = 2  # how long a forming rendezvous waits for more agents once it has enough
MONITOR_S = 0.5
# how often the launcher looks at its agents and at a stop signal: a stop reaches the ranks
# within this, and must come before the round in flight ends (a smoke round is ~0.1 s);
# a look is a few process and queue polls, so 50 a second cost nothing measurable
POLL_S = 0.02
# how long an agent waits in the rendezvous (torch's join_timeout): a late or rejoining agent
# waits there while the running ranks finish their round (torch stops them within 30 s)
# and restart; at least launcher.timeout_s
JOIN_TIMEOUT_S = 600
BOOT_TIMEOUT_S = 300  # how long the first agents wait for each other (_boot_barrier)
_BOOT_KEY = "dipaco/agents_started"  # how often an agent looks at its ranks (and at agents waiting to join)
_ROUND_DIR = re.compile(r"^round_(\d{6})$")
# the agents' own log lines ("Received 15 death signal ...") would break the one-line rule
_QUIET = ("torch.distributed.elastic", "torch.distributed.elastic.agent.server.api",
          "torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.rendezvous")


@dataclass
class ElasticOutcome:
    """How an elastic launch ended: rank 0's value, or why not."""

    value: Any = None  # rank 0's return value, when the last start of the ranks finished
    finished: bool = False
    stopped: bool = False  # a stop signal: the ranks stopped at a round boundary
    failures: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # agents lost along the way
    rejoined: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # agents that left the rendezvous without a result, and why


def _agent_main(slot: int, lc: dict, entry: Callable[..., Any], fn_args: tuple, out: Any,
                first: Optional[int] = None, handover: Optional[process_start.Handover] = None) -> None:
    """Body of one agent process: torch's elastic agent for the ranks of worker group ``slot``.
    ``first``: one of the launch's first ``first`` agents, which all meet before the rendezvous.
    ``handover``: the launcher's environment and streams (:func:`process_start.enter`). The
    agent's ranks are forked from the agent's own process server, which starts (preloaded)
    at its first rank, after the lines below set the environment: they inherit it as meant."""
    process_start.enter(handover)
    process_start.start_method()  # this process's own server preloads too
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if first is not None:
        _boot_barrier(lc["rdzv_endpoint"], first)

    os.setpgrp()  # a Ctrl-C in the terminal reaches the launcher only, which stops the agents
    os.environ[NODE_ENV] = f"spawn-{slot}"  # the ranks inherit it: the name in membership.jsonl
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # their parent is this agent's process server
    # torch numbers ranks within this agent only: the ranks learn their place on the host
    # (their GPU, their share of the cores) from where this agent's block starts
    os.environ.update(agent_rank_env(slot, lc))
    os.environ[NO_SHARED_STORE_ENV] = "1"  # see HAZARDS
    for name in _QUIET:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        values = elastic_launch(LaunchConfig(**lc), entrypoint=entry)(*fn_args)
    except ChildFailedError as e:
        text = "; ".join(f"rank {r} exited with {f.exitcode}" for r, f in sorted(e.failures.items()))
        out.put(("failed", slot, text))
        sys.exit(1)
    except Exception as e:  # the rendezvous closed (the run ended without it) or timed out
        out.put(("ended", slot, f"{type(e).__name__}: {e}".splitlines()[0]))
        sys.exit(3)
    out.put(("done", slot, values.get(0) if values else None))


def _boot_barrier(endpoint: str, n: int) -> None:
    """Wait until the launch's ``n`` first agents have started (a process start with torch
    imported takes seconds, tens under load). Without it the c10d rendezvous, which needs
    only ``min_nodes`` and then waits ``LAST_CALL_S``, would begin the run with the agents
    that happened to be ready and restart every rank as each late one arrived. A key in
    the launcher's store, not a membership protocol: who trains is still the rendezvous'."""
    from torch.distributed import TCPStore

    host, port = endpoint.rsplit(":", 1)
    store = TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=BOOT_TIMEOUT_S))
    store.add(_BOOT_KEY, 1)
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while store.add(_BOOT_KEY, 0) < n and time.monotonic() < deadline:
        time.sleep(0.1)  # past the deadline the rendezvous goes on with whoever is there


def _newest_round(run: RunDir) -> int:
    """The newest committed round checkpoint's number, by name only (cheap; 0 for none)."""
    try:
        names = [m.group(1) for p in run.checkpoints.iterdir() if (m := _ROUND_DIR.match(p.name))]
    except OSError:
        return 0
    return max((int(n) for n in names), default=0)


def agent_config(la: Any, port: int) -> dict:
    """The torch ``LaunchConfig`` keywords of every agent: one per worker group, ``G`` ranks each."""
    G, slots = la.group_size, la.nproc // la.group_size
    return dict(min_nodes=(la.min_nproc or G) // G, max_nodes=slots, nproc_per_node=G,
                run_id=f"dipaco-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                rdzv_configs={"is_host": False, "join_timeout": int(max(JOIN_TIMEOUT_S, la.timeout_s)),
                              "last_call_timeout": LAST_CALL_S, "keep_alive_interval": KEEP_ALIVE_S,
                              "keep_alive_max_attempt": KEEP_ALIVE_TRIES},
                max_restarts=la.max_restarts, monitor_interval=MONITOR_S,
                start_method=process_start.start_method())


def agent_rank_env(slot: int, lc: dict) -> dict[str, str]:
    """What the agent of ``slot`` adds to its ranks' env: where its block of the host starts
    (torch numbers ranks within one agent only; :mod:`dipaco.runtime.placement`)."""
    return agent_env(slot, lc["nproc_per_node"], lc["max_nodes"] * lc["nproc_per_node"])


def run_agents(cfg: Config, run: RunDir, entry: Callable[..., Any], fn_args: tuple, port: int,
               stop_requested: Callable[[], bool]) -> ElasticOutcome:
    """Run ``entry(*fn_args)`` on ``launcher.nproc`` ranks, one elastic agent per worker group."""
    from torch.distributed import TCPStore

    la = cfg.launcher
    G, slots = la.group_size, la.nproc // la.group_size
    min_slots = (la.min_nproc or G) // G
    # hosted here (see HAZARDS); the agents connect as clients (is_host=False)
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False,
                     timeout=datetime.timedelta(seconds=la.timeout_s))
    lc = agent_config(la, port)
    ctx = process_start.context()
    _quiet_resource_tracker()  # before the first semaphore (the queue's) starts the tracker
    out = ctx.Queue()
    agents: dict[int, Any] = {}
    rejoins = {s: 0 for s in range(slots)}
    pending: dict[int, tuple[float, int]] = {}  # slot -> (rejoin no earlier than, after this round)
    result = ElasticOutcome()

    def start(slot: int, first: Optional[int] = None) -> None:
        p = ctx.Process(target=_agent_main, args=(slot, lc, entry, fn_args, out, first, process_start.handover()),
                        name=f"dipaco-agent-{slot}")
        p.start()
        agents[slot] = p

    for s in range(slots):
        start(s, first=slots)
    done = False
    try:
        while agents or pending:
            _drain(out, result)
            if stop_requested() and not result.stopped:
                result.stopped = True  # each agent stops its ranks with SIGTERM: round boundary
                pending.clear()
                for p in agents.values():
                    _signal(p, signal.SIGTERM)
            for slot, p in list(agents.items()):
                if p.exitcode is None:
                    continue
                del agents[slot]
                if p.exitcode < 0 and not result.stopped and not done:
                    name = signal.Signals(-p.exitcode).name
                    result.lost.append(f"spawn-{slot}")
                    # train.log only: the one line on the console is rank 0's of the next start,
                    # naming the group that left and what it cost (dipaco.runtime.elastic.describe)
                    log.debug(f"elastic: agent spawn-{slot} (worker group {slot}) was lost ({name}); the other "
                              "groups go on from the last round checkpoint" + _rejoin_note(la, rejoins[slot]))
                    if la.rejoin_after_s is not None and rejoins[slot] < la.max_restarts:
                        pending[slot] = (time.monotonic() + la.rejoin_after_s, _newest_round(run))
            _drain(out, result)
            done = result.finished or bool(result.failures) or result.stopped
            if done:
                pending.clear()
            if result.failures and agents:  # the rendezvous is closed: the others end; make sure
                for p in agents.values():
                    _signal(p, signal.SIGTERM)
            for slot, (when, after_round) in list(pending.items()):
                if time.monotonic() >= when and _newest_round(run) > after_round:
                    del pending[slot]
                    rejoins[slot] += 1
                    result.rejoined.append(f"spawn-{slot}")
                    say(f"elastic: starting agent spawn-{slot} again (rejoin {rejoins[slot]} of "
                        f"launcher.max_restarts={la.max_restarts}); it joins at the next round boundary")
                    start(slot)
            if not agents and pending:  # nobody is left to commit the round a rejoin waits for
                pending.clear()
            alive = len(agents) + len(pending)
            if not done and alive < min_slots and not result.stopped:
                result.failures.append(f"{alive} of {slots} worker groups left, fewer than launcher.min_nproc="
                                       f"{la.min_nproc or G} ranks allow")
                for p in agents.values():
                    _signal(p, signal.SIGTERM)
                done = True
            time.sleep(POLL_S)
    finally:
        for p in agents.values():  # an exception here (Ctrl-C twice): leave nothing behind
            _signal(p, signal.SIGKILL, group=True)
        del store
    _drain(out, result)
    return result


def _quiet_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (shared by the agents and their ranks) with
    its leaked-semaphore warning off. A lost agent is killed with SIGKILL by design, so the
    semaphores of its queues are never released by it; the tracker releases them when the
    launch ends, and its warning about them was the last line of every run that lost a group."""
    from multiprocessing import resource_tracker

    before = list(sys.warnoptions)
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")  # read by the tracker's command line
    try:
        resource_tracker.ensure_running()  # a no-op when it runs already
    finally:
        sys.warnoptions[:] = before


def _rejoin_note(la: Any, used: int) -> str:
    if la.rejoin_after_s is None:
        return " (launcher.rejoin_after_s is null: it is not restarted)"
    if used >= la.max_restarts:
        return f" (launcher.max_restarts={la.max_restarts} rejoins used: it is not restarted)"
    return f"; it is restarted in {la.rejoin_after_s:g} s, once they committed a round without it"


def _drain(out: Any, result: ElasticOutcome) -> None:
    """Read what the agents reported so far."""
    import queue

    while True:
        try:
            kind, slot, payload = out.get_nowait()
        except queue.Empty:
            return
        if kind == "done" and payload is not None:
            result.value, result.finished = payload, True
        elif kind == "failed":
            result.failures.append(f"agent spawn-{slot}: {payload}")
        elif kind == "ended":
            result.ended.append(f"agent spawn-{slot}: {payload}")
            if not result.finished:  # after the end, a waiting agent finds the rendezvous closed: expected
                say(f"elastic: agent spawn-{slot} left the rendezvous without a result ({payload})")


def _signal(p: Any, sig: int, group: bool = False) -> None:
    """``sig`` to an agent process; with ``group`` also to the ranks it started (its own
    process group). SIGTERM goes to the agent only: it passes one SIGTERM on to its ranks,
    and a second one would make them stop at once instead of at the round boundary."""
    try:
        if group:
            os.killpg(p.pid, sig)
            return
    except (ProcessLookupError, PermissionError):
        pass  # not yet its own group leader
    try:
        os.kill(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
