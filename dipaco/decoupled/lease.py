"""Path leases of decoupled mode: exclusive, expiring claims built on ``Store.put_new``."""
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
    """An exclusive, expiring claim on a named resource (a path), built on ``put_new``.

    Layout: ``leases/<name>/<epoch:010d>.json`` holding ``{owner, expires_at, released}``.
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

    @staticmethod
    def holder(store: Store, name: str, now: Optional[float] = None) -> Optional[str]:
        """The owner of a live (unreleased, unexpired) lease on ``name``, else None."""
        probe = Lease(store, name, "", 0.0)
        epochs = probe._epochs()
        info = store.get_json(probe._key(epochs[-1])) if epochs else None
        if not info or info.get("released") or float(info["expires_at"]) < (now or time.time()):
            return None
        return str(info["owner"])

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

    def acquire(self) -> bool:
        """Try to take the lease; True on success (then :meth:`renew` and :meth:`release`)."""
        epochs = self._epochs()
        top = epochs[-1] if epochs else 0
        if epochs:
            info = self.store.get_json(self._key(top))
            if info is None:
                return False
            if not info.get("released") and float(info["expires_at"]) >= time.time():
                return False
        body = {"owner": self.owner, "expires_at": time.time() + self.lease_s, "released": False}
        if not self.store.put_new(self._key(top + 1), encode_json(body)):
            return False  # another worker won the race for this epoch
        self.epoch = top + 1
        # taken from a holder that never released it (died or stalled past its expiry)
        self.took_over_from = info.get("owner") if epochs and not info.get("released") else None
        for e in epochs[:-1]:  # keep the previous epoch for post-mortems, drop older ones
            self.store.delete(self._key(e))
        return True

    def renew(self) -> None:
        """Extend the expiry (heartbeat); raise :class:`LeaseLost` if taken over."""
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")
        body = {"owner": self.owner, "expires_at": time.time() + self.lease_s, "released": False}
        self.store.put(self._key(self.epoch), encode_json(body))
        # A taker may have read our *old* expiry before the rewrite landed: check again.
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")

    def check(self) -> None:
        """Raise :class:`LeaseLost` if a higher epoch exists (cheap: one listing)."""
        if self._epochs()[-1:] != [self.epoch]:
            raise LeaseLost(f"lease {self.name} epoch {self.epoch} was taken over")

    def release(self) -> None:
        """Give the resource up (others may take it at once)."""
        if self._epochs()[-1:] == [self.epoch]:
            body = {"owner": self.owner, "expires_at": 0.0, "released": True}
            self.store.put(self._key(self.epoch), encode_json(body))
