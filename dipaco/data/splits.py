"""Train / validation / test assignment of a document by a stable hash of its group.

The split is a pure function of a key (sha256, not Python's salted ``hash``), so a
document keeps its split when other documents are added, removed or reordered, on every
machine and in every process. The corpus passes the document's *group* (its source file
or document family, ``data.group_field``; the id when there is none): chunks of one file
then share a split, and validation never scores text whose neighbours were trained on.
"""
from __future__ import annotations

from dipaco.storage.hashing import sha256_digest


SPLITS = ("train", "validation", "test")


def id_unit_interval(doc_id: str, salt: str = "split") -> float:
    """Map an id to a number in [0, 1), uniform over ids and the same everywhere.

    ``salt`` gives independent streams for different uses (the split, the
    ``max_documents`` sample) so that they are not correlated.
    """
    digest = sha256_digest(f"{salt}\x00{doc_id}")
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_of(key: str, val_fraction: float, test_fraction: float) -> str:
    """Return ``"train"``, ``"validation"`` or ``"test"`` for one group key (or document id).

    About ``test_fraction`` of keys land in test and ``val_fraction`` in validation.
    Raising one fraction only moves documents out of train, never between the other two
    in the other direction: ids in [0, test) are test, [test, test + val) validation.
    """
    if not (0.0 <= val_fraction < 1.0 and 0.0 <= test_fraction < 1.0
            and val_fraction + test_fraction < 1.0):
        raise ValueError(
            f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} must lie in "
            "[0, 1) and sum to less than 1"
        )
    u = id_unit_interval(key)
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "validation"
    return "train"
