"""Leases of decoupled mode: exclusive, expiring claims built on ``Store.put_new``, on
paths (``path_<p>``, held by the decoupled worker training it) and on modules
(``module_<m>``, held by the synchroniser stepping it)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from dipaco.decoupled.store import Store, encode_json

__all__ = ["Lease", "LeaseLost"]


class LeaseLost(RuntimeError):
    """This holder's lease was taken over (it expired): stop working on the resource."""


@dataclass
class Lease:
    """An exclusive, expiring claim on a named resource (a path, a module), built on ``put_new``.

    Layout: ``leases/<name>/<epoch:010d>.json`` holding ``{owner, expires_at, released,
    since}`` (``since``: when this epoch was taken).
    The live lease is the highest epoch. To take a resource whose lease expired or was
    released, a decoupled worker creates epoch+1 with ``put_new``: of two workers racing, exactly
    one create succeeds. The holder renews by rewriting its own epoch file, then checks
    that no higher epoch exists; if one does, somebody took over while it was late and
    it must abandon the work (its pushes would be duplicates; see the synchroniser's
    ``duplicate_phase`` rule for the window where it cannot know yet).
    """

    store: Store
    name: str
    owner: str
    lease_s: float
    epoch: int = 0
    took_over_from: Optional[str] = None
    since: float = 0.0
    expires_at: float = 0.0  # this holder's own expiry, as it last wrote it

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

    def renew(self) -> None:
        """Extend the expiry (heartbeat); raise :class:`LeaseLost` if taken over, or if it
        already expired (the holder was paused or stalled past it: from then on others
        may take it at any moment, so its holder gives it up rather than race them)."""
        self.check()
        self.expires_at = time.time() + self.lease_s
        body = {"owner": self.owner, "expires_at": self.expires_at, "released": False, "since": self.since}
        self.store.put(self._key(self.epoch), encode_json(body))
        # A taker may have read our *old* expiry before the rewrite landed: check again.
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")

    def beat(self, every_s: float) -> None:
        """:meth:`renew` if ``every_s`` passed since the last write of the expiry (long
        work between heartbeats: a phase's pushes to a slow store)."""
        if time.time() > self.expires_at - self.lease_s + every_s:
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
