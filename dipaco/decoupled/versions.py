"""Numbered, write-once revisions of a blob: the fence that keeps a writer who lost its
lease from overwriting its successor's work.

A module's state and a path's state are not one key replaced in place, but a folder of
revisions ``<folder>/<n:010d>.st``, each created with ``Store.put_new`` (create-if-absent):
the current state is the highest revision. A writer holding revision n writes n+1; of two
writers that both loaded n (a synchroniser paused past its lease and its successor, a
worker's zombie phase and the path's new holder), exactly one creates n+1 and the other
learns that it lost (``put_new`` returns False) and writes nothing: it reloads, or drops
what it held. A lease check just before the put makes that rare; the revision numbers make
it safe whatever the timing between the check and the put (docs/decoupled.md, "Leases").

Readers list the folder and read the highest revision; old revisions are pruned behind
the writer, keeping :data:`KEEP` of them so that a reader who listed just before a
prune still finds what it listed (else it lists again). Stores written before revisions
hold the single key ``<folder>.st``: it is read as revision 0.
"""
from __future__ import annotations

from typing import Any, Optional

from dipaco.decoupled.store import CorruptBlob, Store, decode_state, peek_meta

__all__ = ["KEEP", "revision_key", "revisions", "latest", "read_latest", "publish", "prune"]

KEEP = 3  # revisions kept behind the newest (readers that listed just before a prune)
_TRIES = 20  # re-lists when the listed newest was pruned before it was read


def revision_key(folder: str, n: int) -> str:
    """The key of revision ``n`` under ``folder``."""
    return f"{folder}/{int(n):010d}.st"


def revisions(store: Store, folder: str) -> list[int]:
    """The revision numbers under ``folder``, ascending."""
    out = []
    for name in store.list(folder):
        stem, dot, ext = name.partition(".")
        if dot and ext == "st" and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def latest(store: Store, folder: str) -> Optional[tuple[int, bytes]]:
    """``(revision, blob)`` of the newest revision under ``folder`` (the legacy single
    key ``<folder>.st`` as revision 0), or None when there is none."""
    for _ in range(_TRIES):
        revs = revisions(store, folder)
        if not revs:
            legacy = store.get(f"{folder}.st")
            return None if legacy is None else (0, legacy)
        blob = store.get(revision_key(folder, revs[-1]))
        if blob is not None:
            return revs[-1], blob
        # pruned between the listing and the read: a newer one exists, list again
    raise OSError(f"{store}: {folder} changed {_TRIES} times while being read")


def read_latest(store: Store, folder: str, meta_only: bool = False) -> Optional[tuple[int, Any, dict]]:
    """``(revision, state, meta)`` of the newest revision, checked against the sha256
    recorded when it was written (a mismatch is :class:`CorruptBlob` naming its key);
    with ``meta_only`` the state is None and the header is read unchecked
    (:func:`~dipaco.decoupled.store.peek_meta`: for display only). None when there is none."""
    got = latest(store, folder)
    if got is None:
        return None
    rev, blob = got
    try:
        if meta_only:
            return rev, None, peek_meta(blob)
        state, meta = decode_state(blob)
    except CorruptBlob as e:
        key = revision_key(folder, rev) if revisions(store, folder) else f"{folder}.st"
        raise CorruptBlob(f"{store!r}: key {key!r} is corrupt: {e}") from None
    return rev, state, meta


def publish(store: Store, folder: str, n: int, blob: bytes) -> bool:
    """Create revision ``n``; False (nothing left written) when it already exists: another
    writer got there first, and the caller's state is no longer the newest.

    Also False when, once written, a newer revision exists: a writer paused between its
    lease check and its put long enough for its successor to write past ``n`` and prune
    it finds ``n``'s slot free again (a failure drill's SIGSTOP did). Its revision is
    deleted (readers take the highest, so none read it), and it learns that it lost as a
    fenced writer does: one listing per write closes the hole pruning opens in the fence.
    """
    key = revision_key(folder, n)
    if not store.put_new(key, blob):
        return False
    if any(r > n for r in revisions(store, folder)):
        store.delete(key)
        return False
    return True


def prune(store: Store, folder: str, newest: int, everything: bool = False) -> None:
    """Delete the revision :data:`KEEP` + 1 behind ``newest`` (each write prunes one), or
    with ``everything`` every revision that old (a new holder's clean-up)."""
    old = newest - KEEP - 1
    if old < 0:
        return
    targets = [r for r in revisions(store, folder) if r <= old] if everything else [old]
    for r in targets:
        store.delete(revision_key(folder, r))
