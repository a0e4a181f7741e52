"""Leases of decoupled mode: exclusive, expiring claims built on ``Store.put_new``, on
paths (``path_<p>``, held by the decoupled worker training it) and on modules
(``module_<m>``, held by the synchroniser stepping it)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar, Optional

from dipaco.decoupled.store import Store, encode_json
from dipaco.runtime.progress import say

__all__ = ["LATE_SHARE", "Lease", "LeaseLost", "RENEW_SHARE", "RenewalMargin"]

# The renewal rule (docs/decoupled.md, "Leases on a slow store"): a holder renews a lease
# once RENEW_SHARE of it has passed since the last renewal, so a renewal has the rest
# (two thirds) to land in, whatever the store's latency and whatever work came between.
RENEW_SHARE = 1 / 3
# A renewal that lands later than this share of lease_s after the previous one is a
# warning (its margin is half gone), and is checked with a listing: a taker comparing the
# old expiry with a clock up to a third of a lease ahead of ours may have taken it.
LATE_SHARE = 2 / 3


class LeaseLost(RuntimeError):
    """This holder's lease was taken over (it expired): stop working on the resource."""


class RenewalMargin:
    """How close this process's lease renewals came to losing a lease.

    A lease holds while each renewal lands within ``lease_s`` of the previous one. A
    renewal is due :data:`RENEW_SHARE` of a lease after the previous one and lands
    ``interval`` after it: the due time plus the store work that ran before the holder got
    to it (one module of a synchroniser's pass, one inner step of a worker) plus its own
    put. The first renewal later than :data:`LATE_SHARE` of ``lease_s`` prints one line
    naming the fix; ``worst`` keeps the longest interval (published with the role's
    heartbeat: ``syncs/<name>.json``, ``speed/worker_<i>.json``).
    """

    def __init__(self) -> None:
        self.worst = 0.0
        self.warned = False

    def observe(self, lease: "Lease", interval: float, took: float) -> None:
        """Record a renewal of ``lease`` that landed ``interval`` s after the previous one,
        ``took`` s of it its own put; warn (once) if it came later than ``LATE_SHARE``."""
        self.worst = max(self.worst, interval)
        if interval > LATE_SHARE * lease.lease_s and not self.warned:
            self.warned = True
            stall = max(interval - RENEW_SHARE * lease.lease_s, took)
            say(f"{lease.owner}: lease {lease.name} was renewed {interval:.2f}s after the previous renewal, "
                f"{stall:.2f}s after it was due ({took:.2f}s of it the renewal's own put), with "
                f"diloco.decoupled.lease_s={lease.lease_s:g}: the store is too slow for the lease, and a slower "
                f"moment will lose it and the work under it; raise lease_s to 6x that delay or more "
                f"(e.g. diloco.decoupled.lease_s={max(1, math.ceil(6 * stall))}), or lighten the store's load")


@dataclass
class Lease:
    """An exclusive, expiring claim on a named resource (a path, a module), built on ``put_new``.

    Layout: ``leases/<name>/<epoch:010d>.json`` holding ``{owner, expires_at, released,
    since}`` (``since``: when this epoch was taken).
    The live lease is the highest epoch. To take a resource whose lease expired or was
    released, a decoupled worker creates epoch+1 with ``put_new``: of two workers racing, exactly
    one create succeeds. The holder renews by rewriting its own epoch file once
    :data:`RENEW_SHARE` of the lease has passed (:meth:`beat`); a renewal that lands late
    then checks that no higher epoch exists; if one does, somebody took over while it was
    late and it must abandon the work (its pushes would be duplicates; see the
    synchroniser's ``duplicate_phase`` rule for the window where it cannot know yet).
    """

    store: Store
    name: str
    owner: str
    lease_s: float
    epoch: int = 0
    took_over_from: Optional[str] = None
    since: float = 0.0
    expires_at: float = 0.0  # this holder's own expiry, as it last wrote it
    margin: ClassVar[RenewalMargin] = RenewalMargin()  # the process's renewals (one role per process)

    @staticmethod
    def holder(store: Store, name: str, now: Optional[float] = None) -> Optional[str]:
        """The owner of a live (unreleased, unexpired) lease on ``name``, else None."""
        info = Lease.info(store, name)
        if not info or info.get("released") or float(info["expires_at"]) < (now or time.time()):
            return None
        return str(info["owner"])

    @staticmethod
    def info(store: Store, name: str) -> Optional[dict]:
        """The newest epoch's record of ``name`` with its ``epoch`` (None: never leased)."""
        probe = Lease(store, name, "", 0.0)
        epochs = probe._epochs()
        info = store.get_json(probe._key(epochs[-1])) if epochs else None
        return None if info is None else {**info, "epoch": epochs[-1]}

    @property
    def _folder(self) -> str:
        return f"leases/{self.name}"

    def _key(self, epoch: int) -> str:
        return f"{self._folder}/{epoch:010d}.json"

    def _epochs(self) -> list[int]:
        out = []
        for n in self.store.list(self._folder):
            if n.endswith(".json"):
                try:
                    out.append(int(n[:-5]))
                except ValueError:
                    pass
        return sorted(out)

    @staticmethod
    def is_free(store: Store, name: str, now: Optional[float] = None) -> bool:
        """Whether nobody holds ``name`` right now (never leased, released or expired)."""
        probe = Lease(store, name, "", 0.0)
        epochs = probe._epochs()
        if not epochs:
            return True
        info = store.get_json(probe._key(epochs[-1]))
        if info is None:  # pruned between list and read: treat as contended
            return False
        return bool(info.get("released")) or float(info["expires_at"]) < (now or time.time())

    def acquire(self, reclaim: bool = False) -> bool:
        """Try to take the lease; True on success (then :meth:`renew` and :meth:`release`).

        ``reclaim``: also take it while it is live if its holder has this lease's owner
        name, at once: a process restarted under the name of one known to be dead (a
        supervisor restarting its synchroniser) need not wait ``lease_s``. The new epoch
        fences the old holder all the same; names must be unique among live processes.
        """
        epochs = self._epochs()
        top = epochs[-1] if epochs else 0
        if epochs:
            info = self.store.get_json(self._key(top))
            if info is None:
                return False
            mine = reclaim and info.get("owner") == self.owner
            if not info.get("released") and float(info["expires_at"]) >= time.time() and not mine:
                return False
        self.since = time.time()
        self.expires_at = self.since + self.lease_s
        body = {"owner": self.owner, "expires_at": self.expires_at, "released": False, "since": self.since}
        if not self.store.put_new(self._key(top + 1), encode_json(body)):
            return False  # another worker won the race for this epoch
        self.epoch = top + 1
        # taken from a holder that never released it (died or stalled past its expiry)
        self.took_over_from = info.get("owner") if epochs and not info.get("released") else None
        for e in epochs[:-1]:  # keep the previous epoch for post-mortems, drop older ones
            self.store.delete(self._key(e))
        return True

    @property
    def renewed_at(self) -> float:
        """When the expiry now in the store was written (the last renewal or the take)."""
        return self.expires_at - self.lease_s

    def renew(self) -> None:
        """Extend the expiry (heartbeat); raise :class:`LeaseLost` if taken over, or if it
        already expired (the holder was paused or stalled past it: from then on others
        may take it at any moment, so its holder gives it up rather than race them).

        One put when on time. A taker can only have taken the lease by reading the old
        expiry as past, so a put that lands before ``LATE_SHARE`` of the lease (a third
        of a lease before the old expiry: room for clocks that disagree) needs no check;
        a later one lists the epochs (two requests), as every renewal did before.
        """
        start = time.time()
        late = start - self.expires_at
        if late > 0:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} expired {late:.1f}s ago (its holder was paused "
                            "or stalled past lease_s)")
        previous = self.renewed_at
        expires = start + self.lease_s
        body = {"owner": self.owner, "expires_at": expires, "released": False, "since": self.since}
        self.store.put(self._key(self.epoch), encode_json(body))
        self.expires_at = expires  # only once written: a failed put leaves the old expiry in force
        landed = time.time()
        if landed - previous > LATE_SHARE * self.lease_s and self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")
        self.margin.observe(self, landed - previous, landed - start)

    def due(self, every_s: Optional[float] = None) -> bool:
        """Whether a renewal is due: :data:`RENEW_SHARE` of the lease (or ``every_s``, if
        sooner) passed since the expiry was last written."""
        every = RENEW_SHARE * self.lease_s if every_s is None else min(every_s, RENEW_SHARE * self.lease_s)
        return time.time() >= self.renewed_at + every

    def beat(self, every_s: Optional[float] = None) -> None:
        """:meth:`renew` if it is :meth:`due` (cheap otherwise: call it between any two
        pieces of work, an inner step, a module's push, a module of a pass)."""
        if self.due(every_s):
            self.renew()

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease expired or a higher epoch exists (one listing)."""
        late = time.time() - self.expires_at
        if late > 0:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} expired {late:.1f}s ago (its holder was paused "
                            "or stalled past lease_s)")
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")

    def release(self) -> None:
        """Give the resource up (others may take it at once)."""
        if self._epochs()[-1:] == [self.epoch]:
            body = {"owner": self.owner, "expires_at": 0.0, "released": True, "since": self.since}
            self.store.put(self._key(self.epoch), encode_json(body))
