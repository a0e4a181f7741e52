"""Bytes on the wire of a network namespace's loopback, against the payload dipaco counts.

``bytes_sent`` in ``metrics.jsonl`` is the payload of the module exchanges (the codec's
bytes of each collective). The interface carries more: TCP/IP headers, gloo's own
framing, and the round's control collectives that the sync does not count (the
round-end barrier and the all-gather of the round record). Two measurements, both read from ``/proc/net/dev`` (per network namespace;
``/sys/class/net`` would show the namespace that mounted ``/sys``, not this one):

* :class:`WireMeter`: a thread sampling the loopback's transmitted bytes while a run
  trains, and noting the count each time rank 0 appends a round's line to
  ``metrics.jsonl``: the bytes between two lines are one round on the wire.
* :func:`control_bytes`: 4 gloo ranks issuing only the per-round control collectives, N
  times each, so their share of a round is measured apart from the exchange; beside them
  a ``gather_object`` to rank 0 of the same record, the cheaper collective the round
  record could use (only rank 0 writes it).

And the shaper alone (:func:`transfer_times`): how long one message takes on the shaped
loopback after the link idled (the token bucket full) and right behind another one (the
bucket empty), with no rank, no gloo and next to no CPU: what a fragment costs the link.
"""
from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Optional
from dipaco.storage.strict_json import dumps_strict


def lo_tx_bytes() -> int:
    """Bytes the loopback of this process's network namespace has transmitted."""
    with open("/proc/self/net/dev", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # receive: 8 fields, then transmit bytes
    raise RuntimeError("no loopback in /proc/self/net/dev")


class WireMeter:
    """Loopback bytes per round of a run (``with WireMeter(run.metrics) as m: train()``)."""

    def __init__(self, metrics: Path, every_s: float = 0.01) -> None:
        self.metrics, self.every_s = Path(metrics), every_s
        self.marks: list[int] = []  # loopback tx count when round i's line appeared
        self.start = self.end = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _lines(self) -> int:
        try:
            with open(self.metrics, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def _poll(self) -> None:
        while not self._stop.is_set():
            n, tx = self._lines(), lo_tx_bytes()
            while len(self.marks) < n:  # rounds whose line appeared since the last poll
                self.marks.append(tx)
            time.sleep(self.every_s)

    def __enter__(self) -> "WireMeter":
        self.start = lo_tx_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.end = lo_tx_bytes()

    def per_round(self) -> list[int]:
        """Loopback bytes of each round (round 1 from the launch: it holds the set-up)."""
        edges = [self.start, *self.marks]
        return [b - a for a, b in zip(edges, edges[1:])]

    def steady(self) -> float:
        """Median over rounds 2..R-1, the rounds the benchmark's other columns use."""
        rounds = self.per_round()
        return float(statistics.median(rounds[1:-1] or rounds)) if rounds else 0.0


def _control_rank(rank: int, world: int, port: int, record: dict, repeats: int, out: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()  # connections made before anything is counted
    cases = {
        "barrier": lambda: dist.barrier(),
        "all_gather_object (the round record)": lambda: dist.all_gather_object([None] * world, record),
        # what the record needs: only rank 0 writes it (dipaco/rounds/record.py)
        "gather_object to rank 0 (the same record)": lambda: dist.gather_object(
            record, [None] * world if rank == 0 else None, dst=0),
    }
    for name, op in cases.items():
        dist.barrier()
        before = lo_tx_bytes()
        for _ in range(repeats):
            op()
        dist.barrier()
        if rank == 0:
            out.put((name, before, lo_tx_bytes()))
    if rank == 0:
        out.put(None)  # the last case is in
    dist.barrier()
    dist.destroy_process_group()


def control_bytes(record: dict, repeats: int = 20, world: int = 4) -> dict[str, float]:
    """Loopback bytes of one call of each per-round control collective over ``world``
    gloo ranks (all ranks, headers included; the two barriers around a case are
    measured too and subtracted)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_control_rank, args=(r, world, port, record, repeats, q)) for r in range(world)]
    [p.start() for p in procs]
    got = {}
    while (item := q.get(timeout=1800)) is not None:
        name, before, after = item
        got[name] = after - before
    [p.join(timeout=60) for p in procs]
    barrier = got["barrier"] / (repeats + 1)  # a case's window holds one more barrier
    return {name: (b - barrier) / repeats if name != "barrier" else barrier for name, b in got.items()}


def last_record(metrics: Path) -> Optional[dict]:
    """The last round record of a run (the size an all-gather of it sends)."""
    import json

    lines = [x for x in Path(metrics).read_text().splitlines() if x.strip()]
    return json.loads(lines[-1]) if lines else None


def round_record_proxy(run: Any) -> Optional[dict]:
    """What one rank hands the round record's all-gather, rebuilt from a finished run:
    the last ``metrics.jsonl`` line (paths and modules) and that round's ``steps.jsonl``
    lines, a quarter of them (one rank's of 4); its size as JSON beside it (the collective
    sends it pickled: about as large)."""
    import json

    line = last_record(run.metrics)
    if line is None:
        return None
    step = line.get("step")
    steps = [json.loads(x) for x in Path(run.steps).read_text().splitlines() if x.strip()] \
        if Path(run.steps).is_file() else []
    last = [x for x in steps if step is None or x.get("step", 0) > step - 16]  # H = 16 in the benchmark
    mine = last[: max(1, len(last) // 4)]
    record = {**{k: v for k, v in line.items() if k != "step"}, "steps": mine}
    return {"record": record, "json_bytes": len(dumps_strict(record))}


def _receive(conn: socket.socket, nbytes: int) -> None:
    left = nbytes
    while left:
        chunk = conn.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the probe's sender closed early")
        left -= len(chunk)


def transfer_times(nbytes: int, repeats: int = 5, idle_s: float = 0.5) -> dict[str, float]:
    """Median seconds to deliver ``nbytes`` over one TCP connection on 127.0.0.1: after
    ``idle_s`` of silence (``idle_s``: a shaper's bucket refilled) and right behind
    another ``nbytes`` (``behind_s``: the bucket drained)."""
    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    payload = bytes(nbytes)

    def one() -> float:
        t0 = time.perf_counter()
        send = threading.Thread(target=sender.sendall, args=(payload,))
        send.start()
        _receive(receiver, nbytes)
        send.join()
        return time.perf_counter() - t0

    idle, behind = [], []
    try:
        for _ in range(repeats):
            time.sleep(idle_s)
            idle.append(one())
            behind.append(one())
    finally:
        for s in (sender, receiver, server):
            s.close()
    return {"idle_s": statistics.median(idle), "behind_s": statistics.median(behind)}
